"""Discrete-event simulator of a prefill pool driven by the project's own policy cores.

One virtual clock, a heap of events, and simulated workers whose prefill takes the *ground
truth* time (``sim.groundtruth``, with seeded noise). Everything that decides runs through the
same cores as the live services:

* placement — the policy from ``services.scheduler`` (``make_policy``), with the scheduler's
  :class:`~services.scheduler.load.WorkerLoad` reservations;
* the global prefix trie — ``services.cachemgr.trie.PrefixTrie`` fed by each worker's local
  LRU block cache (``services.rankd.blockcache.BlockCache``) through cache events; Algorithm 1
  per request and Algorithm 2 scans with replication transfers that become visible only when
  the destination's own stored event arrives;
* the controller — ``services.controller`` windows, planner and lifecycle: split and merge with
  drain (queued requests redirected, in-flight prefill finishing under the old geometry) and a
  switch time, then §6.2 reconciliation of the retained prefixes.

Honesty: the policies see only the fitted :class:`~shared.costmodel.Profile`; ground truth is
consulted only to advance the clock. Deterministic for a given seed.

TTFT = prefill finish + KV handoff + first decode step − arrival (design.md, Metrics).
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.cachemgr.actions import Demote, Reclaim, Replicate
from services.cachemgr.pull import PullConfig, demotion, pull_on_route
from services.cachemgr.reconcile import (
    RehomeConfig,
    on_reuse,
    pending_reach,
    reconcile_merge,
    reconcile_split,
    rehome_on_merge,
    rehome_on_split,
)
from services.cachemgr.scan import ScanConfig
from services.cachemgr.trie import PrefixTrie
from services.controller.core import ControllerCore
from services.controller.lattice import Composition, Lattice, OpKind
from services.controller.planner import ControllerConfig, Plan, Trigger
from services.rankd.blockcache import BlockCache
from services.scheduler.core import SchedulerCore
from services.scheduler.errors import NoEligibleWorker
from services.scheduler.placement import PullCredit
from services.scheduler.policies.vertumnus import JPolicy
from services.scheduler.registry import make_policy
from services.scheduler.view import ClusterView, RequestInfo, WorkerView
from shared.costmodel import Profile
from shared.ids import BlockHash, InvalidInput, RequestId, WorkerId, tp_worker_name
from shared.worker import GpuGroup, Lifecycle, WorkerKind
from sim import calibration
from sim.groundtruth import GroundTruth, NoisyGroundTruth
from sim.metrics import refusal_reason
from sim.workloads.workload import Request, Workload


def controller_profile(profile: Profile, kappa_scale: float) -> Profile:
    """The profile the controller judges capacity with: κ_C × ``kappa_scale`` for every degree
    the profile measured (the scheduler keeps the plain profile; it never uses κ)."""
    if kappa_scale == 1.0 or not profile.kappa:
        return profile
    return profile.with_kappa({c: k * kappa_scale for c, k in profile.kappa.items()})


# Event kinds (ints: the heap compares tuples, and ints are the cheapest tie-breakers).
_ARRIVE, _FINISH, _WINDOW, _SCAN, _XFER, _SWITCHED, _PULLED = range(7)

DEFAULT_SCAN_CONFIG: ScanConfig = calibration.SCAN
"""The calibrated scan thresholds (services/calibration.py ``SCAN``, reasons there), as the live
cache manager uses them.

θ_inter in seconds of predicted benefit missed at the preferred degree; θ_intra / θ_reclaim in
decayed accesses per replica (with decay 0.5 a steady rate of n accesses per scan settles at 2n);
one action per list per scan (the paper dispatches at most one transfer per scan)."""


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment.

    ``adaptive`` turns the controller's split/merge on; ``cache_manager`` turns Algorithm 1's
    statistics, the scan's replication / reclamation and lazy reconciliation on.
    ``cache_blocks_per_gpu`` = None uses the ground truth's HBM budget.
    """

    policy: str = "vertumnus"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    gpus: int = 40
    degrees: tuple[int, ...] = (2, 4)
    gpus_per_node: int = 8
    worker_kind: WorkerKind = WorkerKind.CP
    adaptive: bool = False
    cache_manager: bool = False
    cache_blocks_per_gpu: int | None = None
    max_seq_len: int = 262_144
    window_s: float = 20.0
    scan_interval_s: float = 20.0
    seed: int = 0
    noise_sigma: float = 0.04
    scan_config: ScanConfig = DEFAULT_SCAN_CONFIG
    controller_config: ControllerConfig | None = None
    rehome: RehomeConfig | None = None
    """With ``cache_manager``: re-home a split parent's long prefixes to its degree's other
    workers when the split starts, and a merged worker's degree's long prefixes to it when it
    is exposed (services/cachemgr/reconcile.py ``rehome_on_split`` / ``rehome_on_merge``)."""
    pull: PullConfig | None = None
    """With ``cache_manager``: pull a request's prefix to the worker it was routed to from
    the worker holding the most of it (services/cachemgr/pull.py ``pull_on_route``)."""
    pull_credit_blocks: int = 0
    """With ``cache_manager`` and ``pull``: a J policy counts on the pull for copies of up to
    this many blocks (services/scheduler/placement.py ``PullCredit``, its ``min_blocks`` the
    pull's); 0: J counts only what is held."""
    pull_displace_block_s: float = 0.0
    """With the credit: J's price per block a credited copy moves (``PullCredit``'s
    ``displace_block_s``; 0: none)."""
    pull_wait: bool = False
    """With the credit: it also goes to a worker whose queue is shorter than the copy
    (``PullCredit.wait``), and a request J counted a pull for starts only once the copies
    with its credited prefix have landed -- the pull it was routed with, and every copy
    already on its way to its worker with a part of that prefix (``_arriving``) -- as a live
    rank daemon holds it until its cache has the prefix (services/rankd/core.py
    ``WorkerCore.pull_hold``; placement.py "Pull credit")."""
    pending_credit: bool = False
    """With the credit: J also counts a prefix pending at a worker after a split or merge as
    a copy to it (placement.py "A pending prefix"; reconcile.py ``pending_reach``), and with
    ``pull_wait`` a request J counted it for waits for those reconcile copies too."""
    kappa_scale: float = 1.0
    """Multiplies the profile's κ_C for the controller only (see sim/calibration.py)."""

    def __post_init__(self) -> None:
        if not self.kappa_scale > 0:
            raise InvalidInput(f"kappa_scale must be > 0, got {self.kappa_scale}")
        if self.gpus < 1:
            raise InvalidInput(f"gpus must be >= 1, got {self.gpus}")
        if not self.degrees:
            raise InvalidInput("degrees must not be empty")
        if self.window_s <= 0 or self.scan_interval_s <= 0:
            raise InvalidInput("window_s and scan_interval_s must be > 0")
        if self.cache_blocks_per_gpu is not None and self.cache_blocks_per_gpu < 1:
            raise InvalidInput("cache_blocks_per_gpu must be >= 1")
        c = self.pull_credit_blocks
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise InvalidInput(f"pull_credit_blocks must be an integer >= 0, got {c!r}")
        d = self.pull_displace_block_s
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d < math.inf:
            raise InvalidInput(f"pull_displace_block_s must be a finite number >= 0, got {d!r}")
        if not isinstance(self.pull_wait, bool):
            raise InvalidInput(f"pull_wait must be a bool, got {self.pull_wait!r}")
        if not isinstance(self.pending_credit, bool):
            raise InvalidInput(f"pending_credit must be a bool, got {self.pending_credit!r}")
        if self.adaptive and self.worker_kind is not WorkerKind.CP:
            # The controller splits and merges CP workers (§6); a TP pool is held fixed.
            raise InvalidInput(f"adaptive needs CP workers; a {self.worker_kind.value} pool is "
                               "held fixed")


def pull_credit(config: SimConfig) -> PullCredit | None:
    """J's credit for the route-time pull in ``config``'s deployment: only where its cache
    manager pulls (``cache_manager`` and ``pull``) and ``pull_credit_blocks`` > 0; copies of
    ``pull.min_blocks`` to ``pull_credit_blocks`` blocks, priced ``pull_displace_block_s`` a
    copied block, with ``pull_wait`` as its ``wait`` (raises :class:`InvalidInput` when
    ``pull_credit_blocks`` is below ``pull.min_blocks``)."""
    if not config.cache_manager or config.pull is None or not config.pull_credit_blocks:
        return None
    return PullCredit(min_blocks=config.pull.min_blocks, max_blocks=config.pull_credit_blocks,
                      displace_block_s=config.pull_displace_block_s, wait=config.pull_wait)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (seconds, tokens). ``ttft_s`` < 0: never completed.

    ``failed``: the scheduler's message when no worker could take it ('' otherwise), for
    people; ``failed_reason``: why, as a key (:func:`sim.metrics.refusal_reason` of the
    exception: ``no_memory``, ``too_long``, ...), what the results count.
    """

    request_id: str
    arrival_s: float
    input_len: int
    worker: str = ""
    degree: int = 0
    reused_tokens: int = 0
    predicted_s: float = 0.0
    actual_s: float = 0.0
    start_s: float = -1.0
    finish_s: float = -1.0
    ttft_s: float = -1.0
    redirected: int = 0
    failed: str = ""
    failed_reason: str = ""

    # Where a completed request's TTFT went (``queue_s + prefill_s + handoff_s == ttft_s``);
    # the one definition of the split, for the results rows and the per-request logs.
    @property
    def queue_s(self) -> float:
        """Arrival to the start of its prefill: the worker's queue, a wait for a pulled
        prefix, a redirection after a drain (completed requests only)."""
        return self.start_s - self.arrival_s

    @property
    def prefill_s(self) -> float:
        """The prefill itself, the ground truth's time (completed requests only)."""
        return self.finish_s - self.start_s

    @property
    def handoff_s(self) -> float:
        """The rest of the TTFT: the KV hand-off to decode and the first decode step
        (completed requests only)."""
        return self.ttft_s - (self.finish_s - self.arrival_s)


@dataclass(slots=True)
class Reconfiguration:
    """One split or merge as it happened (times in simulated seconds)."""

    kind: str
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    decided_s: float
    reason: str
    rid: int = -1
    drained_s: float = -1.0
    exposed_s: float = -1.0
    trigger: Trigger | None = None
    """The controller rule that decided it (``Decision.trigger``, services/controller/planner)."""

    @property
    def drain_s(self) -> float:
        return self.drained_s - self.decided_s

    @property
    def switch_s(self) -> float:
        return self.exposed_s - self.drained_s


@dataclass(slots=True)
class _Job:
    req: Request
    rec: RequestRecord
    info: RequestInfo
    pull_end: float = -1.0
    """When the pull J counted on for it lands (``SimConfig.pull_wait``); -1: none."""


class _SimWorker:
    __slots__ = ("wid", "group", "kind", "kind_name", "degree", "cache", "queue", "running",
                 "lifecycle", "pinned")

    def __init__(self, wid: WorkerId, group: GpuGroup, kind: WorkerKind, capacity: int) -> None:
        self.wid = wid
        self.group = group
        self.kind = kind
        self.kind_name = kind.value  # what the ground truth's ``kind`` argument takes
        self.degree = group.degree
        self.cache = BlockCache(wid, capacity)
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None
        self.lifecycle = Lifecycle.ACTIVE
        self.pinned: tuple[BlockHash, ...] = ()


@dataclass
class SimResult:
    """Everything a run produced."""

    config: SimConfig
    workload_name: str
    records: list[RequestRecord]
    reconfigurations: list[Reconfiguration]
    composition_timeline: list[tuple[float, dict[int, int]]]
    gpu_seconds: float
    replications: int
    reclamations: int
    reconcile_transfers: int
    end_s: float
    pulls: int = 0
    """Route-time pulls that landed (services/cachemgr/pull.py)."""
    copy_waits: int = 0
    """Copies (replicas, pulls, reconcile transfers) that waited for their workers' links."""
    copy_wait_s: float = 0.0
    """The seconds they waited, in all."""
    pull_waits: int = 0
    """Requests that reached the head of their worker's queue before the pull J counted on
    for them had landed, and waited for it (``SimConfig.pull_wait``)."""
    pull_wait_s: float = 0.0
    """The seconds they waited, in all."""
    rehome_demoted: int = 0
    """Blocks a split's re-homing demoted at full peers to make room for its copies
    (services/cachemgr/reconcile.py ``rehome_on_split``, ``RehomeConfig.displace``)."""


def install_copy(trie: PrefixTrie, cache: BlockCache, act: Replicate) -> int | None:
    """Install the copy ``act`` at its destination, whose local cache is ``cache``, as a rank
    daemon does when the pages arrive; returns the blocks of the path now cached there, or
    None (nothing changed) when the copied node is no longer in ``trie`` (collected meanwhile:
    the caller fails the action).

    The whole root->node path is inserted (the missing blocks plus what the destination
    already has), and the cache's events are applied to ``trie``: its ``Stored`` event is the
    confirmation that makes the replica visible (and turns a reconcile copy's pending pages
    valid). NOTE: the insert stores only the leading part that fits when the destination's
    pinned blocks leave too little room, so only blocks the cache then holds are confirmed:
    confirming all of ``act.blocks`` would make the trie claim pages the worker lacks, for
    good (no ``Removed`` ever comes for a block the cache never had).
    """
    path: list[BlockHash] = []
    x: BlockHash | None = act.node_hash
    try:
        while x is not None:
            path.append(x)
            x = trie.parent(x)
    except InvalidInput:
        return None
    path.reverse()
    stored = cache.insert(path)
    for ev in cache.take_events():
        trie.apply(ev)
    if act.kind == "reconcile":
        # Already valid by the Stored event: a cached block is never left pending.
        trie.confirm_installed(act.dest, [h for h in act.blocks if h in cache])
    return stored


class Simulator:
    """Run one workload through one :class:`SimConfig`. One :meth:`run` per instance."""

    def __init__(
        self, config: SimConfig, profile: Profile, ground_truth: GroundTruth | None = None
    ) -> None:
        self.cfg = config
        self.profile = profile
        self.B = profile.block_size
        self.gt = NoisyGroundTruth(ground_truth or GroundTruth(), seed=config.seed,
                                   sigma=config.noise_sigma)
        self.lattice = Lattice(config.gpus, config.degrees, gpus_per_node=config.gpus_per_node)
        policy = make_policy(config.policy, profile=profile,
                             rng=random.Random(config.seed + 1), **dict(config.policy_params))
        credit = pull_credit(config)
        if credit is not None and isinstance(policy, JPolicy):
            policy = policy.with_pull(credit)
        # J's credit of a pending prefix (SimConfig.pending_credit): only where J has the credit.
        self._pending_credit = config.pending_credit and credit is not None \
            and isinstance(policy, JPolicy)
        self._reconciled = False  # a split or merge has happened (pending blocks may exist)
        self.sched = SchedulerCore(policy, ClusterView((), block_size=self.B))
        self.trie = PrefixTrie(config.degrees, block_size=self.B)
        self.workers: dict[WorkerId, _SimWorker] = {}
        self.jobs: dict[str, _Job] = {}
        self.ctl: ControllerCore | None = None
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self.records: list[RequestRecord] = []
        self.reconfigs: list[Reconfiguration] = []
        self.timeline: list[tuple[float, dict[int, int]]] = []
        # Reconfigurations in flight (a plan's operations run concurrently), by protocol id.
        self._active: dict[int, tuple[Reconfiguration, Plan]] = {}
        self._parked: deque[_Job] = deque()
        self.gpu_seconds = 0.0
        self.replications = 0
        self.reclamations = 0
        self.reconcile_transfers = 0
        self.pulls = 0
        self.pull_waits = 0
        self.pull_wait_s = 0.0
        # Copies in flight: id(action) -> (action, when it lands); see _arriving.
        self._landing: dict[int, tuple[Replicate, float]] = {}
        self.rehome_demoted = 0
        self._lost = 0
        # Copies share the links they use (ground-truth.md: ~40 GB/s per RDMA link): the time
        # each GPU's links are next free (_issue_transfer), and what the copies waited.
        self._link_free = [0.0] * config.gpus
        self.copy_waits = 0
        self.copy_wait_s = 0.0

    # ------------------------------------------------------------------ set-up
    def _capacity_blocks(self, degree: int) -> int:
        per_gpu = self.cfg.cache_blocks_per_gpu
        if per_gpu is None:
            return self.gt.truth.kv_capacity_blocks(degree, block_size=self.B)
        return per_gpu * degree

    def _worker_id(self, group: GpuGroup) -> WorkerId:
        if self.cfg.worker_kind is WorkerKind.CP:
            return group.worker_id
        return tp_worker_name(group.degree, group.first_gpu)

    def _new_worker(self, group: GpuGroup, *, register: bool = True) -> _SimWorker:
        wid = self._worker_id(group)
        w = _SimWorker(wid, group, self.cfg.worker_kind, self._capacity_blocks(group.degree))
        self.workers[wid] = w
        if register:
            self.trie.add_worker(wid, group.degree, w.cache.capacity_blocks)
        return w

    def _rebuild_view(self) -> None:
        self.sched.set_view(ClusterView(
            tuple(
                WorkerView(
                    worker_id=wid,
                    degree=w.group.degree,
                    kind=w.kind,
                    lifecycle=w.lifecycle,
                    max_seq_len=self.cfg.max_seq_len,
                    kv_capacity_tokens=w.cache.capacity_blocks * self.B,
                )
                for wid, w in self.workers.items()
                if w.lifecycle is Lifecycle.ACTIVE
            ),
            block_size=self.B,
        ))

    def _record_composition(self, now: float) -> None:
        counts: dict[int, int] = {}
        for w in self.workers.values():
            counts[w.group.degree] = counts.get(w.group.degree, 0) + 1
        self.timeline.append((now, dict(sorted(counts.items()))))

    # ------------------------------------------------------------------ event plumbing
    def _push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def _drain_cache_events(self, w: _SimWorker) -> None:
        apply = self.trie.apply
        for ev in w.cache.take_events():
            apply(ev)

    # ------------------------------------------------------------------ run
    def run(self, workload: Workload, composition: Composition,
            progress: Callable[[int], None] | None = None) -> SimResult:
        """Simulate ``workload`` from ``composition``; returns every request's record.

        ``progress(n)`` is called with the number of requests finished so far, every 1,000.
        """
        # Speed: a run allocates millions of small objects while ~10^5 trie nodes and the
        # workload stay alive, so the cyclic collector's passes would cost ~40% of it; the
        # simulator creates no garbage cycles it relies on collecting, so the collector is
        # paused for the run (reference counting still frees everything) and restored after.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(workload, composition, progress)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self, workload: Workload, composition: Composition,
             progress: Callable[[int], None] | None) -> SimResult:
        if workload.block_size != self.B:
            raise InvalidInput(
                f"workload block size {workload.block_size} != profile block size {self.B}"
            )
        if composition.lattice.num_gpus != self.cfg.gpus:
            raise InvalidInput("composition and config disagree on the GPU count")
        for g in composition.groups:
            self._new_worker(g)
        self._rebuild_view()
        self._record_composition(0.0)
        if self.cfg.adaptive:
            cc = self.cfg.controller_config or ControllerConfig(window_s=self.cfg.window_s)
            # κ per window of the controller's H (Profile.for_window): a profile's κ is per
            # window of its own length (20 s), a controller file may set another H.
            judge = controller_profile(self.profile, self.cfg.kappa_scale)
            self.ctl = ControllerCore(composition, judge.for_window(cc.window_s), cc)
            self._push(cc.window_s, _WINDOW)
        # Arrivals are not pushed on the heap (speed: a heap holding every request costs
        # log N per event): they are numbered as if pushed here, taken in workload order --
        # sorted by arrival, ties in the given order (a Workload invariant), i.e. by (time,
        # number) -- and merged with the heap by the (time, number) order the heap uses, so
        # every event is handled in exactly the order one heap of all events would give.
        reqs = workload.requests
        base = self._seq + 1
        self._seq += len(reqs)
        arrivals = [(r.arrival_s, base + i, r) for i, r in enumerate(reqs)]
        n_arr = len(arrivals)
        ai = 0
        if self.cfg.cache_manager:
            self._push(self.cfg.scan_interval_s, _SCAN)
        remaining = len(reqs)
        done = 0
        now = 0.0
        heap = self._heap
        pop = heapq.heappop
        while True:
            if ai < n_arr:
                t_a, s_a, req = arrivals[ai]
                if heap:
                    top = heap[0]
                    t_h = top[0]
                    take = t_a < t_h or (t_a == t_h and s_a < top[1])
                else:
                    take = True
                if take:
                    ai += 1
                    now = t_a
                    self._arrive(req, now)
                    continue
            elif not heap:
                break
            now, _, kind, a, b = pop(heap)
            if kind == _FINISH:
                self._finish(a, b, now)
                remaining -= 1
                done += 1
                if progress is not None and done % 1000 == 0:
                    progress(done)
            elif kind == _WINDOW:
                if remaining > self._lost:
                    self._window(now)
                    ctl = self.ctl
                    assert ctl is not None
                    self._push(now + ctl.config.window_s, _WINDOW)
            elif kind == _SCAN:
                if remaining > self._lost:
                    self._scan(now)
                    self._push(now + self.cfg.scan_interval_s, _SCAN)
            elif kind == _XFER:
                self._transfer_done(a, now)
            elif kind == _SWITCHED:
                self._switched(a, now)
            elif kind == _PULLED:
                self._prefill(a, b, now)
        # Requests that never got a worker (failed placement) were counted as records already.
        return SimResult(
            config=self.cfg,
            workload_name=workload.name,
            records=self.records,
            reconfigurations=self.reconfigs,
            composition_timeline=self.timeline,
            gpu_seconds=self.gpu_seconds,
            replications=self.replications,
            reclamations=self.reclamations,
            reconcile_transfers=self.reconcile_transfers,
            pulls=self.pulls,
            end_s=now,
            copy_waits=self.copy_waits,
            copy_wait_s=self.copy_wait_s,
            pull_waits=self.pull_waits,
            pull_wait_s=self.pull_wait_s,
            rehome_demoted=self.rehome_demoted,
        )

    # ------------------------------------------------------------------ requests
    def _arrive(self, req: Request, now: float) -> None:
        rec = RequestRecord(req.request_id, req.arrival_s, req.input_len)
        self.records.append(rec)
        info = RequestInfo(RequestId(req.request_id), req.input_len, req.block_hashes,
                           req.arrival_s)
        job = _Job(req, rec, info)
        self.jobs[req.request_id] = job
        self._place(job, now)

    def _place(self, job: _Job, now: float) -> None:
        req = job.req
        job.pull_end = -1.0  # a redirected request waits only for a pull of its new placement
        match = self.trie.match(req.block_hashes)
        # Pending blocks exist only after a split or merge (speed: no walk before one).
        pending = pending_reach(self.trie, req.block_hashes, match.held_blocks) \
            if self._pending_credit and self._reconciled else None
        try:
            d = self.sched.place(job.info, match.held_blocks, now, pending=pending)
        except NoEligibleWorker as exc:
            if self._active and req.input_len <= self.cfg.max_seq_len:
                # Every fitting worker is reconfiguring: hold it until the new workers exist.
                self._parked.append(job)
                return
            job.rec.failed = str(exc)
            # From the exception's data, not its text (the message may be reworded).
            job.rec.failed_reason = refusal_reason(exc)
            del self.jobs[req.request_id]
            self._lost += 1  # it will never finish: periodic events must not wait for it
            return
        if self.cfg.cache_manager:
            self.trie.record_request(
                # The decision may count prefixes still in flight on the worker (SchedulerCore);
                # ReusedPath is the part of MatchedPath the worker reuses.
                match, d.worker, d.degree, min(d.reused_blocks, len(match.path)),
                d.preferred_degree, req.input_len,
                self.profile.predict_fast,
            )
            # on_reuse issues copies only for blocks pending at the worker (after a split or
            # merge); asking first skips its per-request set-up in the common case (speed).
            if self.trie.has_pending(d.worker):
                for act in on_reuse(self.trie, d.worker, req.block_hashes):
                    self._issue_transfer(act, now)
            if self.cfg.pull is not None and (match.held_blocks or d.pulled_blocks):
                wait = d.pulled_blocks > 0 and self.cfg.pull_wait
                acts = pull_on_route(self.trie, match, d.worker, self.cfg.pull)
                for act in acts:
                    end = self._issue_transfer(act, now)
                    if wait and end > job.pull_end:
                        # J counted on this copy: the request starts once it has landed (a
                        # live rank daemon holds it while the copy is on its way to it).
                        job.pull_end = end
                if wait:
                    # ... and on every copy already on its way to the worker with a part of
                    # the prefix J counted on (an earlier request's pull, the scan's, a
                    # re-homing copy: the cache manager sends no second one): it waits for
                    # the last of them, as a live rank daemon holds a request until its cache
                    # has the prefix. Otherwise (no copy at all) it recomputes what the
                    # worker lacks.
                    end = self._arriving(
                        d.worker, req.block_hashes[match.held(d.worker):d.reused_blocks])
                    if end > job.pull_end:
                        job.pull_end = end
        if self.ctl is not None and not job.rec.redirected:
            # D(k) counts a request once: a redirect re-places demand already counted.
            self.ctl.assigned(now, d.predicted_s, req.input_len, d.degree,
                              min(d.reused_blocks * self.B, req.input_len - 1))
        job.rec.worker = d.worker
        job.rec.degree = d.degree
        job.rec.predicted_s = d.predicted_s
        w = self.workers[d.worker]
        w.queue.append(job)
        if w.running is None:
            self._start(w, now)

    def _start(self, w: _SimWorker, now: float) -> None:
        job = w.queue.popleft()
        w.running = job
        self.sched.start(job.info.request_id, now)
        if job.pull_end > now:
            # It waits here for the pull J counted on (SimConfig.pull_wait), holding the
            # worker: to the scheduler and the controller it is running.
            self.pull_waits += 1
            self.pull_wait_s += job.pull_end - now
            self._push(job.pull_end, _PULLED, w, job)
            return
        self._prefill(w, job, now)

    def _prefill(self, w: _SimWorker, job: _Job, now: float) -> None:
        """Run ``job``, which holds ``w``, from ``now``: what its cache gives, then its
        prefill's ground-truth time."""
        L = job.req.input_len
        blocks = job.req.block_hashes
        # What the worker can reuse *now* (its cache may have changed since placement),
        # pinned while the request runs so that no other insert evicts it.
        hit = w.cache.lookup(blocks, pin=True)
        p = min(hit * self.B, L - 1)
        degree = w.degree
        t = self.gt.prefill_time(L - p, p, degree, kind=w.kind_name)
        if hit:
            w.pinned = blocks[:hit]
        rec = job.rec
        rec.start_s = now
        rec.reused_tokens = p
        rec.actual_s = t
        self.gpu_seconds += t * degree
        self._seq += 1  # self._push(now + t, _FINISH, w, job), inlined (speed)
        heapq.heappush(self._heap, (now + t, self._seq, _FINISH, w, job))

    def _finish(self, w: _SimWorker, job: _Job, now: float) -> None:
        if w.pinned:
            w.cache.unpin(w.pinned)
            w.pinned = ()
        req = job.req
        if req.block_hashes:
            cache = w.cache
            cache.insert(req.block_hashes)
            apply = self.trie.apply  # self._drain_cache_events(w), inlined (speed)
            for ev in cache.take_events():
                apply(ev)
        rid = job.info.request_id
        self.sched.finish(rid, now)
        del self.jobs[req.request_id]
        rec = job.rec
        rec.finish_s = now
        rec.ttft_s = now + self.gt.external_time(req.input_len, w.degree) - req.arrival_s
        w.running = None
        if self.ctl is not None and w.lifecycle is Lifecycle.DRAINING:
            self.ctl.protocol.finished(w.wid, rid, now)
            self._maybe_drained(now)
        elif w.queue:
            self._start(w, now)

    # ------------------------------------------------------------------ controller (§6)
    def _window(self, now: float) -> None:
        ctl = self.ctl
        assert ctl is not None
        drain = {wid: self.sched.load(wid).queue_delay(now) for wid in self.sched.view.worker_ids}
        for dec in ctl.tick(now, drain_s=drain, traffic=self._traffic):
            if dec.plans and not self._active:
                self._begin(dec.plans, now, dec.trigger)

    def _traffic(self, op: Any) -> float:
        """Expected reconciliation traffic of an op: blocks its sources hold (an upper bound of
        what the new geometry must move, weighted equally; the planner only compares)."""
        return float(sum(self.trie.used_blocks(g.worker_id) for g in op.sources
                         if g.worker_id in self.workers))

    def _begin(self, plans: Sequence[Plan], now: float, trigger: Trigger | None = None) -> None:
        """Start every operation of a plan (``trigger``: the decision's rule); their sources
        drain in parallel."""
        ctl = self.ctl
        assert ctl is not None
        redirect: list[_Job] = []
        leaving = {w for plan in plans for w in plan.source_ids}
        for plan in plans:
            srcs = [self.workers[g.worker_id] for g in plan.sources]
            if plan.kind is OpKind.SPLIT and self.cfg.cache_manager and self.cfg.rehome:
                # Copies start with the drain and may outlast the switch (_transfer_done).
                deg = srcs[0].group.degree
                peers = [wid for wid, w in self.workers.items() if w.group.degree == deg
                         and w.lifecycle is Lifecycle.ACTIVE and wid not in leaving]
                acts = rehome_on_split(self.trie, srcs[0].wid, peers, self.cfg.rehome)
                # The displaced blocks are demoted before any copy can land (reconcile.py).
                for act in acts:
                    if isinstance(act, Demote):
                        self.rehome_demoted += self.workers[act.worker].cache.demote(act.blocks)
                for act in acts:
                    if isinstance(act, Replicate):
                        self._issue_transfer(act, now)
            queued = {w.wid: [j.info.request_id for j in w.queue] for w in srcs}
            in_flight = {w.wid: [w.running.info.request_id] for w in srcs
                         if w.running is not None}
            res = ctl.start(plan, now, queued=queued, in_flight=in_flight)
            rc = Reconfiguration(plan.kind.value, tuple(plan.source_ids),
                                 tuple(plan.target_ids), now, plan.reason,
                                 rid=res.reconfiguration, trigger=trigger)
            self._active[rc.rid] = (rc, plan)
            self.reconfigs.append(rc)
            for w in srcs:
                w.lifecycle = Lifecycle.DRAINING
                for info in self.sched.drain(w.wid):
                    redirect.append(self.jobs[info.request_id])
                w.queue.clear()
        # Redirect only after every source stopped admitting, so no queued request lands on
        # a worker that a later operation of the same plan drains.
        self._rebuild_view()
        for job in redirect:
            job.rec.redirected += 1
            self._place(job, now)
        self._maybe_drained(now)

    def _maybe_drained(self, now: float) -> None:
        for rc, _ in self._active.values():
            if rc.drained_s >= 0:
                continue
            if any(self.workers[WorkerId(wid)].running is not None for wid in rc.sources):
                continue
            rc.drained_s = now
            for wid in rc.sources:
                self.workers[WorkerId(wid)].lifecycle = Lifecycle.SWITCHING
            self._push(now + self.gt.switch_time(), _SWITCHED, rc.rid)

    def _switched(self, rid: int, now: float) -> None:
        """Activate the pre-created groups: commit the epoch, every rank acks, expose."""
        rc, plan = self._active.pop(rid)
        ctl = self.ctl
        assert ctl is not None
        record = ctl.protocol.switch_started(rc.rid, now)
        for g in plan.targets:
            for gpu in g.gpus:
                ctl.protocol.ack(gpu, record.epoch, g.degree)
        ctl.protocol.exposed(rc.rid, now)
        old = [self.workers.pop(WorkerId(wid)) for wid in rc.sources]
        new = [self._new_worker(g, register=False) for g in plan.targets]
        self._reconcile(plan, old, new)
        if plan.kind is OpKind.MERGE and self.cfg.cache_manager and self.cfg.rehome:
            # The merged worker gets copies of its peers' long prefixes as it is exposed.
            deg = new[0].group.degree
            peers = [wid for wid, w in self.workers.items() if w.group.degree == deg
                     and w.lifecycle is Lifecycle.ACTIVE and w is not new[0]]
            for act in rehome_on_merge(self.trie, new[0].wid, peers, self.cfg.rehome):
                self._issue_transfer(act, now)
        rc.exposed_s = now
        self._rebuild_view()
        self._record_composition(now)
        parked, self._parked = self._parked, deque()
        for job in parked:
            self._place(job, now)

    def _reconcile(self, plan: Plan, old: Sequence[_SimWorker], new: Sequence[_SimWorker]) -> None:
        """§6.2: retained prefixes stay resident; the manager records what is valid on its new
        rank and what is pending; each new worker's local cache starts with its valid whole
        prefixes (pending pages arrive by lazy reconcile transfers on first reuse)."""
        caps = {w.wid: w.cache.capacity_blocks for w in new}
        self._reconciled = True
        if plan.kind is OpKind.SPLIT:
            reconcile_split(self.trie, old[0].wid, (new[0].wid, new[1].wid), caps)
        else:
            reconcile_merge(self.trie, (old[0].wid, old[1].wid), new[0].wid, caps[new[0].wid])
        parent = self.trie.parent
        for w in new:
            held = self.trie.held_nodes(w.wid)
            if held:
                w.cache.adopt([(h, parent(h)) for h in held])

    # ------------------------------------------------------------------ cache manager (§7)
    def _scan(self, now: float) -> None:
        load = {wid: self.sched.load(wid).queue_delay(now) for wid in self.sched.view.worker_ids}
        in_use = {w.wid: w.pinned for w in self.workers.values() if w.pinned}
        # lists=False: only the actions are used here; same actions, O(changes) per scan.
        result = self.trie.scan(self.cfg.scan_config, load, in_use, lists=False)
        for act in result.actions:
            if isinstance(act, Replicate):
                self._issue_transfer(act, now)
            elif isinstance(act, Reclaim):
                w = self.workers.get(act.worker)
                if w is None or w.lifecycle is not Lifecycle.ACTIVE:
                    self.trie.reclaim_failed(act)
                    continue
                removed = w.cache.remove(act.blocks)
                if removed:
                    self.reclamations += 1
                    self._drain_cache_events(w)
                self.trie.reclaim_executed(act, len(removed))

    def _arriving(self, worker: WorkerId, blocks: Sequence[BlockHash]) -> float:
        """When the last copy in flight to ``worker`` that carries any of ``blocks`` lands
        (-1: none). All of them, not only the copy with the first block: a re-homing after a
        reconfiguration sends one prefix in several copies (seed 104 of the reconfiguration
        preset: a 153-block document in copies of 2, 76 and 75 blocks; waiting for the first
        alone started the request 38 ms early, and it recomputed 76K tokens for 16.6 s)."""
        if not blocks or not self._landing:
            return -1.0
        need = set(blocks)
        return max((end for act, end in self._landing.values()
                    if act.dest == worker and not need.isdisjoint(act.blocks)), default=-1.0)

    def _issue_transfer(self, act: Replicate, now: float) -> float:
        """Start the copy ``act``; returns when it lands (-1: failed at once)."""
        src, dst = self.workers.get(act.source), self.workers.get(act.dest)
        if src is None or dst is None:
            self.trie.replication_failed(act)
            return -1.0
        node = self.cfg.gpus_per_node
        same_node = src.group.first_gpu // node == dst.group.first_gpu // node
        # Pages move rank to rank in parallel (min of the two degrees' rank pairs).
        links = min(src.group.degree, dst.group.degree)
        dt = self.gt.truth.replication_time(len(act.blocks), same_node=same_node, links=links,
                                            block_size=self.B)
        # A copy holds the links of every GPU of both workers until it lands, and waits until
        # they are all free: copies through one worker go one after another (FIFO by issue),
        # as they would share its links' bandwidth. Conservative: a CP2 -> CP4 copy uses two
        # rank pairs and leaves the CP4's other two ranks' links idle. (The KV handoff to
        # decode has links of its own in this model: it adds to the request's TTFT, T_ext of
        # §3.1, after the worker is free, and never delays a copy.)
        free = self._link_free
        gpus = (*src.group.gpus, *dst.group.gpus)
        start = max(now, *(free[g] for g in gpus))
        end = start + dt
        for g in gpus:
            free[g] = end
        if start > now:
            self.copy_waits += 1
            self.copy_wait_s += start - now
        self._push(end, _XFER, act)
        self._landing[id(act)] = (act, end)
        return end

    def _transfer_done(self, act: Replicate, now: float) -> None:
        self._landing.pop(id(act), None)
        dst = self.workers.get(act.dest)
        if dst is None:
            self.trie.replication_failed(act)
            return
        # A source reconfigured while its copy ran (a split's re-homing copies outlast the
        # switch when the drain is short) does not fail it: the pages stay resident on the
        # same GPUs through the switch and the source pins them for the transfer (§6.2, §8;
        # the torch backend copies from the retired engine cache, services/rankd/
        # torch_backend.py ``prepare_cache_command``). Seed 59 of the reconfiguration preset
        # lost the last 8 of a split's 22 re-homing copies this way, documents its next long
        # phase then recomputed.
        if install_copy(self.trie, dst.cache, act) is None:
            self.trie.replication_failed(act)  # the node was collected meanwhile
            return
        if act.kind == "reconcile":
            self.reconcile_transfers += 1
        elif act.kind == "route":
            self.pulls += 1
            # With demote_source a pull is a move (services/cachemgr/pull.py): the source's
            # private copy goes first.
            # Only what the destination took: a full destination takes the leading part.
            cache = dst.cache
            landed = 0
            for h in act.blocks:
                if h not in cache:
                    break
                landed += 1
            dem = demotion(act, self.cfg.pull, self.trie, landed=landed) \
                if self.cfg.pull is not None else None
            # A source reconfigured meanwhile has no LRU left to demote in.
            if dem is not None and (src := self.workers.get(dem.worker)) is not None:
                src.cache.demote(dem.blocks)
        else:
            self.replications += 1
        self.trie.replication_done(act)
