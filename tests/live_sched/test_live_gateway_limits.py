"""Gateway HTTP and NATS errors: each limit answers a clear 4xx and the service keeps serving."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from live_sched_support import Services, http
from nats.aio.client import Client
from pydantic import ValidationError

from services.gateway.adapter import INTAKE_HEADROOM_BYTES, check_client_id, new_request_id
from services.gateway.settings import GatewaySettings
from shared.natsserver import EmbeddedNats
from shared.schemas import MAX_TOKENS, CompletionRequest, FirstToken
from shared.service import RemoteError, call
from shared.subjects import Subjects

LIMITS = {"max_body_bytes": 2048, "max_prompt_tokens": 64, "max_seq_len": 80,
          "vocab_size": 1000}


@pytest.mark.parametrize(
    ("method", "path", "kw", "status", "needle"),
    [
        ("POST", "/v1/completions", {"raw": b"{not json"}, 400, "not valid JSON"),
        ("POST", "/v1/completions", {"raw": b"[" * 2000}, 400, "not valid JSON"),  # too deep
        ("POST", "/v1/completions", {"body": [1, 2]}, 400, "JSON object"),
        ("POST", "/v1/completions", {"body": {"max_tokens": 1}}, 400, "'prompt' is required"),
        ("POST", "/v1/completions", {"body": {"prompt": [1, 2], "stream": True}}, 400,
         "stream=true is not supported"),
        ("POST", "/v1/completions", {"body": {"prompt": ["a"]}}, 400, "prompt.0"),
        ("POST", "/v1/completions", {"body": {"prompt": [1, -3]}}, 400, "prompt.1"),
        ("POST", "/v1/completions", {"body": {"prompt": []}}, 400, "prompt"),
        ("POST", "/v1/completions", {"body": {"prompt": [1], "max_tokens": 0}}, 400,
         "max_tokens"),
        ("POST", "/v1/completions", {"body": {"prompt": [1], "temprature": 0.1}}, 400,
         "unknown field(s) temprature"),
        ("POST", "/v1/completions", {"body": {"prompt": [[1], [2]]}}, 400, "one prompt"),
        ("POST", "/v1/completions", {"raw": b"x" * 3000}, 413, "over the limit of 2048"),
        ("POST", "/v1/completions", {"body": {"prompt": list(range(65))}}, 413,
         "at most 64"),
        ("POST", "/v1/completions", {"body": {"prompt": list(range(60)), "max_tokens": 30}},
         422, "maximum sequence length 80"),
        ("POST", "/v1/completions", {"body": {"prompt": [5, 1000]}}, 422, "vocabulary"),
        ("POST", "/v1/completions", {"body": {"prompt": "hello"}}, 422, "tokenizer"),
        ("POST", "/v1/completions", {"body": {"prompt": [1]},
                                     "headers": {"Content-Type": "text/plain"}}, 415,
         "Content-Type"),
        # (this client always sends Content-Length too: both framings at once are refused;
        # chunked alone is a 411, tests/live/test_live_http_server.py)
        ("POST", "/v1/completions", {"raw": b"{}", "headers": {"Transfer-Encoding": "chunked"}},
         400, "both Transfer-Encoding and Content-Length"),
        ("GET", "/v1/completions", {}, 405, "POST only"),
        ("GET", "/v2/nothing", {}, 404, "no route"),
    ],
)
async def test_http_errors_are_clear_and_service_keeps_serving(
    live: Services, method: str, path: str, kw: dict, status: int, needle: str
) -> None:
    gw = await live.gateway(**LIMITS)
    reply = await http(gw.http_port, method, path, **kw)
    assert reply.status == status, reply.body
    err = reply.json()["error"]
    assert err["code"] == status and needle in err["message"], err
    # Still serving after the error.
    health = await http(gw.http_port, "GET", "/health")
    assert health.status == 200 and health.json()["status"] == "ok"
    workers = await http(gw.http_port, "GET", "/v1/workers")
    assert workers.status == 200 and workers.json() == {"workers": []}


async def test_oversized_head_is_431(live: Services) -> None:
    gw = await live.gateway(**LIMITS)
    reply = await http(gw.http_port, "GET", "/health", headers={"X-Big": "y" * 20_000})
    assert reply.status == 431
    assert (await http(gw.http_port, "GET", "/health")).status == 200


async def test_nats_endpoint_errors(live: Services, nc: Client, uniq: str) -> None:
    await live.gateway(**LIMITS)
    subject = Subjects(uniq).gateway_completions()
    cases = [
        (b"{", 400, "not valid JSON"),
        (b'{"prompt_tokens": [1], "bogus": 1}', 400, "bogus"),
        (CompletionRequest(prompt_tokens=[1], stream=True), 400, "stream=true"),
        (CompletionRequest(prompt_tokens=list(range(65))), 413, "at most 64"),
        (CompletionRequest(prompt="text"), 422, "tokenizer"),
    ]
    for body, code, needle in cases:
        with pytest.raises(RemoteError) as err:
            await call(nc, subject, body, FirstToken, timeout_s=10)
        assert err.value.code == code and needle in err.value.description, err.value
    # Strict as over HTTP (JSON's own types only): these were coerced and queued.
    strict = [
        (b'{"prompt_tokens": [true, 2]}', "prompt_tokens.0"),
        (b'{"prompt_tokens": ["7", 2]}', "prompt_tokens.0"),
        (b'{"prompt_tokens": [2.0]}', "prompt_tokens.0"),
        (b'{"prompt_tokens": [1], "max_tokens": "3"}', "max_tokens"),
        (b'{"prompt_tokens": [1], "stream": "no"}', "stream"),
    ]
    for raw, field in strict:
        with pytest.raises(RemoteError) as err:
            await call(nc, subject, raw, FirstToken, timeout_s=10)
        assert err.value.code == 400 and field in err.value.description, err.value
    with pytest.raises(RemoteError) as err:
        await call(nc, subject, b'{"prompt_tokens": [1]}', FirstToken, timeout_s=10,
                   headers={"Content-Type": "text/plain"})
    assert err.value.code == 415 and "text/plain" in err.value.description, err.value


def test_the_gateways_settings_name_what_they_refuse_and_take_off_for_no_http() -> None:
    """A timeout of inf or past a day is refused by name (an infinite one crashed the start,
    making the claim bucket); ``off`` / ``none`` from the environment or ``--port`` is the
    documented NATS-only gateway (``http_port`` None), which no text could give before."""
    from services.gateway.main import parse_settings

    for field in ("nats_wait_s", "publish_timeout_s", "result_timeout_s"):
        for bad in ("inf", "nan", 1e300):
            with pytest.raises(ValidationError, match=field):
                GatewaySettings(**{field: bad})
    assert GatewaySettings(http_port="off").http_port is None  # type: ignore[arg-type]
    assert GatewaySettings(http_port="None").http_port is None  # type: ignore[arg-type]
    assert GatewaySettings(http_port="8081").http_port == 8081  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="http_port"):
        GatewaySettings(http_port="")  # type: ignore[arg-type]
    assert parse_settings(["--port", "off"]).http_port is None
    assert parse_settings(["--port", "0"]).http_port == 0
    with pytest.raises(SystemExit) as exit_:
        parse_settings(["--port", "eighty"])
    assert exit_.value.code == 2


async def test_no_nats_is_503(live: Services) -> None:
    """Once its NATS connection is gone, the gateway answers 503 (health and completions)."""
    gw = await live.gateway(**LIMITS)
    await gw.nc.close()
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": [1, 2, 3]})
    assert reply.status == 503 and "NATS" in reply.json()["error"]["message"]
    assert (await http(gw.http_port, "GET", "/health")).status == 503
    assert (await http(gw.http_port, "GET", "/v1/workers")).status == 503


def test_a_prompt_limit_beyond_the_intake_bound_is_refused_at_start() -> None:
    """``max_prompt_tokens`` above the intake message's bound (2^24 tokens) would accept
    prompts the intake then refuses to encode: the setting itself is refused, naming it."""
    assert GatewaySettings(max_prompt_tokens=MAX_TOKENS).max_prompt_tokens == MAX_TOKENS
    with pytest.raises(ValidationError, match="max_prompt_tokens"):
        GatewaySettings(max_prompt_tokens=MAX_TOKENS + 1)


async def test_a_client_id_of_the_gateways_own_form_is_400(live: Services) -> None:
    """The gateway's ids for requests without one ('r' + 32 hex digits) are claimed by
    nobody: a client may not send one (else other content under it got the first answer)."""
    gw = await live.gateway()
    own = new_request_id()
    reply = await http(gw.http_port, "POST", "/v1/completions",
                       {"prompt": [1, 2, 3], "request_id": own})
    assert reply.status == 400, reply.body
    assert own in reply.json()["error"]["message"] and "gateway's own ids" in \
        reply.json()["error"]["message"]
    check_client_id("r" + "0" * 31)  # one digit short: a client's
    check_client_id("R" + "0" * 32)
    check_client_id("r" + "0" * 32 + "x")


async def test_headers_count_against_max_payload_and_the_connection_survives(
        uniq: str, tmp_path: Path) -> None:
    """The NATS server checks a message's headers and payload against its max_payload and
    closes the connection of a client that exceeds it (for good: nats-py does not reconnect
    after that error); nats-py itself counts the payload alone. A prompt whose message fits
    by the payload alone but not with its headers and the room the scheduler needs to
    forward it is a 413, and the gateway keeps its connection. A client's huge tracestate
    is not forwarded."""
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 16384\n")
    server = EmbeddedNats(extra_args=("-c", str(conf))).start()
    services = Services(server.url, uniq, AsyncExitStack())
    try:
        gw = await services.gateway(result_timeout_s=0.5)
        assert gw.nc.max_payload == 16384
        # ~2 bytes a token in the message: a payload of ~13,000 bytes, under max_payload
        # alone, over it with the room.
        tokens = [1] * 6_500
        reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": tokens})
        assert reply.status == 413, reply.body
        msg = reply.json()["error"]["message"]
        assert "max_payload of 16384" in msg and "room to forward it" in msg
        size = int(msg.split("intake message of ")[1].split(" ")[0])
        assert size - INTAKE_HEADROOM_BYTES < 16384 < size  # the payload would have passed
        # A tracestate of many vendors' entries: accepted, not forwarded (the request then
        # waits for a first token that no scheduler here gives: 504).
        state = ",".join(f"v{i}=" + "x" * 200 for i in range(30))
        sub = await gw.nc.subscribe(Subjects(uniq).intake_requests())
        reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": [1, 2, 3]},
                           headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
                                    "tracestate": state})
        assert reply.status in (503, 504), reply.body
        got = await sub.next_msg(timeout=10)
        assert "tracestate" not in (got.headers or {}) and b"tracestate" not in got.data
        assert (got.headers or {}).get("traceparent", "").startswith("00-" + "1" * 32)
        assert gw.nc.is_connected
        assert (await http(gw.http_port, "GET", "/health")).status == 200
    finally:
        await services.close()
        server.stop()
