"""The gateway over HTTPS (``VTM_HTTP_TLS_CERT`` / ``VTM_HTTP_TLS_KEY``) and the live tools'
client (``vertumnus.live.http``: ``https://`` URLs verified against ``VTM_GATEWAY_CA``),
with a throw-away CA (``trustme``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from live_sched_support import Services
from natssecurity_support import make_pki

from vertumnus.live.http import GATEWAY_CA_ENV, HttpError, get_json, request

REPO = Path(__file__).resolve().parents[2]


async def test_the_gateway_serves_https_to_clients_that_trust_its_ca(
        live: Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pki = make_pki(tmp_path)
    gw = await live.gateway(http_tls_cert=pki["server_cert"], http_tls_key=pki["server_key"],
                            api_keys="tls-key")
    url = gw.http_url
    assert url.startswith("https://127.0.0.1:"), url

    monkeypatch.delenv(GATEWAY_CA_ENV, raising=False)
    with pytest.raises(HttpError, match="CERTIFICATE_VERIFY_FAILED"):  # not a public CA
        await get_json(f"{url}/health")
    with pytest.raises(HttpError):  # plain HTTP on the TLS port gets no answer
        await request(f"http://127.0.0.1:{gw.http_port}/health", timeout_s=10)

    monkeypatch.setenv(GATEWAY_CA_ENV, str(pki["ca"]))
    assert await get_json(f"{url}/health") == (200, {
        "status": "ok", "nats": "connected", "service": "vtm-gateway",
        "version": gw.version})
    status, _ = await get_json(f"{url}/v1/workers")
    assert status == 401  # TLS does not replace the API key
    status, body = await get_json(f"{url}/v1/workers", api_key="tls-key")
    assert (status, body) == (200, {"workers": []})

    monkeypatch.setenv(GATEWAY_CA_ENV, str(tmp_path / "missing.pem"))
    with pytest.raises(HttpError, match=GATEWAY_CA_ENV):
        await get_json(f"{url}/health")


def test_tls_settings_that_cannot_serve_stop_the_gateway_naming_them(tmp_path: Path) -> None:
    """Read with the settings, before the gateway connects anywhere (the NATS URL here points
    nowhere: a check made later would never be reached)."""
    pki = make_pki(tmp_path)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key\n")
    cases = [
        ({"VTM_HTTP_TLS_CERT": str(pki["server_cert"])},
         "VTM_HTTP_TLS_CERT and VTM_HTTP_TLS_KEY go together"),
        ({"VTM_HTTP_TLS_CERT": str(pki["server_cert"]), "VTM_HTTP_TLS_KEY": str(junk)},
         "are not a certificate chain and its private key"),
    ]
    for env, message in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "services.gateway"], cwd=REPO, capture_output=True,
            text=True, timeout=60, env={**os.environ, "VTM_NATS_URL": "nats://127.0.0.1:9",
                                        "VTM_HTTP_PORT": "0", **env})
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
