"""Exactly once when a scheduler crash meets a redirect (real nats-server, services in-process).

The scenario: scheduler A places intake message M1 of request ``x`` on worker W; W acks; A dies
before its ``dispatched`` record and before acking M1 (the record stays ``dispatching``). W is
then drained: it hands ``x`` back to intake as M2 (``Nats-Msg-Id`` ``x>W``), which a new
scheduler B places on W2. M1 is redelivered to B too (ack_wait), and B re-sends the recorded
assignment to W. Whatever the order in which B sees M1's redelivery and M2, ``x`` must run
exactly once:

* W answers the re-sent assignment 410 (``HandedBack``: the message it came from was handed
  back and intake acknowledged the redirect), and B acks M1 without placing it;
* if B placed M2 first, M1's redelivery finds a record with a newer stream sequence and is
  acked as superseded.

Before this was handled, W answered 409 (not ACTIVE); B deleted the record and NAK'ed, and a
later delivery of M1 was placed afresh: ``x`` ran twice. Nothing is left to chance:
:class:`GatedScheduler` forces the order of M1 and M2, and holds any further delivery until W2
is drained and W3 is ACTIVE, so a wrong second placement lands on W3 and shows (on W2 rankd's
idempotent admission would hide it).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
from live_accept_support import (
    CRASH_MAX_DELIVER,
    ActingController,
    DiesBeforeDispatchedRecord,
    InProcess,
    ResultTap,
    wait_quiescent,
    wait_until,
)
from nats.aio.msg import Msg

from services.rankd.backend import SimBackend
from services.rankd.core import HANDED_BACK_CODE, INTAKE_MSG_HEADER, REDIRECTING_CODE
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from services.scheduler.service import SchedulerService
from shared.natsserver import EmbeddedNats
from shared.schemas import Assignment, AssignmentAck, IntakeRequest, encode
from shared.service import RemoteError, call, epoch_kv
from shared.worker import Lifecycle

W, W2, W3 = "w-cp2-g0", "w-cp2-g2", "w-cp2-g4"
RID = "resend-x"
BLOCKER_LEN = 4000  # the blocker's input length: its prefill holds W while x waits queued


class GatedScheduler(SchedulerService):
    """Scheduler B: the first message it handles is of kind ``first`` ("redelivery": M1 again;
    "redirect": M2); M2, if not first, waits for that; anything else waits for ``later``."""

    first = "redelivery"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.gate = asyncio.Event()
        self.later = asyncio.Event()
        self.handled: list[str] = []

    async def handle_intake(self, msg: Msg) -> None:
        msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        kind = "redelivery" if msg_id == RID else "redirect"
        if kind != self.first or self.gate.is_set():
            if kind == "redirect" and "redirect" not in self.handled:
                await self.gate.wait()
            else:
                await self.later.wait()
        await super().handle_intake(msg)
        self.handled.append(kind)
        self.gate.set()


async def start_rankd(live: InProcess, wid: str) -> RankdService:
    settings = RankdSettings(nats_url=live.url, subject_prefix=live.prefix, worker_id=wid,
                             heartbeat_s=0.2, drain_timeout_s=0.5)
    # The blocker occupies W far longer than the scenario takes (a bound, not a speed check:
    # the test stops W while it still runs).
    backend = SimBackend(prefill_time=lambda r, p, c, kind="cp": 120.0 if r >= BLOCKER_LEN
                         else 0.02, handoff_time=lambda n, c: 0.001)
    return await live.run(RankdService(settings, backend))


async def assign(nc: Any, live: InProcess, a: Assignment, headers: dict[str, str] | None = None
                 ) -> AssignmentAck:
    """Send an assignment as a scheduler does (retrying nats-server's occasional "no
    responders" for a just-registered endpoint, bounded)."""
    import nats.errors

    for _ in range(50):
        try:
            return await call(nc, live.subjects.worker_assign(a.worker_id), a, AssignmentAck,
                              timeout_s=5.0, headers=headers)
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.1)
    raise AssertionError("no responders")


def assignment(rid: str, wid: str, length: int, arrival_s: float | None = None) -> Assignment:
    """``rid`` assigned to ``wid`` now; arrived at ``arrival_s`` (None: now). A re-sent
    assignment carries its intake message's request, so its arrival stamp too: the worker
    tells a re-send from a later attempt under the same message id by it."""
    req = IntakeRequest(request_id=rid, input_len=length, block_size=16,
                        arrival_s=time.time() if arrival_s is None else arrival_s)
    return Assignment(request=req, worker_id=wid, epoch=0, degree=2, prefix_tokens=0,
                      recompute_tokens=length, predicted_s=0.1, assigned_at_s=time.time())


@pytest.mark.parametrize("first", ["redelivery", "redirect"])
async def test_resent_assignment_of_redirected_request_runs_once(
        nats_server: EmbeddedNats, first: str) -> None:
    import nats

    live = InProcess(nats_server.url, "t" + os.urandom(5).hex())
    nc = await nats.connect(nats_server.url, connect_timeout=5)
    tap = await ResultTap(nc, live.subjects).start()
    try:
        w = await start_rankd(live, W)
        # W busy for the whole scenario: x, placed next, waits in its FIFO.
        await assign(nc, live, assignment("resend-blocker", W, BLOCKER_LEN))
        await wait_until(lambda: w.core.running is not None, "the blocker running on W")

        a = await live.scheduler(cls=DiesBeforeDispatchedRecord, block_size=16, ack_wait_s=1.0,
                                 max_deliver=CRASH_MAX_DELIVER,
                                 instance_id="sched-a")
        await wait_until(lambda: len(a.core.view) == 1, "W in A's view")
        req = IntakeRequest(request_id=RID, input_len=40, block_size=16, arrival_s=time.time())
        data, headers = encode(req)
        headers["Nats-Msg-Id"] = RID
        await nc.jetstream().publish(live.subjects.intake_requests(), data, headers=headers)
        await wait_until(lambda: any(j.request_id == RID for j in w.core.queued), "x queued on W")
        await live.stop(a)  # M1 stays unacked, its record "dispatching"

        # Drain W (as the controller would): x goes back to intake as M2.
        others = [await start_rankd(live, wid) for wid in (W2, W3)]
        kv = await epoch_kv(nc.jetstream(), live.subjects)
        rec = ActingController._make(1, {W: Lifecycle.DRAINING, W2: Lifecycle.ACTIVE}, "drain W")
        await kv.put(live.subjects.epoch_key(), rec.model_dump_json().encode())
        await wait_until(lambda: all(s.core.epoch == 1 for s in [w, *others]),
                         "epoch 1 adopted")
        await wait_until(lambda: not w.core.redirecting and not w.core.queued, "x handed back")

        # What W answers a re-send of M1's assignment: 410 (the scheduler acks M1).
        with pytest.raises(RemoteError) as err:
            await assign(nc, live, assignment(RID, W, 40, req.arrival_s),
                         {INTAKE_MSG_HEADER: RID})
        assert err.value.code == int(HANDED_BACK_CODE), err.value
        # Any other source (an older scheduler without the header) is just "not ACTIVE".
        with pytest.raises(RemoteError) as err:
            await assign(nc, live, assignment(RID, W, 40))
        assert err.value.code == 409, err.value

        GatedScheduler.first = first
        b = await live.scheduler(cls=GatedScheduler, block_size=16, ack_wait_s=1.0,
                                 max_deliver=CRASH_MAX_DELIVER,
                                 instance_id="sched-b")
        await wait_until(lambda: "redirect" in b.handled, "B placed M2")
        # Now only W3 may take a new placement: W2 drains (x finishes there), W stays draining.
        rec = ActingController._make(2, {W: Lifecycle.DRAINING, W2: Lifecycle.DRAINING,
                                         W3: Lifecycle.ACTIVE}, "drain W2")
        await kv.put(live.subjects.epoch_key(), rec.model_dump_json().encode())
        await wait_until(lambda: any(v.worker_id == W3 and v.lifecycle is Lifecycle.ACTIVE
                                     for v in b.core.view.workers), "W3 ACTIVE in B's view")
        b.later.set()
        await wait_until(lambda: "redelivery" in b.handled, "B handled M1's redelivery")
        await wait_until(lambda: any(r.request_id == RID for r in tap.results), "x's result")
        # Settled: intake holds nothing (M1 and M2 acked: no redelivery can come) and no
        # worker holds anything but W its blocker -- a wrongly NAK'ed or re-placed M1 would
        # have run again.
        await wait_quiescent(nc, live.subjects, (W, W2, W3), besides=("resend-blocker",))
        assert not any(s.core.redirecting for s in (w, *others))
        runs = [(r.worker_id, r.error) for r in tap.results if r.request_id == RID]
        assert runs == [(W2, None)], f"x ran {len(runs)} times: {runs}"
        if first == "redelivery":
            assert b.stats.handed_back_acked >= 1, b.stats
        else:
            assert b.stats.superseded_acked >= 1, b.stats
    finally:
        await live.close()
        await tap.stop()
        await nc.drain()



async def test_rankd_answers_a_resent_assignment_by_its_redirect_state(
        nats_server: EmbeddedNats) -> None:
    """The wire answers the scheduler acts on: 425 while the request's redirect is unsettled
    (the scheduler NAKs and keeps its record), 410 once intake acknowledged it (the scheduler
    acks its old message), 409 for a message this worker never admitted. The redirect is held
    unsettled by handing the job back in the core directly (no redirect task runs)."""
    import nats

    live = InProcess(nats_server.url, "t" + os.urandom(5).hex())
    nc = await nats.connect(nats_server.url, connect_timeout=5)
    try:
        w = await start_rankd(live, W)
        await assign(nc, live, assignment("resend-blocker", W, BLOCKER_LEN))
        y = assignment("y", W, 40)  # re-sent below as it is (the same arrival stamp)
        await assign(nc, live, y, {INTAKE_MSG_HEADER: "y"})
        assert [j.source for j in w.core.queued] == ["y"]
        assert [j.request_id for j in w.core.set_lifecycle(Lifecycle.DRAINING)] == ["y"]
        for source in ("y", "y-r1-" + W):
            with pytest.raises(RemoteError) as err:
                await assign(nc, live, y, {INTAKE_MSG_HEADER: source})
            assert err.value.code == int(REDIRECTING_CODE), err.value
        w.core.redirect_settled("y", in_intake=True)
        with pytest.raises(RemoteError) as err:
            await assign(nc, live, y, {INTAKE_MSG_HEADER: "y"})
        assert err.value.code == int(HANDED_BACK_CODE), err.value
        with pytest.raises(RemoteError) as err:
            await assign(nc, live, y, {INTAKE_MSG_HEADER: "y-r1-" + W})
        assert err.value.code == 409, err.value
        assert len(w.core) == 1  # only the blocker: the refusals changed nothing
    finally:
        await live.close()
        await nc.drain()
