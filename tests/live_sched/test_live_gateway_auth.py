"""Gateway API keys (``VTM_API_KEYS``): every /v1 route needs a bearer key, /health stays open
for probes, a refused request reaches nothing behind the gateway, and no error shows a key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from live_sched_support import Services, fake_token, http, wait_until

REPO = Path(__file__).resolve().parents[2]

KEYS = "k-old-123,k-new-456"  # two keys: one being rotated out


async def test_every_v1_route_needs_one_of_the_keys(live: Services,
                                                    fake_worker) -> None:  # type: ignore[no-untyped-def]
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=2)
    gw = await live.gateway(block_size=2, api_keys=KEYS)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    body = {"prompt_tokens": list(range(9)), "request_id": "auth-1"}

    health = await http(gw.http_port, "GET", "/health")  # probes need no key
    assert health.status == 200 and health.json()["status"] == "ok"
    refused = [
        await http(gw.http_port, "GET", "/v1/workers"),
        await http(gw.http_port, "POST", "/v1/completions", body),
        await http(gw.http_port, "POST", "/v1/completions", body,
                   headers={"Authorization": "Bearer k-old-12"}),  # a prefix of a key
        await http(gw.http_port, "GET", "/v1/workers",
                   headers={"Authorization": "Basic k-old-123"}),  # the key, wrong scheme
        await http(gw.http_port, "GET", "/v1/nothing"),  # /v1 routes are the key's first
    ]
    for reply in refused:
        assert reply.status == 401, reply.body
        assert reply.headers["www-authenticate"].startswith("Bearer")
        err = reply.json()["error"]
        assert (err["code"], err["type"]) == (401, "invalid_api_key")
        assert "k-old" not in reply.body.decode() and "k-new" not in reply.body.decode()
    assert w.assignments == []  # nothing refused reached a worker
    assert (await http(gw.http_port, "GET", "/nothing")).status == 404

    for key in ("k-old-123", "k-new-456"):
        workers = await http(gw.http_port, "GET", "/v1/workers",
                             headers={"Authorization": f"bearer {key}"})
        assert workers.status == 200 and workers.json()["workers"], workers.body
    done = await http(gw.http_port, "POST", "/v1/completions", body,
                      headers={"Authorization": "Bearer k-new-456"})
    assert done.status == 200, done.body
    assert done.json()["choices"][0]["token_ids"] == [fake_token("auth-1")]
    assert [a.request.request_id for a in w.assignments] == ["auth-1"]


def test_bad_keys_are_refused_at_start_without_showing_them() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.gateway"], cwd=REPO, capture_output=True, text=True,
        timeout=60, env={**os.environ, "VTM_NATS_URL": "nats://127.0.0.1:9",
                         "VTM_API_KEYS": "good-key,,bad key"})
    assert proc.returncode == 2, proc.stderr
    assert "VTM_API_KEYS" in proc.stderr and "value not shown: a secret" in proc.stderr
    assert "good-key" not in proc.stderr and "bad key" not in proc.stderr


def test_a_key_a_client_could_never_send_is_refused() -> None:
    """A header is read as latin-1: a key with characters outside visible ASCII would be
    accepted here and never match (a review found ``ключ`` configured and refused forever)."""
    from pydantic import ValidationError

    from services.gateway.settings import GatewaySettings

    for bad in ("k1,ключ", "k1,tab\tkey", "k\u00e9y"):
        with pytest.raises(ValidationError, match="visible ASCII"):
            GatewaySettings(api_keys=bad)
    assert GatewaySettings(api_keys="k1,K-2_x.~!").api_key_list == (b"k1", b"K-2_x.~!")
