"""A NATS completion still waiting for its first token when the gateway's stop grace ends
(``stop_grace_s``) is answered 503 ``service stopping`` (shared/service.py's contract for a
request its service gave up at a stop), as an HTTP one is answered 503 by the HTTP server's
close.

Found by a review of the gateway's stop: each NATS completion waits in a task of its own
(the endpoint's handler returns at once), which the stop cancelled without a word, so the
micro drain had nothing to wait for and the caller waited out its whole timeout for an
answer that never came."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from nats.aio.client import Client

from services.gateway.adapter import GatewayService
from services.gateway.settings import GatewaySettings
from shared.natsserver import EmbeddedNats
from shared.service import ERROR_CODE_HEADER, ERROR_HEADER, STOPPING_DESCRIPTION
from shared.subjects import Subjects

WAIT_S = 30.0  # hang guard, never a speed check


async def until(pred: Callable[[], bool], what: str) -> None:
    """Poll ``pred`` until true, for at most :data:`WAIT_S` (a hang guard)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not pred():
        assert loop.time() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.02)


async def test_a_nats_completion_in_flight_at_a_stop_is_answered_503(
        nats_server: EmbeddedNats, nc: Client, uniq: str) -> None:
    # No scheduler: the request waits for a first token that never comes (a long timeout),
    # outlasting the stop's grace (short here: test_gateway_stop_grace.py answers within it).
    gw = GatewayService(GatewaySettings(nats_url=nats_server.url, subject_prefix=uniq,
                                        result_timeout_s=600, http_port=None,
                                        stop_grace_s=0.2))
    run = asyncio.create_task(gw.run(handle_signals=False))
    try:
        await asyncio.wait_for(gw.started.wait(), WAIT_S)
        body = json.dumps({"prompt_tokens": list(range(9)), "request_id": "stop-1"}).encode()
        answer = asyncio.create_task(nc.request(Subjects(uniq).gateway_completions(), body,
                                                timeout=WAIT_S))
        await until(lambda: gw.waiting_for("stop-1") == 1, "the request published")
        gw.request_stop()
        msg = await answer  # before the fix: nats' TimeoutError after WAIT_S
        assert msg.headers is not None, msg
        assert msg.headers.get(ERROR_CODE_HEADER) == "503", msg.headers
        assert msg.headers.get(ERROR_HEADER) == STOPPING_DESCRIPTION, msg.headers
    finally:
        gw.request_stop()
        await asyncio.wait_for(run, WAIT_S)
