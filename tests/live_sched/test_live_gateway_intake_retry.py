"""The gateway tries its intake publish again after a JetStream 5xx answer ("JetStream system
temporarily unavailable", 10008: a leader election, a store being recovered), as it does
after a timeout, no responders or a lost connection: same loop, same deadline
(``nats_wait_s``), same ``Nats-Msg-Id``. Before, such an answer failed the request at once
(503). What retrying cannot change stays final at once: an answer below 500 (a check before
storing) and a failed store or full stream (10077). A 5xx may follow a write all the same, so
the request id's claim is kept after one, whatever came later.

The test plays the intake stream (the real one deleted): it takes the gateway's publishes on
the intake subject and answers them as JetStream would, with an error or a PubAck. Holding a
publish also lets a test lose the idempotency bucket between a claim and its withdrawal.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from live_sched_support import WAIT_S, Services
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from structlog.testing import capture_logs
from test_live_gateway_idempotency import (
    BODY,
    OTHER,
    answer,
    assert_conflict,
    claim_ttl,
    complete,
)

from services.gateway.idempotency import kv_key
from services.gateway.idempotency_kv import idempotency_kv
from shared.schemas import IntakeRequest, decode
from shared.subjects import Subjects

UNAVAILABLE: dict[str, Any] = {"code": 503, "err_code": 10008,
                               "description": "JetStream system temporarily unavailable"}
"""JetStream's answer while it has no leader for the stream, or recovers its store."""
STORE_FAILED: dict[str, Any] = {"code": 503, "err_code": 10077,
                                "description": "maximum messages exceeded"}
"""JetStream's answer of a full stream that discards new messages (or a failed store)."""
WRONG_LAST_SEQUENCE: dict[str, Any] = {"code": 400, "err_code": 10071,
                                       "description": "wrong last sequence: 0"}
"""A refusal on a check the stream makes before storing."""
RETRY_LOG = "intake publish failed; trying again"


class PlayedIntake:
    """The intake stream played by the test (the real one deleted): every publish the gateway
    sends is kept in :attr:`got` in order; with ``always`` each is answered with that error at
    once, else it waits until the test answers it (:meth:`refuse`, :meth:`ack`)."""

    def __init__(self, nc: Client, s: Subjects, always: dict[str, Any] | None = None) -> None:
        self.nc = nc
        self.s = s
        self.always = always
        self.got: asyncio.Queue[Msg] = asyncio.Queue()
        self.seen: list[Msg] = []

    async def start(self) -> PlayedIntake:
        async def take(msg: Msg) -> None:
            self.seen.append(msg)
            if self.always is not None:
                await self.refuse(msg, self.always)
            else:
                await self.got.put(msg)

        # The real stream gone, this subscription is the intake subject's only responder.
        await self.nc.jetstream().delete_stream(self.s.intake_stream())
        self.sub = await self.nc.subscribe(self.s.intake_requests(), cb=take)
        await self.nc.flush()
        return self

    async def next(self, request: asyncio.Task[Any]) -> Msg:
        """The gateway's next publish try for ``request``; fails with the client's reply if
        that came first (no try followed)."""
        taking = asyncio.ensure_future(self.got.get())
        await asyncio.wait({taking, request}, timeout=WAIT_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if taking.done():
            return taking.result()
        taking.cancel()
        if request.done():
            reply = request.result()
            raise AssertionError(f"answered without another try: {reply.status} {reply.body!r}")
        raise AssertionError("no publish try came")

    async def refuse(self, msg: Msg, error: dict[str, Any]) -> None:
        await msg.respond(json.dumps({"error": error}).encode())

    async def ack(self, msg: Msg, seq: int) -> None:
        await msg.respond(json.dumps({"stream": self.s.intake_stream(), "seq": seq}).encode())

    async def settled(self, gw: Any) -> None:
        """Whatever the gateway published so far has reached :attr:`seen`: the gateway's
        flush returns after the server took its publishes, ours after the server passed them
        on to us -- nats-py reads in order, so each of them is in the subscription's queue by
        then. ``take`` appends a message to :attr:`seen` in the very step it leaves that queue
        (before its first await), so an empty queue means all of them are there; no timer
        could say more, a pause would only guess (the bound is a hang guard)."""
        await gw.nc.flush()
        await self.nc.flush()
        async with asyncio.timeout(WAIT_S):
            while self.sub.pending_msgs:
                await asyncio.sleep(0)


def msg_id(msg: Msg) -> str | None:
    return (msg.headers or {}).get("Nats-Msg-Id")


def error_message(reply: Any) -> str:
    return str(reply.json()["error"]["message"])


async def test_a_5xx_answer_is_tried_again_under_the_same_msg_id(
    live: Services, nc: Client, uniq: str
) -> None:
    """The first publish gets "JetStream system temporarily unavailable" (503, 10008): the
    gateway publishes again, the same message under the same Nats-Msg-Id, and once that is
    stored waits for the result and answers it (before: 503 at once, one publish)."""
    s = Subjects(uniq)
    with capture_logs() as logs:
        # nats_wait_s (10 s) and publish_timeout_s (5 s) are the defaults, written out: the
        # test answers each try within them, however loaded the machine.
        gw = await live.gateway(nats_wait_s=10.0, publish_timeout_s=5.0,
                                result_timeout_s=WAIT_S)
        intake = await PlayedIntake(nc, s).start()
        request = asyncio.create_task(complete(gw, {**BODY, "request_id": "jsu-1"}))
        first = await intake.next(request)
        assert msg_id(first) == "jsu-1", first.headers
        await intake.refuse(first, UNAVAILABLE)
        second = await intake.next(request)
        assert msg_id(second) == "jsu-1", second.headers
        assert second.data == first.data
        await intake.ack(second, 1)
        # Stored: the gateway waits for this attempt's result (its arrival stamp echoed).
        sent = decode(IntakeRequest, second.data, second.headers)
        await answer(nc, s, "jsu-1", 7, sent.arrival_s)
        reply = await asyncio.wait_for(request, WAIT_S)
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["token_ids"] == [7]
    assert reply.json()["vtm"]["duplicate"] is False
    retried = [e for e in logs if e["event"] == RETRY_LOG]
    assert [(e["error"], e["code"], e["err_code"]) for e in retried] \
        == [("ServiceUnavailableError", 503, 10008)], retried
    await intake.settled(gw)
    assert len(intake.seen) == 2  # nothing after the ack
    await intake.sub.unsubscribe()


async def test_a_full_stream_or_failed_store_is_final_at_once_and_keeps_the_claim(
    live: Services, nc: Client, uniq: str
) -> None:
    """10077 (a 503 too: a store that failed, or a full stream discarding new messages) does
    not go away within seconds: one publish, 503 at once, though nats_wait_s would allow
    more tries. Like every 5xx it may follow a write, so the claim is kept: another request
    under the id is refused (409)."""
    s = Subjects(uniq)
    with capture_logs() as logs:
        gw = await live.gateway(nats_wait_s=10.0, publish_timeout_s=5.0, result_timeout_s=0.5)
        intake = await PlayedIntake(nc, s).start()
        body = {**BODY, "request_id": "jsu-2"}
        request = asyncio.create_task(complete(gw, body))
        first = await intake.next(request)
        assert msg_id(first) == "jsu-2", first.headers
        await intake.refuse(first, STORE_FAILED)
        reply = await asyncio.wait_for(request, WAIT_S)
    assert reply.status == 503, reply.body
    assert error_message(reply) \
        == "intake stream refused the request: maximum messages exceeded", reply.body
    # The publish is over once the client has its answer: everything it sent is here now.
    await intake.settled(gw)
    assert len(intake.seen) == 1 and intake.got.empty()
    assert not [e for e in logs if e["event"] == RETRY_LOG]
    assert gw.stats_data()["idempotency_keys"] == 1
    assert_conflict(await complete(gw, {**body, **OTHER}), "jsu-2")
    await intake.sub.unsubscribe()


async def test_a_5xx_on_every_try_ends_as_503_when_nats_wait_s_runs_out_and_keeps_the_claim(
    live: Services, nc: Client, uniq: str
) -> None:
    """JetStream stays unavailable: the publish is tried again (same Nats-Msg-Id) until
    nats_wait_s runs out, then 503 naming JetStream's answer -- not the 504 of a missing
    result. Any of those tries may have been stored, so the claim is kept, here and in the
    shared bucket: another request under the id is refused (409) at either gateway."""
    s = Subjects(uniq)
    js = nc.jetstream()
    # nats_wait_s leaves room for more than one try even if the first answer is slow.
    a = await live.gateway(nats_wait_s=2.0, publish_timeout_s=5.0, result_timeout_s=0.5)
    b = await live.gateway(nats_wait_s=0.0, result_timeout_s=0.5)
    intake = await PlayedIntake(nc, s, always=UNAVAILABLE).start()
    body = {**BODY, "request_id": "jsu-3"}
    reply = await complete(a, body)
    assert reply.status == 503, reply.body
    assert error_message(reply) == ("intake stream unavailable: JetStream system temporarily "
                                    "unavailable (code 503, err_code 10008)"), reply.body
    await intake.settled(a)
    assert len(intake.seen) >= 2, len(intake.seen)
    assert {msg_id(m) for m in intake.seen} == {"jsu-3"}
    kv = await js.key_value(s.idempotency_bucket())
    assert (await kv.get(kv_key("jsu-3"))).value
    assert a.stats_data()["idempotency_keys"] == 1
    seen = len(intake.seen)
    assert_conflict(await complete(b, {**body, **OTHER}), "jsu-3")
    assert_conflict(await complete(a, {**body, **OTHER}), "jsu-3")
    await intake.settled(b)
    assert len(intake.seen) == seen  # refused before publishing
    assert (a.counters["conflicts_shared"], b.counters["conflicts_shared"]) == (0, 1)
    assert a.counters["idempotency_release_failed"] == 0
    await intake.sub.unsubscribe()


async def test_a_refusal_after_a_5xx_keeps_the_claim(
    live: Services, nc: Client, uniq: str
) -> None:
    """A 5xx, then a refusal on a check before storing (a 4xx: final at once). The 4xx alone
    would withdraw the claim (nothing stored), but the 5xx try before it may have stored the
    message: the claim is kept, and another request under the id is refused (409)."""
    s = Subjects(uniq)
    gw = await live.gateway(nats_wait_s=10.0, publish_timeout_s=5.0, result_timeout_s=0.5)
    intake = await PlayedIntake(nc, s).start()
    body = {**BODY, "request_id": "jsu-4"}
    request = asyncio.create_task(complete(gw, body))
    await intake.refuse(await intake.next(request), UNAVAILABLE)
    await intake.refuse(await intake.next(request), WRONG_LAST_SEQUENCE)
    reply = await asyncio.wait_for(request, WAIT_S)
    assert reply.status == 503, reply.body
    assert error_message(reply) \
        == "intake stream refused the request: wrong last sequence: 0", reply.body
    await intake.settled(gw)
    assert len(intake.seen) == 2 and intake.got.empty()
    kv = await nc.jetstream().key_value(s.idempotency_bucket())
    assert (await kv.get(kv_key("jsu-4"))).value
    assert_conflict(await complete(gw, {**body, **OTHER}), "jsu-4")
    await intake.sub.unsubscribe()


async def test_a_withdrawal_after_the_bucket_was_made_again_lets_the_id_go(
    live: Services, nc: Client, uniq: str
) -> None:
    """A request claims its id in the bucket, and while its publish waits for the intake the
    bucket is lost and made again (empty). The intake then refuses the publish (a check
    before storing: definite), so the claim is withdrawn: the delete at the claim's revision
    finds no such revision in the new bucket. No record holds the id there, so the
    withdrawal is done and the local entry goes too: other content under the id is a new
    claim (refused by the intake as well: 503), not a 409. Before: the withdrawal counted as
    beaten by a later record, and this gateway refused the id for the claim's whole TTL."""
    s = Subjects(uniq)
    js = nc.jetstream()
    gw = await live.gateway(nats_wait_s=10.0, publish_timeout_s=5.0, result_timeout_s=0.5)
    intake = await PlayedIntake(nc, s).start()
    body = {**BODY, "request_id": "remade-1"}
    request = asyncio.create_task(complete(gw, body))
    first = await intake.next(request)
    kv = await js.key_value(s.idempotency_bucket())
    assert (await kv.get(kv_key("remade-1"))).value  # claimed
    await js.delete_key_value(s.idempotency_bucket())
    kv = await idempotency_kv(js, s, ttl_s=claim_ttl(gw))  # made again, empty
    await intake.refuse(first, WRONG_LAST_SEQUENCE)
    assert (await asyncio.wait_for(request, WAIT_S)).status == 503
    assert gw.counters["idempotency_release_failed"] == 0
    assert gw.stats_data()["idempotency_keys"] == 0
    other = asyncio.create_task(complete(gw, {**body, **OTHER}))
    await intake.refuse(await intake.next(other), WRONG_LAST_SEQUENCE)
    assert (await asyncio.wait_for(other, WAIT_S)).status == 503
    with pytest.raises(KeyNotFoundError):  # its claim in the new bucket withdrawn in turn
        await kv.get(kv_key("remade-1"))
    await intake.sub.unsubscribe()
