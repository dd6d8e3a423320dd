"""The scheduler core: a policy plus the per-worker load trackers it reads.

:class:`SchedulerCore` is what the scheduler service (and the simulator) drives:

* :meth:`place` asks the policy for a decision and **immediately reserves** the predicted
  service s_{i,w} on the chosen worker (§5.2), so the next placement — even one arriving before
  the worker reports anything — sees it in q_w; a request longer than every worker's
  ``max_seq_len`` is refused with :class:`~services.scheduler.errors.SequenceTooLong` before
  the policy sees it (a :class:`~services.scheduler.errors.NoEligibleWorker` that will not
  pass: the caller must not retry it);
* :meth:`start` / :meth:`finish` follow the request's execution on the worker (``finish`` also
  calls the policy's ``on_finish`` hook);
* :meth:`drain` takes a worker's *queued* requests off it (§6.2: "Queued requests are redirected
  to other eligible workers, while in-flight prefill executions finish under the old CP
  geometry"); the caller re-places them with fresh cache matches;
* :meth:`set_view` installs a new cluster view (lifecycle / epoch changes, split, merge). A
  worker that left the view keeps its tracker until its last request finishes.

* **in-flight prefixes** (for policies with ``counts_inflight_prefixes``, the J family): a
  request queued behind another on the same worker that shares its prefix will find that
  prefix cached when it starts (a worker serves its queue in order and caches every full
  block it prefills). So the reusable prefix P_{i,w} the policy sees is the longer of the
  cache view's and the longest prefix shared with a request already assigned to w and not
  finished. Without it, a burst of requests on one new document (L-Eval) is spread over
  every worker and each recomputes the document; SGLang's router gets the same effect by
  inserting a prompt into its tree at routing time. With several scheduler replicas, the
  requests the *others* placed count too (:meth:`note_foreign`, from their placement
  statistics; :meth:`forget_foreign` at their result): otherwise a conversation's next turn,
  pulled by another replica while the previous one waits, would lose its worker.

Pure: time is a parameter; no clock, no IO. Every call validates first and changes nothing when
it raises.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping

from services.scheduler.decision import Decision
from services.scheduler.eligibility import longest_max_seq_len, sequence_too_long
from services.scheduler.errors import DuplicateRequest, UnknownRequest
from services.scheduler.load import Assignment, LoadSnapshot, WorkerLoad
from services.scheduler.policy import Policy
from services.scheduler.view import ClusterView, RequestInfo
from shared.ids import BlockHash, InvalidInput, RequestId, UnknownWorker, WorkerId
from shared.worker import Lifecycle


class SchedulerCore:
    """Placement + reservation bookkeeping for one policy over one (changing) cluster view."""

    def __init__(self, policy: Policy, view: ClusterView, *, overrun_floor_s: float = 0.0,
                 time_scale: float = 1.0) -> None:
        """``time_scale``: clock seconds per predicted second (:class:`WorkerLoad`)."""
        if not isinstance(view, ClusterView):
            raise InvalidInput(f"view must be a ClusterView, got {type(view).__name__}")
        if not hasattr(policy, "place"):
            raise InvalidInput(f"policy must implement place(), got {type(policy).__name__}")
        self.policy = policy
        self._overrun_floor_s = overrun_floor_s
        self._time_scale = time_scale
        self._view = view
        # Kept per view (immutable) so place() checks the permanent bound in O(1).
        self._longest = longest_max_seq_len(view)
        self._loads: dict[WorkerId, WorkerLoad] = {
            w.worker_id: WorkerLoad(w.worker_id, overrun_floor_s=overrun_floor_s,
                                    time_scale=time_scale)
            for w in view.workers
        }
        self._where: dict[RequestId, WorkerId] = {}
        self._requests: dict[RequestId, RequestInfo] = {}
        # worker -> full-block hash -> number of unfinished requests on it containing the block
        self._inflight: dict[WorkerId, dict[BlockHash, int]] = {}
        # worker -> unfinished requests on it whose last block is partial (never shared): with
        # _inflight, the worker's distinct active blocks (policies that read_inflight_blocks)
        self._inflight_tails: dict[WorkerId, int] = {}
        # Other replicas' unfinished requests in _inflight: id -> (worker, request, noted at)
        self._foreign: dict[RequestId, tuple[WorkerId, RequestInfo, float]] = {}

    # --- state -----------------------------------------------------------------------------
    @property
    def view(self) -> ClusterView:
        return self._view

    @property
    def loads(self) -> Mapping[WorkerId, WorkerLoad]:
        """Read-only use, please: mutate through this object so the request index stays right."""
        return self._loads

    def load(self, worker: WorkerId) -> WorkerLoad:
        try:
            return self._loads[worker]
        except KeyError:
            raise UnknownWorker(f"worker {worker!r} has no load tracker") from None

    def worker_of(self, request_id: RequestId) -> WorkerId:
        try:
            return self._where[request_id]
        except KeyError:
            raise UnknownRequest(f"request {request_id!r} is not placed") from None

    def snapshot(self, now: float) -> dict[WorkerId, LoadSnapshot]:
        return {w: ld.snapshot(now) for w, ld in self._loads.items()}

    def set_view(self, view: ClusterView) -> None:
        """Install a new view; add trackers for new workers, drop idle ones that left.

        :class:`InvalidInput` (nothing changes) for a view whose block size differs from the
        current one while requests are in flight: their prefixes are counted and released in
        blocks of the view's size, so a change would corrupt the in-flight index (the block
        size is a deployment constant; no caller changes it)."""
        if not isinstance(view, ClusterView):
            raise InvalidInput(f"view must be a ClusterView, got {type(view).__name__}")
        if view.block_size != self._view.block_size and (self._where or self._foreign):
            raise InvalidInput(
                f"block size {view.block_size} differs from {self._view.block_size} while "
                f"{len(self._where) + len(self._foreign)} request(s) are in flight")
        for w in view.workers:
            if w.worker_id not in self._loads:
                self._loads[w.worker_id] = WorkerLoad(
                    w.worker_id, overrun_floor_s=self._overrun_floor_s,
                    time_scale=self._time_scale,
                )
        for wid in [w for w, ld in self._loads.items() if w not in view and len(ld) == 0]:
            del self._loads[wid]
        self._view = view
        self._longest = longest_max_seq_len(view)

    # --- request lifecycle --------------------------------------------------------------------
    def place(
        self, request: RequestInfo, held_blocks: Mapping[WorkerId, int], now: float,
        *, pending: Mapping[WorkerId, int] | None = None,
        avoid: Collection[WorkerId] = (),
    ) -> Decision:
        """Decide and reserve. ``pending``: what each worker's pending reconcile copies will
        give it of the request (services/cachemgr/reconcile.py ``pending_reach``), for a
        policy with J's pull credit (placement.py "A pending prefix"); others ignore it.
        ``avoid``: workers this request may not go to on this call (they refused it: the
        service's retry), excluded as DRAINING in the policy's view (no candidate, still a
        holder the cache manager copies from: J's pull credit counts on them) -- its
        :class:`NoEligibleWorker` when no other worker is eligible (the caller decides
        whether to place it without them); the refusal of a request too long for every
        worker still reads the whole view.
        :class:`DuplicateRequest` if the id is already placed;
        :class:`SequenceTooLong` if the request is longer than the ``max_seq_len`` of every
        worker of the view (any lifecycle; an empty view never refuses: see
        :func:`~services.scheduler.eligibility.longest_max_seq_len`); the policy's
        :class:`~services.scheduler.errors.NoEligibleWorker` when no worker may serve it *now*."""
        # Checked here, not left to the policy: the foreign-entry and in-flight steps below
        # read request.request_id / .length first (an AttributeError, not InvalidInput).
        if not isinstance(request, RequestInfo):
            raise InvalidInput(f"request must be a RequestInfo, got {type(request).__name__}")
        if request.request_id in self._where:
            where = self._where[request.request_id]
            raise DuplicateRequest(
                f"request {request.request_id!r} is already placed on {where}")
        refused = sequence_too_long(request, self._view, self._longest)
        if refused is not None:
            raise refused
        handed_back = None
        if self._foreign and request.request_id in self._foreign:
            # Handed back, and now ours to place: forgotten first, so that its own prefix does
            # not count as in flight on the worker it left.
            handed_back = self._foreign[request.request_id]
            self.forget_foreign(request.request_id)
        try:
            view = self._avoiding(avoid) if avoid else self._view
            held = held_blocks
            if getattr(self.policy, "counts_inflight_prefixes", False) and self._inflight:
                held = self._with_inflight(request, held_blocks)
            if getattr(self.policy, "pull", None) is not None:
                # The pull credit copies only what the trie says is held, not in-flight
                # prefixes (placement.py "Pull credit").
                d = self.policy.place(request, view, held, self._loads, now,
                                      holdings=held_blocks, pending=pending)
            elif getattr(self.policy, "reads_inflight_blocks", False):
                d = self.policy.place(request, view, held, self._loads, now,
                                      inflight_blocks=self._inflight,
                                      inflight_tails=self._inflight_tails)
            else:
                d = self.policy.place(request, view, held, self._loads, now)
        except BaseException:
            if handed_back is not None:
                # A refused call changes nothing (module docstring): the other replica's
                # entry stays until the request is placed here (the caller holds and
                # retries a NoEligibleWorker) or its result comes.
                self._foreign[request.request_id] = handed_back
                self._add_inflight(handed_back[0], handed_back[1])
            raise
        self._loads[d.worker].reserve(
            request.request_id,
            d.predicted_s,
            tokens=request.length,
            uncached_tokens=d.uncached_tokens,
            blocks=-(-request.length // self._view.block_size),
            now=now,
        )
        self._where[request.request_id] = d.worker
        self._requests[request.request_id] = request
        self._add_inflight(d.worker, request)
        return d

    def _avoiding(self, avoid: Collection[WorkerId]) -> ClusterView:
        """The view with the ACTIVE workers of ``avoid`` DRAINING (the view itself when none
        is: a policy keeps per-view data by identity). DRAINING, not UNAVAILABLE: an avoided
        worker admits nothing for this request but keeps its cache, and the cache manager
        copies from it (placement.py "Pull credit": an UNAVAILABLE holder is no copy source,
        so the request refused by its prefix's holder lost the credit for that copy)."""
        ws = self._view.workers
        if not any(w.lifecycle is Lifecycle.ACTIVE and w.worker_id in avoid for w in ws):
            return self._view
        return ClusterView(
            tuple(dataclasses.replace(w, lifecycle=Lifecycle.DRAINING)
                  if w.lifecycle is Lifecycle.ACTIVE and w.worker_id in avoid else w
                  for w in ws),
            block_size=self._view.block_size)

    def adopt(self, request: RequestInfo, worker: WorkerId, predicted_s: float, now: float,
              *, uncached_tokens: int = 0, running: bool = False) -> bool:
        """Reserve a request placed on ``worker`` by an earlier process of this scheduler
        (its work counts as this core's from now on, as if :meth:`place` had placed it;
        ``running``: the worker already began it). Returns False, changing nothing, when the
        request is placed here already. :class:`UnknownWorker` when ``worker`` has no load
        tracker (not in the view); :class:`InvalidInput` on a bad argument."""
        if not isinstance(request, RequestInfo):
            raise InvalidInput(f"request must be a RequestInfo, got {type(request).__name__}")
        rid = request.request_id
        if rid in self._where:
            return False
        ld = self.load(worker)
        # Reserve (which validates every argument, raising InvalidInput; it converts to
        # float itself) before forgetting another replica's entry for it: a refused call
        # changes nothing, and float() of a bad argument raised TypeError/ValueError.
        ld.reserve(rid, predicted_s, tokens=request.length,
                   uncached_tokens=uncached_tokens,
                   blocks=-(-request.length // self._view.block_size), now=now)
        self.forget_foreign(rid)
        self._where[rid] = worker
        self._requests[rid] = request
        self._add_inflight(worker, request)
        if running:
            ld.start(rid, float(now))
        return True

    def _add_inflight(self, worker: WorkerId, request: RequestInfo) -> None:
        idx = self._inflight.setdefault(worker, {})
        for h in self._full_blocks(request):
            idx[h] = idx.get(h, 0) + 1
        if request.length % self._view.block_size:
            tails = self._inflight_tails
            tails[worker] = tails.get(worker, 0) + 1

    # --- other replicas' requests (in-flight prefixes only) ----------------------------------
    def note_foreign(self, request: RequestInfo, worker: WorkerId, now: float) -> bool:
        """Another scheduler replica placed ``request`` on ``worker``: its full blocks count as
        in flight there (never as load: that comes from the worker's report) until
        :meth:`forget_foreign`. A request this core placed itself is ignored (False); one
        noted before moves to ``worker`` (re-placed after a hand-back)."""
        if not isinstance(request, RequestInfo):
            raise InvalidInput(f"request must be a RequestInfo, got {type(request).__name__}")
        if not isinstance(worker, str) or not worker:
            raise InvalidInput(f"worker must be a non-empty string, got {worker!r}")
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            raise InvalidInput(f"now must be a finite number of seconds, got {now!r}")
        rid = request.request_id
        if rid in self._where:
            return False
        self.forget_foreign(rid)
        self._foreign[rid] = (worker, request, float(now))
        self._add_inflight(worker, request)
        return True

    def forget_foreign(self, request_id: RequestId) -> bool:
        """The other replica's request finished (or left): its blocks stop counting."""
        entry = self._foreign.pop(request_id, None)
        if entry is None:
            return False
        self._release_inflight(entry[0], entry[1])
        return True

    def expire_foreign(self, before: float) -> int:
        """Forget other replicas' requests noted before ``before`` (their result was missed:
        a bound on what a lost message can leave behind). Returns how many. InvalidInput
        (nothing forgotten) unless ``before`` is a finite number of seconds."""
        if isinstance(before, bool) or not isinstance(before, (int, float)) \
                or not math.isfinite(before):
            raise InvalidInput(f"before must be a finite number of seconds, got {before!r}")
        old = [rid for rid, (_, _, at) in self._foreign.items() if at < before]
        for rid in old:
            self.forget_foreign(rid)
        return len(old)

    @property
    def foreign_requests(self) -> int:
        """Other replicas' requests counted in the in-flight prefixes now."""
        return len(self._foreign)

    def _full_blocks(self, request: RequestInfo) -> tuple[BlockHash, ...]:
        n = request.length // self._view.block_size
        hs = request.block_hashes
        return hs if len(hs) <= n else hs[:n]

    def _with_inflight(
        self, request: RequestInfo, held_blocks: Mapping[WorkerId, int]
    ) -> Mapping[WorkerId, int]:
        """``held_blocks`` extended by prefixes of unfinished requests on each worker.
        :class:`InvalidInput` for a count that is not an integer >= 0 (the policy's check,
        made here first: a longer in-flight prefix would replace the bad count before the
        policy sees it, and a non-number would fail the comparison with a TypeError)."""
        for w, h in held_blocks.items():
            if h.__class__ is not int or h < 0:  # fast exact-int check first (speed)
                if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                    raise InvalidInput(f"held_blocks[{w!r}] must be an integer >= 0, got {h!r}")
        blocks = self._full_blocks(request)
        if not blocks:
            return held_blocks
        merged: dict[WorkerId, int] | None = None
        first = blocks[0]
        for w, idx in self._inflight.items():
            if first not in idx:
                continue
            n = 1
            for h in blocks[1:]:
                if h not in idx:
                    break
                n += 1
            if n > held_blocks.get(w, 0):
                if merged is None:
                    merged = dict(held_blocks)
                merged[w] = n
        return held_blocks if merged is None else merged

    def _release_inflight(self, worker: WorkerId, request: RequestInfo) -> None:
        if request.length % self._view.block_size:
            tails = self._inflight_tails
            left = tails.get(worker, 0) - 1
            if left > 0:
                tails[worker] = left
            else:
                tails.pop(worker, None)
        idx = self._inflight.get(worker)
        if idx is None:
            return
        for h in self._full_blocks(request):
            c = idx.get(h, 0) - 1
            if c > 0:
                idx[h] = c
            else:
                idx.pop(h, None)
        if not idx:
            del self._inflight[worker]

    def start(self, request_id: RequestId, now: float) -> None:
        """The chosen worker began the request's prefill."""
        self.load(self.worker_of(request_id)).start(request_id, now)

    def finish(self, request_id: RequestId, now: float) -> Assignment:
        """The request's prefill finished (or it was aborted): release its reservation."""
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            raise InvalidInput(f"now must be a finite number of seconds, got {now!r}")
        worker = self.worker_of(request_id)
        ld = self.load(worker)
        a = ld.finish(request_id)
        del self._where[request_id]
        self._release_inflight(worker, self._requests.pop(request_id))
        if worker not in self._view and len(ld) == 0:
            del self._loads[worker]
        self.policy.on_finish(request_id, worker, now)
        return a

    def drain(self, worker: WorkerId) -> tuple[RequestInfo, ...]:
        """Withdraw ``worker``'s queued requests (reservation order) for redirection (§6.2).

        The caller marks the worker DRAINING in the view (so it is no longer eligible) and
        re-places each returned request. Running requests stay and finish normally.
        """
        ld = self.load(worker)
        withdrawn = ld.withdraw_queued()
        out = []
        for a in withdrawn:
            del self._where[a.request_id]
            req = self._requests.pop(a.request_id)
            self._release_inflight(worker, req)
            out.append(req)
        if worker not in self._view and len(ld) == 0:
            # As finish() does: a worker that left the view keeps its tracker only while it
            # holds a request (set_view); withdrawing its last one ends it too.
            del self._loads[worker]
        return tuple(out)
