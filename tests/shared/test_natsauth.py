"""NATS credentials and TLS settings (shared/settings.py) and the connect options they become
(shared/natsauth.py), with throw-away certificates (``natssecurity_support``)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from natssecurity_support import make_pki
from pydantic import ValidationError

from shared.ids import InvalidInput
from shared.natsauth import security_options, tls_context
from shared.service import security_hint
from shared.servicemain import settings_errors
from shared.settings import ServiceSettings


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A CA and a client certificate (and a server's), as PEM files."""
    return make_pki(tmp_path)


def _errors(**kw: object) -> str:
    with pytest.raises(ValidationError) as err:
        ServiceSettings(**kw)  # type: ignore[arg-type]
    return settings_errors(err.value, ServiceSettings)


def test_no_security_setting_leaves_nats_py_defaults() -> None:
    assert security_options(ServiceSettings()) == {}
    # A user:password in the URL is nats-py's own business (still allowed on its own).
    assert security_options(ServiceSettings(nats_url="nats://u:p@h:4222")) == {}


def test_each_way_to_authenticate_becomes_its_connect_option(tmp_path: Path) -> None:
    seed = tmp_path / "user.nk"
    seed.write_text("SUAEXAMPLE")
    creds = tmp_path / "user.creds"
    creds.write_text("jwt and seed")
    assert security_options(ServiceSettings(nats_token="s3cret")) == {"token": "s3cret"}
    assert security_options(ServiceSettings(nats_user="vtm", nats_password="pw")) == {
        "user": "vtm", "password": "pw"}
    assert security_options(ServiceSettings(nats_nkey_seed=seed)) == {"nkeys_seed": str(seed)}
    assert security_options(ServiceSettings(nats_creds=creds)) == {
        "user_credentials": str(creds)}


def test_secrets_never_show_in_a_repr_or_a_dump() -> None:
    s = ServiceSettings(nats_token="tok-123", nats_url="nats://h:4222")
    t = ServiceSettings(nats_user="vtm", nats_password="pw-456")
    for text in (repr(s), str(s.model_dump()), repr(t), str(t.model_dump())):
        assert "tok-123" not in text and "pw-456" not in text


@pytest.mark.parametrize(("kw", "message"), [
    ({"nats_token": "a", "nats_user": "u", "nats_password": "p"},
     "more than one way to authenticate to NATS: VTM_NATS_TOKEN, VTM_NATS_USER"),
    ({"nats_token": "a", "nats_url": "nats://u:p@h:4222,nats://h2:4222"},
     "VTM_NATS_TOKEN, credentials in VTM_NATS_URL"),
    ({"nats_password": "p"}, "VTM_NATS_USER and VTM_NATS_PASSWORD go together"),
    ({"nats_user": "u"}, "VTM_NATS_USER and VTM_NATS_PASSWORD go together"),
], ids=["token+user", "token+url", "password-alone", "user-alone"])
def test_settings_that_do_not_go_together_are_refused(kw: dict[str, str], message: str) -> None:
    assert message in _errors(**kw)


def test_a_certificate_needs_its_key_and_files_must_exist(pki: dict[str, Path],
                                                          tmp_path: Path) -> None:
    assert "VTM_NATS_TLS_CERT and VTM_NATS_TLS_KEY go together" in _errors(
        nats_tls_cert=pki["client_cert"])
    text = _errors(nats_tls_ca=tmp_path / "nope.pem")
    assert "VTM_NATS_TLS_CA: Path does not point to a file" in text
    assert "VTM_NATS_CREDS: Path does not point to a file" in _errors(nats_creds=tmp_path)


def test_an_unreadable_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "seed.nk"
    f.write_text("SU")
    # Permission bits do not stop root (CI runs as root): ask the access check itself.
    monkeypatch.setattr("shared.settings.os.access", lambda path, mode: Path(path) != f)
    assert "VTM_NATS_NKEY_SEED: Value error, file" in _errors(nats_nkey_seed=f)
    assert "is not readable by this process" in _errors(nats_nkey_seed=f)


def test_tls_verifies_the_server_against_the_ca_and_presents_the_client_cert(
        pki: dict[str, Path]) -> None:
    ctx = tls_context(ServiceSettings(nats_tls_ca=pki["ca"]))
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode is ssl.CERT_REQUIRED and ctx.check_hostname
    assert len(ctx.get_ca_certs()) == 1
    opts = security_options(ServiceSettings(
        nats_tls_ca=pki["ca"], nats_tls_cert=pki["client_cert"], nats_tls_key=pki["client_key"],
        nats_tls_hostname="nats", nats_token="t"))
    assert set(opts) == {"tls", "tls_hostname", "token"} and opts["tls_hostname"] == "nats"
    # A client certificate alone still turns TLS on (the system's CAs verify the server).
    assert tls_context(ServiceSettings(nats_tls_cert=pki["client_cert"],
                                       nats_tls_key=pki["client_key"])) is not None
    assert tls_context(ServiceSettings(nats_tls_hostname="nats")) is None


def test_a_file_that_is_not_a_certificate_or_key_is_named(pki: dict[str, Path],
                                                          tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(InvalidInput, match="VTM_NATS_TLS_CA .*junk.pem"):
        tls_context(ServiceSettings(nats_tls_ca=junk))
    with pytest.raises(InvalidInput, match="VTM_NATS_TLS_CERT .*VTM_NATS_TLS_KEY"):
        tls_context(ServiceSettings(nats_tls_cert=pki["client_cert"], nats_tls_key=junk))
    # The key of another certificate does not match this one.
    with pytest.raises(InvalidInput, match="VTM_NATS_TLS_CERT"):
        tls_context(ServiceSettings(nats_tls_cert=pki["client_cert"], nats_tls_key=pki["ca"]))


def test_security_hints_name_what_to_check() -> None:
    refused = security_hint(Exception("nats: 'Authorization Violation'"))
    assert refused is not None and "VTM_NATS_TOKEN" in refused
    tls = security_hint(ssl.SSLCertVerificationError(1, "certificate verify failed"))
    assert tls is not None and "VTM_NATS_TLS_CA" in tls
    assert security_hint(ConnectionRefusedError(111, "refused")) is None
