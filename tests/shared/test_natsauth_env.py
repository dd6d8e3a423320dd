"""The security settings a command-line tool reads from its environment
(``shared.natsauth.env_nats_security_options``): the ``VTM_NATS_*`` credentials and TLS
variables, checked as a service checks them, and no other setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from natssecurity_support import make_pki

from shared.ids import InvalidInput
from shared.natsauth import SECURITY_FIELDS, env_nats_security_options, env_security_options
from shared.settings import ServiceSettings

UNRELATED = {"VTM_LOG__LEVEL": "verbose", "VTM_STOP_TIMEOUT_S": "abc",
             "VTM_TELEMETRY__EXPORTER": "foo", "VTM_LOG": "not json",
             "VTM_SUBJECT_PREFIX": "Bad Prefix"}


def test_the_security_fields_are_settings_of_every_service() -> None:
    assert SECURITY_FIELDS <= set(ServiceSettings.model_fields)
    assert all(f.startswith("nats_") for f in SECURITY_FIELDS) and "nats_url" not in SECURITY_FIELDS


def test_settings_a_tool_does_not_read_are_not_checked() -> None:
    env = {**UNRELATED, "VTM_NATS_TOKEN": "t", "PATH": "/bin"}
    assert env_nats_security_options(env) == {"token": "t"}
    assert env_nats_security_options(UNRELATED) == {}
    assert env_nats_security_options({}) == {}
    # Names as the services match them: not case-sensitive.
    assert env_nats_security_options({"vtm_nats_user": "u", "Vtm_Nats_Password": "p"}) == {
        "user": "u", "password": "p"}


def test_a_tls_setting_becomes_the_tools_tls_context(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    opts = env_nats_security_options({"VTM_NATS_TLS_CA": str(pki["ca"]),
                                      "VTM_NATS_TLS_HOSTNAME": "nats", **UNRELATED})
    assert opts["tls_hostname"] == "nats" and opts["tls"].verify_mode.name == "CERT_REQUIRED"


def test_bad_security_settings_are_named_and_nothing_else(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as err:
        env_nats_security_options({"VTM_NATS_TLS_CA": str(tmp_path / "absent.pem"),
                                   **UNRELATED})
    text = str(err.value)
    assert "VTM_NATS_TLS_CA" in text and not any(k in text for k in UNRELATED), text
    with pytest.raises(InvalidInput, match="more than one way to authenticate"):
        env_nats_security_options({"VTM_NATS_TOKEN": "s3cret", "VTM_NATS_USER": "u",
                                   "VTM_NATS_PASSWORD": "pw"})
    with pytest.raises(InvalidInput) as err:
        env_nats_security_options({"VTM_NATS_PASSWORD": "pw-only"})
    assert "go together" in str(err.value) and "pw-only" not in str(err.value)


def test_up_still_checks_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``env_security_options`` (up's: its children read every setting) is unchanged."""
    monkeypatch.setenv("VTM_LOG__LEVEL", "verbose")
    with pytest.raises(InvalidInput, match="VTM_LOG__LEVEL"):
        env_security_options()


def test_up_names_a_group_that_is_no_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """``VTM_LOG`` that is no JSON is a settings error naming it, not a traceback
    (pydantic-settings raises its SettingsError, not a ValidationError, for it)."""
    monkeypatch.setenv("VTM_LOG", "not json")
    with pytest.raises(InvalidInput, match="VTM_LOG"):
        env_security_options()
