"""A snapshot request that fails with an exception the fetch does not expect (real
nats-server, the scheduler in-process on a real nats-py client, a fake worker).

The scheduler asks a worker new to it for its cache index. The fetch handled no answer, a
micro error and a malformed reply (asked again by housekeeping), but anything else -- here
nats-py's ``OutboundBufferLimitError``, what a publish raises that the client can neither send
nor buffer (the connection is reconnecting and its pending buffer is full; at once with
``pending_size=0``) -- ended the fetch's task with the exception unretrieved, and the worker
was never asked again: not stale, and not in the retry set, its cached prefixes stayed
unknown to J until an event gap. Now such a failure is logged and asked again like an
unanswered one; the worker-state watch (the fetch runs in a task of its own) goes on.
"""

from __future__ import annotations

from typing import Any

import nats.errors
from live_sched_support import FakeWorker, Services, wait_until
from nats.aio.client import Client

from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.blockhash import chain_hashes
from shared.natsserver import EmbeddedNats
from shared.subjects import Subjects

B = 16
PROMPT = list(range(100, 100 + 3 * B + 5))
W1, W2 = "w-cp2-g0", "w-cp2-g2"


class FirstPublishFails(Client):
    """A real nats-py client whose first ``failures`` publishes on ``subject`` raise what the
    client raises for a publish it can neither send nor buffer (third-party behaviour played,
    not the scheduler's: every other call is the client's own)."""

    def __init__(self, subject: str, failures: int = 1) -> None:
        super().__init__()
        self.failing_subject = subject
        self.failures_left = failures

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        if subject == self.failing_subject and self.failures_left > 0:
            self.failures_left -= 1
            raise nats.errors.OutboundBufferLimitError
        await super().publish(subject, payload, reply=reply, headers=headers)


async def scheduler_on(live: Services, nc: Client, **kw: Any) -> SchedulerService:
    """A scheduler on the connection ``nc`` (the caller's; closed with ``live``), stopped by
    the ``live`` fixture like the others."""
    settings = SchedulerSettings(nats_url=live.url, subject_prefix=live.prefix,
                                 instance_id="sched-snap", **kw)
    return await live._run(SchedulerService(settings), nc)  # type: ignore[no-any-return]


async def test_a_first_snapshot_that_fails_unexpectedly_is_asked_again(
        live: Services, nats_server: EmbeddedNats, nc: Client, uniq: str) -> None:
    a = await FakeWorker(nc, Subjects(uniq), W1, 2, 0).start()
    b: FakeWorker | None = None
    try:
        hashes = chain_hashes(PROMPT, B)
        await a.store(None, hashes[:2], publish=False)  # cached before the scheduler came
        client = FirstPublishFails(Subjects(uniq).cache_snapshot(W1))
        await client.connect(nats_server.url, connect_timeout=5)
        live.stack.push_async_callback(client.close)  # after the services stop
        sched = await scheduler_on(live, client, block_size=B)
        await wait_until(lambda: client.failures_left == 0, "the first snapshot request failed")
        await wait_until(lambda: W1 not in sched._snapshotting, "the failed fetch ended")
        assert a.snapshot_requests == 0
        # The worker-state watch goes on (the fetch ran in a task of its own): a new worker
        # enters the view and is tracked.
        b = await FakeWorker(nc, Subjects(uniq), W2, 2, 2).start()
        await wait_until(lambda: W2 in sched.trie.workers() and len(sched.core.view) == 2,
                         "the second worker tracked")
        # Housekeeping asks a worker whose snapshot is owed every round (at most 1 s each):
        # within five rounds, or never.
        rounds = sched.stats.housekeeping_rounds
        await wait_until(lambda: a.snapshot_requests >= 1
                         or sched.stats.housekeeping_rounds >= rounds + 5,
                         "the snapshot asked again, or five housekeeping rounds")
        assert a.snapshot_requests >= 1, "the failed snapshot was never asked again"
        await wait_until(lambda: sched.trie.match(hashes).held_blocks == {W1: 2},
                         "the snapshot applied")
        assert sched.stats.snapshots_failed == 1, sched.stats
    finally:
        await a.stop()
        if b is not None:
            await b.stop()
