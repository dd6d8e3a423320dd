"""A client's request id names one request at every gateway replica, and after a gateway
restart: the content digests live in a JetStream KV bucket all replicas share
(services/gateway/idempotency_kv.py), with each gateway's memory in front. Before, each
gateway remembered only the ids it had seen itself, so a reuse with another request that came
to another replica (or to a restarted one) was answered with the first request's token.

Also: ids that are no legal KV key are claimed under their encoding, a claim whose intake
publish was definitely refused is withdrawn while one whose publish timed out (and may have
landed) is kept, a claim lasts the intake's window plus the publish's bound from the last
request sent under its id, it is withdrawn only by the last request holding it at a gateway,
the gateway's connection queues no publish while it is down, a bucket whose TTL may not be
raised is used as it is, and a bucket that does not answer fails open (and is made again).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from live_sched_support import WAIT_S, Services, fake_token, http, wait_until
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StreamConfig
from nats.js.errors import KeyNotFoundError
from structlog.testing import capture_logs

from services.gateway.idempotency import Claim, IdempotencyRecord, kv_key, request_digest
from services.gateway.idempotency_kv import (
    CLAIM_TRIES,
    STREAM_NOT_FOUND,
    WRONG_LAST_SEQUENCE,
    idempotency_kv,
)
from shared.natsserver import EmbeddedNats
from shared.schemas import FirstToken, IntakeRequest, TtftStages, decode, encode, to_json
from shared.service import INTAKE_DUPLICATE_WINDOW_S, bucket_keys, ensure_intake_stream
from shared.subjects import Subjects

B = 2
JS_UNAVAILABLE = 10008  # JetStream API error code: "JetStream system temporarily unavailable"
BODY: dict[str, Any] = {"prompt_tokens": list(range(9))}
OTHER: dict[str, Any] = {"prompt_tokens": list(range(1, 10))}


async def complete(gw: Any, body: dict[str, Any]) -> Any:
    return await http(gw.http_port, "POST", "/v1/completions", body)


def assert_conflict(reply: Any, rid: str) -> None:
    assert reply.status == 409, (reply.status, reply.body)
    err = reply.json()["error"]
    assert err["type"] == "conflict" and repr(rid) in err["message"], err


async def stats_data(nc: Client, gw: Any) -> dict[str, Any]:
    """The gateway's counters as ``$SRV.STATS`` shows them (the completions endpoint's data)."""
    answer = await nc.request(f"$SRV.STATS.{gw.name}.{gw.service.id}", b"", timeout=10)
    endpoints = json.loads(answer.data)["endpoints"]
    return next(e for e in endpoints if e["name"] == "completions")["data"]  # type: ignore[no-any-return]


async def served(live: Services, fake_worker: Any) -> Any:
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    return w


async def test_another_gateway_refuses_a_reused_id_and_replays_the_same_request(
    live: Services, fake_worker: Any, nc: Client
) -> None:
    """Gateway A accepts an id; gateway B (another replica on the same NATS, which never saw
    it) refuses the id with another prompt or max_tokens (409 naming it) and answers the same
    request with A's result, computed once (before: B answered the other request with A's
    token, 200)."""
    w = await served(live, fake_worker)
    a = await live.gateway(block_size=B)
    b = await live.gateway(block_size=B)
    body = {**BODY, "request_id": "shared-1"}
    first = await complete(a, body)
    assert first.status == 200 and first.json()["vtm"]["duplicate"] is False, first.body
    assert_conflict(await complete(b, {**body, **OTHER}), "shared-1")
    assert_conflict(await complete(b, {**body, "max_tokens": 2}), "shared-1")
    again = await complete(b, body)
    assert again.status == 200 and again.json()["vtm"]["duplicate"] is True, again.body
    assert again.json()["choices"] == first.json()["choices"]
    assert again.json()["choices"][0]["token_ids"] == [fake_token("shared-1")]
    assert [x.request.request_id for x in w.assignments] == ["shared-1"]  # computed once
    seen = await stats_data(nc, b)
    assert (seen["conflicts"], seen["conflicts_shared"]) == (2, 2), seen
    assert seen["idempotency_store_failed"] == 0, seen
    # B keeps no memory of A's id (its window runs from A's claim, which the bucket keeps);
    # A refuses from its own memory, with no round trip.
    assert b.stats_data()["idempotency_keys"] == 0
    assert_conflict(await complete(a, {**body, **OTHER}), "shared-1")
    assert (a.counters["conflicts"], a.counters["conflicts_shared"]) == (1, 0)


async def test_a_restarted_gateway_still_refuses_a_reused_id(
    live: Services, fake_worker: Any
) -> None:
    """The claim outlives the gateway that made it: a new gateway process (empty memory)
    refuses the id with another request and replays the same one."""
    w = await served(live, fake_worker)
    old = await live.gateway(block_size=B)
    body = {**BODY, "request_id": "restart-1"}
    first = await complete(old, body)
    assert first.status == 200, first.body
    await live.stop(old)
    new = await live.gateway(block_size=B)
    assert new.stats_data()["idempotency_keys"] == 0
    assert_conflict(await complete(new, {**body, **OTHER}), "restart-1")
    again = await complete(new, body)
    assert again.status == 200 and again.json()["vtm"]["duplicate"] is True, again.body
    assert again.json()["choices"] == first.json()["choices"]
    assert [x.request.request_id for x in w.assignments] == ["restart-1"]
    assert new.counters["conflicts_shared"] == 1


# The schema admits request ids of [a-z0-9_-] only, each its own key; the encoding is for any
# other string (the gateway's own claims, on its own bucket).
ODD_IDS = ["a b/ü*>", ".dot.", "a.b", "=YSBi", "YSBi", "$x", "plain-1"]
"""``=YSBi`` is ``a b``'s key if an id that is a legal key were its own key whatever it is:
under the encoding they are two keys."""


async def test_ids_that_are_no_legal_kv_key_are_claimed_under_their_encoding(
    live: Services, nc: Client, uniq: str
) -> None:
    gw = await live.gateway(result_timeout_s=0.5)
    # An id the schema admits, through the gateway (no scheduler: no first token, 504).
    assert (await complete(gw, {**BODY, "request_id": "plain-2"})).status == 504
    claims = gw._claims
    assert claims is not None
    d1, d2 = request_digest([1], 1), request_digest([2], 1)
    for rid in ODD_IDS:
        assert (await claims.claim(rid, d1)).claim is Claim.NEW, rid
    for rid in ODD_IDS:
        assert (await claims.claim(rid, d1)).claim is Claim.SAME, rid
        found = await claims.claim(rid, d2)
        assert found.claim is Claim.CONFLICT and found.first is not None, rid
        assert found.first.digest == d1.hex()
    s = Subjects(uniq)
    keys = await bucket_keys(nc.jetstream(), s.idempotency_bucket())
    assert keys == sorted(kv_key(r) for r in [*ODD_IDS, "plain-2"])
    assert "plain-2" in keys and "plain-1" in keys and "YSBi" in keys and "=YSBi" not in keys
    assert gw.counters["idempotency_store_failed"] == 0


async def test_a_claim_whose_publish_failed_is_withdrawn(
    live: Services, nc: Client, uniq: str
) -> None:
    """No intake (the stream is gone): the request is refused (503) and its claim withdrawn
    from the shared bucket, so another request under the id is not refused (409) at another
    gateway for a request that never ran."""
    s = Subjects(uniq)
    js = nc.jetstream()
    a = await live.gateway(nats_wait_s=0.0, result_timeout_s=0.5)
    b = await live.gateway(nats_wait_s=0.0, result_timeout_s=0.5)
    kv = await js.key_value(s.idempotency_bucket())
    # Published (no scheduler here: no first token, 504): its claim stays.
    assert (await complete(a, {**BODY, "request_id": "kept-1"})).status == 504
    assert (await kv.get(kv_key("kept-1"))).value
    await js.delete_stream(s.intake_stream())
    body = {**BODY, "request_id": "lost-1"}
    refused = await complete(a, body)
    assert refused.status == 503, refused.body
    with pytest.raises(KeyNotFoundError):
        await kv.get(kv_key("lost-1"))
    assert a.counters["idempotency_release_failed"] == 0
    await ensure_intake_stream(js, s)
    # Accepted and published (no scheduler here: no first token, 504), not refused.
    later = await complete(b, {**body, **OTHER})
    assert later.status == 504, later.body
    assert (await js.stream_info(s.intake_stream())).state.messages == 1


async def test_a_bucket_that_does_not_answer_fails_open_and_is_made_again(
    live: Services, fake_worker: Any, nc: Client, uniq: str
) -> None:
    """The bucket is gone (deleted, or lost with a server's store): a request with an id of
    its own is accepted all the same, counted, and checked by this gateway's memory alone;
    the gateway makes the bucket again, so the next ids are shared again."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await served(live, fake_worker)
    a = await live.gateway(block_size=B)
    b = await live.gateway(block_size=B)
    await js.delete_key_value(s.idempotency_bucket())
    body = {**BODY, "request_id": "open-1"}
    first = await complete(a, body)
    assert first.status == 200, first.body
    seen = await stats_data(nc, a)
    assert seen["idempotency_store_failed"] == 1 and seen["idempotency_keys"] == 1, seen
    assert_conflict(await complete(a, {**body, **OTHER}), "open-1")  # the memory still holds
    await js.key_value(s.idempotency_bucket())  # made again
    body2 = {**BODY, "request_id": "open-2"}
    assert (await complete(a, body2)).status == 200
    assert_conflict(await complete(b, {**body2, **OTHER}), "open-2")
    assert a.counters["idempotency_store_failed"] == 1


async def test_a_claim_whose_publish_was_refused_by_the_stream_is_withdrawn(
    live: Services, nc: Client, uniq: str
) -> None:
    """The intake stream answers, refusing the message (an APIError: here every message is
    over its size limit): definitely not stored, so the claim is withdrawn and another
    request under the id is not refused (409) -- it is refused by the stream too (503)."""
    s = Subjects(uniq)
    js = nc.jetstream()
    a = await live.gateway(nats_wait_s=0.0, result_timeout_s=0.5)
    b = await live.gateway(nats_wait_s=0.0, result_timeout_s=0.5)
    await js.delete_stream(s.intake_stream())
    await js.add_stream(StreamConfig(name=s.intake_stream(), subjects=[s.intake_requests()],
                                     max_msg_size=1))
    body = {**BODY, "request_id": "refused-1"}
    refused = await complete(a, body)
    assert refused.status == 503 and "refused" in refused.body.decode(), refused.body
    kv = await js.key_value(s.idempotency_bucket())
    with pytest.raises(KeyNotFoundError):
        await kv.get(kv_key("refused-1"))
    assert a.stats_data()["idempotency_keys"] == 0
    again = await complete(b, {**body, **OTHER})
    assert again.status == 503, again.body
    assert (a.counters["conflicts"], b.counters["conflicts"]) == (0, 0)


async def test_a_claim_whose_publish_timed_out_is_kept(
    live: Services, nc: Client, uniq: str
) -> None:
    """A publish whose ack never came may have been stored all the same; here it was (a
    silent responder took the gateway's message, made the intake stream again and stored the
    message there under its Nats-Msg-Id, answering nobody). The gateway answers 503, but
    keeps the id's claim, here and in the shared bucket: another request under the id is
    refused (409) at either gateway. Before, the claim was withdrawn, so the other request
    was published, de-duplicated by the intake as the stored one, and would have been
    answered with its result (no scheduler here: it waited for that result, 504)."""
    s = Subjects(uniq)
    js = nc.jetstream()
    # publish_timeout_s also bounds the bucket's claims: long enough for a loaded machine.
    a = await live.gateway(nats_wait_s=0.0, publish_timeout_s=2.0, result_timeout_s=0.5)
    b = await live.gateway(nats_wait_s=0.0, publish_timeout_s=2.0, result_timeout_s=0.5)
    await js.delete_stream(s.intake_stream())
    landed = asyncio.Event()

    async def store_silently(msg: Msg) -> None:
        # NOTE: nats-py runs one subscription's callbacks one after another, so the store
        # below, which this subscription sees too, comes here after `landed` is set.
        if landed.is_set():
            return
        assert msg.headers is not None and msg.headers["Nats-Msg-Id"] == "late-1"
        await ensure_intake_stream(js, s)
        ack = await js.publish(s.intake_requests(), msg.data, headers=msg.headers)
        assert ack.duplicate is None
        landed.set()

    sub = await nc.subscribe(s.intake_requests(), cb=store_silently)
    await nc.flush()
    body = {**BODY, "request_id": "late-1"}
    timed_out = await complete(a, body)
    assert timed_out.status == 503 and "TimeoutError" in timed_out.body.decode(), \
        timed_out.body
    await asyncio.wait_for(landed.wait(), WAIT_S)
    await sub.unsubscribe()
    assert (await js.stream_info(s.intake_stream())).state.messages == 1
    kv = await js.key_value(s.idempotency_bucket())
    assert (await kv.get(kv_key("late-1"))).value
    assert a.stats_data()["idempotency_keys"] == 1
    assert_conflict(await complete(b, {**body, **OTHER}), "late-1")
    assert_conflict(await complete(a, {**body, **OTHER}), "late-1")
    assert (a.counters["conflicts_shared"], b.counters["conflicts_shared"]) == (0, 1)
    assert (await js.stream_info(s.intake_stream())).state.messages == 1  # nothing more
    assert a.counters["idempotency_release_failed"] == 0


async def test_a_publish_that_timed_out_before_it_was_refused_keeps_its_claim(
    live: Services, nc: Client, uniq: str
) -> None:
    """The publish is tried again: a first try that timed out (a silent responder, which
    then goes) may have been stored though the later tries found no stream at all. Its
    claim is kept (before: the last try's "no responders" withdrew it)."""
    s = Subjects(uniq)
    js = nc.jetstream()
    # The first try ends by publish_timeout_s (which also bounds the bucket's claims: long
    # enough for a loaded machine); the tries go on for nats_wait_s, well past the flushed
    # unsubscribe below, so the last one finds no responders.
    a = await live.gateway(nats_wait_s=4.0, publish_timeout_s=1.0, result_timeout_s=0.5)
    b = await live.gateway(nats_wait_s=0.0, result_timeout_s=0.5)
    await js.delete_stream(s.intake_stream())
    sub = await nc.subscribe(s.intake_requests())  # answers nothing
    await nc.flush()
    body = {**BODY, "request_id": "late-2"}
    publishing = asyncio.create_task(complete(a, body))
    first = await sub.next_msg(timeout=WAIT_S)
    # The first try times out; once the server has the unsubscribe (the flush's answer
    # comes after it: shared.natsclient), the next ones find no responders.
    await sub.unsubscribe()
    await nc.flush()
    assert first.headers is not None and first.headers["Nats-Msg-Id"] == "late-2"
    failed = await publishing
    assert failed.status == 503 and "NoStreamResponseError" in failed.body.decode(), \
        failed.body
    kv = await js.key_value(s.idempotency_bucket())
    assert (await kv.get(kv_key("late-2"))).value
    assert a.stats_data()["idempotency_keys"] == 1
    assert_conflict(await complete(b, {**body, **OTHER}), "late-2")


def claim_ttl(gw: Any) -> float:
    """What a claim must last: the intake's window plus the longest its publish goes on
    (tries for nats_wait_s, each ending by publish_timeout_s)."""
    return INTAKE_DUPLICATE_WINDOW_S + gw.gsettings.nats_wait_s + gw.gsettings.publish_timeout_s


async def bucket_max_age(nc: Client, s: Subjects) -> float:
    info = await nc.jetstream().stream_info(f"KV_{s.idempotency_bucket()}")
    assert info.config.max_age is not None
    return info.config.max_age


async def test_a_claim_lasts_the_intake_window_plus_the_publish_bound(
    live: Services, nc: Client, uniq: str
) -> None:
    """The intake's window runs from the stored message, which may be stored up to
    nats_wait_s + publish_timeout_s after the claim: the bucket keeps a claim that much
    longer than the window (before: the window alone, 120 s), in a bucket the gateway makes,
    in one an older gateway made with the window alone (raised), and in one it makes again;
    a longer max_age (another replica's need) is left as it is. The local memory keeps its
    claims as long, from the start of each publish (its timer restarts there: the shared
    claim before it may take its timeout, and the bucket's re-making another)."""
    s = Subjects(uniq)
    js = nc.jetstream()
    a = await live.gateway(nats_wait_s=3.0, publish_timeout_s=2.5)
    assert await bucket_max_age(nc, s) == pytest.approx(claim_ttl(a)) == 125.5
    assert a._fingerprints.window_s == pytest.approx(claim_ttl(a))
    # A bucket made with the window alone (an older gateway's) is raised.
    await js.delete_key_value(s.idempotency_bucket())
    await js.create_key_value(bucket=s.idempotency_bucket(), ttl=INTAKE_DUPLICATE_WINDOW_S)
    b = await live.gateway(nats_wait_s=4.0, publish_timeout_s=2.0)
    assert await bucket_max_age(nc, s) == pytest.approx(claim_ttl(b)) == 126.0
    # A gateway that needs less leaves the longer max_age alone.
    c = await live.gateway(nats_wait_s=0.0, publish_timeout_s=1.0, result_timeout_s=0.5)
    assert claim_ttl(c) < claim_ttl(b)
    assert await bucket_max_age(nc, s) == pytest.approx(claim_ttl(b))
    # Made again after it was lost: with the TTL of the gateway that makes it.
    await js.delete_key_value(s.idempotency_bucket())
    assert (await complete(c, {**BODY, "request_id": "ttl-1"})).status == 504  # no scheduler
    assert c.counters["idempotency_store_failed"] == 1
    assert await bucket_max_age(nc, s) == pytest.approx(claim_ttl(c)) == 121.0


async def test_a_replay_stored_anew_holds_the_id_for_the_window_it_starts(
    live: Services, nc: Client, uniq: str
) -> None:
    """R1's publish times out having stored nothing, so its claim is kept; the same request
    sent again later (R2) is stored anew, and the intake de-duplicates the id from R2's
    message on. Before, R2 relied on R1's claim, which expired a claim TTL after R1: another
    request under the id between then and the end of R2's window was published, taken as a
    duplicate and answered with R2's result. Now every request restarts the claim's timer
    before it publishes -- the bucket's record is written again, this gateway's entry
    restarted -- so that request is refused (409), or, come after R2's window, is a message
    of its own. A short intake window (the gateway reads its stream's) lets the first claim
    expire within the test; the sleeps below only let the scenario's time pass, no assertion
    depends on how fast anything is."""
    s = Subjects(uniq)
    js = nc.jetstream()
    # Wide enough that a stall of a few seconds on a loaded machine changes nothing: the
    # bucket's claims are bounded by publish_timeout_s too (one that does not answer in time
    # fails open), and each step below has seconds to spare within the windows it relies on.
    window = 8.0
    await ensure_intake_stream(js, s, duplicate_window_s=window)
    a = await live.gateway(nats_wait_s=0.0, publish_timeout_s=3.0, result_timeout_s=0.5)
    b = await live.gateway(nats_wait_s=0.0, publish_timeout_s=3.0, result_timeout_s=0.5)
    ttl = window + 3.0  # + nats_wait_s + publish_timeout_s
    assert a._claim_ttl_s == pytest.approx(ttl)
    assert a._fingerprints.window_s == pytest.approx(ttl)
    assert await bucket_max_age(nc, s) == pytest.approx(ttl)
    kv = await js.key_value(s.idempotency_bucket())
    loop = asyncio.get_running_loop()
    # R1: a silent responder stands in for an intake that does not answer; nothing is stored.
    await js.delete_stream(s.intake_stream())
    sub = await nc.subscribe(s.intake_requests())
    await nc.flush()
    body = {**BODY, "request_id": "again-1"}
    first = await complete(a, body)
    r1_done = loop.time()  # R1's claim was made before this
    # R1's publish began publish_timeout_s (3 s) before it timed out: its claim ends by
    # r1_done - 3 + ttl = r1_done + window.
    assert first.status == 503 and "TimeoutError" in first.body.decode(), first.body
    rev1 = (await kv.get(kv_key("again-1"))).revision
    await sub.unsubscribe()
    await ensure_intake_stream(js, s, duplicate_window_s=window)
    # R2 well into R1's claim: stored (no scheduler here: no first token, 504), not a
    # duplicate, so the intake de-duplicates the id until `window` after R2's message.
    await asyncio.sleep(max(0.0, r1_done + 4.0 - loop.time()))
    r2_start = loop.time()
    again = await complete(a, body)
    assert again.status == 504, again.body
    assert (await js.stream_info(s.intake_stream())).state.messages == 1
    # The claim's timers restarted: the record written again (its age starts anew), the
    # local entry restarted as R2's publish started.
    assert (await kv.get(kv_key("again-1"))).revision > rev1
    until = a._fingerprints.expires_at("again-1")
    assert until is not None and until >= r2_start + ttl
    # Past R1's claim (by r1_done + window), within R2's window (from r1_done + 4 at the
    # earliest to r1_done + 12 or later, unless a loaded machine took longer): another
    # request under the id, at the replica that holds no memory of it.
    await asyncio.sleep(max(0.0, r1_done + window + 1.5 - loop.time()))
    other = await complete(b, {**body, **OTHER})
    messages = (await js.stream_info(s.intake_stream())).state.messages
    # Never R2's answer: refused, or (come after R2's window) a message of its own.
    assert other.status == 409 or (messages == 2 and other.status == 504), \
        (other.status, other.body, messages)


async def answer(nc: Client, s: Subjects, rid: str, token: int, arrival_s: float) -> None:
    """Publish a worker's FirstToken of the attempt stamped ``arrival_s`` (echoed, as workers
    do), stored in the results stream as workers store it."""
    stages = TtftStages(intake_wait_s=0, schedule_s=0, queue_wait_s=0, prefill_s=0,
                        kv_transfer_s=0, first_decode_s=0, total_s=0)
    data, headers = encode(FirstToken(request_id=rid, token=token, stages=stages,
                                      finished_at_s=time.time(), arrival_s=arrival_s))
    await nc.jetstream().publish(s.result(rid), data, headers=headers)


async def test_an_earlier_attempts_result_does_not_answer_a_new_request_under_its_id(
    live: Services, nc: Client, uniq: str
) -> None:
    """A is answered; its claim and its intake window pass, but the results stream keeps its
    answer (for its max_age from when it was stored). B, another prompt under A's id, is
    rightly a new claim and a message of its own -- and must get its own answer, never A's:
    not through a retry of B that is a duplicate publish (the kept result of the id), not
    through the look-up after a reconnect, not live (A's worker answering late). Before, a
    result was matched by request id alone and B got A's token. Results carry the arrival
    stamp of the attempt they answer: B takes its own; the retry, whose stored message is
    B's, takes those stamped after its publish's start minus the claim TTL. The sleep below
    only lets the scenario's time pass; no assertion depends on how fast anything is."""
    from structlog.testing import capture_logs

    s = Subjects(uniq)
    js = nc.jetstream()
    window = 8.0  # short, so that A's claim expires within the test; long for a stall
    await ensure_intake_stream(js, s, duplicate_window_s=window)
    taken: asyncio.Queue[IntakeRequest] = asyncio.Queue()

    async def take(msg: Msg) -> None:  # every intake publish, duplicates too
        await taken.put(decode(IntakeRequest, msg.data, msg.headers))

    sub = await nc.subscribe(s.intake_requests(), cb=take)
    await nc.flush()
    loop = asyncio.get_running_loop()
    with capture_logs() as logs:
        gw = await live.gateway(nats_wait_s=0.0, publish_timeout_s=3.0,
                                result_timeout_s=WAIT_S)
        ttl = window + 3.0
        assert gw._claim_ttl_s == pytest.approx(ttl)
        body = {**BODY, "request_id": "attempt-1"}
        first = asyncio.create_task(complete(gw, body))
        a = await asyncio.wait_for(taken.get(), WAIT_S)
        await answer(nc, s, "attempt-1", 11, a.arrival_s)
        answered = await first
        a_done = loop.time()  # A's claim restarted, and its message stored, before this
        assert answered.status == 200, answered.body
        assert answered.json()["choices"][0]["token_ids"] == [11]
        # Past A's claim (and so past A's window).
        await asyncio.sleep(max(0.0, a_done + ttl + 1.0 - loop.time()))
        other = {**body, **OTHER}
        b_task = asyncio.create_task(complete(gw, other))
        b = await asyncio.wait_for(taken.get(), WAIT_S)
        assert b.arrival_s > a.arrival_s and b.input_len == len(OTHER["prompt_tokens"])
        # (1) A retry of B: a duplicate publish, while the results stream keeps A's answer.
        retry = asyncio.create_task(complete(gw, other))

        def looked_up() -> list[dict[str, Any]]:
            return [e for e in logs if e["event"].startswith("replayed request id")]

        await wait_until(lambda: bool(looked_up()) or retry.done(), "the retry's look-up")
        assert not retry.done(), retry.result().body  # not answered with A's token
        assert looked_up()[0]["kept"] is False
        assert (await js.stream_info(s.intake_stream())).state.messages == 2  # A's, B's
        # (2) The look-up after a reconnect (the sweeper sees the counter move).
        gw.nc.stats["reconnects"] += 1

        def swept() -> list[dict[str, Any]]:
            return [e for e in logs if e["event"].startswith("waiting requests looked up")]

        await wait_until(lambda: bool(swept()), "the sweeper's look-up")
        assert swept()[0]["answered"] == 0
        assert not b_task.done() and not retry.done()
        # (3) Live: A's worker answers again (late), then B's answers B. One publisher on
        # one subject: the gateway sees them in this order.
        await answer(nc, s, "attempt-1", 11, a.arrival_s)
        await answer(nc, s, "attempt-1", 22, b.arrival_s)
        got_b, got_retry = await asyncio.wait_for(asyncio.gather(b_task, retry), WAIT_S)
    await sub.unsubscribe()
    assert got_b.status == 200 and got_retry.status == 200, (got_b.body, got_retry.body)
    assert got_b.json()["choices"][0]["token_ids"] == [22]
    assert got_retry.json()["choices"][0]["token_ids"] == [22]
    assert (got_b.json()["vtm"]["duplicate"], got_retry.json()["vtm"]["duplicate"]) \
        == (False, True)
    assert gw.waiting_for("attempt-1") == 0


class PlayedBucket:
    """The idempotency bucket played by the test (the real one deleted): each write (a
    claim's create or rewrite) and delete (a withdrawal) the gateway sends waits until the
    test answers it, as JetStream would (a PubAck naming the revision written)."""

    def __init__(self, nc: Client, s: Subjects) -> None:
        self.nc = nc
        self.bucket = s.idempotency_bucket()
        self.got: asyncio.Queue[Msg] = asyncio.Queue()

    async def start(self) -> PlayedBucket:
        async def hold(msg: Msg) -> None:
            await self.got.put(msg)

        self.sub = await self.nc.subscribe(f"$KV.{self.bucket}.>", cb=hold)
        await self.nc.flush()
        return self

    async def next(self) -> Msg:
        return await asyncio.wait_for(self.got.get(), WAIT_S)

    async def answer(self, msg: Msg, revision: int) -> None:
        await msg.respond(json.dumps({"stream": f"KV_{self.bucket}", "seq": revision}).encode())

    async def refuse(self, msg: Msg, err_code: int, code: int = 400) -> None:
        """Answer the write with a JetStream API error (10071: the key's last revision is not
        the one the write expected -- for a create, the key exists)."""
        await msg.respond(json.dumps({"error": {"code": code, "err_code": err_code,
                                                "description": "played"}}).encode())


async def refused_with_played_bucket(live: Services, nc: Client,
                                     s: Subjects) -> tuple[Any, PlayedBucket]:
    """A gateway whose every intake publish is refused (no intake stream) and whose bucket
    the test plays (:class:`PlayedBucket`)."""
    js = nc.jetstream()
    gw = await live.gateway(nats_wait_s=0.0, publish_timeout_s=WAIT_S, result_timeout_s=0.5)
    await js.delete_key_value(s.idempotency_bucket())
    bucket = await PlayedBucket(nc, s).start()
    await js.delete_stream(s.intake_stream())
    return gw, bucket


def is_delete(msg: Msg, revision: int) -> bool:
    h = msg.headers or {}
    return h.get("KV-Operation") == "DEL" and \
        h.get("Nats-Expected-Last-Subject-Sequence") == str(revision)


async def test_a_claim_answered_after_five_seconds_is_decided_within_a_longer_publish_bound(
    live: Services, nc: Client, uniq: str
) -> None:
    """``publish_timeout_s`` bounds a claim (8 s here): a bucket that answers after 5.5 s --
    past nats-py's default JetStream request timeout, 5 s -- decides it. Before, the claim's
    request gave up at 5 s whatever the setting, and the request failed open
    (``idempotency_store_failed``)."""
    s = Subjects(uniq)
    js = nc.jetstream()
    a = await live.gateway(publish_timeout_s=8.0, result_timeout_s=0.5)
    await js.delete_key_value(s.idempotency_bucket())
    bucket = await PlayedBucket(nc, s).start()
    r = asyncio.create_task(complete(a, {**BODY, "request_id": "slow-1"}))
    write = await bucket.next()
    await asyncio.sleep(5.5)  # the bucket is slow: past nats-py's 5 s, within the 8 s bound
    await bucket.answer(write, 1)
    assert (await r).status == 504  # claimed, published; no scheduler here
    assert a.counters["idempotency_store_failed"] == 0
    assert a.stats_data()["idempotency_keys"] == 1


async def test_a_refused_request_leaves_the_claim_to_those_still_holding_it(
    live: Services, nc: Client, uniq: str
) -> None:
    """R1 and R2, one request under one id at one gateway, every publish refused (no intake
    stream). R2 has made its local claim and waits for the bucket when R1's publish is
    refused: R1 withdraws nothing (before: it saw no one waiting for a result -- R2 was not
    yet -- and withdrew the claim R2 was about to publish under). R2, the last holder, then
    withdraws what they wrote (every publish refused). A request that comes while that
    withdrawal waits for the bucket finds the claim still there: with other content it is
    refused (409), with this content it holds the claim, and R2 leaves it the local entry."""
    s = Subjects(uniq)
    a, bucket = await refused_with_played_bucket(live, nc, s)
    body = {**BODY, "request_id": "two-1"}
    r1 = asyncio.create_task(complete(a, body))
    w1 = await bucket.next()  # R1's create
    r2 = asyncio.create_task(complete(a, body))
    w2 = await bucket.next()  # R2's: it holds its local claim and waits for the bucket
    assert not is_delete(w1, 0) and not is_delete(w2, 0)
    await bucket.answer(w1, 1)  # R1: NEW; its publish is refused
    sent = asyncio.create_task(bucket.next())
    done, _ = await asyncio.wait({r1, sent}, timeout=WAIT_S,
                                 return_when=asyncio.FIRST_COMPLETED)
    assert done == {r1}, "R1 withdrew the claim R2 holds"
    assert (await r1).status == 503
    assert a.stats_data()["idempotency_keys"] == 1
    await bucket.answer(w2, 2)  # R2: NEW (as played); its publish is refused: it is last
    d2 = await sent
    assert is_delete(d2, 2), d2.headers  # what they wrote, at its revision
    # While that withdrawal waits: other content is refused, this content holds the claim.
    assert_conflict(await complete(a, {**body, **OTHER}), "two-1")
    r3 = asyncio.create_task(complete(a, body))
    w3 = await bucket.next()
    await bucket.answer(d2, 3)
    assert (await r2).status == 503
    assert a.stats_data()["idempotency_keys"] == 1  # left to R3
    await bucket.answer(w3, 4)  # R3: NEW; refused, the last: withdraws all
    d3 = await bucket.next()
    assert is_delete(d3, 4), d3.headers
    await bucket.answer(d3, 5)
    assert (await r3).status == 503
    assert a.stats_data()["idempotency_keys"] == 0
    assert a.counters["idempotency_release_failed"] == 0
    await bucket.sub.unsubscribe()


async def test_a_claim_whose_key_keeps_changing_is_refused_not_failed_open(
    live: Services, nc: Client, uniq: str
) -> None:
    """Every create of the claim is refused as the key exists, and every read that follows
    finds no key -- what a lagging replica of a clustered bucket answers (played: the
    bucket's stream is gone, so each read is "not found"). After CLAIM_TRIES rounds the
    request is refused (503, counted as contended), nothing is published and the local claim
    is gone again. Before: the claim failed open and the request ran on this gateway's
    memory alone, though the bucket held someone's claim of the id. A claim that loses two
    rounds and wins the third goes on as usual; one that loses a round and then runs out of
    time (a slow lagging cluster) is refused too."""
    s = Subjects(uniq)
    js = nc.jetstream()
    # The claim's bound (publish_timeout_s) far above what the played rounds take.
    a = await live.gateway(result_timeout_s=0.5, publish_timeout_s=WAIT_S)
    slow = await live.gateway(result_timeout_s=0.5, publish_timeout_s=1.0)
    await js.delete_key_value(s.idempotency_bucket())
    bucket = await PlayedBucket(nc, s).start()
    body = {**BODY, "request_id": "busy-1"}
    r1 = asyncio.create_task(complete(a, body))
    for _ in range(CLAIM_TRIES):
        write = await bucket.next()
        assert not is_delete(write, 0)
        await bucket.refuse(write, WRONG_LAST_SEQUENCE)
    refused = await r1
    assert refused.status == 503 and "being claimed" in refused.body.decode(), refused.body
    assert (a.counters["idempotency_contended"], a.counters["idempotency_store_failed"]) \
        == (1, 0)
    assert (await js.stream_info(s.intake_stream())).state.messages == 0
    assert a.stats_data()["idempotency_keys"] == 0
    # Two rounds lost, the third decides: claimed (NEW), published, no first token (504).
    r2 = asyncio.create_task(complete(a, {**body, **OTHER}))
    for _ in range(2):
        await bucket.refuse(await bucket.next(), WRONG_LAST_SEQUENCE)
    await bucket.answer(await bucket.next(), 7)
    assert (await r2).status == 504
    assert (await js.stream_info(s.intake_stream())).state.messages == 1
    assert a.counters["idempotency_contended"] == 1
    # One round lost, the next create never answered: out of time, still contended.
    r3 = asyncio.create_task(complete(slow, {**BODY, "request_id": "busy-2"}))
    await bucket.refuse(await bucket.next(), WRONG_LAST_SEQUENCE)
    held = await bucket.next()
    assert not is_delete(held, 0)
    refused = await r3
    assert refused.status == 503 and "being claimed" in refused.body.decode(), refused.body
    assert (slow.counters["idempotency_contended"], slow.counters["idempotency_store_failed"]) \
        == (1, 0)
    assert (await js.stream_info(s.intake_stream())).state.messages == 1
    await bucket.sub.unsubscribe()


async def test_a_burst_of_one_requests_replays_at_one_gateway_is_never_contended(
    live: Services, nc: Client, uniq: str
) -> None:
    """Many replays of one request (one id, one content) at once at one gateway: each claim
    finds the record and rewrites it, and all but one rewrite lose to another's. A rewrite
    lost to the same content is a replay all the same (SAME): none is refused. Before: a
    claim whose rewrites kept losing was refused (503) after its rounds -- some of a
    hundred, on one server with nothing wrong."""
    s = Subjects(uniq)
    js = nc.jetstream()
    a = await live.gateway(result_timeout_s=0.5, publish_timeout_s=WAIT_S)
    body = {**BODY, "request_id": "replays-1"}
    assert (await complete(a, body)).status == 504  # claimed and published; no scheduler
    replies = await asyncio.gather(*(complete(a, body) for _ in range(100)))
    assert sorted({r.status for r in replies}) == [504], [r.body for r in replies
                                                          if r.status != 504][:3]
    assert (a.counters["idempotency_contended"], a.counters["idempotency_store_failed"],
            a.counters["conflicts"]) == (0, 0, 0)
    assert (await js.stream_info(s.intake_stream())).state.messages == 1


async def test_a_burst_that_finds_the_bucket_missing_makes_it_once(
    live: Services, nc: Client, uniq: str
) -> None:
    """Four requests with ids of their own claim at once, and the bucket answers each that
    it is missing (played: "stream not found"). Each goes on unchecked (fail open: published,
    no scheduler here, 504), and the bucket is made again once -- by the first; the others
    await that making or find it ended since their claim began. Before: each request made it
    again itself, one after another."""
    s = Subjects(uniq)
    js = nc.jetstream()
    a = await live.gateway(result_timeout_s=0.5)
    await js.delete_key_value(s.idempotency_bucket())
    bucket = await PlayedBucket(nc, s).start()
    n = 4
    requests = [asyncio.create_task(complete(a, {**BODY, "request_id": f"burst-{i}"}))
                for i in range(n)]
    writes = [await bucket.next() for _ in range(n)]  # every claim waits for the bucket
    for write in writes:
        await bucket.refuse(write, STREAM_NOT_FOUND, code=404)
    assert [r.status for r in await asyncio.gather(*requests)] == [504] * n
    assert a.counters["idempotency_store_failed"] == n
    assert a.counters["idempotency_bucket_remade"] == 1
    await bucket.sub.unsubscribe()
    await js.key_value(s.idempotency_bucket())  # made again
    # The next claim is shared again and goes to the made bucket: no further making.
    assert (await complete(a, {**BODY, "request_id": "burst-after"})).status == 504
    assert (a.counters["idempotency_store_failed"], a.counters["idempotency_bucket_remade"]) \
        == (n, 1)


async def test_a_claim_the_bucket_did_not_decide_is_written_there_once_it_answers(
    live: Services, nc: Client, uniq: str
) -> None:
    """The bucket is missing when gateway A claims an id: the request goes on (fail open),
    and once the bucket is made again A writes the claim there, so gateway B refuses the id
    with other content (409). Before: B took it as new, and its publish -- a duplicate at
    the intake -- would have answered B's request with A's token. An id claimed at B with
    other content while A's claim was undecided is counted as split when A gets to it."""
    s = Subjects(uniq)
    js = nc.jetstream()
    a = await live.gateway(result_timeout_s=0.5)
    b = await live.gateway(result_timeout_s=0.5)
    await js.delete_key_value(s.idempotency_bucket())
    body = {**BODY, "request_id": "late-1"}
    assert (await complete(a, body)).status == 504  # accepted, published; no scheduler here
    assert a.counters["idempotency_store_failed"] == 1
    await wait_until(lambda: a.counters["idempotency_shared_late"] == 1, "claim shared late")
    kv = await js.key_value(s.idempotency_bucket())
    assert (await kv.get(kv_key("late-1"))).value
    assert_conflict(await complete(b, {**body, **OTHER}), "late-1")
    assert b.counters["conflicts_shared"] == 1
    # Undecided at A (the bucket answers "temporarily unavailable"), and claimed with other
    # content (at another gateway, played) before A's next try: A finds it split.
    await js.delete_key_value(s.idempotency_bucket())
    bucket = await PlayedBucket(nc, s).start()
    r = asyncio.create_task(complete(a, {**BODY, "request_id": "late-2"}))
    await bucket.refuse(await bucket.next(), JS_UNAVAILABLE, code=503)
    assert (await r).status == 504
    held = await bucket.next()  # A's try to share it
    # A's next tries wait until the bucket is made with the other claim in it. Without
    # that, a stalled machine could let `held` end at A unanswered (a JetStream request
    # gives up after 5 s), and A's next try would find the played bucket gone and the real
    # one not there yet (no responders: A makes the bucket itself, counted) or made and
    # still empty (A's claim NEW: no split) -- windows the test opens, not the bucket.
    ready = asyncio.Event()
    claims = a._claims
    real_claim = claims.claim

    async def claim_once_ready(rid: str, digest: Any) -> Any:
        await ready.wait()
        return await real_claim(rid, digest)

    claims.claim = claim_once_ready  # `held`'s try is under way already: it is not held up
    await bucket.sub.unsubscribe()
    kv = await idempotency_kv(js, s, ttl_s=claim_ttl(a))
    other = IdempotencyRecord(digest="0" * 32, accepted_s=time.time())
    await kv.create(kv_key("late-2"), to_json(other))
    ready.set()
    await bucket.refuse(held, JS_UNAVAILABLE, code=503)
    await wait_until(lambda: a.counters["idempotency_split"] == 1, "late-2 found split")
    assert a.counters["idempotency_shared_late"] == 1 and not a._unshared
    assert (a.counters["idempotency_store_failed"], a.counters["idempotency_bucket_remade"]) \
        == (2, 1)


async def test_a_catch_up_step_that_fails_unexpectedly_is_tried_again(
    live: Services, nc: Client, uniq: str
) -> None:
    """The bucket is missing when gateway A claims an id (fail open), and A's first try to
    write the claim there once it is back raises an exception no bucket gives (a defect,
    played by the test): it is logged with its traceback, and the claim is written on the
    next try all the same. Before: the exception ended the catch-up task, and the claim
    waited unshared until another fail-open claim started it again."""
    s = Subjects(uniq)
    js = nc.jetstream()
    a = await live.gateway(result_timeout_s=0.5)
    await js.delete_key_value(s.idempotency_bucket())
    claims = a._claims
    real_claim = claims.claim
    calls: list[str] = []

    async def claim(rid: str, digest: Any) -> Any:
        calls.append(rid)
        if len(calls) == 2:  # the request's own claim is the first; the catch-up's the second
            raise RuntimeError("played defect")
        return await real_claim(rid, digest)

    claims.claim = claim
    with capture_logs() as logs:
        assert (await complete(a, {**BODY, "request_id": "defect-1"})).status == 504
        await wait_until(lambda: a.counters["idempotency_shared_late"] == 1,
                         "claim shared after the failed step")
    assert calls == ["defect-1"] * 3
    failed = [e for e in logs if e["event"].startswith("idempotency catch-up step failed")]
    assert len(failed) == 1 and failed[0]["log_level"] == "error", failed
    kv = await js.key_value(s.idempotency_bucket())
    assert (await kv.get(kv_key("defect-1"))).value


async def test_a_withdrawal_the_bucket_did_not_decide_is_done_once_it_answers(
    live: Services, nc: Client, uniq: str
) -> None:
    """A request's publish is refused (no intake stream), and the withdrawal of its claim
    meets a bucket that answers "temporarily unavailable" (played): the claim stays for the
    moment -- here too, other content under the id is refused (409) --, and the delete at
    the claim's revision is sent again until the bucket takes it; then the local entry goes
    as well, and other content under the id is a new claim. Before: the claim stayed,
    here and in the bucket, until it expired (the intake's window plus the publish's bound)."""
    s = Subjects(uniq)
    a, bucket = await refused_with_played_bucket(live, nc, s)
    body = {**BODY, "request_id": "unwithdrawn-1"}
    r1 = asyncio.create_task(complete(a, body))
    await bucket.answer(await bucket.next(), 3)  # claimed: NEW at revision 3
    delete = await bucket.next()  # its publish refused: the withdrawal
    assert is_delete(delete, 3), delete.headers
    await bucket.refuse(delete, JS_UNAVAILABLE, code=503)
    assert (await r1).status == 503
    assert a.counters["idempotency_release_failed"] == 1
    assert_conflict(await complete(a, {**body, **OTHER}), "unwithdrawn-1")  # kept for now
    again = await bucket.next()  # tried again, at the same revision
    assert is_delete(again, 3), again.headers
    await bucket.answer(again, 4)
    await wait_until(lambda: a.counters["idempotency_withdrawn_late"] == 1, "withdrawn late")
    assert a.stats_data()["idempotency_keys"] == 0
    # Other content under the id: no longer refused here; it claims the id in the bucket.
    r2 = asyncio.create_task(complete(a, {**body, **OTHER}))
    claim = await bucket.next()
    assert not is_delete(claim, 3) and claim.subject.endswith(kv_key("unwithdrawn-1"))
    await bucket.answer(claim, 5)
    withdrawal = await bucket.next()  # its publish refused too: withdrawn at once
    assert is_delete(withdrawal, 5), withdrawal.headers
    await bucket.answer(withdrawal, 6)
    assert (await r2).status == 503
    assert (a.counters["idempotency_release_failed"], a.stats_data()["idempotency_keys"]) \
        == (1, 0)
    await bucket.sub.unsubscribe()


async def test_a_replay_stored_anew_after_the_intake_was_lost_takes_the_first_answer(
    live: Services, nc: Client, uniq: str
) -> None:
    """A is published and waits (no scheduler here). The intake is then lost (deleted and
    made anew, as by a server that lost its store) and A is sent again, the same request
    under the same id: its claim holds (SAME), and its publish is stored anew, no
    duplicate. A's first attempt's answer (its worker, late) answers both. Before, a replay
    stored anew took only its own attempt's result -- so it got A's answer only when the
    gateway's republish after the loss happened to store the message first (its own
    publish then a duplicate), else it waited for nothing (504)."""
    s = Subjects(uniq)
    js = nc.jetstream()
    taken: asyncio.Queue[IntakeRequest] = asyncio.Queue()

    async def take(msg: Msg) -> None:
        await taken.put(decode(IntakeRequest, msg.data, msg.headers))

    sub = await nc.subscribe(s.intake_requests(), cb=take)
    await nc.flush()
    gw = await live.gateway(nats_wait_s=0.0, publish_timeout_s=WAIT_S, result_timeout_s=WAIT_S)
    body = {**BODY, "request_id": "lost-intake-1"}
    original = asyncio.create_task(complete(gw, body))
    first = await asyncio.wait_for(taken.get(), WAIT_S)
    await js.delete_stream(s.intake_stream())
    await ensure_intake_stream(js, s)
    replay = asyncio.create_task(complete(gw, body))
    again = await asyncio.wait_for(taken.get(), WAIT_S)
    assert again.arrival_s > first.arrival_s
    # The replay's publish acknowledged (stored anew) before the answer comes.
    await wait_until(lambda: all(w.decided for w in gw._waiting.get("lost-intake-1", [])),
                     "the replay's ack")
    assert (await js.stream_info(s.intake_stream())).state.messages == 1
    await answer(nc, s, "lost-intake-1", 7, first.arrival_s)
    for reply in (await original, await replay):
        assert reply.status == 200, reply.body
        assert reply.json()["choices"][0]["token_ids"] == [7], reply.body
    await sub.unsubscribe()


async def test_a_gateway_queues_no_publish_while_disconnected(uniq: str) -> None:
    """nats-py keeps what is published while its connection is down and sends it once the
    connection is back, however late: an intake publish given up after its bound could be
    stored after its claim expired. The gateway's connection queues no publish
    (pending_size=0): one while disconnected fails at once, sent never, and the intake
    publish is tried again once the connection is back (before: that error escaped the
    publish, a 500 with the claim kept)."""
    from structlog.testing import capture_logs

    from shared.schemas import IntakeRequest, encode

    server = EmbeddedNats().start()
    port = int(server.url.rsplit(":", 1)[1])
    services = Services(server.url, uniq, AsyncExitStack())
    again: EmbeddedNats | None = None
    try:
        s = Subjects(uniq)
        # From the gateway's first log line on: structlog keeps a logger's configuration.
        with capture_logs() as logs:
            gw = await services.gateway(nats_wait_s=WAIT_S, publish_timeout_s=2.0,
                                        result_timeout_s=0.5)
            assert server.pid is not None
            os.kill(server.pid, signal.SIGKILL)  # its store stays for the next one
            await wait_until(lambda: not server.running and not gw.nats_connected,
                             "the gateway sees the server gone")
            with pytest.raises(nats.errors.OutboundBufferLimitError):
                await gw.nc.publish(s.intake_requests(), b"queued?")
            data, headers = encode(IntakeRequest(
                request_id="down-1", input_len=4, block_hashes=[], block_size=B, max_tokens=1,
                arrival_s=1.0, trace_context={}))
            headers["Nats-Msg-Id"] = "down-1"
            publishing = asyncio.create_task(gw._publish_intake(data, headers))
            await wait_until(lambda: publishing.done() or any(
                e["event"] == "intake publish failed; trying again"
                and e.get("error") == "OutboundBufferLimitError" for e in logs),
                "a try refused while disconnected")
            assert not publishing.done(), publishing.exception()  # waits for the connection
            again = EmbeddedNats(port=port, store_dir=server.store_dir).start()
            ack = await asyncio.wait_for(publishing, WAIT_S)
        assert ack.duplicate is None and ack.seq == 1
        check = await nats.connect(again.url)
        try:
            info = await check.jetstream().stream_info(s.intake_stream())
            assert info.state.messages == 1
        finally:
            await check.close()
    finally:
        await services.close()
        if again is not None:
            again.stop()
        server.stop()


async def test_a_bucket_whose_ttl_may_not_be_raised_is_used_as_it_is(
    uniq: str, tmp_path: Path
) -> None:
    """A gateway whose NATS user may not update streams finds the bucket made with a shorter
    TTL (an older gateway's): the refused raise is a warning and the bucket is used as it is
    (before: the gateway did not start)."""
    from structlog.testing import capture_logs

    conf = tmp_path / "perms.conf"
    conf.write_text(
        'authorization { users = [\n'
        '  {user: "gw", password: "gw-pass", permissions: {\n'
        '    publish: {allow: [">"], deny: ["$JS.API.STREAM.UPDATE.>"]},\n'
        '    subscribe: {allow: [">"]}}}\n'
        '  {user: "admin", password: "admin-pass"}\n'
        ']}\n')
    server = EmbeddedNats(extra_args=("-c", str(conf))).start()
    port = int(server.url.rsplit(":", 1)[1])
    admin = await nats.connect(f"nats://admin:admin-pass@127.0.0.1:{port}")
    services = Services(server.url, uniq, AsyncExitStack())
    s = Subjects(uniq)
    try:
        await admin.jetstream().create_key_value(bucket=s.idempotency_bucket(),
                                                 ttl=INTAKE_DUPLICATE_WINDOW_S)
        with capture_logs() as logs:
            gw = await services.gateway(nats_user="gw", nats_password="gw-pass",
                                        nats_wait_s=0.0, result_timeout_s=0.5)
        assert [e for e in logs if e["event"].startswith("idempotency bucket's max_age not")]
        assert await bucket_max_age(admin, s) == INTAKE_DUPLICATE_WINDOW_S
        # Serving, with the bucket as it is.
        assert (await complete(gw, {**BODY, "request_id": "perm-1"})).status == 504
        kv = await admin.jetstream().key_value(s.idempotency_bucket())
        assert (await kv.get(kv_key("perm-1"))).value
        assert gw.counters["idempotency_store_failed"] == 0
    finally:
        await services.close()
        await admin.close()
        server.stop()
