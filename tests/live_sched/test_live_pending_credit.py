"""J's credit of a pending prefix, live: the cache manager's ReconciledNotice of a split's
children (published here as the manager builds it: ``reconciled_blocks`` of a trie that split
the parent) reaches the scheduler before the children's worker states, is kept until they
register, and is marked in the replica trie; a request that reuses the pending prefix is then
priced with it (its Assignment's P counts the pending pages and it carries the copy's hold),
as the simulator's J prices it (``simulate --pending-credit``). Without the setting the same
request is priced with the valid blocks only."""

from __future__ import annotations

import json

import pytest
from live_sched_support import FakeWorker, Services, http, wait_until
from nats.aio.client import Client

from services.cachemgr.events import Stored
from services.cachemgr.reconcile import reconciled_blocks
from services.cachemgr.trie import PrefixTrie
from shared.blockhash import chain_hashes
from shared.schemas import ReconciledNotice, encode
from shared.subjects import Subjects

B = 256  # the 2 pending blocks must save more prefill time than their copy takes
PROMPT = list(range(300, 300 + 4 * B + 3))  # 4 full blocks + a partial one
PARENT, LEFT, RIGHT = "w-cp4-g0", "w-cp2-g0", "w-cp2-g2"


def split_notices(hashes: list[int]) -> list[ReconciledNotice]:
    """The manager's notices after splitting a CP4 parent that held the prompt's 4 blocks:
    pages 0-1 stay valid on the left child, pages 2-3 are pending there (the right child
    keeps them as donor pages)."""
    t = PrefixTrie([2, 4], block_size=B)
    t.add_worker(PARENT, 4, 100)
    t.apply(Stored(PARENT, 1, None, tuple(hashes[:4])))
    t.reconcile_split(PARENT, (LEFT, RIGHT), {LEFT: 50, RIGHT: 50})
    assert t.pending_blocks(LEFT) == set(hashes[2:4])
    return [ReconciledNotice(worker=w, degree=2, epoch=1, blocks=reconciled_blocks(t, w))
            for w in (LEFT, RIGHT)]


def seeded(hashes: list[int]) -> dict[str, object]:
    """The left child's FakeWorker fields: pages 0-1 cached, as the split's seeding leaves it."""
    return {"blocks": {hashes[0]: None, hashes[1]: hashes[0]}, "event_id": 1}


@pytest.mark.parametrize("credit", [True, False], ids=["pending-credit", "without"])
async def test_a_pending_prefix_counts_once_the_managers_notice_is_marked(
    live: Services, fake_worker, nc: Client, uniq: str, credit: bool  # type: ignore[no-untyped-def]
) -> None:
    s = Subjects(uniq)
    hashes = chain_hashes(PROMPT, B)
    sched = await live.scheduler(block_size=B, degrees=[2, 4], pending_credit=credit)
    gw = await live.gateway(block_size=B)
    for notice in split_notices(hashes):  # before the children run: kept for them
        data, headers = encode(notice)
        await nc.publish(s.cache_pending(notice.worker), data, headers=headers)
    await nc.flush()
    if credit:
        await wait_until(lambda: sched.stats.reconciled_buffered == 2, "notices kept")
    # Its cache, seeded by the split, is there before its first state (and snapshot).
    left: FakeWorker = await fake_worker(LEFT, 2, 0, **seeded(hashes))
    await fake_worker(RIGHT, 2, 2)
    await wait_until(lambda: sched.stats.snapshots_applied >= 2, "the children's snapshots")
    assert sched.trie.match(hashes).held_blocks == {LEFT: 2}
    status = json.loads((await nc.request(f"{uniq}.scheduler.status", b"", timeout=10)).data)
    pending = {w["worker_id"]: w["pending_blocks"] for w in status["workers"]}
    if credit:
        assert sched.stats.reconciled_applied == 2
        assert sched.trie.pending_blocks(LEFT) == set(hashes[2:4])
        assert sched.trie.donor_blocks(RIGHT) == set(hashes[2:4])
        assert pending == {LEFT: 2, RIGHT: 0}  # what the status endpoint shows an operator
    else:
        assert sched.stats.reconciled_buffered == 0  # not subscribed
        assert sched.trie.pending_blocks(LEFT) == frozenset()
        assert pending == {LEFT: 0, RIGHT: 0}

    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 200, reply.body
    a = left.assignments[-1]
    if credit:
        # Priced as holding the 4 blocks its reconcile copies bring (the cache manager sends
        # them on this placement's RequestStats); the rank daemon holds it until they land.
        assert a.prefix_tokens == 4 * B and a.pull_copy_s > 0
        assert sched.stats.pending_credited == 1
    else:
        assert a.prefix_tokens == 2 * B and a.pull_copy_s == 0
        assert sched.stats.pending_credited == 0


async def test_a_bad_notice_is_dropped_and_the_scheduler_keeps_placing(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    s = Subjects(uniq)
    sched = await live.scheduler(block_size=B, degrees=[2, 4], pending_credit=True)
    gw = await live.gateway(block_size=B)
    await fake_worker(LEFT, 2, 0)
    await wait_until(lambda: sched.stats.snapshots_applied >= 1, "snapshot")
    for body in (b"{", b'{"schema_version": 1, "worker": "w-cp2-g0", "degree": 2, '
                       b'"epoch": 1, "blocks": [[2, 1, "pending", null], [1, null, "path", '
                       b'null]]}'):
        await nc.publish(s.cache_pending(LEFT), body)
    # A notice on another worker's subject is not the manager's: rejected, nothing marked.
    stray = ReconciledNotice(worker=LEFT, degree=2, epoch=1,
                             blocks=[(5, None, "path", None), (6, 5, "pending", None)])
    data, headers = encode(stray)
    await nc.publish(s.cache_pending(RIGHT), data, headers=headers)
    # A notice whose chain contradicts the replica's trie (7 is at the root, or unknown when
    # the notice comes first: 99 is nowhere): its entries are skipped, the notice applied.
    await left_stores(nc, s)
    bad = ReconciledNotice(worker=LEFT, degree=2, epoch=2,
                           blocks=[(7, 99, "path", None), (8, 7, "pending", None)])
    data, headers = encode(bad)
    await nc.publish(s.cache_pending(LEFT), data, headers=headers)
    await wait_until(lambda: sched.stats.reconciled_applied == 1, "the good notice applied")
    assert sched.trie.pending_blocks(LEFT) == frozenset()
    assert sched.stats.reconciled_buffered == 0  # the stray one was not kept for RIGHT either
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 200, reply.body


async def left_stores(nc: Client, s: Subjects) -> None:
    """The left worker caches 7 under no parent (its event): the replica has 7 at the root,
    whichever of the event and the notice the scheduler handles first."""
    ev = {"type": "stored", "worker": LEFT, "event_id": 1, "parent_hash": None,
          "block_hashes": [7]}
    await nc.publish(s.cache_events(LEFT), json.dumps(ev).encode())
    await nc.flush()


async def test_only_the_latest_reconcile_of_a_worker_waits_for_it(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """A worker split, merged and split again before it ran: only the last reconcile's
    notice is marked, once, when it registers; an older one arriving late is dropped."""
    s = Subjects(uniq)
    hashes = chain_hashes(PROMPT, B)
    sched = await live.scheduler(block_size=B, degrees=[2, 4], pending_credit=True)
    first = split_notices(hashes)[0]
    latest = ReconciledNotice(worker=LEFT, degree=2, epoch=3, blocks=[
        (hashes[0], None, "path", None), (hashes[1], hashes[0], "path", None),
        (hashes[2], hashes[1], "pending", None)])
    # The latest part sent twice (the manager asked again): its copy replaces it.
    for notice in (first, latest, first, latest):
        data, headers = encode(notice)
        await nc.publish(s.cache_pending(LEFT), data, headers=headers)
    await nc.flush()
    await wait_until(lambda: sched.stats.reconciled_dropped == 3, "the older notices dropped")
    assert sched.stats.reconciled_buffered == 3 and sched.stats.reconciled_applied == 0
    await fake_worker(LEFT, 2, 0, **seeded(hashes))
    await wait_until(lambda: sched.stats.snapshots_applied >= 1, "its snapshot")
    assert sched.stats.reconciled_applied == 1
    assert sched.trie.pending_blocks(LEFT) == {hashes[2]}


async def test_an_empty_reconcile_replaces_an_older_one_of_the_same_worker_id(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """Worker ids come back (split, merge, split again). The cache manager publishes a notice
    for every worker a split or merge makes, an empty one where nothing is pending there, so
    an older reconcile of the same id still waiting here is not marked on the new worker."""
    s = Subjects(uniq)
    hashes = chain_hashes(PROMPT, B)
    sched = await live.scheduler(block_size=B, degrees=[2, 4], pending_credit=True)
    older = split_notices(hashes)[0]  # epoch 1: pages 2-3 pending
    empty = ReconciledNotice(worker=LEFT, degree=2, epoch=3, blocks=[])
    for notice in (older, empty):
        data, headers = encode(notice)
        await nc.publish(s.cache_pending(LEFT), data, headers=headers)
    await nc.flush()
    await wait_until(lambda: sched.stats.reconciled_buffered == 2, "both notices kept")
    assert sched.stats.reconciled_dropped == 1  # the older one, overtaken
    await fake_worker(LEFT, 2, 0, **seeded(hashes))
    await wait_until(lambda: sched.stats.snapshots_applied >= 1, "its snapshot")
    assert sched.stats.reconciled_applied == 1 and sched.stats.reconciled_asked == 0
    assert sched.trie.pending_blocks(LEFT) == set()


def test_what_waits_for_unregistered_workers_is_bounded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Notices for workers that never register (another deployment's, a forged flood) are
    kept within a bound on the entries of all of them together, not only per worker."""
    import services.scheduler.service as sched_mod
    from services.scheduler.service import SchedulerService, SchedulerSettings

    monkeypatch.setattr(sched_mod, "_BUFFERED_ENTRIES", 10)
    svc = SchedulerService(SchedulerSettings(nats_url="nats://127.0.0.1:1",
                                             subject_prefix="unused", block_size=B,
                                             degrees=[2, 4], pending_credit=True))
    chain = [(1, None, "path", None), (2, 1, "pending", None), (3, 2, "pending", None),
             (4, 3, "pending", None)]
    for k in range(4):  # 4 workers × 4 entries: the third and fourth would pass 10
        svc.on_reconciled(ReconciledNotice(worker=f"w-cp2-g{2 * k}", degree=2, epoch=1,
                                           blocks=chain))
    assert svc.stats.reconciled_buffered == 2 and svc.stats.reconciled_dropped == 2
    assert svc._buffered_entries() == 8
    # A worker whose notice was not kept has nothing waiting: at registration it asks.
    assert set(svc._reconciled) == {"w-cp2-g0", "w-cp2-g2"}


async def test_the_pending_question_names_the_incarnation_the_replica_registered(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """A replica that registers a worker with no notice of it asks the cache manager's
    ``pending`` endpoint (answered here by a stand-in that records the questions), naming the
    incarnation of the state it registered; after the worker's restart it asks again under
    the new one, so a manager that has not yet handled the restart can tell (PendingQuery)."""
    from shared.schemas import PendingQuery, PendingReply, decode

    s = Subjects(uniq)
    asked: list[PendingQuery] = []

    async def answer(msg) -> None:  # type: ignore[no-untyped-def]
        q = decode(PendingQuery, msg.data, msg.headers)
        asked.append(q)
        data, _ = encode(PendingReply(worker_id=q.worker_id, parts=0))
        await msg.respond(data)

    await nc.subscribe(s.cache_pending_ask(), cb=answer)
    await nc.flush()
    sched = await live.scheduler(block_size=B, degrees=[2, 4], pending_credit=True)
    left: FakeWorker = await fake_worker(LEFT, 2, 0, incarnation="life-1")
    await wait_until(lambda: sched.stats.reconciled_asked == 1, "the first question")
    assert [(q.worker_id, q.incarnation) for q in asked] == [(LEFT, "life-1")]
    left.incarnation = "life-2"  # started again under its id
    await left.publish_state()
    await wait_until(lambda: sched.stats.reconciled_asked == 2, "the question after the restart")
    assert [(q.worker_id, q.incarnation) for q in asked] == [(LEFT, "life-1"), (LEFT, "life-2")]
