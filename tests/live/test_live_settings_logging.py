"""Settings read VTM_* with __ nesting; logs are JSON lines carrying request and trace ids."""

from __future__ import annotations

import json
import logging

import pytest
import structlog
from pydantic import ValidationError

from shared.logging import bind_request, configure_logging, get_logger
from shared.settings import ServiceSettings
from shared.telemetry import tracer


def test_env_prefix_and_nesting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTM_NATS_URL", "nats://a:1, nats://b:2")
    monkeypatch.setenv("VTM_SUBJECT_PREFIX", "dev.vtm")
    monkeypatch.setenv("VTM_TELEMETRY__EXPORTER", "otlp")
    monkeypatch.setenv("VTM_TELEMETRY__SAMPLING_RATIO", "0.25")
    monkeypatch.setenv("VTM_LOG__FORMAT", "json")
    s = ServiceSettings()
    assert s.nats_servers == ["nats://a:1", "nats://b:2"]
    assert s.subjects.result("r") == "dev.vtm.result.r"
    assert (s.telemetry.exporter, s.telemetry.sampling_ratio) == ("otlp", 0.25)
    assert s.log.format == "json"


def test_bad_values_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTM_SUBJECT_PREFIX", "Bad Prefix")
    with pytest.raises(ValidationError):
        ServiceSettings()
    monkeypatch.delenv("VTM_SUBJECT_PREFIX")
    monkeypatch.setenv("VTM_TELEMETRY__SAMPLING_RATIO", "2")
    with pytest.raises(ValidationError):
        ServiceSettings()


def test_every_setting_is_documented() -> None:
    for model in (
        ServiceSettings,
        ServiceSettings.model_fields["telemetry"].annotation,
        ServiceSettings.model_fields["log"].annotation,
    ):
        for name, f in model.model_fields.items():  # type: ignore[union-attr]
            if name in ("telemetry", "log"):
                continue
            assert f.description, f"{model.__name__}.{name} has no description"


def test_json_logs_carry_bound_ids(capsys: pytest.CaptureFixture[str], spans: object) -> None:
    configure_logging("json", "info", service="vtm-test")
    try:
        log = get_logger("t")
        with tracer().start_as_current_span("s") as span:
            with bind_request("r-1"):
                log.info("hello", n=1)
        log.info("after")
        logging.getLogger("nats").warning("stdlib too")
        lines = [json.loads(x) for x in capsys.readouterr().err.strip().splitlines()]
        first = lines[0]
        assert first["event"] == "hello" and first["request_id"] == "r-1" and first["n"] == 1
        assert first["trace_id"] == format(span.get_span_context().trace_id, "032x")
        assert first["service"] == "vtm-test" and first["level"] == "info"
        assert "request_id" not in lines[1]
        assert lines[2]["event"] == "stdlib too" and lines[2]["service"] == "vtm-test"
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
