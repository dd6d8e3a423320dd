"""A worker that refuses a dispatch with a micro error other than 410 / 425 (real
nats-server, the scheduler in-process, fake workers answering micro errors as a rank daemon's
endpoint does: 500 for an internal error, 409 for a core refusal, 503 from a proxy).

Such a refusal releases the reservation and NAKs the message (``retry_delay_s``). Before, the
next delivery was placed from scratch: nothing had changed for J (the reservation was
released, the refusing worker still ACTIVE), so it chose the same worker again, delivery after
delivery, until ``max_deliver`` failed the request -- while another worker was free. Now the
retry avoids the workers that refused the request when another one is eligible; when the
refusing worker is the only one, it is retried there (or failed) under the usual rules.
"""

from __future__ import annotations

import time

import pytest
from live_sched_support import FakeWorker, publish_intake, results_for, wait_until
from nats.aio.msg import Msg
from nats.micro.request import Request

from services.rankd.core import HANDBACK_CAUSE_HEADER, handback_msg_id
from shared.schemas import Assignment, IntakeRequest, decode, encode
from shared.subjects import Subjects

W1, W2 = "w-cp2-g0", "w-cp2-g2"


class Refusing(FakeWorker):
    """A fake worker that refuses assignments with a micro error: every assignment of a
    request ``refuses(request id)`` names (shared between workers: a callable over the
    worker and the request), the others as FakeWorker does."""

    code: str = "503"
    refuses: object = None  # Callable[[str, str], bool]: (worker id, request id) -> refuse?
    refusals: int = 0

    async def _on_assign(self, msg: Msg) -> None:
        a = decode(Assignment, msg.data, msg.headers)
        rule = self.refuses
        if callable(rule) and rule(self.worker_id, a.request.request_id):
            self.assignments.append(a)
            self.refusals += 1
            await Request(msg).respond_error(self.code, "engine refused the request")
            return
        await super()._on_assign(msg)


@pytest.mark.parametrize("code", ["500", "503", "409"])
async def test_a_retry_avoids_the_worker_that_refused_it(live, nc, uniq, code) -> None:  # type: ignore[no-untyped-def]
    """Whichever worker J picks first refuses the request, and goes on refusing it; the
    other worker would take it. The retry goes to the other worker: one refusal, one answer."""
    first: dict[str, str] = {}

    def refuses(worker: str, rid: str) -> bool:
        return first.setdefault(rid, worker) == worker

    workers = []
    for wid, gpu in ((W1, 0), (W2, 2)):
        w = Refusing(nc, Subjects(uniq), wid, 2, gpu)
        w.code, w.refuses = code, refuses
        workers.append(await w.start())
    sched = await live.scheduler(block_size=16, retry_delay_s=0.05, max_deliver=5)
    await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")
    got = await results_for(nc, uniq, "x")
    await publish_intake(nc, uniq, "x")
    # Until the answer, or a second refusal (the retry went back to the refusing worker).
    await wait_until(lambda: got or sum(w.refusals for w in workers) >= 2,
                     "x answered or refused twice")
    refuser = next(w for w in workers if w.worker_id == first["x"])
    other = next(w for w in workers if w is not refuser)
    assert refuser.refusals == 1 and len(refuser.assignments) == 1, (
        f"the retry went back to {refuser.worker_id} ({refuser.refusals} refusals) while "
        f"{other.worker_id} was free")
    await wait_until(lambda: got, "x's answer")
    assert [(t.worker_id, t.error) for t in got] == [(other.worker_id, None)], got
    assert [a.request.request_id for a in other.assignments] == ["x"]
    st = sched.stats
    assert (st.retried, st.failed, st.worker_refusals, st.refusals_avoided) == (1, 0, 1, 1), st
    # Dispatched: forgotten once the scheduler has read the worker's ack, which the fake
    # worker sends just before the answer, on another connection than the test's: waited for.
    await wait_until(lambda: "x" not in sched._refused_by, "x's refusals forgotten")
    for w in workers:
        await w.stop()


async def test_the_only_worker_refusing_once_still_serves_the_retry(live, nc, uniq) -> None:  # type: ignore[no-untyped-def]
    """Avoiding a worker that refused is a preference: the only worker is retried."""
    refused: set[str] = set()

    def once(worker: str, rid: str) -> bool:
        if rid in refused:
            return False
        refused.add(rid)
        return True

    w = Refusing(nc, Subjects(uniq), W1, 2, 0)
    w.refuses = once
    await w.start()
    try:
        sched = await live.scheduler(block_size=16, retry_delay_s=0.05, max_deliver=5)
        await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
        got = await results_for(nc, uniq, "x")
        await publish_intake(nc, uniq, "x")
        await wait_until(lambda: got, "x's answer")
        assert [(t.worker_id, t.error) for t in got] == [(W1, None)], got
        assert w.refusals == 1 and len(w.assignments) == 2
        st = sched.stats
        assert (st.retried, st.failed, st.worker_refusals, st.refusals_avoided) == (1, 0, 1, 0), st
    finally:
        await w.stop()


async def test_the_only_worker_refusing_every_time_fails_the_request_on_its_last_delivery(
        live, nc, uniq) -> None:  # type: ignore[no-untyped-def]
    """Nothing else to try: every delivery goes to it, and the last one fails the request
    (the client gets a "not scheduled" error, not a wait for its timeout)."""
    w = Refusing(nc, Subjects(uniq), W1, 2, 0)
    w.refuses = lambda worker, rid: True
    await w.start()
    try:
        sched = await live.scheduler(block_size=16, retry_delay_s=0.05, max_deliver=3)
        await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
        got = await results_for(nc, uniq, "x")
        await publish_intake(nc, uniq, "x")
        await wait_until(lambda: got, "x's failure")
        assert len(got) == 1 and got[0].token is None, got
        assert got[0].error is not None and got[0].error.startswith("not scheduled"), got
        assert w.refusals == 3
        st = sched.stats
        assert (st.retried, st.failed, st.worker_refusals, st.refusals_avoided) == (2, 1, 3, 0), st
        assert "x" not in sched._refused_by  # failed: forgotten
    finally:
        await w.stop()


async def test_a_hand_back_is_placed_away_from_the_worker_that_handed_it_back(
        live, nc, uniq) -> None:  # type: ignore[no-untyped-def]
    """A worker hands a request back (it drains, stops, failed) before this replica has seen
    why -- the epoch record can arrive after the hand-back. J still prefers that worker (idle,
    the other busy), but the hand-back goes to the other one: before, it went back to the
    worker, which refused it (409 draining), and only the retry, a ``retry_delay_s`` later,
    went elsewhere (tests/live_accept/test_accept_handback_trace.py caught it as a third
    dispatch span)."""
    idle = await FakeWorker(nc, Subjects(uniq), W1, 2, 0).start()
    busy = FakeWorker(nc, Subjects(uniq), W2, 2, 2)
    busy.outstanding_s = 0.5
    await busy.start()
    try:
        sched = await live.scheduler(block_size=16, retry_delay_s=0.05, max_deliver=5)
        await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")
        got_y = await results_for(nc, uniq, "y")
        await publish_intake(nc, uniq, "y")
        await wait_until(lambda: got_y, "y's answer")
        assert [t.worker_id for t in got_y] == [W1]  # J's choice: the idle worker
        got = await results_for(nc, uniq, "x")
        await publish_handback(nc, uniq, "x", W1, cause="draining")
        await wait_until(lambda: got, "x's answer")
        assert [(t.worker_id, t.error) for t in got] == [(W2, None)], got
        assert [a.request.request_id for a in idle.assignments] == ["y"]
        st = sched.stats
        assert (st.handbacks_steered, st.refusals_avoided, st.worker_refusals, st.retried) \
            == (1, 1, 0, 0), st
    finally:
        await idle.stop()
        await busy.stop()


async def test_a_hand_back_goes_back_to_its_worker_when_no_other_is_eligible(
        live, nc, uniq) -> None:  # type: ignore[no-untyped-def]
    """Avoiding the worker that handed a request back is a preference, as after a refusal:
    the only worker (a restarted one, say, still ACTIVE) takes it."""
    w = await FakeWorker(nc, Subjects(uniq), W1, 2, 0).start()
    try:
        sched = await live.scheduler(block_size=16, retry_delay_s=0.05, max_deliver=5)
        await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
        got = await results_for(nc, uniq, "x")
        await publish_handback(nc, uniq, "x", W1)
        await wait_until(lambda: got, "x's answer")
        assert [(t.worker_id, t.error) for t in got] == [(W1, None)], got
        st = sched.stats
        assert (st.handbacks_steered, st.refusals_avoided, st.retried) == (1, 0, 0), st
    finally:
        await w.stop()


async def publish_handback(nc, uniq: str, rid: str, worker: str,  # type: ignore[no-untyped-def]
                           cause: str | None = None) -> None:
    """``rid`` (40 tokens) on intake as ``worker``'s hand-back of its first message (the
    id rankd gives it, ``{rid}>{worker}``), with ``cause`` in its header if given."""
    req = IntakeRequest(request_id=rid, input_len=40, block_size=16, arrival_s=time.time())
    data, headers = encode(req)
    headers["Nats-Msg-Id"] = handback_msg_id(rid, rid, worker, 1)
    if cause is not None:
        headers[HANDBACK_CAUSE_HEADER] = cause
    await nc.jetstream().publish(Subjects(uniq).intake_requests(), data, headers=headers)
