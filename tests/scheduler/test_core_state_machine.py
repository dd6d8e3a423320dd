"""The scheduler core driven as its callers drive it, checked against its definitions.

A hypothesis state machine runs one :class:`SchedulerCore` with the ``vertumnus`` policy (as the
simulator builds it, ``make_policy``) over a changing cluster view and a small forest of
chained block hashes (so prefixes are shared), the way ``sim/simulator.py`` and
``services/scheduler/service.py`` call it: requests placed (with cache matches, some of them too
long for every worker or for none eligible), started, finished, released and placed again (a
live redirect); workers drained and their queue re-placed after the worker is marked DRAINING
(the simulator's ``_begin``), parked requests placed again later; other replicas' requests
noted (with their work added to the tracker, as ``_on_peer_stats`` does), forgotten, expired,
handed back and placed here; requests adopted from an earlier process; workers joining,
leaving, rejoining, changing lifecycle and epoch; time passing. Alongside, the machine keeps a
model of what the calls mean. After every step the core must agree with the definitions in
the docstrings of ``services/scheduler/core.py``, ``load.py`` and ``view.py``:

* every placed and unfinished request is on exactly one worker's tracker, the one it was
  placed (or adopted) on; a finished, drained or never placed one is on none and
  ``worker_of`` says :class:`UnknownRequest`; own and foreign requests are disjoint;
* there is a tracker for every worker of the view and, outside it, exactly for the workers
  still holding a request ("a worker that left the view keeps its tracker until its last
  request finishes");
* each :class:`WorkerLoad` holds what was reserved there and not finished or withdrawn: its
  running set is what was started, ``queued()`` the rest in reservation order, and its token,
  uncached-token and block sums and ``queued_work_s`` are the sums over them;
  ``queue_delay(now)`` is >= 0, finite and equals q_w's definition (waiting predictions, the
  running ones less their run time but not below the floor, other replicas' work run down);
* the in-flight prefix index (core docstring, "in-flight prefixes") is, per worker, the
  multiset of full blocks of the unfinished requests there, own and other replicas'; and a
  decision's P for every eligible worker is min(max(cache-held, longest prefix shared with
  an unfinished request there) · B, L − 1), its exclusions the eligibility filter's;
* a call that raises the documented error for bad input (or for a refusal: too long, none
  eligible, duplicate, unknown) changed nothing (module docstring: "Every call validates
  first and changes nothing when it raises"); compared on a full snapshot of the core.

It found (fixed in ``services/scheduler/core.py``; fixed cases in
``tests/scheduler/test_registry_core.py``): a refused placement of a handed-back request
forgetting the other replica's entry; ``adopt`` with a bad argument forgetting one likewise
(and raising ``TypeError`` for a non-number); a cache match with a bad count accepted when
an in-flight prefix masked it; ``place`` of a non-request raising ``AttributeError`` once
anything was in flight; and a drain of a worker that had left the view keeping its emptied
tracker.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from services.scheduler import (
    ClusterView,
    DuplicateRequest,
    IllegalTransition,
    NoEligibleWorker,
    RequestInfo,
    SchedulerCore,
    SequenceTooLong,
    UnknownRequest,
    WorkerView,
    make_policy,
)
from services.scheduler.decision import Decision, Exclusion
from services.scheduler.view import UNLIMITED
from shared.ids import InvalidInput, UnknownWorker
from shared.worker import Lifecycle

B = 4  # block size: small, so requests span a few blocks of the forest
N_BLOCKS = 24
DEGREES = (1, 2, 4)
# Mostly unlimited, so that most placements succeed; requests are at most 12 blocks = 48
# tokens.
MAX_SEQ = (UNLIMITED, UNLIMITED, UNLIMITED, 64, 32)
KV_CAP = (UNLIMITED, UNLIMITED, UNLIMITED, 200, 24)
# ACTIVE twice as likely as each other lifecycle (a worker changed mostly comes back).
LIFECYCLES = (Lifecycle.ACTIVE, Lifecycle.ACTIVE, Lifecycle.DRAINING, Lifecycle.SWITCHING,
              Lifecycle.UNAVAILABLE)
LIFECYCLE_EXCLUSION = {
    Lifecycle.DRAINING: Exclusion.DRAINING,
    Lifecycle.SWITCHING: Exclusion.SWITCHING,
    Lifecycle.UNAVAILABLE: Exclusion.UNAVAILABLE,
}
BAD_TIMES = (math.nan, math.inf, -math.inf)
REL = 1e-9
ABS = 1e-12


@dataclass
class Own:
    """A request this core placed (or adopted) and has not finished or withdrawn."""

    worker: str
    info: RequestInfo
    predicted_s: float
    uncached: int
    seq: int  # reservation order (global, so per worker too)
    started_at: float | None = None


@dataclass(frozen=True)
class Foreign:
    """Another replica's request, noted on ``worker`` at ``at``."""

    worker: str
    info: RequestInfo
    at: float


def full_blocks(info: RequestInfo) -> tuple[int, ...]:
    """The request's full blocks (view.py: the last hash may cover a partial block, never
    reused): the first L // B hashes."""
    return tuple(info.block_hashes[: info.length // B])


def shared_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def core_state(core: SchedulerCore) -> Any:
    """Everything a core call could change, as a comparable value (white box, on purpose:
    "changed nothing" must cover the private indexes too)."""
    loads = {}
    for w, ld in core.loads.items():
        loads[w] = (
            ld.worker, ld.overrun_floor_s, ld._per_clock_s,
            tuple((a.request_id, a.predicted_s, a.tokens, a.uncached_tokens, a.blocks,
                   a.reserved_at, a.started_at) for a in ld._reqs.values()),
            tuple(ld._running), ld._queued_s, ld._tokens, ld._uncached, ld._blocks,
            ld._foreign_s, ld._foreign_at,
        )
    return (
        core.view, core._longest, dict(core._where), dict(core._requests), loads,
        # An empty per-worker map means the same as none (no block in flight there).
        {w: dict(idx) for w, idx in core._inflight.items() if idx}, dict(core._foreign),
        dict(core._inflight_tails),
    )


class CoreMachine(RuleBasedStateMachine):
    """One scheduler core, its callers' calls, and a model of what they mean."""

    @initialize(seed=st.integers(0, 2**20), n=st.integers(1, 3),
                floor=st.sampled_from([0.0, 0.002]), scale=st.sampled_from([1.0, 2.0]))
    def setup(self, seed: int, n: int, floor: float, scale: float) -> None:
        rng = random.Random(seed)
        # A forest with unique parents: a hash names its whole prefix (chained hashes).
        self.parents: dict[int, int | None] = {}
        for h in range(1, N_BLOCKS + 1):
            self.parents[h] = None if h <= 2 or rng.random() < 0.1 else rng.randint(1, h - 1)
        self.floor, self.scale = floor, scale
        self.now = 0.0
        self.next_w = 0
        self.next_r = 0
        self.seq = 0
        self.workers: dict[str, WorkerView] = {}  # the view, in its order
        self.left: set[str] = set()  # workers that were in the view once
        for _ in range(n):
            wid = self._fresh_worker()
            self.workers[wid] = WorkerView(
                wid, rng.choice(DEGREES), max_seq_len=rng.choice(MAX_SEQ),
                kv_capacity_tokens=rng.choice(KV_CAP))
        self.core = SchedulerCore(make_policy("vertumnus"), self._view(),
                                  overrun_floor_s=floor, time_scale=scale)
        self.own: dict[str, Own] = {}
        self.foreign: dict[str, Foreign] = {}
        self.gone: set[str] = set()  # ids that were own once and are not now
        self.parked: list[RequestInfo] = []  # drained / released, to be placed again
        # other replicas' work per tracker: (seconds, at), as WorkerLoad.add_foreign keeps it
        self.fwork: dict[str, tuple[float, float]] = {}
        self.tracked: set[str] = self._trackers()  # the trackers after the last call
        # Σ predictions reserved on a worker since its queue was last empty: the scale of
        # the rounding an incremental queued_work_s may carry (load.py: it is reset to
        # exactly 0 when the queue empties, so the error never outgrows this).
        self.qsum: dict[str, float] = {}

    # --- helpers --------------------------------------------------------------------------
    def _view(self) -> ClusterView:
        return ClusterView(tuple(self.workers.values()), block_size=B)

    def _fresh_worker(self) -> str:
        self.next_w += 1
        return f"w{self.next_w}"

    def _fresh_request(self) -> str:
        self.next_r += 1
        return f"r{self.next_r}"

    def _path(self, leaf: int) -> tuple[int, ...]:
        out: list[int] = []
        x: int | None = leaf
        while x is not None:
            out.append(x)
            x = self.parents[x]
        return tuple(reversed(out))

    def _request(self, data: st.DataObject, rid: str) -> RequestInfo:
        """A request on a root->leaf path: ceil(L / B) hashes, the last block maybe partial;
        now and then one without hashes."""
        path = self._path(data.draw(st.integers(1, N_BLOCKS), label="leaf"))[:12]
        if data.draw(st.integers(0, 9), label="hashless") == 0:
            return RequestInfo(rid, data.draw(st.integers(1, 48), label="length"), ())
        length = (len(path) - 1) * B + data.draw(st.integers(1, B), label="tail")
        return RequestInfo(rid, length, path, self.now)

    def _held(self, data: st.DataObject, info: RequestInfo) -> dict[str, int]:
        """A cache match: some workers of the view (and one the view lacks, which is ignored)
        hold a prefix of the request's blocks."""
        names = sorted(self.workers) + ["ghost"]
        n = len(info.block_hashes)
        return data.draw(st.dictionaries(st.sampled_from(names), st.integers(0, n),
                                         max_size=3), label="held")

    def _trackers(self) -> set[str]:
        """Workers that must have a tracker: the view's, and those still holding a request."""
        return set(self.workers) | {o.worker for o in self.own.values()}

    def _sync_trackers(self) -> None:
        """After a call that may drop trackers: a tracker dropped takes the other replicas'
        work with it (one made again later starts with none)."""
        now = self._trackers()
        for w in self.tracked - now:
            self.fwork.pop(w, None)
        self.tracked = now

    def _set_view(self) -> None:
        self.core.set_view(self._view())
        self._sync_trackers()

    def _reserved(self, worker: str, predicted_s: float) -> None:
        self.qsum[worker] = self.qsum.get(worker, 0.0) + predicted_s

    def _dequeued(self, worker: str) -> None:
        if not any(o.started_at is None for o in self._own_on(worker)):
            self.qsum.pop(worker, None)

    def _tol(self, worker: str) -> float:
        """Tolerance of an incremental sum of the worker's predictions: a few ulps of what
        went through its queue since it was last empty."""
        return ABS + 1e-12 * self.qsum.get(worker, 0.0)

    def _own_on(self, worker: str) -> list[Own]:
        return sorted((o for o in self.own.values() if o.worker == worker), key=lambda o: o.seq)

    def _inflight_prefix(self, worker: str, info: RequestInfo, skip: str) -> int:
        """Longest prefix of ``info``'s full blocks shared with an unfinished request on
        ``worker`` (own or foreign), ``skip`` excluded (a handed-back request: not there)."""
        mine = full_blocks(info)
        best = 0
        reqs = [o.info for r, o in self.own.items() if o.worker == worker and r != skip]
        reqs += [f.info for r, f in self.foreign.items() if f.worker == worker and r != skip]
        for other in reqs:
            best = max(best, shared_prefix(mine, full_blocks(other)))
        return best

    def _q(self, worker: str, now: float) -> float:
        """q_w(now) by its definition (load.py module docstring)."""
        per = 1.0 / self.scale
        q = 0.0
        for o in self._own_on(worker):
            if o.started_at is None:
                q += o.predicted_s
            else:
                q += max(o.predicted_s - (now - o.started_at) * per, self.floor)
        if worker in self.fwork:
            s, at = self.fwork[worker]
            left = s - (now - at) * per
            q += max(left, 0.0)
        return q

    def _expected_refusal(self, info: RequestInfo) -> type[Exception] | None:
        """The refusal a placement of ``info`` must meet, or None when some worker may take it."""
        if self.workers and info.length > max(w.max_seq_len for w in self.workers.values()):
            return SequenceTooLong
        if not any(self._exclusion(w, info.length) is None for w in self.workers.values()):
            return NoEligibleWorker
        return None

    @staticmethod
    def _exclusion(w: WorkerView, length: int) -> Exclusion | None:
        """The eligibility filter (eligibility.py module docstring), restated."""
        if w.lifecycle is not Lifecycle.ACTIVE:
            return LIFECYCLE_EXCLUSION[w.lifecycle]
        if length > w.max_seq_len:
            return Exclusion.TOO_LONG
        if length > w.kv_capacity_tokens:
            return Exclusion.NO_MEMORY
        return None

    def _place(self, info: RequestInfo, held: dict[str, int]) -> Decision | None:
        """Place as the callers do; check the refusal or the decision against the model and
        record the reservation. None when refused (the caller parks or drops it)."""
        rid = info.request_id
        refusal = self._expected_refusal(info)
        before = core_state(self.core)
        if refusal is not None:
            with pytest.raises(refusal) as exc:
                self.core.place(info, held, self.now)
            assert type(exc.value) is refusal
            assert core_state(self.core) == before, "a refused placement changed the core"
            return None
        expect_p = {}
        expect_q = {}
        for wid, w in self.workers.items():
            if self._exclusion(w, info.length) is None:
                n = max(held.get(wid, 0), self._inflight_prefix(wid, info, skip=rid))
                expect_p[wid] = min(n * B, info.length - 1)
                expect_q[wid] = self._q(wid, self.now)
        d = self.core.place(info, held, self.now)
        cols = d.columns
        assert cols.workers == tuple(self.workers)
        for i, wid in enumerate(cols.workers):
            assert cols.excluded[i] == self._exclusion(self.workers[wid], info.length), wid
            if wid in expect_p:
                assert cols.prefix_tokens[i] == expect_p[wid], (wid, cols.prefix_tokens[i])
                assert cols.q[i] == pytest.approx(expect_q[wid], rel=REL,
                                                  abs=self._tol(wid)), wid
        assert d.worker in expect_p, "placed on an ineligible worker"
        assert d.prefix_tokens == expect_p[d.worker]
        assert d.uncached_tokens == info.length - d.prefix_tokens
        assert math.isfinite(d.predicted_s) and d.predicted_s >= 0
        self.foreign.pop(rid, None)  # handed back, now ours (core.place)
        self.seq += 1
        self.own[rid] = Own(d.worker, info, d.predicted_s, d.uncached_tokens, self.seq)
        self._reserved(d.worker, d.predicted_s)
        self.gone.discard(rid)
        return d

    def _rejects(self, error: type[Exception], call: Any) -> None:
        """``call()`` raises ``error`` (that very type: InvalidInput is the base of several)
        and changes nothing."""
        before = core_state(self.core)
        with pytest.raises(error) as exc:
            call()
        assert type(exc.value) is error, exc.value
        after = core_state(self.core)
        changed = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
        assert not changed, (f"a call refused with {error.__name__} changed the core",
                             [(before[i], after[i]) for i in changed])

    def _drop_own(self, rid: str) -> Own:
        o = self.own.pop(rid)
        self.gone.add(rid)
        self._dequeued(o.worker)
        return o

    # --- time -----------------------------------------------------------------------------
    @rule(dt=st.sampled_from([0.0, 1e-4, 1e-3, 0.01, 0.5]))
    def tick(self, dt: float) -> None:
        self.now += dt

    # --- placement ------------------------------------------------------------------------
    @rule(data=st.data())
    def place_new(self, data: st.DataObject) -> None:
        info = self._request(data, self._fresh_request())
        self._place(info, self._held(data, info))

    @rule(data=st.data())
    def place_too_long(self, data: st.DataObject) -> None:
        """A prompt longer than some (or every) worker's max_seq_len."""
        info = RequestInfo(self._fresh_request(), data.draw(st.sampled_from([33, 65, 2**40])))
        self._place(info, {})

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def place_parked(self, data: st.DataObject) -> None:
        """A drained or released request placed again (sim ``_place`` of a parked job; the
        service's hold and retry)."""
        info = self.parked.pop(data.draw(st.integers(0, len(self.parked) - 1)))
        if info.request_id in self.own:
            return  # placed again meanwhile (a duplicate is checked elsewhere)
        if self._place(info, self._held(data, info)) is None:
            self.parked.append(info)

    @precondition(lambda self: self.foreign)
    @rule(data=st.data())
    def place_handed_back(self, data: st.DataObject) -> None:
        """Another replica's request comes back through intake and this one places it."""
        rid = data.draw(st.sampled_from(sorted(self.foreign)))
        info = self.foreign[rid].info
        self._place(info, self._held(data, info))

    @precondition(lambda self: self.own)
    @rule(data=st.data())
    def place_duplicate(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.own)))
        info = self.own[rid].info
        self._rejects(DuplicateRequest, lambda: self.core.place(info, {}, self.now))

    @rule(data=st.data(), kind=st.sampled_from(["not_request", "held", "now"]),
          foreign=st.booleans())
    def place_bad_input(self, data: st.DataObject, kind: str, foreign: bool) -> None:
        """Bad arguments: InvalidInput (the policy's contract, policy.py), nothing changed --
        also for a handed-back request (its foreign entry stays)."""
        if foreign and self.foreign:
            info = self.foreign[data.draw(st.sampled_from(sorted(self.foreign)))].info
        else:
            info = self._request(data, self._fresh_request())
        held = self._held(data, info)
        now = self.now
        request: Any = info
        if kind == "not_request":
            request = data.draw(st.sampled_from([info.request_id, None, (info.request_id,)]))
        elif kind == "held":
            ws = sorted(self.workers) or ["ghost"]
            held[data.draw(st.sampled_from(ws))] = data.draw(
                st.sampled_from([-1, 1.5, "2", None]))
        else:
            now = data.draw(st.sampled_from(BAD_TIMES))
        error: type[Exception] = InvalidInput
        if kind != "not_request" and self._expected_refusal(info) is SequenceTooLong:
            error = SequenceTooLong  # checked first: permanent, whatever else is wrong
        self._rejects(error, lambda: self.core.place(request, held, now))

    # --- execution ------------------------------------------------------------------------
    @precondition(lambda self: any(o.started_at is None for o in self.own.values()))
    @rule(data=st.data(), fifo=st.booleans())
    def start(self, data: st.DataObject, fifo: bool) -> None:
        """The worker began a waiting request: its queue head (the simulator; the service's
        inferred start) or any (the service on an AssignmentAck)."""
        waiting = sorted((o for o in self.own.values() if o.started_at is None),
                         key=lambda o: o.seq)
        # The oldest waiting request is the head of its worker's queue (reservation order).
        o = waiting[0] if fifo else data.draw(st.sampled_from(waiting))
        self.core.start(o.info.request_id, self.now)
        o.started_at = self.now
        self._dequeued(o.worker)

    @precondition(lambda self: self.own)
    @rule(data=st.data(), redirect=st.booleans())
    def finish(self, data: st.DataObject, redirect: bool) -> None:
        """Its prefill finished (or it was aborted); ``redirect``: the live scheduler releases
        it to place it afresh (a redirect from a draining worker)."""
        rid = data.draw(st.sampled_from(sorted(self.own)))
        o = self.own[rid]
        a = self.core.finish(rid, self.now)
        assert (a.request_id, a.predicted_s, a.started_at) == (rid, o.predicted_s,
                                                              o.started_at)
        self._drop_own(rid)
        self._sync_trackers()
        if redirect:
            self.parked.append(o.info)

    @rule(data=st.data(), kind=st.sampled_from(["unknown", "twice", "now_start", "now_finish"]))
    def execution_bad_input(self, data: st.DataObject, kind: str) -> None:
        running = sorted(r for r, o in self.own.items() if o.started_at is not None)
        waiting = sorted(r for r, o in self.own.items() if o.started_at is None)
        if kind == "unknown" or (kind == "twice" and not running) or (
                kind == "now_start" and not waiting) or (kind == "now_finish" and not self.own):
            rid = data.draw(st.sampled_from(sorted(self.gone | set(self.foreign) | {"never"})))
            which = data.draw(st.sampled_from(["start", "finish", "worker_of"]))
            call = {"start": lambda: self.core.start(rid, self.now),
                    "finish": lambda: self.core.finish(rid, self.now),
                    "worker_of": lambda: self.core.worker_of(rid)}[which]
            self._rejects(UnknownRequest, call)
        elif kind == "twice":
            rid = data.draw(st.sampled_from(running))
            self._rejects(IllegalTransition, lambda: self.core.start(rid, self.now))
        elif kind == "now_start":
            rid = data.draw(st.sampled_from(waiting))
            t = data.draw(st.sampled_from(BAD_TIMES))
            self._rejects(InvalidInput, lambda: self.core.start(rid, t))
        else:
            rid = data.draw(st.sampled_from(sorted(self.own)))
            t = data.draw(st.sampled_from((*BAD_TIMES, True, None)))
            self._rejects(InvalidInput, lambda: self.core.finish(rid, t))

    # --- drain (§6.2, the simulator's _begin) ---------------------------------------------
    @precondition(lambda self: self.own)
    @rule(data=st.data())
    def drain(self, data: st.DataObject) -> None:
        """Withdraw a worker's queue, mark it DRAINING, re-place what it returned (parking
        what nothing may take). A worker holding requests (draining an idle one only takes
        it out of service): one of the view (the simulator's order), or one that left the
        view (drain's contract does not restrict it)."""
        wid = data.draw(st.sampled_from(sorted({o.worker for o in self.own.values()})))
        expect = [o.info for o in self._own_on(wid) if o.started_at is None]
        out = self.core.drain(wid)
        assert list(out) == expect, "drain must return the queue in reservation order"
        for info in out:
            self._drop_own(info.request_id)
        if wid in self.workers:
            w = self.workers[wid]
            self.workers[wid] = WorkerView(wid, w.degree, w.kind, Lifecycle.DRAINING, w.epoch,
                                           w.max_seq_len, w.kv_capacity_tokens)
            self._set_view()
        self._sync_trackers()
        for info in out:
            if self._place(info, self._held(data, info)) is None:
                self.parked.append(info)

    @rule(name=st.sampled_from(["ghost", "w999"]), drain=st.booleans())
    def drain_unknown(self, name: str, drain: bool) -> None:
        if name in self._trackers():
            return
        call = self.core.drain if drain else self.core.load
        self._rejects(UnknownWorker, lambda: call(name))

    # --- other replicas -------------------------------------------------------------------
    @rule(data=st.data(), again=st.booleans(),
          work=st.sampled_from([0.0, 0.001, 0.05]))
    def note_foreign(self, data: st.DataObject, again: bool, work: float) -> None:
        """Another replica placed a request (``_on_peer_stats``): noted, and its predicted
        work added to the tracker; one noted before moves; one of ours is ignored."""
        pool = sorted(self.foreign) + sorted(self.own)
        if again and pool:
            rid = data.draw(st.sampled_from(pool))
            info = self.foreign[rid].info if rid in self.foreign else self.own[rid].info
        else:
            info = self._request(data, self._fresh_request())
            rid = info.request_id
        wid = data.draw(st.sampled_from(sorted(self.workers) + sorted(self.left) + ["ghost"]))
        noted = self.core.note_foreign(info, wid, self.now)
        assert noted == (rid not in self.own)
        if not noted:
            return
        self.foreign[rid] = Foreign(wid, info, self.now)
        ld = self.core.loads.get(wid)
        if ld is not None:
            ld.add_foreign(work, self.now)
            s, at = self.fwork.get(wid, (0.0, 0.0))
            left = s - (self.now - at) / self.scale
            self.fwork[wid] = (max(left, 0.0) + work, self.now)

    @rule(data=st.data())
    def forget_foreign(self, data: st.DataObject) -> None:
        """Its result came (``_on_result`` forgets whatever the id); ours are not touched."""
        pool = sorted(self.foreign) + sorted(self.own) + ["never"]
        rid = data.draw(st.sampled_from(pool))
        if rid in self.foreign:
            assert self.core.forget_foreign(rid) is True
            del self.foreign[rid]
        else:
            self._rejects_nothing(lambda: self.core.forget_foreign(rid), False)

    @rule(back=st.sampled_from([0.0, 0.001, 0.01, 0.5, 2.0]))
    def expire_foreign(self, back: float) -> None:
        before = self.now - back
        old = {r for r, f in self.foreign.items() if f.at < before}
        assert self.core.expire_foreign(before) == len(old)
        for r in old:
            del self.foreign[r]

    @precondition(lambda self: self._trackers())
    @rule(data=st.data(), running=st.booleans(), uncached=st.integers(0, 8),
          predicted=st.sampled_from([0.0, 0.002, 0.3, 1, 5]))
    def adopt(self, data: st.DataObject, running: bool, uncached: int,
              predicted: float) -> None:
        """A request placed on a worker by this scheduler's earlier process (``adopt``): a
        fresh one, another replica's, or one placed here already (False, nothing changed)."""
        wid = data.draw(st.sampled_from(sorted(self._trackers())))
        pick = data.draw(st.sampled_from(["new", "foreign", "own"]))
        if pick == "foreign" and self.foreign:
            info = self.foreign[data.draw(st.sampled_from(sorted(self.foreign)))].info
        elif pick == "own" and self.own:
            info = self.own[data.draw(st.sampled_from(sorted(self.own)))].info
            self._rejects_nothing(
                lambda: self.core.adopt(info, wid, predicted, self.now,
                                        uncached_tokens=uncached, running=running), False)
            return
        else:
            info = self._request(data, self._fresh_request())
        rid = info.request_id
        assert self.core.adopt(info, wid, predicted, self.now, uncached_tokens=uncached,
                               running=running) is True
        self.foreign.pop(rid, None)
        self.seq += 1
        self.own[rid] = Own(wid, info, float(predicted), uncached, self.seq,
                            self.now if running else None)
        self._reserved(wid, float(predicted))
        self._dequeued(wid)
        self.gone.discard(rid)

    @rule(data=st.data(), kind=st.sampled_from(
        ["note_request", "note_worker", "note_now", "adopt_worker", "adopt_value",
         "adopt_request"]))
    def foreign_bad_input(self, data: st.DataObject, kind: str) -> None:
        """Bad arguments to note_foreign / adopt: the documented error, nothing changed --
        also for a request another replica placed (its entry must stay)."""
        if self.foreign and data.draw(st.booleans()):
            info = self.foreign[data.draw(st.sampled_from(sorted(self.foreign)))].info
        else:
            info = self._request(data, self._fresh_request())
        wid = data.draw(st.sampled_from(sorted(self.workers) + ["ghost"]))
        now = self.now
        if kind == "note_request":
            self._rejects(InvalidInput, lambda: self.core.note_foreign(
                info.request_id, wid, now))  # type: ignore[arg-type]
        elif kind == "note_worker":
            bad_w = data.draw(st.sampled_from(["", None, 3]))
            self._rejects(InvalidInput, lambda: self.core.note_foreign(info, bad_w, now))
        elif kind == "note_now":
            t = data.draw(st.sampled_from((*BAD_TIMES, True, None)))
            self._rejects(InvalidInput, lambda: self.core.note_foreign(info, wid, t))
        elif kind == "adopt_worker":
            name = data.draw(st.sampled_from(["ghost", "w999"]))
            if name in self._trackers():
                return
            self._rejects(UnknownWorker, lambda: self.core.adopt(info, name, 0.1, now))
        elif kind == "adopt_request":
            self._rejects(InvalidInput, lambda: self.core.adopt(
                info.request_id, wid, 0.1, now))  # type: ignore[arg-type]
        else:
            if not self._trackers():
                return
            wid = data.draw(st.sampled_from(sorted(self._trackers())))
            bad_values: dict[str, tuple[object, ...]] = {
                "predicted_s": (-1.0, math.nan, math.inf, None),
                "now": (*BAD_TIMES, None),  # any finite time is a time, negative too
                "uncached_tokens": (-1, 1.5, None),
            }
            arg = data.draw(st.sampled_from(sorted(bad_values)))
            kw: dict[str, Any] = {"predicted_s": 0.1, "now": now, "uncached_tokens": 0}
            kw[arg] = data.draw(st.sampled_from(bad_values[arg]))
            self._rejects(InvalidInput, lambda: self.core.adopt(info, wid, **kw))

    def _rejects_nothing(self, call: Any, result: object) -> None:
        """``call()`` returns ``result`` and changes nothing (a documented no-op)."""
        before = core_state(self.core)
        assert call() == result
        assert core_state(self.core) == before

    # --- the view -------------------------------------------------------------------------
    @precondition(lambda self: len(self.workers) < 5)
    @rule(data=st.data(), degree=st.sampled_from(DEGREES), max_seq=st.sampled_from(MAX_SEQ),
          kv=st.sampled_from(KV_CAP), rejoin=st.booleans())
    def join(self, data: st.DataObject, degree: int, max_seq: int, kv: int,
             rejoin: bool) -> None:
        """A worker joins (a new one, or one that left comes back, maybe re-shaped)."""
        back = sorted(self.left - set(self.workers))
        wid = data.draw(st.sampled_from(back)) if rejoin and back else self._fresh_worker()
        self.workers[wid] = WorkerView(wid, degree, max_seq_len=max_seq,
                                       kv_capacity_tokens=kv)
        self._set_view()

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), last=st.integers(0, 3))
    def leave(self, data: st.DataObject, last: int) -> None:
        """A worker leaves the view (split, merge, lease expiry); its requests stay on it.
        The last one leaves now and then (``last`` 0): an empty view refuses nothing for
        length, and places nothing."""
        if len(self.workers) == 1 and last:
            return
        wid = data.draw(st.sampled_from(sorted(self.workers)))
        del self.workers[wid]
        self.left.add(wid)
        self._set_view()

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), lifecycle=st.sampled_from(LIFECYCLES), epoch=st.booleans())
    def change(self, data: st.DataObject, lifecycle: Lifecycle, epoch: bool) -> None:
        """A worker's lifecycle or epoch changes (a new worker-state or epoch message)."""
        wid = data.draw(st.sampled_from(sorted(self.workers)))
        w = self.workers[wid]
        self.workers[wid] = WorkerView(wid, w.degree, w.kind, lifecycle, w.epoch + epoch,
                                       w.max_seq_len, w.kv_capacity_tokens)
        self._set_view()

    @rule(bad=st.sampled_from([None, (), "view"]))
    def set_view_bad_input(self, bad: object) -> None:
        self._rejects(InvalidInput, lambda: self.core.set_view(bad))  # type: ignore[arg-type]

    # --- invariants -----------------------------------------------------------------------
    @invariant()
    def requests_are_where_they_were_placed(self) -> None:
        core = self.core
        assert not set(self.own) & set(self.foreign)
        for rid, o in self.own.items():
            assert core.worker_of(rid) == o.worker
            assert [w for w, ld in core.loads.items() if rid in ld] == [o.worker], rid
        for rid in self.gone | set(self.foreign):
            if rid in self.own:
                continue
            with pytest.raises(UnknownRequest):
                core.worker_of(rid)
            assert not any(rid in ld for ld in core.loads.values()), rid

    @invariant()
    def trackers_exist_for_the_view_and_busy_leavers(self) -> None:
        assert set(self.core.loads) == self._trackers()
        assert set(self.core.view.worker_ids) == set(self.workers)

    @invariant()
    def each_tracker_holds_what_was_reserved_there(self) -> None:
        for wid, ld in self.core.loads.items():
            mine = self._own_on(wid)
            waiting = [o for o in mine if o.started_at is None]
            running = [o for o in mine if o.started_at is not None]
            assert ld.unfinished == len(ld) == len(mine)
            assert ld.waiting == len(waiting) and ld.running == len(running)
            assert list(ld.queued()) == [o.info.request_id for o in waiting]
            assert ld.inflight_tokens == sum(o.info.length for o in mine)
            assert ld.inflight_uncached_tokens == sum(o.uncached for o in mine)
            assert ld.inflight_blocks == sum(-(-o.info.length // B) for o in mine)
            for o in mine:
                a = ld.assignment(o.info.request_id)
                assert (a.predicted_s, a.started_at) == (o.predicted_s, o.started_at)
            qw = sum(o.predicted_s for o in waiting)
            assert ld.queued_work_s == pytest.approx(qw, rel=REL, abs=self._tol(wid)), (
                wid, ld.queued_work_s, [(o.info.request_id, o.predicted_s) for o in waiting])
            if not waiting:
                assert ld.queued_work_s == 0.0  # reset exactly when the queue empties
            q = ld.queue_delay(self.now)
            assert math.isfinite(q) and q >= 0.0
            assert q == pytest.approx(self._q(wid, self.now), rel=REL,
                                      abs=self._tol(wid)), wid
            snap = self.core.snapshot(self.now)[wid]
            assert (snap.waiting, snap.running, snap.inflight_tokens) == (
                len(waiting), len(running), ld.inflight_tokens)

    @invariant()
    def inflight_index_is_the_unfinished_requests_full_blocks(self) -> None:
        want: dict[str, Counter[int]] = {}
        for o in self.own.values():
            want.setdefault(o.worker, Counter()).update(full_blocks(o.info))
        for f in self.foreign.values():
            want.setdefault(f.worker, Counter()).update(full_blocks(f.info))
        # A worker whose unfinished requests have no full block may keep an empty map: it
        # means the same as none (no block in flight there).
        got = {w: dict(idx) for w, idx in self.core._inflight.items() if idx}
        assert got == {w: dict(c) for w, c in want.items() if c}
        # ... and, per worker, how many of them end in a partial block (Dynamo's active set).
        tails = Counter(o.worker for o in (*self.own.values(), *self.foreign.values())
                        if o.info.length % B)
        assert self.core._inflight_tails == dict(tails)

    @invariant()
    def foreign_entries_are_the_noted_ones(self) -> None:
        assert self.core.foreign_requests == len(self.foreign)
        assert {r: (w, i, at) for r, (w, i, at) in self.core._foreign.items()} == \
            {r: (f.worker, f.info, f.at) for r, f in self.foreign.items()}


CoreMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=60,
                                         deadline=None)
test_core_state_machine = CoreMachine.TestCase
