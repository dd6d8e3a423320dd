"""A worker process that dies takes nothing with it (real nats-server, real rank daemon
processes killed with SIGKILL, scheduler in-process).

1. *Killed and restarted.* W (a ``python -m services.rankd.main`` process) runs x; it is
   SIGKILLed and started again under the same worker id. The new process publishes a state
   with a new incarnation: the scheduler hands x back to intake on W's behalf (x is placed
   again and answered once), and forgets W's cache view, so the new process' cache events
   (ids from 1 again) are applied instead of being dropped as duplicates.
2. *Killed for good.* W runs x and is SIGKILLed; its heartbeat ages past the lease and its
   ``queue`` endpoint has no responder: x is handed back and answered by W2.
3. *A send that finds nobody.* W is dead but its last state is still fresh: the first send
   of y gets "no responders"; W is excluded until its state changes, so y waits for W2
   instead of going back to W until its deliveries run out.

Before the change, x's client waited for the gateway's result timeout (180 s) in 1 and 2, and
in 3 y failed after ``max_deliver`` sends to the same dead worker. Waits are bounded by
events; nothing asserts on speed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats
from live_accept_support import InProcess, ResultTap, wait_until
from test_accept_dispatch_unknown import running

from shared.natsserver import EmbeddedNats
from shared.schemas import IntakeRequest, QueueQuery, QueueReport, encode
from shared.service import call
from shared.worker import Lifecycle

ROOT = Path(__file__).resolve().parents[2]
W, W2 = "w-cp2-g0", "w-cp2-g2"
LONG = 64_000  # tokens: about 11 predicted seconds, × the first process's time scale


@contextmanager
def rankd_process(live: InProcess, wid: str, time_scale: float) -> Iterator[subprocess.Popen]:
    """One rank daemon process (sim backend: it sleeps the predicted time × time_scale)."""
    env = {**os.environ, "VTM_NATS_URL": live.url, "VTM_SUBJECT_PREFIX": live.prefix,
           "VTM_WORKER_ID": wid, "VTM_HEARTBEAT_S": "0.2", "VTM_TIME_SCALE": str(time_scale),
           "VTM_LOG__FORMAT": "json"}
    proc = subprocess.Popen([sys.executable, "-m", "services.rankd.main"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def chain(rid: str, length: int) -> tuple[int, ...]:
    """Block hashes for ``rid``'s full 16-token blocks, distinct per request."""
    base = (sum(map(ord, rid)) + 1) << 20
    return tuple(base + i for i in range(length // 16))


async def publish_intake(nc: nats.NATS, live: InProcess, rid: str, length: int) -> None:
    req = IntakeRequest(request_id=rid, input_len=length, block_size=16, arrival_s=time.time(),
                        block_hashes=list(chain(rid, length)))
    data, headers = encode(req)
    headers["Nats-Msg-Id"] = rid
    await nc.jetstream().publish(live.subjects.intake_requests(), data, headers=headers)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


async def holds(nc: nats.NATS, live: InProcess, wid: str, rid: str) -> bool:
    try:
        rep = await call(nc, live.subjects.worker_queue(wid), QueueQuery(worker_id=wid),
                         QueueReport, timeout_s=2.0)
    except Exception:
        return False
    return rid in rep.in_flight or rid in rep.queued


async def wait_holds(nc: nats.NATS, live: InProcess, wid: str, rid: str) -> None:
    deadline = time.monotonic() + 60
    while not await holds(nc, live, wid, rid):
        assert time.monotonic() < deadline, f"{wid} never held {rid}"
        await asyncio.sleep(0.05)


def answers(tap: ResultTap, rid: str) -> list[tuple[str | None, str | None]]:
    return [(r.worker_id, r.error) for r in tap.results if r.request_id == rid]


async def handed_back_once(sched: Any) -> None:
    """The scheduler counted x's hand-back, once. Waited for, not read when the tap has x's
    first token: the scheduler counts it (and lets go of x's old reservation) only when
    intake's acknowledgement of its publish reaches it, and the re-placed x may have run and
    answered by then."""
    await wait_until(lambda: sched.stats.lost_handed_back >= 1, "x's hand-back counted")
    assert sched.stats.lost_handed_back == 1, sched.stats


async def test_a_restarted_worker_s_request_is_placed_again_and_its_cache_view_reset(
        nats_server: EmbeddedNats) -> None:
    async with running(nats_server) as (live, nc, tap):
        with rankd_process(live, W, time_scale=5.0) as first:  # x: about a minute
            await live.until_served(live.subjects.worker_assign(W))
            sched = await live.scheduler(policy="round_robin", block_size=16,
                                         retry_delay_s=0.05)
            await wait_until(lambda: len(sched.core.view) == 1, "W in the view")
            # A short request first: W stores its blocks (cache event id 1).
            await publish_intake(nc, live, "warm", 64)
            await wait_until(lambda: answers(tap, "warm") == [(W, None)], "warm answered")
            await wait_until(lambda: sched.trie.last_event_id(W) >= 1, "W's first event")
            old_incarnation = sched._states[W].incarnation
            assert old_incarnation
            # x on W, then W dies with it.
            await publish_intake(nc, live, "x", LONG)
            await wait_holds(nc, live, W, "x")
            await wait_until(lambda: "x" in sched.ledger, "x in the ledger")
            kill(first)
        # Started again, fast this time: the same worker id, a new incarnation.
        with rankd_process(live, W, time_scale=0.001):
            await wait_until(lambda: answers(tap, "x") != [], "x answered")
            assert answers(tap, "x") == [(W, None)]
            assert sched.stats.workers_restarted == 1, sched.stats
            await handed_back_once(sched)
            assert sched._states[W].incarnation != old_incarnation
            # The scheduler hears x's first token on its own connection, maybe after the tap.
            await wait_until(lambda: "x" not in sched.ledger and len(sched.core.loads[W]) == 0,
                             "x's first token seen by the scheduler (x out of its ledger)")
            # x's run stored its blocks as event 1 of the new process: applied, not dropped
            # (the old view's last event id would have made it a duplicate).
            await wait_until(lambda: sched.trie.match(chain("x", LONG)).held(W) > 0,
                             "x's blocks held by the new W in the scheduler's trie")
            assert sched.trie.match(chain("warm", 64)).held(W) == 0  # the old process' blocks
            assert sched.stats.failed == 0, sched.stats


async def test_a_killed_worker_s_request_is_handed_back_after_its_lease(
        nats_server: EmbeddedNats) -> None:
    async with running(nats_server) as (live, nc, tap):
        with rankd_process(live, W, time_scale=1000.0) as proc:
            await live.until_served(live.subjects.worker_assign(W))
            sched = await live.scheduler(policy="round_robin", block_size=16,
                                         retry_delay_s=0.05, lease_s=1.5)
            await wait_until(lambda: len(sched.core.view) == 1, "W in the view")
            await publish_intake(nc, live, "x", LONG)
            await wait_holds(nc, live, W, "x")
            await wait_until(lambda: "x" in sched.ledger, "x in the ledger")
            await live.rankd(W2)
            kill(proc)
            await wait_until(lambda: answers(tap, "x") != [], "x answered")
            assert answers(tap, "x") == [(W2, None)]
            await handed_back_once(sched)
            assert sched.stats.workers_restarted == 0, sched.stats
            # The scheduler hears x's first token on its own connection, maybe after the tap.
            await wait_until(lambda: "x" not in sched.ledger, "x's first token seen by the "
                             "scheduler (x out of its ledger)")
            assert W not in sched.core.loads or len(sched.core.loads[W]) == 0


async def test_a_send_that_finds_no_responder_excludes_the_worker_until_it_changes(
        nats_server: EmbeddedNats) -> None:
    async with running(nats_server) as (live, nc, tap):
        with rankd_process(live, W, time_scale=0.001) as proc:
            await live.until_served(live.subjects.worker_assign(W))
            sched = await live.scheduler(policy="round_robin", block_size=16,
                                         retry_delay_s=0.05, max_deliver=3, hold_s=30.0)
            await wait_until(lambda: len(sched.core.view) == 1, "W in the view")
            kill(proc)  # its last state stays fresh for the lease (10 s)
            await publish_intake(nc, live, "y", 64)
            await wait_until(lambda: sched.stats.unreachable_marked == 1, "W marked")
            [view] = sched.core.view.workers
            assert view.lifecycle is Lifecycle.UNAVAILABLE
            await live.rankd(W2)  # y was held for an eligible worker: it goes here
            await wait_until(lambda: answers(tap, "y") != [], "y answered")
            assert answers(tap, "y") == [(W2, None)]
            assert sched.stats.failed == 0, sched.stats

