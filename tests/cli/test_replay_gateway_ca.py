"""``VTM_GATEWAY_CA`` that names a file there but of no use -- one that cannot be read (a
directory; a file without read permission) or that holds no PEM certificate -- is said to be
so, naming the variable and the path (exit 2, before anything is sent). It was reported as a
gateway that "is not reachable", which sent the user looking for a server that was never
asked; the client side's message said "not a readable CA bundle" for either case."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trustme
from cli_support import Started, _refused
from typer.testing import CliRunner

from vertumnus.cli import app
from vertumnus.live.http import GATEWAY_CA_ENV, GatewayCaError, client_tls

HTTPS = "https://127.0.0.1:9"  # never reached: the check comes first


def _replay(ca: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setenv(GATEWAY_CA_ENV, str(ca))
    return CliRunner().invoke(app, ["replay", "--gateway", HTTPS, "--no-progress",
                                    "--duration", "5", "--max-requests", "1"])


def test_a_directory_cannot_be_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = _refused(_replay(tmp_path, monkeypatch),
                    f"{GATEWAY_CA_ENV} {str(tmp_path)!r} cannot be read: Is a directory")
    assert "not reachable" not in text, text


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_without_read_permission_cannot_be_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    ca.chmod(0)
    text = _refused(_replay(ca, monkeypatch),
                    f"{GATEWAY_CA_ENV} {str(ca)!r} cannot be read: Permission denied")
    assert "not reachable" not in text, text


def test_a_file_without_a_pem_certificate_is_said_to_be_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    text = _refused(_replay(ca, monkeypatch),
                    f"{GATEWAY_CA_ENV} {str(ca)!r} is not a PEM certificate bundle")
    assert "not reachable" not in text, text


def test_the_client_says_the_same_where_it_is_used_without_the_cli(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "missing.pem"
    monkeypatch.setenv(GATEWAY_CA_ENV, str(missing))
    with pytest.raises(GatewayCaError, match="cannot be read: No such file or directory"):
        client_tls(HTTPS)
    assert client_tls("http://127.0.0.1:9") is None  # plain HTTP reads no CA


def _up(ca: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> object:
    """``up`` whose gateway would serve HTTPS (the certificate files need not be real: the
    CA's check comes before anything reads them)."""
    monkeypatch.setenv("VTM_HTTP_TLS_CERT", str(tmp_path / "server.pem"))
    monkeypatch.setenv("VTM_HTTP_TLS_KEY", str(tmp_path / "server.key"))
    monkeypatch.setenv(GATEWAY_CA_ENV, str(ca))
    return CliRunner().invoke(app, ["up", "--duration", "10", "--max-requests", "2"])


def test_up_with_an_https_gateway_checks_the_ca_before_it_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        tripwire: list[dict[str, object]]) -> None:
    """Before: ``up`` started the stack, and its health wait, unable to verify the gateway,
    ran out (a minute later) with a ValueError."""
    text = _refused(_up(tmp_path, monkeypatch, tmp_path),
                    f"{GATEWAY_CA_ENV} {str(tmp_path)!r} cannot be read: Is a directory")
    assert "Traceback" not in text
    assert tripwire == []


def test_up_sees_the_certificate_variable_in_any_case(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        tripwire: list[dict[str, object]]) -> None:
    """The gateway's settings read ``vtm_http_tls_cert`` as ``VTM_HTTP_TLS_CERT``; so does the
    check (before: only the upper-case name turned it on)."""
    monkeypatch.setenv("vtm_http_tls_cert", str(tmp_path / "server.pem"))
    monkeypatch.setenv("vtm_http_tls_key", str(tmp_path / "server.key"))
    monkeypatch.setenv(GATEWAY_CA_ENV, str(tmp_path))
    result = CliRunner().invoke(app, ["up", "--duration", "10", "--max-requests", "2"])
    _refused(result, f"{GATEWAY_CA_ENV} {str(tmp_path)!r} cannot be read: Is a directory")
    assert tripwire == []


def test_up_with_a_usable_ca_goes_on_to_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        tripwire: list[dict[str, object]]) -> None:
    ca = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca))
    result = _up(ca, monkeypatch, tmp_path)
    assert isinstance(result.exception, Started), result.output  # type: ignore[attr-defined]
    assert len(tripwire) == 1
