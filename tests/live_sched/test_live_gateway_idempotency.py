"""A client's request id names one request at every gateway replica, and after a gateway
restart: the content digests live in a JetStream KV bucket all replicas share
(services/gateway/idempotency_kv.py), with each gateway's memory in front. Before, each
gateway remembered only the ids it had seen itself, so a reuse with another request that came
to another replica (or to a restarted one) was answered with the first request's token.

Also: ids that are no legal KV key are claimed under their encoding, a claim whose intake
publish was definitely refused is withdrawn while one whose publish timed out (and may have
landed) is kept, a claim lasts the intake's window plus the publish's bound, and a bucket
that does not answer fails open (and is made again).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from live_sched_support import WAIT_S, Services, fake_token, http, wait_until
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StreamConfig
from nats.js.errors import KeyNotFoundError

from services.gateway.idempotency import Claim, kv_key, request_digest
from shared.service import INTAKE_DUPLICATE_WINDOW_S, bucket_keys, ensure_intake_stream
from shared.subjects import Subjects

B = 2
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
    a = await live.gateway(nats_wait_s=0.0, publish_timeout_s=0.2, result_timeout_s=0.5)
    b = await live.gateway(nats_wait_s=0.0, publish_timeout_s=0.2, result_timeout_s=0.5)
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
    a = await live.gateway(nats_wait_s=1.0, publish_timeout_s=0.2, result_timeout_s=0.5)
    b = await live.gateway(nats_wait_s=0.0, result_timeout_s=0.5)
    await js.delete_stream(s.intake_stream())
    sub = await nc.subscribe(s.intake_requests())  # answers nothing
    body = {**BODY, "request_id": "late-2"}
    publishing = asyncio.create_task(complete(a, body))
    first = await sub.next_msg(timeout=WAIT_S)
    await sub.unsubscribe()  # the first try times out; the later ones find no responders
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
    claims longer still by the shared claim's timeout, which its claim precedes."""
    s = Subjects(uniq)
    js = nc.jetstream()
    a = await live.gateway(nats_wait_s=3.0, publish_timeout_s=2.5)
    assert await bucket_max_age(nc, s) == pytest.approx(claim_ttl(a)) == 125.5
    assert a._fingerprints.window_s == pytest.approx(claim_ttl(a) + 2.5)
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
