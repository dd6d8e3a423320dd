"""The cache manager's NATS adapter: the authoritative PrefixTrie of §7 and §6.2.

One asyncio process, micro service ``vtm-cachemgr`` (group ``{prefix}.cachemgr``, endpoints
``inspect`` and ``pending``: a scheduler replica that registers a worker asks for its
reconcile, published again as ReconciledNotices). Every decision comes from
:class:`~services.cachemgr.trie.PrefixTrie` (events, Algorithm 1, Algorithm 2 + selection,
reconcile); this module moves messages.

=====================================  ============================================================
input                                  what the adapter does
=====================================  ============================================================
``{prefix}.cache.events.*``            ``trie.apply``; a worker seen for the first time is
(stored / removed / cleared)           registered (degree from its lattice id, capacity from its
                                       WorkerState); a GAP marks it stale in the trie and its
                                       snapshot is requested on ``{prefix}.cache.snapshot.{wid}``
                                       (request-reply, CacheSnapshot) and applied
``{prefix}.cache.stats.*``             RequestStats of the scheduler (§7.1 Algorithm 1 inputs):
                                       ``trie.match(block_hashes)`` then ``trie.record_request``
                                       with the chosen worker, degree, reused blocks, preferred
                                       degree, L and the profile's Ê; then ``trie.on_reuse``: the
                                       lazy reconcile copies for pages pending at that worker;
                                       then ``pull_on_route``: the part of the longest held
                                       prefix that worker lacks, copied from a holder
timer, every ``scan_interval_s`` (H)   ``trie.scan(config, load)`` with each worker's outstanding
                                       work from the worker-state bucket (no ``in_use``: pinned
                                       blocks are the worker's to protect, and a reclaim skips
                                       them); each selected action is sent as a command (below)
worker-state KV (watch)                capacities and loads; registers workers before their
                                       first event (and asks for their snapshot); remembers
                                       each registered worker's ``incarnation``: another
                                       (non-empty) one is a restart of the worker under the
                                       same id, whose cache and event ids start afresh, so its
                                       view is reset (untracked, in-flight operations
                                       cancelled, registered again with the same degree and
                                       capacity, empty, ``last_event_id`` 0) and its snapshot
                                       is requested
epoch KV key (watch)                   a changed composition: a degree-2C worker replaced by its
                                       two halves → ``trie.reconcile_split``; two halves replaced
                                       by their parent → ``trie.reconcile_merge``, then
                                       ``rehome_on_merge`` copies the degree's long prefixes
                                       to the merged worker; each worker a split or merge made
                                       is asked for its snapshot once it runs (its own index
                                       settles what it holds), and its pending and donor pages
                                       are published (ReconciledNotice on
                                       ``{prefix}.cache.pending.{wid}``: the scheduler
                                       replicas' tries mark them, for J's credit of a pending
                                       prefix); any other worker gone →
                                       ``remove_worker``, new → registered; a worker
                                       whose state has not arrived is planned with the
                                       capacity the known states imply for its degree
                                       (``guess_capacity``), as its rank host seeds it
``{prefix}.ctl.drain`` (DrainNotice)   a split starts (its parent stops admitting, its cache
                                       intact until the switch): ``rehome_on_split`` copies the
                                       parent's long prefixes to the workers of its degree that
                                       stay, sent as ReplicateCommands (the simulator does the
                                       same at the split's start), after the DemoteCommands of
                                       the colder blocks they displace at a full peer
=====================================  ============================================================

Commands (JSON, shared/schemas CacheCommand) go request-reply to
``{prefix}.cache.cmd.{wid}`` of the worker that executes them:

=====================  =============  ==============================================================
command                sent to        when / what
=====================  =============  ==============================================================
ReplicateCommand       destination    a scan's replica, a re-homing or a route-time pull
                                      (``blocks`` = the whole root→node path, root first; the
                                      worker copies from ``source_worker`` only what it lacks)
ReconcileCommand       destination    a lazy reconcile copy after a split or merge (§6.2)
ReclaimCommand         owner          a scan's reclamation (exact-key deletion)
DemoteCommand          pull source    a route-time pull answered ok (``pull_demote``): the copied
                                      blocks become the first the source evicts (pull.py, "A pull
                                      is a move"); nothing is removed, no event follows
DemoteCommand          split's peer   a split's re-homing displaces a full peer's colder blocks
                                      (``rehome_displace``): sent, and answered, before the
                                      re-homing's copies (reconcile.py ``rehome_on_split``)
=====================  =============  ==============================================================

The reply is a CacheCommandResult. Visibility follows the paper (§7.2): a replica
counts only when the destination's own ``stored`` event arrives, a reclaimed one leaves only on
its ``removed`` event; an ok reply just retires the in-flight action
(``replication_done``), a failed reply, micro error, timeout or missing responder -- or any
other error on the way, a nats client error or an unexpected exception (logged as an error)
-- calls ``replication_failed`` / ``reclaim_failed`` so a later scan may choose again. A
demote is fire-and-forget: it is not an action of the trie (nothing in flight, holders
unchanged), so whatever becomes of it is only counted (``demotes_ok`` / ``demotes_failed``)
and logged; a failed route copy sends none.

Incarnations (WorkerState ``incarnation``, drawn by the rank daemon at each start): the first
non-empty one seen for a registered worker is only recorded; an empty one (older rank daemons)
never resets anything. The record belongs to one registration: whenever a worker leaves the
trie by any path (epoch record, UNAVAILABLE, split parent, merged children, restart) it is
forgotten, so a worker a reconfiguration removes and registers again (with the reconcile plans
of a split or merge) takes its new process's incarnation as a first one and keeps its plans.
A snapshot reply asked of the worker before its restart is not applied (it may describe the
old process's cache); the snapshot is asked again.

Tracing (services/cachemgr/tracing.py): every command is sent under a CLIENT span of its own
(``cache_pull`` for a route-time pull, else ``cache_{op}``) with its op, workers, block counts
and outcome, whose W3C context travels in the command's headers: the worker's ``cache-cmd``
span is its child. A copy a placement triggered (a pull, a lazy reconcile copy) names the
request (``vtm.request_id``) and links to the trace context the RequestStats' headers carry,
when they carry one; a lazy reconcile copy links to the ``cachemgr_epoch`` span whose reconcile
left its pages pending too (``vtm.link`` = ``reconciles``), and is kept whenever that
reconfiguration's trace is. The manager's part in a reconfiguration is in that
reconfiguration's trace: its handling of a DrainNotice is a ``cachemgr_drain`` span, a child of
the context the notice's headers carry (the controller's ``drain`` phase), and its handling of
a newer epoch record a ``cachemgr_epoch`` span, a child of the record's ``traceparent`` (the
phase that wrote it); the re-homing commands, the reconcile's snapshot requests and their
server spans at the rank daemons descend from them, so the controller's always-sampled trace
keeps them at any sampling ratio. A missing context makes those spans roots (sampled by the
ratio); a malformed one as well, with a warning -- the work is done either way. The
ReconciledNotices of a split or merge carry the context of the ``cachemgr_epoch`` span that
reconciled it in their headers (also when ``pending`` publishes them again): each scheduler
replica's ``reconciled_apply`` span of one is its child.

Message this module consumes: RequestStats (shared/schemas.py), published by the scheduler.
Message it publishes: ReconciledNotice (shared/schemas.py), read by the schedulers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any, Final

import nats.errors
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from nats.micro.request import Request
from opentelemetry import trace
from pydantic import Field
from structlog.contextvars import bound_contextvars

from services import calibration
from services.cachemgr.actions import CacheAction, Demote, Reclaim, Replicate
from services.cachemgr.events import MalformedEvent, Snapshot, event_from_json, snapshot_reply
from services.cachemgr.metrics import CacheMetrics
from services.cachemgr.pull import PullConfig, demotion, pull_on_route
from services.cachemgr.reconcile import (
    RehomeConfig,
    diff_compositions,
    guess_capacity,
    reconciled_blocks,
    reconciled_parts,
    rehome_on_merge,
    rehome_on_split,
)
from services.cachemgr.scan import ScanConfig, ScanResult
from services.cachemgr.tracing import (
    DRAIN_SPAN,
    EPOCH_SPAN,
    ReconcileOrigin,
    RequestTrigger,
    carried_parent,
    command_attributes,
    command_span_name,
    drain_attributes,
    record_carrier,
)
from services.cachemgr.trie import ApplyOutcome, PrefixTrie
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DEGREES,
    BlockHash,
    InvalidInput,
    VertumnusError,
    WorkerId,
    tp_worker_name,
)
from shared.logging import current_trace_id
from shared.schemas import (
    CacheCommandResult,
    DemoteCommand,
    DrainNotice,
    EpochRecord,
    Message,
    PendingQuery,
    PendingReply,
    ReclaimCommand,
    ReconcileCommand,
    ReconciledNotice,
    ReplicateCommand,
    RequestStats,
    SchemaError,
    WorkerState,
    decode,
    encode,
)
from shared.service import (
    WORKER_LEASE_S,
    Endpoint,
    KvWatch,
    MicroService,
    RemoteError,
    call,
    epoch_kv,
    optional_request_model,
    request_in_parts,
    worker_state_kv,
)
from shared.settings import ServiceSettings
from shared.subjects import Subjects, micro_service_name
from shared.tasks import spawn_once, spawn_tracked
from shared.telemetry import ALWAYS_SAMPLE, inject, tracer
from shared.worker import GpuGroup, Lifecycle, worker_restarted
from shared.workerstates import worker_state_changes

VERSION: Final[str] = "0.1.0"

RECONCILED_PART_BLOCKS: Final[int] = 8192
"""Most entries in one ReconciledNotice (about 0.5 MB of JSON at most, within NATS' default
1 MB max_payload); a larger reconcile goes out in parts."""


# -- settings ---------------------------------------------------------------------------------


class CacheMgrSettings(ServiceSettings):
    """The cache-manager process (environment ``VTM_*``; CLI flags of ``main`` override).

    Scan thresholds map one-to-one onto :class:`~services.cachemgr.scan.ScanConfig`; the
    defaults are the calibrated ones the simulator's experiments use (services/calibration.py
    ``SCAN``), so a live run and a simulation of the same trace scan alike.
    """

    service_name: str = Field(default="vtm-cachemgr", description="Name in logs / traces.")
    degrees: list[int] = Field(
        default_factory=lambda: list(DEFAULT_DEGREES),
        description="Supported CP degrees (statistics are kept per degree); a worker of "
        "another degree is not tracked.",
    )
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1, description="Tokens per block B.")
    profile_path: Path | None = Field(
        default=None,
        description="Fitted cost-model profile (Ê_C for Algorithm 1's missed benefit); None: "
        "the built-in default profile.",
    )
    scan_interval_s: float = Field(
        default=20.0, gt=0, description="H: seconds between periodic scans (Algorithm 2)."
    )
    theta_inter: float = Field(
        default=calibration.SCAN.theta_inter, ge=0,
        description="θ_inter: missed benefit (s) for a first replica."
    )
    theta_intra: float = Field(
        default=calibration.SCAN.theta_intra, ge=0,
        description="θ_intra: decayed accesses per replica for another one."
    )
    theta_reclaim: float = Field(
        default=calibration.SCAN.theta_reclaim,
        ge=0,
        description="θ_reclaim (< θ_intra): accesses per replica below which "
        "a replica is reclaimed (never the last one in the pool).",
    )
    decay: float = Field(
        default=calibration.SCAN.decay, gt=0, lt=1, description="Statistics decay per scan."
    )
    max_actions_per_list: int = Field(
        default=calibration.SCAN.max_actions_per_list, ge=0,
        description="Actions taken per list and scan."
    )
    max_replications: int | None = Field(
        default=calibration.SCAN.max_replications, ge=0,
        description="Replication copies started per scan, both lists together (§8: at most "
        "one transfer per scan); null: only the per-list bound.",
    )
    gc_threshold: float = Field(
        default=1e-3, ge=0, description="Statistics below this are negligible for node GC."
    )
    default_capacity_blocks: int = Field(
        default=4096,
        ge=1,
        description="Cache capacity assumed for a worker whose WorkerState is not known yet "
        "while no worker's is (after that, guessed from the known ones: reconcile.guess_capacity).",
    )
    snapshot_timeout_s: float = Field(default=5.0, gt=0, description="Wait for a snapshot.")
    command_timeout_s: float = Field(
        default=30.0, gt=0, description="Wait for a worker's CacheCommandResult."
    )
    lease_s: float = Field(
        default=WORKER_LEASE_S, gt=0, description="Worker-state bucket TTL (as other services)."
    )
    housekeeping_s: float = Field(
        default=1.0, gt=0,
        description="How often snapshots of stale workers (and unanswered ones) are asked again."
    )
    rehome: bool = Field(
        default=True,
        description="When a split starts (the controller's DrainNotice), copy the parent's long "
        "prefixes to the workers of its degree that stay (reconcile.py rehome_on_split); when "
        "a merge's worker is exposed, copy its degree's long prefixes to it (rehome_on_merge).",
    )
    rehome_min_blocks: int = Field(
        default=calibration.REHOME.min_blocks, ge=1,
        description="Re-homing: prefixes of at least this many blocks are copied.",
    )
    rehome_fill: float = Field(
        default=calibration.REHOME.fill, gt=0, le=1,
        description="Re-homing: a split's peer takes copies only up to this fraction of its "
        "capacity; a merged worker takes at most this fraction of its capacity in copies.",
    )
    rehome_displace: bool = Field(
        default=calibration.REHOME.displace,
        description="Re-homing a split: beyond rehome_fill a peer still takes a copy when as "
        "many of its blocks are colder than the copied prefix; those are demoted at the peer "
        "first (a DemoteCommand), so its LRU evicts them to make room (reconcile.py).",
    )

    pull: bool = Field(
        default=True,
        description="Route-time pull (pull.py): when a placement's worker lacks part of the "
        "longest prefix another worker holds, copy that part to it from the holder.",
    )
    pull_min_blocks: int = Field(
        default=calibration.PULL.min_blocks, ge=1,
        description="Route-time pull: only when the worker lacks at least this many blocks.",
    )
    pull_demote: bool = Field(
        default=calibration.PULL.demote_source,
        description="Route-time pull: once a pull is answered ok, demote the source's copy of "
        "the copied blocks (a DemoteCommand: evicted first there, nothing removed; pull.py, "
        "\"A pull can be a move\").",
    )

    def pull_config(self) -> PullConfig | None:
        """The route-time pull's settings, or None when it is off."""
        if not self.pull:
            return None
        return PullConfig(min_blocks=self.pull_min_blocks, demote_source=self.pull_demote)

    def rehome_config(self) -> RehomeConfig | None:
        """The re-homing settings, or None when re-homing is off."""
        if not self.rehome:
            return None
        return RehomeConfig(min_blocks=self.rehome_min_blocks, fill=self.rehome_fill,
                            displace=self.rehome_displace)

    def scan_config(self) -> ScanConfig:
        return ScanConfig(
            theta_inter=self.theta_inter,
            theta_intra=self.theta_intra,
            theta_reclaim=self.theta_reclaim,
            decay=self.decay,
            max_actions_per_list=self.max_actions_per_list,
            max_replications=self.max_replications,
            gc_threshold=self.gc_threshold,
        )


# -- names ---------------------------------------------------------------------------------------


def cachemgr_group(subjects: Subjects) -> str:
    return subjects.service_group("cachemgr")


# -- messages ------------------------------------------------------------------------------------


class InspectQuery(Message):
    """Optional body of ``inspect``: ``match`` = a request's block hashes to look up."""

    match: list[int] | None = Field(default=None, max_length=1 << 16)


# -- pure helpers ----------------------------------------------------------------------------------


def degree_of(worker: str) -> int | None:
    """The CP degree encoded in a lattice worker id (``w-cp4-g8`` → 4), or None.

    Only the canonical spelling counts: ``from_worker_id`` also parses ``W-cp4-g8`` or
    ``w-cp+4-g08``, which name no worker and no legal subject token (a command to or from
    one could never be sent)."""
    try:
        group = GpuGroup.from_worker_id(worker)
    except InvalidInput:
        return None
    canonical = {group.worker_id, tp_worker_name(group.degree, group.first_gpu)}
    return group.degree if worker in canonical else None


def record_groups(record: EpochRecord) -> dict[WorkerId, GpuGroup]:
    return {WorkerId(w.worker_id): w.group for w in record.workers}


def in_pool(record: EpochRecord | None, worker: str) -> bool:
    """Whether the manager tracks ``worker`` on its own events or state: without an epoch
    record, any worker; with one, a worker the record lists and does not call UNAVAILABLE
    (such a worker holds nothing the pool can count on: ``_follow_lifecycles``)."""
    if record is None:
        return True
    return any(w.worker_id == worker and w.lifecycle is not Lifecycle.UNAVAILABLE
               for w in record.workers)


def path_to(trie: PrefixTrie, node: BlockHash) -> list[BlockHash]:
    """The root→``node`` path of block hashes (root first)."""
    out = [node]
    parent = trie.parent(node)
    while parent is not None:
        out.append(parent)
        parent = trie.parent(parent)
    out.reverse()
    return out


# -- the service --------------------------------------------------------------------------------


class CacheMgrService(MicroService):
    """The live cache manager. Construct, then ``await run()`` (or ``start(stack)``)."""

    def __init__(
        self,
        settings: CacheMgrSettings,
        *,
        profile: Profile | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            settings,
            name=micro_service_name("cachemgr"),
            version=VERSION,
            group=cachemgr_group(settings.subjects),
            description="vertumnus global prefix-cache manager",
            metadata={"degrees": ",".join(map(str, settings.degrees)), "epoch": "0"},
        )
        self.msettings = settings
        self.clock = clock
        if profile is None:
            profile = (
                Profile.load(settings.profile_path) if settings.profile_path else DEFAULT_PROFILE
            )
        self.profile = profile
        self.scan_config = settings.scan_config()
        self.trie = PrefixTrie(settings.degrees, block_size=settings.block_size)
        # Read by the metric reader's thread: len() of the trie's node dict, one C call.
        self.metrics = CacheMetrics(lambda: len(self.trie))
        self.states: dict[str, WorkerState] = {}
        self.record: EpochRecord | None = None
        self.last_scan: dict[str, Any] | None = None
        self._state_kv: KeyValue | None = None
        self._epoch_kv: KeyValue | None = None
        self._snapshotting: set[str] = set()
        self._snapshot_retry: set[str] = set()  # unanswered snapshot requests, asked again
        # Incarnation of each registered worker's current process (first non-empty one seen
        # while registered); forgotten whenever the worker leaves the trie.
        self._incarnations: dict[str, str] = {}
        # The epoch record whose reconcile made each worker a split or merge made (what its
        # ReconciledNotices carry, also when ``pending`` sends them again); forgotten with it.
        self._reconciled_epoch: dict[str, int] = {}
        # The W3C context (headers) of the span whose reconcile made each such worker (its
        # record's ``cachemgr_epoch``): its notices carry it, also when ``pending`` sends them
        # again, so a replica's ``reconciled_apply`` is in the reconfiguration's trace.
        self._reconciled_carrier: dict[str, dict[str, str]] = {}
        # Restarts seen per worker: a snapshot asked before one is not applied after it.
        self._restarts: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._cmd_seq = 0
        self.counters: dict[str, int] = {
            "events_applied": 0,
            "duplicates": 0,
            "gaps": 0,
            "snapshots_applied": 0,
            "snapshots_failed": 0,
            "malformed": 0,
            "rejected": 0,
            "stats_recorded": 0,
            "stats_skipped": 0,
            "scans": 0,
            "commands_sent": 0,
            "commands_ok": 0,
            "commands_failed": 0,
            "commands_errored": 0,  # of commands_failed: an unexpected exception (a bug)
            # Demotes after a pull (fire-and-forget, not in commands_*: no trie action).
            "demotes_sent": 0,
            "demotes_ok": 0,
            "demotes_failed": 0,
            "splits": 0,
            "rehomed": 0,
            "pulls": 0,
            "merges": 0,
            "reconciled_notices": 0,  # ReconciledNotice parts published (splits and merges)
            "reconciled_asked": 0,  # ... of them again, asked for by a scheduler (``pending``)
            "restarts": 0,
        }

    # -- endpoints --------------------------------------------------------------------------

    def stats_data(self) -> dict[str, Any]:
        """The manager's counters (``$SRV.STATS``: ``nats micro stats vtm-cachemgr``; ``vertumnus
        up`` reports the pulls from them)."""
        return dict(self.counters)

    def endpoints(self) -> Sequence[Endpoint]:
        return [Endpoint("inspect", self._on_inspect), Endpoint("pending", self._on_pending)]

    async def _on_pending(self, request: Request) -> PendingReply:
        """Publish the worker's reconcile as it stands now (its pending and donor pages,
        :meth:`reconciled_notices`) for the scheduler replica that asks; the reply says how
        many parts went out. Every replica subscribed gets them: marking is idempotent."""
        query = decode(PendingQuery, request.data, request.headers)
        wid = WorkerId(query.worker_id)
        known = self._incarnations.get(wid, "")
        if wid not in self.trie.workers() or (query.incarnation and known
                                              and known != query.incarnation):
            # Untracked, or another life of the worker than the asker's (PendingQuery): a
            # restart not handled yet would publish pages the new, empty process never gets.
            notices = []
        else:
            notices = self.reconciled_notices(wid, self._reconciled_epoch.get(
                wid, self.record.epoch if self.record else 0))
        # Nothing to mark: the asker holds no older notice of it (it asks only then).
        notices = [n for n in notices if n.blocks]
        if notices:
            self.counters["reconciled_notices"] += len(notices)
            self.counters["reconciled_asked"] += 1
        # In the trace of the reconcile that made them (this handler's span when none is kept).
        carrier = self._reconciled_carrier.get(wid) or inject({})
        return PendingReply(worker_id=query.worker_id,
                            parts=await self._publish_notices(notices, carrier))

    async def _on_inspect(self, request: Request) -> bytes:
        query: InspectQuery = optional_request_model(request, InspectQuery)
        return json.dumps(self.inspect(query.match)).encode()

    def inspect(self, match: Sequence[int] | None = None) -> dict[str, Any]:
        """What ``inspect`` answers: trie size, per-worker blocks, stale workers, in flight."""
        t = self.trie
        body: dict[str, Any] = {
            "nodes": sum(1 for _ in t.node_hashes()),
            "workers": {
                w: {
                    "degree": int(t.worker_degree(w)),
                    "blocks": len(t.worker_blocks(w)),
                    "held_nodes": len(t.held_nodes(w)),
                    "pending": len(t.pending_blocks(w)),
                    "capacity_blocks": t.capacity_blocks(w),
                    "last_event_id": t.last_event_id(w),
                    "stale": t.is_stale(w),
                    "incarnation": self._incarnations.get(w, ""),
                }
                for w in t.workers()
            },
            "stale_workers": list(t.stale_workers()),
            "in_flight": [a.to_wire() for a in t.inflight()],
            "last_scan": self.last_scan,
            "epoch": self.record.epoch if self.record else None,
            "counters": dict(self.counters),
        }
        if match is not None:
            m = t.match([BlockHash(h) for h in match])
            body["match"] = {"matched_blocks": m.matched_blocks, "held": dict(m.held_blocks)}
        return body

    # -- setup ------------------------------------------------------------------------------

    async def ensure_jetstream(self) -> None:
        js = self.jetstream()
        self._state_kv = await worker_state_kv(js, self.subjects, lease_s=self.msettings.lease_s)
        self._epoch_kv = await epoch_kv(js, self.subjects)

    async def setup(self, stack: AsyncExitStack) -> None:
        s = self.subjects
        await self.ensure_jetstream()
        states, epochs = self._state_kv, self._epoch_kv
        assert states is not None and epochs is not None
        # Watches that are made again after a server restart (KvWatch).
        state_watch = await KvWatch(self.nc, states).start()
        epoch_watch = await KvWatch(self.nc, epochs, s.epoch_key()).start()
        subs = [
            await self.nc.subscribe(s.cache_events_all(), cb=self._on_event),
            await self.nc.subscribe(s.cache_stats_all(), cb=self._on_stats),
            await self.nc.subscribe(s.ctl_drain(), cb=self._on_drain),
        ]
        self._tasks = [
            asyncio.create_task(self._watch_states(state_watch), name="cm-states"),
            asyncio.create_task(self._watch_epochs(epoch_watch), name="cm-epochs"),
            asyncio.create_task(self._scanner(), name="cm-scan"),
            asyncio.create_task(self._housekeeping(), name="cm-housekeeping"),
        ]

        async def teardown() -> None:
            await self.stop_listening(self._tasks, (state_watch, epoch_watch), subs)

        stack.push_async_callback(teardown)

    def _spawn(self, coro: Any, name: str) -> None:
        spawn_tracked(self._tasks, coro, name)

    # -- workers ------------------------------------------------------------------------------

    def _capacity(self, worker: str, degree: int | None = None) -> int:
        """``worker``'s cache capacity in blocks: its WorkerState's; before that arrives,
        ``guess_capacity`` from the states that did (``degree`` given), else the setting's
        default."""
        st = self.states.get(worker)
        if st is not None and st.kv_total_blocks > 0:
            return st.kv_total_blocks
        default = self.msettings.default_capacity_blocks
        if degree is None:
            return default
        known = [(s.degree, s.kv_total_blocks) for s in self.states.values()
                 if s.kv_total_blocks > 0]
        return guess_capacity(degree, known, default)

    def _register(self, worker: str, degree: int | None = None, *, snapshot: bool) -> bool:
        """Track ``worker`` if its degree is supported; optionally ask for its snapshot."""
        if worker in self.trie.workers():
            return True
        degree = degree if degree is not None else degree_of(worker)
        if degree is None or degree not in self.trie.degrees:
            return False
        self.trie.add_worker(WorkerId(worker), degree, self._capacity(worker, degree))
        self.log.info("worker tracked", worker=worker, degree=degree)
        if snapshot:
            self._request_snapshot(worker)
        return True

    async def _watch_states(self, watcher: Any) -> None:
        async for key, state in worker_state_changes(watcher, self.log, self.counters):
            if state is None:
                self.states.pop(key, None)
                continue
            try:
                self.on_state(state)
            except VertumnusError as exc:
                self.counters["rejected"] += 1
                self.log.error("worker state not acted on", worker=state.worker_id,
                               error=str(exc))

    def on_state(self, state: WorkerState) -> None:
        """One worker's state from the bucket: keep it (capacity, load); register a worker of
        the pool (and ask for its snapshot); a registered worker's new incarnation is a
        restart (``_reset_restarted``)."""
        wid = state.worker_id
        named = degree_of(wid)
        if named is not None and named != state.degree:  # the schema checks gpus, not the id
            raise InvalidInput(f"worker state of {wid} gives degree {state.degree}, "
                               f"its id names degree {named}")
        self.states[wid] = state
        if wid in self.trie.workers():
            if worker_restarted(self._incarnations.get(wid), state.incarnation):
                self._reset_restarted(WorkerId(wid), state.incarnation)
                return
            if 0 < state.kv_total_blocks != self.trie.capacity_blocks(WorkerId(wid)):
                # Registered before its state was known (from the epoch record, with the
                # default capacity): its own figure replaces the guess.
                self.trie.set_capacity(WorkerId(wid), state.kv_total_blocks)
        # Without an epoch record the worker states define the pool; with one, only
        # workers of the record are tracked (a retired worker's last state lingers), and not
        # while it calls them UNAVAILABLE (a heartbeat is no re-admission: the record is).
        if in_pool(self.record, wid):
            if self._register(wid, state.degree, snapshot=True) and state.incarnation:
                self._incarnations.setdefault(wid, state.incarnation)

    def _forget(self, worker: str) -> None:
        """What the service keeps of a worker beside the trie, dropped as it leaves the trie."""
        self._incarnations.pop(worker, None)
        self._reconciled_epoch.pop(worker, None)
        self._reconciled_carrier.pop(worker, None)

    def _reset_restarted(self, worker: WorkerId, incarnation: str) -> None:
        """``worker`` was started again under its id: its cache is empty and its event ids
        start again at 1. Its view is dropped (in-flight operations to, from or at it are
        cancelled) and registered afresh with the same degree and the capacity its new state
        gives, then its snapshot is asked for."""
        degree = self.trie.worker_degree(worker)
        capacity = self._capacity(worker, degree)
        previous = self._incarnations.get(worker, "")
        cancelled = self.trie.remove_worker(worker)
        self.trie.add_worker(worker, degree, capacity)
        self._reconciled_epoch.pop(worker, None)  # its reconcile went with its cache
        self._reconciled_carrier.pop(worker, None)
        self._incarnations[worker] = incarnation
        self._restarts[worker] = self._restarts.get(worker, 0) + 1
        self.counters["restarts"] += 1
        self.log.info(
            "worker restarted; its cache view was reset",
            worker=worker,
            incarnation=incarnation,
            previous=previous,
            cancelled=len(cancelled),
        )
        self._request_snapshot(worker)

    async def _watch_epochs(self, watcher: Any) -> None:
        async for entry in watcher:
            if entry is None or not entry.value:
                continue
            try:
                record = decode(EpochRecord, entry.value)
            except SchemaError as exc:
                self.counters["malformed"] += 1
                self.log.error("bad epoch record ignored", error=str(exc))
                continue
            try:
                self.on_record(record)
            except VertumnusError as exc:
                self.counters["rejected"] += 1
                self.log.error("epoch change not reconciled", error=str(exc))

    def on_record(self, record: EpochRecord) -> None:
        """Reconcile the trie with a new composition (§6.2); a record no newer than the one
        adopted changes nothing.

        Under an :data:`~services.cachemgr.tracing.EPOCH_SPAN` span, a child of the record's
        ``traceparent`` (the reconfiguration phase that wrote it; a root without a well-formed
        one, which is logged and changes nothing else): what is sent from here -- a merge's
        re-homing commands, the snapshot requests of the workers it made -- is in that trace."""
        old = self.record
        if old is not None and record.epoch <= old.epoch:
            return
        with self._work_span(EPOCH_SPAN, record_carrier(record),
                             {"vtm.epoch": record.epoch}, what="epoch record") as span:
            done = self._adopt_record(old, record)
            if span.is_recording():
                span.set_attributes(done)

    def _adopt_record(self, old: EpochRecord | None, record: EpochRecord) -> dict[str, Any]:
        """:meth:`on_record`'s work for a newer ``record``; returns what it did as span
        attributes (the parents split, the workers merged into, the re-homing copies sent)."""
        self.record = record
        self.set_metadata(epoch=str(record.epoch))  # conventions.md: metadata has the epoch
        new = record_groups(record)
        if old is None:
            # Workers tracked before any record (from worker states or events) that it does
            # not list are no part of the pool: e.g. a retired worker whose state lingers
            # until its lease ends, seen first when this manager (re)starts.
            for w in self.trie.workers():
                if w not in new:
                    self.trie.remove_worker(w)
                    self._forget(w)
                    self.log.info("worker untracked: not in the epoch record", worker=w)
            self._follow_lifecycles(record)
            return {}
        splits, merges, removed, added = diff_compositions(record_groups(old), new)
        split_parents: list[str] = []
        known = set(self.trie.workers())
        merged: list[WorkerId] = []
        for parent, children in splits:
            if parent not in known or any(c in known for c in children):
                # Nothing to reconcile from (untracked parent): plain removal and addition.
                if parent in known:
                    removed.append(parent)
                added.extend(children)
                continue
            plan = self.trie.reconcile_split(
                parent, children, {c: self._capacity(c, new[c].degree) for c in children}
            )
            self._forget(parent)
            self._confirm_reconciled(children)
            self._publish_reconciled(children, record.epoch)
            self.counters["splits"] += 1
            split_parents.append(parent)
            self.log.info(
                "split reconciled",
                parent=parent,
                children=list(children),
                pending={c: len(p) for c, p in plan.pending.items()},
                cancelled=len(plan.cancelled),
            )
        for children, parent in merges:
            if any(c not in known for c in children) or parent in known:
                removed.extend(c for c in children if c in known)
                added.append(parent)
                continue
            mplan = self.trie.reconcile_merge(children, parent,
                                              self._capacity(parent, new[parent].degree))
            for c in children:
                self._forget(c)
            self._confirm_reconciled((parent,))
            self._publish_reconciled((parent,), record.epoch)
            self.counters["merges"] += 1
            self.log.info(
                "merge reconciled",
                children=list(children),
                parent=parent,
                pending=len(mplan.pending),
                cancelled=len(mplan.cancelled),
            )
            merged.append(WorkerId(parent))
        for w in removed:
            if w in self.trie.workers():
                self.trie.remove_worker(w)
                self._forget(w)
                self.log.info("worker untracked", worker=w)
        for w in added:
            self._register(w, new[w].degree, snapshot=False)
        self._follow_lifecycles(record)
        copies = 0
        for m in merged:
            copies += sum(not isinstance(a, Demote) for a in self._rehome_merged(m, record))
        return {"vtm.splits": split_parents, "vtm.merges": [str(m) for m in merged],
                "vtm.rehome_copies": copies}

    def _confirm_reconciled(self, workers: Sequence[str]) -> None:
        """Ask the workers a split or merge made for their snapshot once they run.

        Why: reconciliation registers what §6.2 says they hold, and a rank host seeds their
        caches by the same rule (services/rankd/host.py), but the worker's own index is what
        it reuses and reports, and it can hold less: a backend that keeps real KV starts a new
        worker empty (torch), and a merge of split children counts their donor pages, which no
        rank daemon knows. The snapshot replaces the valid blocks with the worker's index and
        keeps pending and donor pages (lazy reconcile copies still bring those); a worker not
        up yet is asked again by the housekeeping, as any unanswered snapshot."""
        for w in workers:
            self._request_snapshot(w)

    def reconciled_notices(self, worker: WorkerId, epoch: int) -> list[ReconciledNotice]:
        """The ReconciledNotices of ``worker``'s reconcile as the trie has it now (reconcile.py
        ``reconciled_blocks``), in parts of about :data:`RECONCILED_PART_BLOCKS` entries that
        each stand alone (``reconciled_parts``); one empty notice when it has no pending or
        donor page, so that a replica holding an older reconcile of the same worker id
        forgets it."""
        cut = reconciled_parts(reconciled_blocks(self.trie, worker), RECONCILED_PART_BLOCKS)
        degree = int(self.trie.worker_degree(worker))
        return [ReconciledNotice(worker=worker, degree=degree, epoch=epoch, part=i,
                                 parts=max(1, len(cut)), blocks=blocks)
                for i, blocks in enumerate(cut or [[]])]

    def _publish_reconciled(self, workers: Sequence[str], epoch: int) -> None:
        """Publish each new worker's pending and donor pages for the scheduler replicas (made
        now, sent in order by one task: a later change of the trie does not leak in); an
        empty notice for a worker with none. They carry the current span's context (the
        record's ``cachemgr_epoch``, :meth:`on_record`), taken now: the task that sends them
        may run after that span ended."""
        carrier = inject({})
        for w in workers:
            self._reconciled_epoch[w] = epoch
            self._reconciled_carrier[w] = carrier
        notices = [n for w in workers for n in self.reconciled_notices(WorkerId(w), epoch)]
        if not notices:
            return
        self.counters["reconciled_notices"] += len(notices)
        self._spawn(self._publish_notices(notices, carrier), "reconciled")

    async def _publish_notices(self, notices: Sequence[ReconciledNotice],
                               carrier: Mapping[str, str]) -> int:
        """Publish ReconciledNotices in order, each on its worker's subject with the W3C
        ``carrier`` (the context of the span whose reconcile made them) in its headers;
        returns how many went out. One that cannot be sent is logged: the schedulers then do
        without the credit for that worker (or ask again, ``pending``)."""
        sent = 0
        for n in notices:
            data, headers = encode(n)
            headers.update(carrier)
            try:
                await self.nc.publish(self.subjects.cache_pending(n.worker), data,
                                      headers=headers)
                sent += 1
            except (nats.errors.ConnectionClosedError,
                    nats.errors.OutboundBufferLimitError) as exc:
                self.log.warning("reconciled notice not published", worker=n.worker,
                                 error=str(exc))
        return sent

    def _rehome_merged(self, merged: WorkerId,
                       record: EpochRecord) -> list[CacheAction | Demote]:
        """A merge's new worker is exposed: copy its degree's long prefixes to it (reconcile.py
        ``rehome_on_merge``), exactly when the simulator does (``_switched``)."""
        config = self.msettings.rehome_config()
        if config is None or merged not in self.trie.workers():
            return []
        degree = self.trie.worker_degree(merged)
        active = {w.worker_id for w in record.workers if w.lifecycle is Lifecycle.ACTIVE}
        peers = [w for w in self.trie.workers() if w != merged and w in active
                 and self.trie.worker_degree(w) == degree]
        actions: list[CacheAction | Demote] = \
            list(rehome_on_merge(self.trie, merged, peers, config)) if peers else []
        return self._send_rehomed(actions, "merged worker re-homed", worker=merged,
                                  epoch=record.epoch)

    def _send_rehomed(self, actions: list[CacheAction | Demote], what: str,
                      **log: Any) -> list[CacheAction | Demote]:
        """Count, log and send a re-homing's copies, after its demotes when it has any
        (:meth:`_displace_then_copy`); returns ``actions``."""
        copies = [a for a in actions if not isinstance(a, Demote)]
        demotes = [a for a in actions if isinstance(a, Demote)]
        if copies:
            self.counters["rehomed"] += len(copies)
            self.log.info(what, copies=len(copies), displacing=len(demotes), **log)
        if demotes:
            self._spawn(self._displace_then_copy(demotes, copies), "rehome")
        else:
            for a in copies:
                self._send(a)
        return actions

    async def _on_drain(self, msg: Msg) -> None:
        """A DrainNotice: :meth:`on_drain` under a :data:`~services.cachemgr.tracing.DRAIN_SPAN`
        span, a child of the context its headers carry (the controller's drain phase), so the
        re-homing commands it sends are in the reconfiguration's trace; a missing or malformed
        context makes the span a root (the latter logged), and the notice is acted on all
        the same."""
        try:
            notice = decode(DrainNotice, msg.data, msg.headers)
        except SchemaError as exc:
            self.counters["malformed"] += 1
            self.log.error("bad drain notice ignored", error=str(exc))
            return
        try:
            with self._work_span(DRAIN_SPAN, msg.headers, drain_attributes(notice),
                                 what="drain notice",
                                 reconfiguration=notice.reconfiguration) as span:
                actions = self.on_drain(notice)
                if span.is_recording():
                    demotes = sum(isinstance(a, Demote) for a in actions)
                    span.set_attributes({"vtm.rehome_copies": len(actions) - demotes,
                                         "vtm.rehome_demotes": demotes})
        except VertumnusError as exc:
            self.counters["rejected"] += 1
            self.log.error("drain notice not acted on", error=str(exc),
                           reconfiguration=notice.reconfiguration)

    @contextlib.contextmanager
    def _work_span(self, name: str, carrier: Mapping[str, Any] | None,
                   attributes: Mapping[str, Any], *, what: str,
                   **log: Any) -> Iterator[trace.Span]:
        """The current span for this block: ``name`` (kind CONSUMER), a child of the context
        ``carrier`` holds (:func:`~services.cachemgr.tracing.carried_parent`), never of
        whatever is current. Tasks spawned in the block start under it (they copy the
        context), so the commands they send are its descendants. A malformed context is a
        warning naming ``what`` and the span a root; the block runs either way. Log lines of
        the block carry the span's trace id and ``log``; an exception leaving it marks the
        span ERROR and goes on."""
        parent = carried_parent(carrier)
        if parent.malformed is not None:
            self.log.warning(f"{what}'s trace context malformed; handled without a parent",
                             traceparent=parent.malformed, **log)
        with tracer().start_as_current_span(name, context=parent.context,
                                            kind=trace.SpanKind.CONSUMER,
                                            attributes=dict(attributes)) as span:
            tid = current_trace_id()
            with bound_contextvars(**log, **({"trace_id": tid} if tid is not None else {})):
                yield span

    def on_drain(self, notice: DrainNotice) -> list[CacheAction | Demote]:
        """A split starts (its parent stops admitting, its cache still intact until the
        switch): re-home the parent's long prefixes onto the workers of its degree that stay
        (reconcile.py ``rehome_on_split``), exactly when the simulator does (``_begin``).
        Returns what it sends: the copies, then the demotes of the colder blocks they displace
        at full peers (sent, and answered, before the copies); merges and untracked parents
        send nothing."""
        config = self.msettings.rehome_config()
        if config is None or notice.kind != "split" or len(notice.sources) != 1:
            return []
        parent = WorkerId(notice.sources[0])
        tracked = self.trie.workers()
        if parent not in tracked:
            return []
        degree = self.trie.worker_degree(parent)
        leaving = set(notice.sources)
        if self.record is not None:  # every source of the plan is DRAINING in its record
            leaving |= {w.worker_id for w in self.record.workers
                        if w.lifecycle is not Lifecycle.ACTIVE}
        peers = [w for w in tracked
                 if w not in leaving and w != parent and self.trie.worker_degree(w) == degree]
        actions: list[CacheAction | Demote] = \
            list(rehome_on_split(self.trie, parent, peers, config)) if peers else []
        return self._send_rehomed(actions, "split parent re-homed", parent=parent,
                                  reconfiguration=notice.reconfiguration)

    async def _displace_then_copy(self, demotes: list[Demote],
                                  copies: list[CacheAction | Demote]) -> None:
        """A split's re-homing with displacement (reconcile.py ``rehome_on_split``): the peers'
        colder blocks are demoted first, each demote answered (or failed) before any copy is
        sent, so a copy landing on a full peer evicts them and not what the peer serves. A
        failed demote only leaves that peer's LRU as it was; the copies go anyway."""
        for d in demotes:
            await self._demote(d)
        for a in copies:
            self._send(a)

    def _follow_lifecycles(self, record: EpochRecord) -> None:
        """An UNAVAILABLE worker (failed, lease lost) holds nothing we can count on: it is
        untracked; once the record shows it again it is tracked afresh from its snapshot."""
        tracked = set(self.trie.workers())
        for w in record.workers:
            wid = WorkerId(w.worker_id)
            if w.lifecycle is Lifecycle.UNAVAILABLE and wid in tracked:
                cancelled = self.trie.remove_worker(wid)
                self._forget(wid)
                self.log.info("unavailable worker untracked", worker=wid, cancelled=len(cancelled))
            elif w.lifecycle is not Lifecycle.UNAVAILABLE and wid not in tracked:
                self._register(wid, w.degree, snapshot=True)

    # -- cache events and snapshots -------------------------------------------------------------

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = event_from_json(msg.data)
            if isinstance(event, Snapshot):
                raise MalformedEvent("snapshots come as replies, not on the event stream")
        except MalformedEvent as exc:
            self.counters["malformed"] += 1
            self.log.warning("malformed cache event rejected", subject=msg.subject, error=str(exc))
            return
        if event.worker not in self.trie.workers():
            # A late event of a worker the record calls UNAVAILABLE does not track it again:
            # its snapshot would make it a holder, a copy source and a destination.
            if not in_pool(self.record, event.worker) \
                    or not self._register(event.worker, snapshot=False):
                self.counters["rejected"] += 1
                return
        try:
            outcome = self.trie.apply(event)
        except VertumnusError as exc:
            # An inconsistent chain: nothing applied, the next event shows a gap.
            self.counters["rejected"] += 1
            self.log.warning("cache event rejected", worker=event.worker, error=str(exc))
            return
        if outcome is ApplyOutcome.APPLIED:
            self.counters["events_applied"] += 1
        elif outcome is ApplyOutcome.DUPLICATE:
            self.counters["duplicates"] += 1
        else:
            self.counters["gaps"] += 1
            self.log.info("cache event gap", worker=event.worker, event_id=event.event_id)
            self._request_snapshot(event.worker)

    def _request_snapshot(self, worker: str) -> None:
        spawn_once(self._tasks, self._snapshotting, worker, partial(self._fetch_snapshot, worker),
                   f"snapshot-{worker}")

    async def _fetch_snapshot(self, worker: str) -> None:
        restarts = self._restarts.get(worker, 0)
        subject = self.subjects.cache_snapshot(worker)
        try:
            # A full worker's index is several MiB: it may come in parts.
            data, _ = await request_in_parts(
                self.nc, subject, b"{}",
                timeout_s=self.msettings.snapshot_timeout_s, headers=inject({}),
            )  # a micro error is raised: no snapshot
            event = snapshot_reply(worker, data)
            if self._restarts.get(worker, 0) != restarts:
                # Asked before the worker restarted: it may list the old process's cache.
                if worker in self.trie.workers():
                    self._snapshot_retry.add(worker)
                self.log.info("cache snapshot of a previous incarnation ignored", worker=worker)
                return
            self._snapshot_retry.discard(worker)
            if worker in self.trie.workers():
                outcome = self.trie.apply(event)
                if outcome is ApplyOutcome.APPLIED:
                    self.counters["snapshots_applied"] += 1
                self.log.info(
                    "cache snapshot applied",
                    worker=worker,
                    last_event_id=event.last_event_id,
                    blocks=len(event.blocks),
                    outcome=outcome.value,
                )
        except (RemoteError, nats.errors.NoRespondersError, nats.errors.TimeoutError,
                TimeoutError) as exc:
            self.counters["snapshots_failed"] += 1
            # A worker tracked without its index would count its cached prefixes as missing
            # until its first event: housekeeping asks again while it is tracked.
            if worker in self.trie.workers():
                self._snapshot_retry.add(worker)
            self.log.info("cache snapshot unavailable; will ask again", worker=worker,
                          error=repr(exc))
        except VertumnusError as exc:
            self.counters["snapshots_failed"] += 1
            self.log.warning("cache snapshot rejected", worker=worker, error=str(exc))
        except Exception as exc:
            # Anything else (the connection closed, draining, or unable to send or buffer the
            # request while it reconnects; a defect): the fetch runs in a task of its own, so
            # an escaping exception ended it unretrieved and -- the worker neither stale nor
            # in the retry set -- its index was never asked again. Asked again as an
            # unanswered request is (the scheduler's fetch does the same).
            self.counters["snapshots_failed"] += 1
            if worker in self.trie.workers():
                self._snapshot_retry.add(worker)
            self.log.warning("cache snapshot request failed; will ask again", worker=worker,
                             error=repr(exc), exc_info=exc)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(self.msettings.housekeeping_s)
            self._snapshot_retry &= set(self.trie.workers())  # untracked meanwhile
            for w in {*self.trie.stale_workers(), *self._snapshot_retry}:
                self._request_snapshot(w)

    # -- per-request statistics -------------------------------------------------------------------

    async def _on_stats(self, msg: Msg) -> None:
        try:
            stats = decode(RequestStats, msg.data, msg.headers)
        except SchemaError as exc:
            self.counters["malformed"] += 1
            self.log.warning("malformed request stats rejected", error=str(exc))
            return
        actions = self.record_stats(stats)
        if actions:
            # The copies this placement triggered name the request, and their spans link to
            # its trace when the stats' headers carry its context.
            trigger = RequestTrigger.from_headers(stats.request_id, msg.headers)
            for a in actions:
                self._send(a, self._reconcile_trigger(a, trigger))

    def _reconcile_trigger(self, action: Replicate, trigger: RequestTrigger) -> RequestTrigger:
        """``trigger`` for ``action``: a lazy reconcile copy's also names the reconcile whose
        pending pages it copies (:class:`~services.cachemgr.tracing.ReconcileOrigin`: the
        ``cachemgr_epoch`` span that reconciled its destination, else its source -- the
        worker a split or merge made, whose notices carry that context), so its span links to
        the reconfiguration's trace as well as to the request's, and is kept when that trace
        is. Before, such a copy was in the request's trace only. A worker with no context
        kept (made before this process started: its reconcile was not traced here) gives
        none."""
        if action.kind != "reconcile":
            return trigger
        for w in (action.dest, action.source):
            origin = ReconcileOrigin.from_carrier(
                self._reconciled_carrier.get(w), self._reconciled_epoch.get(w, 0))
            if origin is not None:
                return dataclasses.replace(trigger, reconcile=origin)
        return trigger

    def record_stats(self, stats: RequestStats) -> tuple[Replicate, ...]:
        """Algorithm 1 for one placement, then the copies it triggers: the lazy reconcile
        copies (§6.2) and the route-time pull (pull.py)."""
        t = self.trie
        wid = WorkerId(stats.worker_id)
        hashes = [BlockHash(h) for h in stats.block_hashes]
        if wid not in t.workers():
            self.counters["stats_skipped"] += 1
            return ()
        try:
            match = t.match(hashes)
            # The scheduler's replica of the trie may lag ours: never claim more reuse than
            # the path we matched.
            reused = min(stats.reused_blocks, match.matched_blocks)
            t.record_request(
                match,
                wid,
                stats.degree,
                reused,
                stats.preferred_degree,
                stats.input_len,
                self.profile.predict,
            )
            self.counters["stats_recorded"] += 1
            copies = t.on_reuse(wid, hashes)
            pull = self.msettings.pull_config()
            if pull is not None:
                pulled = pull_on_route(t, match, wid, pull)
                self.counters["pulls"] += len(pulled)
                copies += pulled
            return copies
        except VertumnusError as exc:
            self.counters["stats_skipped"] += 1
            self.log.info("request stats not recorded", request_id=stats.request_id, error=str(exc))
            return ()

    # -- the scan and the commands -----------------------------------------------------------------

    async def _scanner(self) -> None:
        while True:
            await asyncio.sleep(self.msettings.scan_interval_s)
            try:
                self.scan()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("scan failed")

    def scan(self) -> ScanResult:
        """One periodic scan (Algorithm 2 + selection); sends the selected actions."""
        load = {
            WorkerId(w): st.outstanding_s
            for w, st in self.states.items()
            if w in self.trie.workers()
        }
        result = self.trie.scan(self.scan_config, load)
        self.counters["scans"] += 1
        self.last_scan = {
            "at_s": self.clock(),
            "inter": len(result.inter),
            "intra": len(result.intra),
            "reclaim": len(result.reclaim),
            "actions": len(result.actions),
            "collected": result.collected,
        }
        if result.actions:
            self.log.info("scan selected actions", **self.last_scan)
        for a in result.actions:
            self._send(a)
        return result

    def _command_id_and_epoch(self) -> tuple[str, int]:
        """A fresh command id, and the epoch every command carries (the adopted record's)."""
        self._cmd_seq += 1
        return (f"cm{self._cmd_seq}-{uuid.uuid4().hex[:8]}",
                self.record.epoch if self.record else 0)

    def _command(self, action: CacheAction) -> ReplicateCommand | ReclaimCommand | ReconcileCommand:
        cid, epoch = self._command_id_and_epoch()
        if isinstance(action, Reclaim):
            return ReclaimCommand(
                command_id=cid, worker_id=action.worker, epoch=epoch, blocks=list(action.blocks)
            )
        # A reconcile copy and any other copy carry the same fields; only the command differs.
        command = ReconcileCommand if action.kind == "reconcile" else ReplicateCommand
        return command(
            command_id=cid,
            worker_id=action.dest,
            epoch=epoch,
            blocks=path_to(self.trie, action.node_hash),
            source_worker=action.source,
        )

    def _send(self, action: CacheAction, trigger: RequestTrigger | None = None) -> None:
        """Send ``action``'s command from a task of its own (:meth:`_execute`); ``trigger``:
        the request whose placement made it, if one did (its span names and links it)."""
        self._spawn(self._execute(action, trigger), "cache-cmd")

    async def _execute(self, action: CacheAction, trigger: RequestTrigger | None = None) -> None:
        """Send ``action``'s command and settle the action exactly once.

        An ok reply retires it as done (``replication_done``; a reclaim waits for the
        ``removed`` events of the blocks the reply says went, ``reclaim_executed``);
        anything else -- a refused reply, a micro error, a malformed reply, no responder, a
        timeout, any nats client error, and any other exception -- settles it as failed
        (:meth:`_failed`), so the trie retires its plan and a later scan or reuse may issue
        it again. A route-time pull settled as done is then followed by its demote
        (:meth:`_demote_source`); a failed one by none. Never raises but
        :class:`asyncio.CancelledError` (shutdown), which leaves the action as it is: the
        service is going away with its trie.
        """
        try:
            error, landed = await self._send_command(action, trigger)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # anything: an unsettled action would stay in flight for ever
            self.counters["commands_errored"] += 1
            self._failed(action, repr(exc), exc=exc)
            return
        if error is not None:
            self._failed(action, error)
            return
        self.counters["commands_ok"] += 1
        self.metrics.done(action, ok=True)
        if isinstance(action, Replicate):
            # NOTE: retires the in-flight copy only; the replica becomes visible with the
            # destination's own stored event (usually already applied by now).
            self.trie.replication_done(action)
            # After it is settled: whatever the demote meets, the copy stays done.
            await self._demote_source(action, landed)
        else:
            # A reclaim waits for the Removed events of the blocks the worker removed, and of
            # those only: a pinned or still-parent block it kept would hold it in flight.
            self.trie.reclaim_executed(action, landed)

    async def _send_command(self, action: CacheAction,
                            trigger: RequestTrigger | None = None) -> tuple[str | None, int]:
        """Build and send ``action``'s command: (None if the worker did it, else why not; for
        a copy, how many of ``action.blocks`` the destination took, else the reply's
        ``blocks_done``).

        The failures a command meets in normal operation come back as the reason; anything
        else raises (for :meth:`_execute`, which settles the action either way).
        """
        try:
            cmd = self._command(action)
        except (InvalidInput, SchemaError) as exc:  # e.g. a node collected meanwhile
            return str(exc), 0
        self.counters["commands_sent"] += 1
        self.log.info(
            "cache command",
            op=cmd.op,
            worker=cmd.worker_id,
            command_id=cmd.command_id,
            action=action.to_wire(),
        )
        error, done = await self._call_worker(cmd, action=action, trigger=trigger)
        if isinstance(action, Replicate):
            # A copy's reply counts the root-to-node path the destination now holds, leading
            # blocks first; the copy is that path's tail.
            done = min(len(action.blocks),
                       max(0, done - (len(cmd.blocks) - len(action.blocks))))
        return error, done

    async def _call_worker(
        self, cmd: ReplicateCommand | ReclaimCommand | ReconcileCommand | DemoteCommand, *,
        action: CacheAction | Demote | None = None, trigger: RequestTrigger | None = None,
    ) -> tuple[str | None, int]:
        """Send ``cmd`` to its worker and wait for the reply: (None if the worker did it, else
        why not; the reply's ``blocks_done``, 0 without an ok reply). The failures a command
        meets in normal operation come back as the reason.

        Under a span of its own (services/cachemgr/tracing.py, ``cache_{op}`` /
        ``cache_pull``): what the command is (``action``: the copy's kind and blocks), the
        request that triggered it (``trigger``: ``vtm.request_id`` and a link to its trace)
        and how it ended. Its context travels in the command's headers (``call`` injects the
        current one), so the worker's ``cache-cmd`` span is its child. Before, that span was
        a root of its own that said nothing of the command or of why it was sent."""
        copy_kind = action.kind if isinstance(action, Replicate) else None
        attrs = command_attributes(cmd)
        if isinstance(action, Replicate):
            attrs["vtm.copy_kind"] = action.kind
            attrs["vtm.copy_blocks"] = len(action.blocks)
        if trigger is not None:
            attrs["vtm.request_id"] = trigger.request_id
            if trigger.always_sample:  # seen by the sampler: given when the span is made
                attrs[ALWAYS_SAMPLE] = True
        with tracer().start_as_current_span(
            command_span_name(cmd.op, copy_kind),
            kind=trace.SpanKind.CLIENT,
            attributes=attrs,
            links=trigger.links() if trigger is not None else None,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            error, done = await self._call_worker_traced(cmd)
            if span.is_recording():
                span.set_attributes({"vtm.cache_ok": error is None, "vtm.blocks_done": done})
                if error is not None:
                    span.set_attribute("vtm.cache_error", error[:500])
                    span.set_status(trace.Status(trace.StatusCode.ERROR, "command failed"))
            return error, done

    async def _call_worker_traced(
        self, cmd: ReplicateCommand | ReclaimCommand | ReconcileCommand | DemoteCommand
    ) -> tuple[str | None, int]:
        """:meth:`_call_worker` inside its span."""
        try:
            res = await call(
                self.nc,
                self.subjects.cache_cmd(cmd.worker_id),
                cmd,
                CacheCommandResult,
                timeout_s=self.msettings.command_timeout_s,
            )
        except (
            RemoteError,
            SchemaError,
            # Every nats client error: no responders, its timeout, and a connection closed,
            # draining or with a full outbound buffer (a long outage) -- the worker did not
            # act on this command, or cannot tell us it did.
            nats.errors.Error,
            TimeoutError,
        ) as exc:
            return repr(exc), 0
        if not res.ok:
            return res.error or "refused", 0
        return None, res.blocks_done

    async def _demote_source(self, action: Replicate, landed: int) -> None:
        """A copy answered ok: for a route-time pull with ``pull_demote``, send the source a
        DemoteCommand of the copied blocks the destination took (``landed`` of them, from
        its reply; pull.py ``demotion``) and wait for its reply.

        Fire-and-forget: a demote only reorders the source's LRU, so its outcome is counted
        and logged and changes nothing else -- not the copy (already settled), not the trie
        (a demote has no in-flight state and moves no holder). Never raises but
        :class:`asyncio.CancelledError` (shutdown)."""
        try:
            config = self.msettings.pull_config()
            dem = demotion(action, config, self.trie, landed=landed) \
                if config is not None else None
        except Exception as exc:  # a bug on the way: logged, the service keeps running
            self.counters["demotes_failed"] += 1
            self.log.error("demote failed unexpectedly", action=action.to_wire(),
                           error=repr(exc), exc_info=exc)
            return
        if dem is not None:
            await self._demote(dem)

    async def _demote(self, dem: Demote) -> None:
        """Send ``dem`` (a pull's source, or a split's re-homing peer) and wait for its reply.

        Fire-and-forget: a demote only reorders the worker's LRU, so its outcome is counted
        (``demotes_ok`` / ``demotes_failed``) and logged and changes nothing else (a demote has
        no in-flight state and moves no holder). Never raises but
        :class:`asyncio.CancelledError` (shutdown)."""
        try:
            if dem.worker not in self.trie.workers():
                # It left the pool since the demote was planned: there is nothing to demote.
                # (A restarted worker is tracked afresh; it skips the blocks it lacks.)
                self.log.info("demote skipped: worker no longer tracked", action=dem.to_wire())
                return
            error = await self._send_demote(dem)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug on the way: logged, the service keeps running
            self.counters["demotes_failed"] += 1
            self.metrics.done(dem, ok=False)
            self.log.error("demote failed unexpectedly", action=dem.to_wire(),
                           error=repr(exc), exc_info=exc)
            return
        self.metrics.done(dem, ok=error is None)
        if error is None:
            self.counters["demotes_ok"] += 1
            return
        self.counters["demotes_failed"] += 1
        # A warning, not an error: the source only keeps its copy at the recent end, as it
        # would without demotion.
        self.log.warning("demote failed", action=dem.to_wire(), error=error)

    async def _send_demote(self, dem: Demote) -> str | None:
        """Send ``dem`` as a DemoteCommand; None if the worker did it, else why not (as
        :meth:`_send_command`)."""
        cid, epoch = self._command_id_and_epoch()
        cmd = DemoteCommand(command_id=cid, worker_id=dem.worker, epoch=epoch,
                            blocks=list(dem.blocks))
        self.counters["demotes_sent"] += 1
        self.log.info("cache command", op=cmd.op, worker=cmd.worker_id, command_id=cid,
                      action=dem.to_wire())
        return (await self._call_worker(cmd, action=dem))[0]

    def _failed(self, action: CacheAction, why: str, *, exc: BaseException | None = None) -> None:
        """Settle ``action`` as failed: counted, logged, its plan retired in the trie.

        ``exc``: an unexpected exception behind the failure, logged as an error with its
        traceback (the expected failures are a warning with ``why``).
        """
        self.counters["commands_failed"] += 1
        self.metrics.done(action, ok=False)
        if exc is None:
            self.log.warning("cache command failed", action=action.to_wire(), error=why)
        else:
            self.log.error("cache command failed unexpectedly", action=action.to_wire(),
                           error=why, exc_info=exc)
        if isinstance(action, Replicate):
            self.trie.replication_failed(action)
        else:
            self.trie.reclaim_failed(action)


__all__ = [
    "CacheMgrService",
    "CacheMgrSettings",
    "InspectQuery",
    "cachemgr_group",
    "degree_of",
    "diff_compositions",
    "path_to",
]
