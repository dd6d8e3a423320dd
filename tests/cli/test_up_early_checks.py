"""``up``'s inputs that only a start used to find are refused before anything starts (exit 2,
one line naming the input and the problem).

* ``--nats-config`` is tested by nats-server itself (``nats-server -t -c FILE``): a file it
  cannot parse, with a field it does not know or naming a TLS certificate that does not
  exist used to be found when the server started, after the hardware profiling (seconds;
  ~15 s on the torch engine), and ended the run with exit 1;
* the nats-server binary (``$VTM_NATS_SERVER_BIN``): a wrong one was a traceback there;
* ``--backend torch``'s engine: the ``engine`` extra, and ``--model-path`` a checkpoint
  directory (a ``config.json``, a safetensors file), where a bad one failed in each rank
  process of the profile.

The commands run in this process with ``run_up`` replaced by a tripwire (a check that
regressed fails at once instead of starting a stack); one runs as a real process, to see that
nothing at all started: no profile, no server, no service.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_support import Started, _refused
from typer.testing import CliRunner

from vertumnus.cli import app

REPO = Path(__file__).resolve().parents[2]
SHORT = ["--duration", "10", "--max-requests", "2"]


def _up(*args: str) -> Any:
    return CliRunner().invoke(app, ["up", *SHORT, *args])


BAD_CONFIGS: list[tuple[str, str, list[str]]] = [
    # (name, text, what nats-server's complaint says)
    ("syntax", "port: 4222\nfoo {{{\n", ["Parse error on line 3"]),
    ("unknown", "bogus_key: 5\n", ['unknown field "bogus_key"']),
    ("tls", 'tls { cert_file: "/nonexistent/c.pem"\n key_file: "/nonexistent/k.pem" }\n',
     ["error parsing X509 certificate/key pair", "/nonexistent/c.pem"]),
]


@pytest.mark.parametrize(("name", "text", "said"), BAD_CONFIGS,
                         ids=[c[0] for c in BAD_CONFIGS])
def test_a_config_nats_server_refuses_is_a_usage_error_before_the_start(
        tmp_path: Path, tripwire: list[dict[str, Any]], name: str, text: str,
        said: list[str]) -> None:
    conf = tmp_path / f"{name}.conf"
    conf.write_text(text)
    out = _refused(_up("--nats-config", str(conf)), f"--nats-config {conf}",
                   "nats-server refuses it", *said)
    assert "Traceback" not in out
    assert tripwire == []


def test_a_config_nats_server_accepts_passes(tmp_path: Path,
                                             tripwire: list[dict[str, Any]]) -> None:
    conf = tmp_path / "good.conf"
    conf.write_text('listen: "127.0.0.1:-1"\nmax_payload: 2MB\n')
    res = _up("--nats-config", str(conf))
    assert isinstance(res.exception, Started), res.output
    assert tripwire[-1]["args"][0].nats_config == conf.resolve()


def test_an_unusable_nats_server_binary_is_a_usage_error_before_the_start(
        tmp_path: Path, tripwire: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTM_NATS_SERVER_BIN", str(tmp_path / "no-such-server"))
    _refused(_up(), "nats-server binary", "no-such-server", "is not an executable",
             "$VTM_NATS_SERVER_BIN")
    assert tripwire == []


def test_the_torch_engine_is_checked_before_the_start(tmp_path: Path,
                                                      tripwire: list[dict[str, Any]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")  # the checkpoint checks are the engine's own
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(_up("--backend", "torch", "--model-path", str(empty)), "--model-path",
             "missing config.json")
    (empty / "config.json").write_text("{not json")
    _refused(_up("--backend", "torch", "--model-path", str(empty)), "--model-path",
             "config.json", "not valid JSON")
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    _refused(_up("--backend", "torch", "--model-path", str(empty)), "--model-path",
             "no *.safetensors file")
    # As on an install without the engine extra: said before anything, with the fix.
    monkeypatch.setitem(sys.modules, "services.rankd.engine.profiling", None)
    _refused(_up("--backend", "torch"), "needs the 'engine' extra",
             "services.rankd.engine.profiling missing", "pip install -e '.[engine]'")
    assert tripwire == []


def test_a_bad_nats_config_starts_nothing(tmp_path: Path) -> None:
    """A real ``up``: the refusal comes before the profiling and before any process starts
    (before, the profile ran and the server was started, then the run failed, exit 1)."""
    conf, logs, out = tmp_path / "bad.conf", tmp_path / "logs", tmp_path / "r.json"
    conf.write_text("port: 4222\nfoo {{{\n")
    res = subprocess.run(
        [sys.executable, "-m", "vertumnus", "up", *SHORT, "--nats-config", str(conf),
         "--log-dir", str(logs), "--json", str(out), "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    err = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stderr + res.stdout
    assert f"error: --nats-config {conf}: nats-server refuses it: Parse error" in err, err
    assert "Traceback" not in res.stderr and "profiling" not in err, err
    assert not out.exists()
    # No profile, no pids.json, no server store (the log dir is made last of the checks).
    assert not logs.exists() or sorted(p.name for p in logs.iterdir()) == []
