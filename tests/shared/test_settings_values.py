"""shared/settings.py and shared/servicemain.py: a setting whose value cannot be used -- a
nested group or list that is no JSON, a duration that is not finite or beyond any sane wait --
ends a service at its start with exit status 2 and one line naming the variable, never a
traceback (and never a process that waits for ever). Real processes, as an operator starts
them; the NATS URL they would use points nowhere (it is never reached)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.settings import LogSettings, ServiceSettings, TelemetrySettings

REPO = Path(__file__).resolve().parents[2]
NOWHERE = {"VTM_NATS_URL": "nats://127.0.0.1:9"}
SETTINGS_CLASSES = (ServiceSettings, TelemetrySettings, LogSettings)
MAX_WAIT_S = 86_400  # a day: the bound of every wait (shared.settings.MAX_WAIT_S)
WAITS = ("connect_timeout_s", "drain_timeout_s", "stop_timeout_s", "reconnect_wait_s",
         "ping_interval_s", "jetstream_timeout_s")


def _float_fields() -> list[tuple[type, str]]:
    return [(cls, name) for cls in SETTINGS_CLASSES for name, f in cls.model_fields.items()
            if f.annotation is float]


def _problem_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("  VTM_")]


@pytest.mark.parametrize(("module", "env", "var"), [
    ("services.gateway", {"VTM_LOG": "json"}, "VTM_LOG"),
    ("services.gateway", {"VTM_TELEMETRY": "{x"}, "VTM_TELEMETRY"),
    ("services.controller", {"VTM_DEGREES": "x"}, "VTM_DEGREES"),
    ("services.gateway", {"VTM_RECONNECT_WAIT_S": "inf"}, "VTM_RECONNECT_WAIT_S"),
    ("services.scheduler", {"VTM_STOP_TIMEOUT_S": "1e300"}, "VTM_STOP_TIMEOUT_S"),
], ids=["log-not-json", "telemetry-not-json", "degrees-not-json", "reconnect-inf",
        "stop-timeout-huge"])
def test_a_service_with_an_unusable_setting_exits_2_naming_it(module: str, env: dict[str, str],
                                                              var: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **NOWHERE, **env})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = _problem_lines(proc.stderr)
    assert line.startswith(f"  {var}: "), proc.stderr


def test_a_nested_group_that_is_no_json_says_how_to_set_it() -> None:
    proc = subprocess.run([sys.executable, "-m", "services.gateway"], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **NOWHERE, "VTM_LOG": "json"})
    assert proc.returncode == 2, proc.stderr
    (line,) = _problem_lines(proc.stderr)
    assert "not JSON" in line and "VTM_LOG__FORMAT" in line, line


LOAD = ("from shared.servicemain import load_settings\n"
        "from shared.settings import ServiceSettings\n"
        "load_settings(ServiceSettings, 'svc')\n"
        "print('loaded')\n")


@pytest.mark.parametrize(("env", "var"), [({"VTM_TELEMETRY": "{x"}, "VTM_TELEMETRY"),
                                          ({"VTM_LOG": "json"}, "VTM_LOG")])
def test_load_settings_exits_2_naming_a_group_that_is_no_json(env: dict[str, str],
                                                              var: str) -> None:
    proc = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **NOWHERE, **env})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "loaded" not in proc.stdout, proc.stderr
    (line,) = _problem_lines(proc.stderr)
    assert line.startswith(f"  {var}: "), proc.stderr


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_number_setting_refuses_a_value_that_is_not_finite(value: float) -> None:
    fields = _float_fields()
    assert {name for _, name in fields} >= {*WAITS, "metrics_interval_s", "sampling_ratio"}
    for cls, name in fields:
        with pytest.raises(ValidationError, match=name):
            cls(**{name: value})


@pytest.mark.parametrize("field", WAITS)
def test_every_wait_is_bounded_by_a_day(field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert getattr(ServiceSettings(**{field: MAX_WAIT_S}), field) == MAX_WAIT_S
    for value in ("inf", "nan", "86400.5", "1e300"):
        monkeypatch.setenv(f"VTM_{field.upper()}", value)
        with pytest.raises(ValidationError, match=field):
            ServiceSettings()
    description = ServiceSettings.model_fields[field].description or ""
    assert "86 400" in description or "a day" in description, description


DEEP = "[" * 1000 + "]" * 1000  # deeper than Python's JSON parser goes: a RecursionError


@pytest.mark.parametrize(("module", "env", "var"), [
    ("services.gateway", {"VTM_LOG": DEEP}, "VTM_LOG"),
    ("services.gateway", {"VTM_TELEMETRY": "{\"x\": " + DEEP + "}"}, "VTM_TELEMETRY"),
    ("services.scheduler", {"VTM_POLICY_PARAMS": DEEP}, "VTM_POLICY_PARAMS"),
    ("services.controller", {"VTM_DEGREES": DEEP}, "VTM_DEGREES"),
], ids=["log", "telemetry", "policy-params", "degrees"])
def test_json_nested_too_deep_exits_2_naming_the_variable(module: str, env: dict[str, str],
                                                          var: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **NOWHERE, **env})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = _problem_lines(proc.stderr)
    assert line.startswith(f"  {var}: ") and "nested too deep" in line, proc.stderr


def test_load_settings_exits_2_naming_json_nested_too_deep() -> None:
    proc = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **NOWHERE, "VTM_LOG": DEEP})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "loaded" not in proc.stdout, proc.stderr
    (line,) = _problem_lines(proc.stderr)
    assert line.startswith("  VTM_LOG: ") and "nested too deep" in line, proc.stderr


def test_a_json_flag_nested_too_deep_exits_2_naming_the_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "services.scheduler", "--policy-params", DEEP],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **NOWHERE})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "--policy-params" in proc.stderr, proc.stderr


def test_env_security_options_names_json_nested_too_deep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.ids import InvalidInput
    from shared.natsauth import env_security_options

    monkeypatch.setenv("VTM_LOG", DEEP)
    with pytest.raises(InvalidInput, match="VTM_LOG: .*nested too deep"):
        env_security_options()
