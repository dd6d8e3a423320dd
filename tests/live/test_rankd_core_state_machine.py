"""The rank daemon's worker core (``services/rankd/core.py``) through random interleavings.

A hypothesis state machine drives one :class:`WorkerCore` as its adapter does: assignments
(new, redelivered, re-sent from an old intake message, for another worker or degree, of an
epoch not adopted yet), the executor starting and finishing requests (ok or failed), epoch
records that take the worker out of ACTIVE and back, local lifecycle changes, faults (naming
the running request or detected elsewhere), redirects settling (in intake, failed, or of
unknown outcome, later confirmed), and cache-manager commands. A model records what the
module's rules promise; after every step:

* every request the core holds is in exactly one place (queued, running or redirecting), and
  ``len`` counts them; a worker that is not ACTIVE has nothing queued; a faulted one is
  UNAVAILABLE;
* the pinned-block count is the running request's pins and the cache's own pin counts;
* outstanding work is finite and >= 0, and a published state is well-formed;
* exactly once: no request that finished runs again, and none runs while being redirected;
  a re-sent assignment of a handed-back intake message is answered HandedBack (or
  HandBackUnknown / Redirecting while its outcome is open), never queued;
* a refused admission changes nothing.
"""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.rankd.core import (
    EpochAhead,
    HandBackUnknown,
    HandedBack,
    NotAccepting,
    QueueFull,
    Redirecting,
    WorkerCore,
)
from shared.ids import InvalidInput, UnknownWorker
from shared.schemas import (
    Assignment,
    EpochRecord,
    EpochWorker,
    IntakeRequest,
    ReclaimCommand,
    ReplicateCommand,
)
from shared.worker import Lifecycle

WID = "w-cp4-g4"
B = 16  # tokens a block
CHAINS = ((1, 2, 3, 4), (1, 2, 5), (6, 7), (1, 8, 9, 10, 11))  # shared prefixes
RIDS = tuple(f"r{i}" for i in range(8))


def _assignment(rid: str, chain: tuple[int, ...], extra: int, *, epoch: int,
                worker: str = WID, degree: int = 4) -> Assignment:
    length = len(chain) * B + extra
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=length, arrival_s=1.0, block_size=B,
                              block_hashes=list(chain)),
        worker_id=worker, epoch=epoch, degree=degree, prefix_tokens=0,
        recompute_tokens=length, predicted_s=0.5, assigned_at_s=1.0)


def _state_of(core: WorkerCore) -> tuple:
    """Everything admission may change (to check a refusal changed nothing)."""
    return (tuple(j.request_id for j in core.queued),
            None if core.running is None else core.running.request_id,
            tuple(j.request_id for j in core.redirecting), len(core), core.lifecycle,
            core.epoch, dict(core._known), tuple(core._finished))


class RankdCoreMachine(RuleBasedStateMachine):
    """One worker core and a model of the promises its rules make."""

    def __init__(self) -> None:
        super().__init__()
        self.core = WorkerCore(WID, kv_total_blocks=12, max_queue=4)
        self.now = 0.0
        self.record_epoch = 0
        self.sources = 0
        # Model: request id -> the source of its current admission here (queued / running).
        self.finished_ok: set[str] = set()
        self.finished: set[str] = set()
        self.handed_back: dict[str, str] = {}  # rid -> source whose redirect intake holds
        self.unknown: dict[str, str] = {}  # rid -> source whose redirect outcome is unknown
        self.starts: dict[str, int] = {}
        self.last_source: dict[str, str] = {}

    def _new_source(self) -> str:
        self.sources += 1
        return f"m{self.sources}"

    # --- assignments ----------------------------------------------------------------------
    @rule(rid=st.sampled_from(RIDS), chain=st.sampled_from(CHAINS), extra=st.integers(0, 20),
          how=st.sampled_from(["new", "new", "again", "old", "other-worker", "other-degree",
                               "ahead"]))
    def assign(self, rid: str, chain: tuple[int, ...], extra: int, how: str) -> None:
        """The scheduler places ``rid`` here: a fresh intake message, a redelivery of the same
        one, an old one re-sent after a crash, or a malformed or early assignment."""
        core = self.core
        kw: dict = {}
        if how == "other-worker":
            kw = {"worker": "w-cp4-g0"}
        elif how == "other-degree":
            kw = {"degree": 2}
        epoch = core.epoch + 1 if how == "ahead" else core.epoch
        a = _assignment(rid, chain, extra, epoch=epoch, **kw)
        if how in ("again", "old") and rid in self.last_source:
            source = self.last_source[rid]
        elif how == "old" and rid in self.handed_back:
            source = self.handed_back[rid]
        else:
            source = self._new_source()
        before = _state_of(core)
        held = {j.request_id for j in core.queued} | (
            {core.running.request_id} if core.running else set())
        try:
            pos = core.admit(a, self.now, source=source)
        except HandedBack:
            assert self.handed_back.get(rid) == source
            assert _state_of(core) == before
            return
        except HandBackUnknown as exc:
            assert self.unknown.get(rid) == source and exc.job.request_id == rid
            assert _state_of(core) == before
            return
        except Redirecting:
            assert rid in {j.request_id for j in core.redirecting}
            assert _state_of(core) == before
            return
        except (NotAccepting, EpochAhead, QueueFull, UnknownWorker, InvalidInput) as exc:
            assert _state_of(core) == before, exc
            if isinstance(exc, NotAccepting):
                assert core.lifecycle is not Lifecycle.ACTIVE
            elif isinstance(exc, EpochAhead):
                assert how == "ahead"
            elif isinstance(exc, QueueFull):
                assert len(core) >= core.max_queue
            else:
                assert how in ("other-worker", "other-degree")
            return
        assert pos >= 0
        # Never queued beside a hand-back intake holds (exactly once across a crash).
        assert self.handed_back.get(rid) != source and self.unknown.get(rid) != source
        if rid in self.finished:
            assert pos == 0 and rid not in {j.request_id for j in core.queued}
            return
        if rid not in held:
            self.last_source[rid] = source

    @precondition(lambda self: bool(self.handed_back) or bool(self.unknown))
    @rule(data=st.data(), chain=st.sampled_from(CHAINS))
    def resend_handed_back(self, data: st.DataObject, chain: tuple[int, ...]) -> None:
        """A scheduler that crashed re-sends the assignment of an intake message this worker
        handed back: intake holds (or may hold) the request under the redirect's message, so
        it must not run here too."""
        rid, source = data.draw(st.sampled_from(sorted({**self.handed_back,
                                                         **self.unknown}.items())))
        core = self.core
        before = _state_of(core)
        held = rid in core._known
        try:
            core.admit(_assignment(rid, chain, 0, epoch=core.epoch), self.now, source=source)
        except (HandedBack, HandBackUnknown, Redirecting, NotAccepting, QueueFull):
            assert _state_of(core) == before
            return
        # Admitted only as a redelivery of what the core already holds or finished (a later
        # admission of the same request from another message), never queued afresh.
        assert held or rid in self.finished, (rid, source)

    # --- execution ------------------------------------------------------------------------
    @rule(dt=st.floats(0.0, 2.0))
    def start(self, dt: float) -> None:
        self.now += dt
        was = self.core.running
        job = self.core.start_next(self.now)
        if was is not None or job is None:
            assert job is None
            return
        rid = job.request_id
        assert rid not in self.finished_ok, f"{rid} ran twice"
        assert rid not in {j.request_id for j in self.core.redirecting}
        self.starts[rid] = self.starts.get(rid, 0) + 1
        ex = job.executed
        assert ex is not None and 0 <= ex.prefix_tokens <= ex.request.input_len - 1
        assert ex.prefix_tokens + ex.recompute_tokens == ex.request.input_len

    @precondition(lambda self: self.core.running is not None)
    @rule(ok=st.booleans(), dt=st.floats(0.0, 2.0))
    def finish(self, ok: bool, dt: float) -> None:
        self.now += dt
        rid = self.core.running.request_id  # type: ignore[union-attr]
        self.core.finish(rid, ok=ok)
        self.finished.add(rid)
        if ok:
            self.finished_ok.add(rid)

    @rule(rid=st.sampled_from(RIDS), rare=st.integers(0, 3))
    def finish_wrong(self, rid: str, rare: int) -> None:
        """The adapter reports a request that is not running: refused, nothing changes."""
        core = self.core
        if rare or (core.running is not None and core.running.request_id == rid):
            return
        before = _state_of(core)
        with contextlib.suppress(InvalidInput):
            core.finish(rid)
            raise AssertionError("finished a request that was not running")
        assert _state_of(core) == before

    @rule(name_running=st.booleans(), rare=st.integers(0, 9))
    def fault(self, name_running: bool, rare: int) -> None:
        """The worker can no longer compute (rare: it ends the worker's useful life)."""
        if rare:
            return
        core = self.core
        running = core.running.request_id if name_running and core.running else None
        handed = core.fault(running)
        assert core.faulted and core.lifecycle is Lifecycle.UNAVAILABLE
        assert not core.queued
        if running is not None:
            assert handed and handed[0].request_id == running and core.running is None

    # --- lifecycle ------------------------------------------------------------------------
    @rule(lifecycle=st.sampled_from([Lifecycle.ACTIVE, Lifecycle.ACTIVE, Lifecycle.ACTIVE,
                                     Lifecycle.DRAINING, Lifecycle.SWITCHING,
                                     Lifecycle.UNAVAILABLE, None]),
          newer=st.sampled_from([True, True, False]))
    def epoch_record(self, lifecycle: Lifecycle | None, newer: bool) -> None:
        """The controller commits a record (this worker in it with ``lifecycle``, or absent);
        an older or equal one is ignored."""
        if newer:
            self.record_epoch += 1
        workers = [EpochWorker(worker_id="w-cp4-g0", first_gpu=0, degree=4,
                               lifecycle=Lifecycle.ACTIVE)]
        if lifecycle is not None:
            workers.append(EpochWorker(worker_id=WID, first_gpu=4, degree=4,
                                       lifecycle=lifecycle))
        before = _state_of(self.core)
        res = self.core.adopt(EpochRecord(epoch=self.record_epoch, workers=workers,
                                          committed_at_s=self.now))
        if not res.adopted:
            assert _state_of(self.core) == before
            return
        assert self.core.epoch == self.record_epoch
        want = lifecycle or Lifecycle.UNAVAILABLE
        assert self.core.lifecycle is (Lifecycle.UNAVAILABLE if self.core.faulted else want)

    @rule(lifecycle=st.sampled_from([Lifecycle.ACTIVE, Lifecycle.ACTIVE, Lifecycle.DRAINING,
                                     Lifecycle.UNAVAILABLE]))
    def set_lifecycle(self, lifecycle: Lifecycle) -> None:
        self.core.set_lifecycle(lifecycle)

    # --- redirects ------------------------------------------------------------------------
    @precondition(lambda self: bool(self.core.redirecting))
    @rule(data=st.data(), outcome=st.sampled_from(["in_intake", "failed", "unknown"]))
    def settle(self, data: st.DataObject, outcome: str) -> None:
        job = data.draw(st.sampled_from(self.core.redirecting))
        rid = job.request_id
        self.core.redirect_settled(rid, in_intake=outcome == "in_intake",
                                   unknown=outcome == "unknown")
        self.last_source.pop(rid, None)
        if job.source is None:
            return
        if outcome == "in_intake":
            self.handed_back[rid] = job.source
            self.unknown.pop(rid, None)
        elif outcome == "unknown":
            self.unknown[rid] = job.source

    @precondition(lambda self: bool(self.unknown))
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.unknown)))
        if rid not in self.core._handback_unknown:
            return  # a later redirect of the same request replaced it and settled otherwise
        self.core.handback_confirmed(rid)
        self.handed_back[rid] = self.unknown.pop(rid)

    # --- the cache manager's commands -----------------------------------------------------
    @rule(chain=st.sampled_from(CHAINS), reclaim=st.booleans(), cut=st.integers(1, 4))
    def command(self, chain: tuple[int, ...], reclaim: bool, cut: int) -> None:
        core = self.core
        if reclaim:
            cmd = ReclaimCommand(command_id="c", worker_id=WID, epoch=core.epoch,
                                 blocks=list(chain[-cut:]))
        else:
            cmd = ReplicateCommand(command_id="c", worker_id=WID, epoch=core.epoch,
                                   blocks=list(chain),
                                   source_worker="w-cp4-g0")
        res = core.apply_command(cmd)
        assert res.ok and res.blocks_done >= 0
        core.take_cache_events()

    # --- what the rules promise -----------------------------------------------------------
    @invariant()
    def one_place_each(self) -> None:
        core = self.core
        queued = [j.request_id for j in core.queued]
        redirecting = [j.request_id for j in core.redirecting]
        running = [] if core.running is None else [core.running.request_id]
        every = queued + redirecting + running
        assert len(every) == len(set(every)) == len(core)
        assert set(core._known) == set(every)
        if core.lifecycle is not Lifecycle.ACTIVE:
            assert not queued
        if core.faulted:
            assert core.lifecycle is Lifecycle.UNAVAILABLE

    @invariant()
    def pins_are_the_running_requests(self) -> None:
        core = self.core
        pinned = () if core.running is None else core.running.pinned
        assert core._pinned_blocks == len(pinned)
        assert core.cache is not None
        assert sum(core.cache._pins.values()) == len(pinned)
        for j in (*core.queued, *core.redirecting):
            assert not j.pinned

    @invariant()
    def state_is_publishable(self) -> None:
        s = self.core.state(self.now)
        assert 0.0 <= s.outstanding_s < float("inf")
        assert 0 <= s.kv_free_blocks <= s.kv_total_blocks
        assert s.queue_len == len(self.core)
        # What the controller's reconciliation-traffic estimate reads: the cache's blocks.
        assert self.core.cache is not None and s.kv_cached_blocks == len(self.core.cache)


RankdCoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
test_rankd_core_state_machine = RankdCoreMachine.TestCase
