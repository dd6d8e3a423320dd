"""A client's request id names one request at every gateway replica, and after a gateway
restart: the content digests live in a JetStream KV bucket all replicas share
(services/gateway/idempotency_kv.py), with each gateway's memory in front. Before, each
gateway remembered only the ids it had seen itself, so a reuse with another request that came
to another replica (or to a restarted one) was answered with the first request's token.

Also: ids that are no legal KV key are claimed under their encoding, a claim whose intake
publish failed is withdrawn, and a bucket that does not answer fails open (and is made again).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from live_sched_support import Services, fake_token, http, wait_until
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from services.gateway.idempotency import Claim, kv_key, request_digest
from shared.service import bucket_keys, ensure_intake_stream
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
