"""A scheduler replica that stops or dies, and *then* the worker of a request it dispatched
dies too: the request is still answered (real nats-server, real rank daemon processes killed
with SIGKILL, schedulers in-process).

The replica that dispatched x keeps x's intake message unacked until x's result
(``hold_intake``). When it goes, x comes back from intake -- at once after a stop (it NAKs
what it holds), after ``ack_wait`` after a crash (nothing renews it) -- to the next replica,
which *adopts* x: the worker lists it, so it enters that replica's ledger. When the worker then
dies, that replica hands x back and another worker answers it.

Before, the dispatching replica acked x at dispatch and only its own in-memory ledger knew x:
its successor never heard of x, and x's client waited for the gateway's result timeout.

A worker that restarted between the two (its new incarnation does not list x; the record
names the incarnation that admitted x) makes the successor hand x back at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
import pytest
from live_accept_support import InProcess, wait_until
from test_accept_dispatch_unknown import running
from test_accept_worker_lost import (
    LONG,
    W2,
    W,
    answers,
    handed_back_once,
    kill,
    publish_intake,
    rankd_process,
    wait_holds,
)

from services.scheduler.service import SchedulerService
from shared.natsserver import EmbeddedNats


class NoTimeToGiveBack(SchedulerService):
    def _give_back_budget_s(self) -> float:
        return 0.0


async def a_holds_x(live: InProcess, nc: nats.NATS, kw: dict[str, Any]) -> Any:
    """Scheduler A (``sched-a``) dispatches x to W, which queues it; A holds x's message."""
    a = await live.scheduler(instance_id="sched-a", **kw)
    await wait_until(lambda: len(a.core.view) == 1, "W in A's view")
    await publish_intake(nc, live, "x", LONG)
    await wait_holds(nc, live, W, "x")
    await wait_until(lambda: "x" in a._held, "x's message held by A")
    return a


async def wait_intake_empty(nc: nats.NATS, live: InProcess) -> None:
    """Every intake message acked (the work queue drops acked messages)."""
    deadline = time.monotonic() + 30
    while (await nc.jetstream().stream_info(live.subjects.intake_stream())).state.messages:
        assert time.monotonic() < deadline, "intake messages left unacked"
        await asyncio.sleep(0.05)


async def w_dies_and_w2_answers_x(live: InProcess, nc: nats.NATS, tap: Any, proc: Any,
                                  *replicas: Any) -> None:
    """W2 starts and W is SIGKILLed: x, adopted by one of ``replicas``, is handed back and
    answered by W2; no replica failed anything, and every intake message is acked."""
    await live.rankd(W2)
    kill(proc)
    await wait_until(lambda: answers(tap, "x") != [], "x answered", timeout_s=60.0)
    assert answers(tap, "x") == [(W2, None)]
    assert all(r.stats.failed == 0 for r in replicas), [r.stats for r in replicas]
    await wait_intake_empty(nc, live)


@pytest.mark.parametrize("crash", [False, True], ids=["stopped", "crashed"])
async def test_a_request_outlives_its_scheduler_and_then_its_worker(
        nats_server: EmbeddedNats, crash: bool) -> None:
    async with running(nats_server) as (live, nc, tap):
        with rankd_process(live, W, time_scale=1000.0) as proc:  # x would run for hours
            await live.until_served(live.subjects.worker_assign(W))
            kw = dict(policy="round_robin", block_size=16, retry_delay_s=0.05, lease_s=1.5,
                      ack_wait_s=1.5)
            a = await a_holds_x(live, nc, kw)
            if crash:
                a._held.clear()  # as a SIGKILL would leave it: neither renewed nor NAKed
            await live.stop(a)
            b = await live.scheduler(instance_id="sched-b", **kw)
            await wait_until(lambda: b.stats.adopted == 1, "B adopts x")
            assert "x" in b.ledger and b.ledger.get("x").worker_id == W  # type: ignore[union-attr]
            assert answers(tap, "x") == []
            await w_dies_and_w2_answers_x(live, nc, tap, proc, b)
            await handed_back_once(b)
            await wait_until(lambda: "x" not in b.ledger and not b._held, "x released")


async def test_a_worker_restarted_meanwhile_gets_the_request_back_at_once(
        nats_server: EmbeddedNats) -> None:
    async with running(nats_server) as (live, nc, tap):
        kw = dict(policy="round_robin", block_size=16, retry_delay_s=0.05, ack_wait_s=1.5)
        with rankd_process(live, W, time_scale=1000.0) as first:
            await live.until_served(live.subjects.worker_assign(W))
            a = await a_holds_x(live, nc, kw)
            old = a._states[W].incarnation
            a._held.clear()  # A dies: x comes back after ack_wait
            await live.stop(a)
            kill(first)
        with rankd_process(live, W, time_scale=0.001):  # the same id, a new incarnation
            await live.until_served(live.subjects.worker_assign(W))
            b = await live.scheduler(instance_id="sched-b", **kw)
            await wait_until(lambda: b._states.get(W) is not None
                             and b._states[W].incarnation != old, "W's new state at B")
            await wait_until(lambda: answers(tap, "x") != [], "x answered")
            assert answers(tap, "x") == [(W, None)]
            assert b.stats.adopted_lost == 1, b.stats
            assert b.stats.adopted == 0 and b.stats.failed == 0, b.stats
            await wait_intake_empty(nc, live)


async def test_a_replica_restarted_under_its_id_takes_back_what_it_held_at_once(
        nats_server: EmbeddedNats) -> None:
    """A crash, then the same replica (fixed instance id) starts again: it NAKs the intake
    message its dead process held, so x comes back now, not after ack_wait (two minutes
    here, longer than any wait below), and is adopted; the worker's death is then recovered."""
    async with running(nats_server) as (live, nc, tap):
        with rankd_process(live, W, time_scale=1000.0) as proc:
            await live.until_served(live.subjects.worker_assign(W))
            kw = dict(policy="round_robin", block_size=16, retry_delay_s=0.05, lease_s=1.5,
                      ack_wait_s=120.0)
            a = await a_holds_x(live, nc, kw)
            a._held.clear()  # as a SIGKILL would leave it: neither renewed nor NAKed
            await live.stop(a)
            other = await live.scheduler(instance_id="sched-b", **kw)
            assert other.stats.predecessor_naked == 0  # not its predecessor's message
            await live.stop(other)
            # The scan is bounded in time (ack_wait / 3; none here: cut short at once).
            hasty = await live.scheduler(NoTimeToGiveBack, instance_id="sched-a", **kw)
            assert hasty.stats.predecessor_naked == 0, hasty.stats
            await live.stop(hasty)
            again = await live.scheduler(instance_id="sched-a", **kw)
            assert again.stats.predecessor_naked == 1, again.stats
            await wait_until(lambda: again.stats.adopted == 1, "A's next process adopts x",
                             timeout_s=60.0)
            # The worker reports x as sched-a's work, so sched-a's core counts it as its own.
            assert again.stats.adopted_reserved == 1, again.stats
            assert again.core.worker_of("x") == W  # type: ignore[arg-type]
            assert again.core.load(W).unfinished == 1  # type: ignore[arg-type]
            await live.rankd(W2)
            kill(proc)
            await wait_until(lambda: answers(tap, "x") != [], "x answered", timeout_s=60.0)
            assert answers(tap, "x") == [(W2, None)]
            assert again.stats.failed == 0, again.stats
            await wait_intake_empty(nc, live)


async def test_an_adopted_request_is_recorded_under_its_new_holder(
        nats_server: EmbeddedNats) -> None:
    """B adopts x after A's crash: x's record now names B as its holder, with B's delivery, so
    B's own next process could give it back at once too; A stays its scheduler."""
    async with running(nats_server) as (live, nc, tap):
        with rankd_process(live, W, time_scale=1000.0):
            await live.until_served(live.subjects.worker_assign(W))
            kw = dict(policy="round_robin", block_size=16, retry_delay_s=0.05, ack_wait_s=1.5)
            a = await a_holds_x(live, nc, kw)
            first = await a._get_record("x")
            assert first is not None and first.scheduler == "sched-a"
            assert first.ack_subject == a._held["x"].reply
            a._held.clear()
            await live.stop(a)
            b = await live.scheduler(instance_id="sched-b", **kw)
            await wait_until(lambda: b.stats.adopted == 1, "B adopts x")

            # x is sched-a's work in W's reports (counted as foreign at B): no reservation.
            assert b.stats.adopted_reserved == 0 and "x" not in b.core._where, b.stats

            async def recorded() -> bool:
                rec = await b._get_record("x")
                return rec is not None and rec.holder == "sched-b" \
                    and rec.scheduler == "sched-a" \
                    and rec.ack_subject == b._held["x"].reply \
                    and rec.ack_subject != first.ack_subject
            deadline = time.monotonic() + 30
            while not await recorded():
                assert time.monotonic() < deadline, "x's record not rewritten"
                await asyncio.sleep(0.05)


@pytest.mark.parametrize("ack_wait_s", [120.0, 1.2], ids=["long-ack-wait", "short-ack-wait"])
async def test_survivors_take_back_what_a_gone_replica_held(
        nats_server: EmbeddedNats, ack_wait_s: float) -> None:
    """A dies and does not come back. The other replicas notice it gone from their listing
    ($SRV.PING) after ``peer_gone_s``; the one with the smallest id (sched-0, not sched-b)
    NAKs x, so x is adopted now rather than after ack_wait (two minutes), and W's death
    after that is recovered. With an ack_wait so short that A's hold expires before A is
    found gone (2/3 of 1.2 s < 2 s), nobody NAKs: x comes back by itself."""
    async with running(nats_server) as (live, nc, tap):
        with rankd_process(live, W, time_scale=1000.0) as proc:
            await live.until_served(live.subjects.worker_assign(W))
            kw = dict(policy="round_robin", block_size=16, retry_delay_s=0.05, lease_s=1.5,
                      ack_wait_s=ack_wait_s, peer_check_s=0.4, peer_gone_s=2.0)
            a = await a_holds_x(live, nc, kw)
            b = await live.scheduler(instance_id="sched-b", **kw)
            c = await live.scheduler(instance_id="sched-0", **kw)
            for s in (b, c):
                await wait_until(lambda s=s: {"sched-a", "sched-b", "sched-0"} <= set(s._peers),
                                 "every replica listed")
            a._held.clear()  # as a SIGKILL would leave it: neither renewed nor NAKed
            await live.stop(a)
            await wait_until(lambda: b.stats.adopted + c.stats.adopted == 1, "x adopted",
                             timeout_s=60.0)
            await wait_until(lambda: "sched-a" not in b._peers and "sched-a" not in c._peers,
                             "A gone at both")
            assert b.stats.peers_gone >= 1 and c.stats.peers_gone >= 1
            # (Each decides right where it counts A gone; a give-back is counted once done.)
            naked = 1 if ack_wait_s > 1.5 else 0
            await wait_until(lambda: c.stats.peer_naked == naked, "C's give-back counted")
            assert c.stats.peer_naked == naked and b.stats.peer_naked == 0, (b.stats, c.stats)
            await w_dies_and_w2_answers_x(live, nc, tap, proc, b, c)


async def test_a_replica_dead_before_the_others_started_is_found_gone(
        nats_server: EmbeddedNats) -> None:
    """A holds x and dies before any other replica runs, so no replica ever lists it. B (no
    fixed id) finds A as x's holder when it starts, watches it like a listed replica, finds
    it gone after ``peer_gone_s`` and NAKs x -- though sched-0, whose id is smaller, runs
    too: sched-0 never knew A (its start-up walk has no time here), so the rank rule would
    leave x to ack_wait (two minutes). x is adopted and W's death after that recovered."""
    async with running(nats_server) as (live, nc, tap):
        with rankd_process(live, W, time_scale=1000.0) as proc:
            await live.until_served(live.subjects.worker_assign(W))
            kw = dict(policy="round_robin", block_size=16, retry_delay_s=0.05, lease_s=1.5,
                      ack_wait_s=120.0, peer_check_s=0.4, peer_gone_s=2.0)
            a = await a_holds_x(live, nc, kw)
            a._held.clear()  # as a SIGKILL would leave it: neither renewed nor NAKed
            await live.stop(a)
            c = await live.scheduler(NoTimeToGiveBack, instance_id="sched-0", **kw)
            b = await live.scheduler(instance_id=None, **kw)
            assert b.reporter > c.reporter
            # (B walks the unacked messages in the background: no fixed id, nothing to NAK.)
            await wait_until(lambda: b.stats.holders_found == 1, "B finds A as x's holder")
            assert c.stats.holders_found == 0, c.stats
            assert "sched-a" not in c._peers
            await wait_until(lambda: b.stats.peer_naked == 1, "B gives back x",
                             timeout_s=60.0)
            await wait_until(lambda: b.stats.adopted + c.stats.adopted == 1, "x adopted",
                             timeout_s=60.0)
            assert b.stats.peers_gone == 1 and c.stats.peer_naked == 0, (b.stats, c.stats)
            assert "sched-a" not in b._peers and not b._unlisted
            await w_dies_and_w2_answers_x(live, nc, tap, proc, b, c)
