"""``vertumnus up --nats-config``: the whole live stack on a secured bus (mutual TLS, an nkey
user), every service and ``up`` itself connecting with the ``VTM_NATS_*`` settings of its
environment, and the gateway on HTTPS with API keys; without the bus's credentials, up stops
at once with an error naming what to check. Neither run's point is the fit: each is given
the profile ``up`` would fit first (``fitted_profile``, conftest.py), its path past the fit
the same."""

from __future__ import annotations

import json
from pathlib import Path

from live_up_support import kill_leftovers, run_cli
from natssecurity_support import make_pki, secured_server


def test_up_runs_every_service_on_a_secured_bus(tmp_path: Path, fitted_profile: Path) -> None:
    conf, env = secured_server(tmp_path)
    (tmp_path / "web").mkdir()
    web = make_pki(tmp_path / "web")  # the gateway's own certificate, another CA
    env |= {"VTM_HTTP_TLS_CERT": str(web["server_cert"]),
            "VTM_HTTP_TLS_KEY": str(web["server_key"]), "VTM_API_KEYS": "up-key",
            "VTM_GATEWAY_CA": str(web["ca"])}  # the gateway's side, and up's as its client
    out, logs = tmp_path / "results.json", tmp_path / "logs"
    try:
        proc = run_cli(["up", "--nats-config", str(conf), "--max-requests", "40", "--duration",
                        "60", "--time-scale", "0.05", "--profile", str(fitted_profile),
                        "--log-dir", str(logs), "--json", str(out), "--no-progress",
                        "--stop-timeout", "10"], env=env)
    finally:
        kill_leftovers(logs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert (data["completed"], data["failed"]) == (40, 0), data["errors"]
    assert data["nats_config"] == str(conf.resolve())
    assert data["services_missing"] == [] and set(data["exit_codes"].values()) == {0}
    assert "tls://" in proc.stderr  # the server up started is the configured one
    assert "gateway https://" in proc.stderr  # and the gateway it found healthy
    # No refusal, and not asyncio's warning at each TLS close either (shared/logging.py).
    assert "eof_received" not in proc.stderr
    for log in logs.glob("*.log"):
        assert "nats refused the connection" not in log.read_text(), log.name
        assert "eof_received" not in log.read_text(), log.name


def test_up_without_the_credentials_stops_naming_them(tmp_path: Path,
                                                      fitted_profile: Path) -> None:
    conf, env = secured_server(tmp_path)
    logs = tmp_path / "logs"
    try:
        proc = run_cli(["up", "--nats-config", str(conf), "--max-requests", "4", "--profile",
                        str(fitted_profile), "--log-dir", str(logs), "--no-progress"],
                       env={"VTM_NATS_TLS_CA": env["VTM_NATS_TLS_CA"]})  # no client identity
    finally:
        kill_leftovers(logs)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = " ".join(proc.stderr.split())
    assert "cannot connect to the embedded nats-server" in text, text
    assert "--nats-config" in text and "Traceback" not in text
