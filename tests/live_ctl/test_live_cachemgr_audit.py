"""The live cache manager on bad or out-of-order bus input (audit findings).

* A cache event whose block hash does not fit 64 bits (the wire schema's HashInt) is rejected
  as malformed: taken into the trie it would make every command naming that block fail to
  build (pydantic refuses it), leaving the action in flight for ever.
* A worker tracked from a lingering WorkerState before the first epoch record arrives (a
  retired worker's state lives until its lease ends) is untracked when the record, which does
  not list it, comes: only the record's workers are the pool.
"""

from __future__ import annotations

import json
from typing import Any

from live_ctl_support import eventually
from nats.aio.client import Client
from nats.aio.msg import Msg
from test_live_cachemgr import A, epoch_record, inspect, reply, settings, state, stored

from services.cachemgr.service import CacheMgrService
from shared.schemas import CacheSnapshot, to_json
from shared.service import epoch_kv, worker_state_kv
from shared.subjects import Subjects


async def test_a_block_hash_beyond_64_bits_is_rejected_as_malformed(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    await services(CacheMgrService(settings(nats_server.url, uniq)))
    for bad in (2**64, -(2**63) - 1):
        ev = {"type": "stored", "worker": A, "event_id": 1, "parent_hash": None,
              "block_hashes": [11, bad]}
        await nc.publish(s.cache_events(A), json.dumps(ev).encode())
    snap = {"type": "stored", "worker": A, "event_id": 1, "parent_hash": 2**64,
            "block_hashes": [11]}
    await nc.publish(s.cache_events(A), json.dumps(snap).encode())
    await stored(nc, s, A, 1, None, [11, 12])

    async def applied() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=[11, 12])
        return body if body["counters"]["events_applied"] >= 1 else None

    body = await eventually(applied, what="the good event applied")
    assert body["counters"]["malformed"] == 3
    assert body["nodes"] == 2 and body["match"]["held"] == {A: 2}


async def test_a_lingering_state_tracked_before_the_first_record_is_untracked_by_it(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    retired = "w-cp4-g0"  # split into w-cp2-g0 / w-cp2-g2; its state lingers until its lease
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put(retired, to_json(state(retired, [0, 1, 2, 3])))
    await services(CacheMgrService(settings(nats_server.url, uniq)))

    async def tracked() -> bool:
        return retired in (await inspect(nc, uniq))["workers"]

    await eventually(tracked, what="the lingering worker tracked (no record yet)")
    epochs = await epoch_kv(nc.jetstream(), s)
    await epochs.put(s.epoch_key(), epoch_record(3, [(0, 2), (2, 2), (4, 4)]))

    async def adopted() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if body["epoch"] == 3 else None

    body = await eventually(adopted, what="the record adopted")
    assert sorted(body["workers"]) == ["w-cp2-g0", "w-cp2-g2", "w-cp4-g4"]


async def test_an_event_of_a_non_canonical_worker_id_registers_nothing(
    nc: Client, nats_server, uniq: str, services
):
    """Without an epoch record an event's worker is registered from its lattice id; an id
    that only parses as one ("W-cp2-g0", "w-cp2-g00", "w-cp+2-g0") is not a worker of the
    pool and could never be named in a cache command (shared.schemas Id), so every action
    from or to it would stay in flight for ever: it is rejected."""
    s = Subjects(uniq)
    await services(CacheMgrService(settings(nats_server.url, uniq)))
    for i, wid in enumerate(("W-cp2-g0", "w-cp2-g00", "w-cp+2-g0", "w-cp2-g 0")):
        ev = {"type": "stored", "worker": wid, "event_id": 1, "parent_hash": None,
              "block_hashes": [100 + i]}
        await nc.publish(s.cache_events(A), json.dumps(ev).encode())
    await stored(nc, s, A, 1, None, [11, 12])

    async def applied() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if body["counters"]["events_applied"] >= 1 else None

    body = await eventually(applied, what="the good event applied")
    assert sorted(body["workers"]) == [A]
    assert body["counters"]["rejected"] == 4 and body["nodes"] == 2


async def test_a_worker_state_whose_degree_contradicts_its_id_registers_nothing(
    nc: Client, nats_server, uniq: str, services
):
    """``w-cp4-g4`` with degree 2 (GPUs 4-5) decodes (the schema checks the GPUs against the
    degree, not against the id) but names no group: tracked at degree 2, its statistics
    and copies would be a degree-2 worker's. It is rejected; its record registers it."""
    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put("w-cp4-g4", to_json(state("w-cp4-g4", [4, 5])))
    await states.put(A, to_json(state(A, [0, 1])))
    await services(CacheMgrService(settings(nats_server.url, uniq)))

    async def tracked() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if A in body["workers"] else None

    body = await eventually(tracked, what="A tracked from its state")
    assert "w-cp4-g4" not in body["workers"] and body["counters"]["rejected"] == 1
    epochs = await epoch_kv(nc.jetstream(), s)
    await epochs.put(s.epoch_key(), epoch_record(1, [(0, 2), (2, 2), (4, 4)]))

    async def adopted() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if body["epoch"] == 1 else None

    body = await eventually(adopted, what="the record adopted")
    assert body["workers"]["w-cp4-g4"]["degree"] == 4


async def test_a_snapshot_answered_with_a_micro_error_is_asked_again(
    nc: Client, nats_server, uniq: str, services
):
    """The worker's snapshot endpoint fails once (a 500 micro error, e.g. its event publish
    failed during a reconnect): the manager asks again, as after no answer, and learns the
    blocks the worker holds with no cache event (before, the error reply was read as a
    malformed snapshot and never asked again)."""
    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    answers: list[str] = []

    async def a_snapshot(msg: Msg) -> None:
        if not answers:
            answers.append("error")
            await nc.publish(msg.reply, b"", headers={"Nats-Service-Error": "publish failed",
                                                      "Nats-Service-Error-Code": "500"})
            return
        answers.append("snapshot")
        await reply(nc, msg, CacheSnapshot(worker=A, last_event_id=0,
                                           blocks=[(31, None), (32, 31)]))

    await nc.subscribe(s.cache_snapshot(A), cb=a_snapshot)
    await nc.flush()
    await states.put(A, to_json(state(A, [0, 1])))
    await services(CacheMgrService(settings(nats_server.url, uniq)))

    async def learnt() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=[31, 32])
        return body if body["counters"]["snapshots_applied"] else None

    body = await eventually(learnt, what="the snapshot asked again and applied", timeout=10)
    assert answers[0] == "error" and body["match"]["held"] == {A: 2}
