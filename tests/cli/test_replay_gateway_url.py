"""``replay --gateway URL``: a URL that is no ``http(s)://host[:port]`` one is said to be so
(exit 2, before the workload is loaded or anything is sent), not reported as a gateway that
"is not reachable", which sent the user looking for a server that was never asked. A
well-formed URL where nothing listens is still "not reachable" (a real closed port)."""

from __future__ import annotations

import socket

import pytest
from cli_support import _refused
from typer.testing import CliRunner

from vertumnus.cli import app


def _replay(gateway: str) -> object:
    return CliRunner().invoke(app, ["replay", "--gateway", gateway, "--no-progress",
                                    "--duration", "5", "--max-requests", "1"])


@pytest.mark.parametrize("url", ["", "ftp://x", "localhost:8080", "http://", "http://h:99999"])
def test_a_malformed_gateway_url_is_said_to_be_one(url: str) -> None:
    text = _refused(_replay(url), f"--gateway {url!r}", "is not an http(s) URL",
                    "http://host:port")
    assert "not reachable" not in text, text


def test_a_closed_port_is_still_not_reachable() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _refused(_replay(f"http://127.0.0.1:{port}"), f"gateway http://127.0.0.1:{port} is not "
             "reachable")
