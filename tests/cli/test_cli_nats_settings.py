"""Unusable ``VTM_NATS_*`` settings (two ways to authenticate, a missing or unreadable file, a
file that is no certificate) stop ``tap``, ``status`` and ``replay --nats`` as they stop ``up``
and every service: exit 2 naming the setting, before any connection -- not as a server that
cannot be reached (README, "A secured bus").

The commands run in this process (typer's runner) with their work replaced by a tripwire, so
a check that regressed fails at once instead of connecting anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from vertumnus.cli import app

NOWHERE = "nats://127.0.0.1:9"


class Started(AssertionError):
    """A command got past its checks: it would have connected or replayed."""


@pytest.fixture(autouse=True)
def tripwire(monkeypatch: pytest.MonkeyPatch) -> None:
    import vertumnus.cmd_live as cmd_live
    import vertumnus.live.status as status
    import vertumnus.live.tap as tap

    async def started(*args: Any, **kwargs: Any) -> Any:
        raise Started("the command started its work")

    monkeypatch.setattr(cmd_live, "_replay_main", started)
    monkeypatch.setattr(tap, "tap", started)
    monkeypatch.setattr(status, "status", started)


COMMANDS = {
    "tap": ["tap", "vtm.>", "--nats", NOWHERE, "--count", "1", "--timeout", "1"],
    "status": ["status", "--nats", NOWHERE, "--timeout", "1"],
    "replay": ["replay", "--gateway", "http://127.0.0.1:9", "--nats", NOWHERE,
               "--max-requests", "1"],
}


def _env(tmp_path: Path, case: str) -> dict[str, str]:
    if case == "two ways":
        return {"VTM_NATS_TOKEN": "t", "VTM_NATS_USER": "u", "VTM_NATS_PASSWORD": "p"}
    if case == "missing file":
        return {"VTM_NATS_TLS_CA": str(tmp_path / "absent.pem")}
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    return {"VTM_NATS_TLS_CA": str(bad)}


NAMED = {"two ways": ("VTM_NATS_TOKEN", "VTM_NATS_USER"), "missing file": ("VTM_NATS_TLS_CA",),
         "no certificate": ("VTM_NATS_TLS_CA",)}


@pytest.mark.parametrize("case", list(NAMED))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_bad_nats_settings_exit_2_naming_the_setting(
        command: str, case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("VTM_NATS_TOKEN", "VTM_NATS_USER", "VTM_NATS_PASSWORD", "VTM_NATS_CREDS",
              "VTM_NATS_NKEY_SEED", "VTM_NATS_TLS_CA", "VTM_NATS_TLS_CERT", "VTM_NATS_TLS_KEY"):
        monkeypatch.delenv(k, raising=False)
    res = CliRunner().invoke(app, COMMANDS[command], env=_env(tmp_path, case))
    text = " ".join(res.output.split())
    assert not isinstance(res.exception, Started), text
    assert res.exit_code == 2, text
    assert "Traceback" not in text
    assert "error: NATS security settings:" in text, text
    for name in NAMED[case]:
        assert name in text, (name, text)
    # A settings problem, not an unreachable server or gateway.
    assert "cannot reach" not in text and "not reachable" not in text, text


def test_good_settings_pass_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VTM_NATS_USER", raising=False)
    res = CliRunner().invoke(app, COMMANDS["tap"], env={"VTM_NATS_TOKEN": "t"})
    assert isinstance(res.exception, Started), res.output


# Settings the NATS tools do not read: each invalid, alone. Before, every one stopped tap,
# status and replay as "NATS security settings: invalid settings: ..." (and VTM_LOG that is no
# JSON with a traceback): the tools validated every service setting under that label.
UNRELATED = {"log level": {"VTM_LOG__LEVEL": "verbose"},
             "stop timeout": {"VTM_STOP_TIMEOUT_S": "abc"},
             "exporter": {"VTM_TELEMETRY__EXPORTER": "foo"},
             "log group": {"VTM_LOG": "not json"}}


@pytest.mark.parametrize("case", list(UNRELATED))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_setting_the_tools_do_not_read_is_no_security_error(
        command: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool that connects with --nats reads the VTM_NATS_* credentials and TLS settings
    only: another invalid setting is the concern of the service that reads it (which refuses
    it when it starts), not reported here as a security setting."""
    for k in ("VTM_NATS_TOKEN", "VTM_NATS_USER", "VTM_NATS_PASSWORD", "VTM_NATS_TLS_CA"):
        monkeypatch.delenv(k, raising=False)
    res = CliRunner().invoke(app, COMMANDS[command], env=UNRELATED[case])
    text = " ".join(res.output.split())
    assert isinstance(res.exception, Started), (res.exit_code, text, res.exception)
    assert "security" not in text, text


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_bad_security_setting_beside_an_unrelated_one_is_named_alone(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the security label only the security setting is named."""
    monkeypatch.delenv("VTM_NATS_TLS_CA", raising=False)
    env = {"VTM_NATS_TLS_CA": str(tmp_path / "absent.pem"), "VTM_LOG__LEVEL": "verbose"}
    res = CliRunner().invoke(app, COMMANDS[command], env=env)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and not isinstance(res.exception, Started), text
    assert "error: NATS security settings:" in text and "VTM_NATS_TLS_CA" in text, text
    assert "VTM_LOG__LEVEL" not in text, text
