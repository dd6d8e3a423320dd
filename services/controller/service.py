"""The controller's NATS adapter: window demand → ControllerCore → epoch records (§6, §8).

One asyncio process, micro service ``vtm-controller`` (group ``{prefix}.controller``,
endpoint ``inspect``). Every decision comes from :class:`~services.controller.core.
ControllerCore`; this module moves messages and keeps the books an adapter must keep
(KV revisions, which record epoch a commit was written under, in-flight request ids).

=======================================  ==========================================================
input                                    what the adapter does
=======================================  ==========================================================
``{prefix}.window.demand.>``             WindowReport of each scheduler replica → ``core.assigned``
(``demand_input="windows"``, default;    (the report is replayed as its ``requests`` assignments
reports ``….{src}``, their copies        at the middle of its window, :func:`replay_report`: D(k),
``….again.{src}``)                       count, long fraction and the demand by preferred degree
                                         — the merge gate's input, when the report's rule is
                                         ours — are exact; reports of several replicas add up;
                                         a replica's second copy of a window is ignored)
``{prefix}.cache.stats.*``               RequestStats, one per placement → ``core.assigned(at_s,
(``demand_input="assignments"``)         predicted_s, input_len, degree)``
timer, every ``tick_s``                  ``core.tick(now - report_grace_s)`` (windows close only
                                         after their reports had time to arrive, and in windows
                                         mode never past the latest reported window: silent
                                         schedulers are not zero demand); a decision with a plan
                                         is carried out (below)
worker-state KV (watch)                  per-worker outstanding work (drain estimate for the
                                         planner), queue length, lifecycle: a draining source
                                         whose state shows an empty queue under the drain record
                                         has finished its in-flight work
``{prefix}.result.*`` (FirstToken)       ``protocol.finished(worker, request)`` for draining sources
``{prefix}.epoch.ack.*`` (EpochAck)      ``protocol.ack`` for ranks of committed targets; a
                                         draining source's ack of its drain record: it
                                         stopped admitting (step 3)
=======================================  ==========================================================

Carrying out a plan (one or more splits and merges on disjoint workers, ``max_ops``):

1. *Queues.* Each source of every operation is asked (concurrently)
   ``{prefix}.worker.queue.{wid}`` (QueueQuery → QueueReport: queued and in-flight ids). A
   worker that does not answer is judged from its WorkerState: nothing queued is known (the
   worker redirects its own queue when it adopts the drain record), and one opaque in-flight
   marker if its ``queue_len`` > 0, resolved when its state shows an empty queue.
2. *Drain.* ``core.start(op, ...)`` for every operation; then **one drain record** — the
   current composition with the sources of all of them DRAINING (none is parked yet: step 3)
   under the next record epoch — is written with compare-and-set (``kv.update(key, value,
   last=revision)``). Rank daemons adopting it stop admitting and hand their queued requests
   back to intake (``Nats-Msg-Id`` ``{source}>{worker}``, rankd's ``handback_msg_id``); since
   every source of the plan stops in the same record, no redirected request is re-placed on a
   worker that another operation of the plan drains. A drain record JetStream does not take
   (an error or timeout, not a lost compare-and-set) -- unless a read shows it stored after
   all -- undoes every operation started for it (``protocol.abort``, sources ACTIVE as the
   stored record still has them; ReconfigurationEvent ``aborted``; ``drains_abandoned``):
   no commit record is ever written for sources no drain record stopped, and the planner
   plans anew. Then per operation the DrainNotice (the
   *redirect* message, :func:`drain_subject`; ``plan`` lists the plan's reconfigurations) and a
   ReconfigurationEvent (phase ``draining``) are published. From here each operation is its
   own reconfiguration of the epoch protocol (which commits disjoint operations under
   epochs of their own), exactly as the simulator times them:
3. *Stopped.* The answers of step 1 predate the drain record, and a source admits and starts
   requests until it adopts that record: no source counts as drained -- however idle its
   answer -- before it shows it stopped admitting (``STOP_MARKER`` awaited from step 2): its
   EpochAck of the drain record (or a later one), or its WorkerState under it. Its queue is
   then asked again; what it lists in flight is awaited too (``protocol.in_flight_found``;
   unanswered: judged from its state, as in step 1). A state under the drain record with an
   empty queue settles the source at once. Before, an idle answer committed the switch right
   after the drain record, under a request the source had started in between.
4. *Commit.* When every source of an operation drained: ``protocol.switch_started`` and the
   **commit record** (sources gone, targets SWITCHING) is written by compare-and-set. The
   adapter remembers the record epoch of the commit: ranks acknowledge record epochs, the
   protocol counts its own.
5. *Acks.* An EpochAck for a rank of a committed target, naming the commit's record epoch or
   a later record (a rank that finished switching after another operation's commit adopts
   that one), is passed to ``protocol.ack``; acks of untouched workers (ranks ack every record
   they adopt) and of earlier records are ignored.
6. *Expose.* When every rank acknowledged: the **exposure record** (targets ACTIVE) is written
   by compare-and-set, then ``protocol.exposed``; the CompositionNotice and the
   ReconfigurationEvent (phase ``exposed``, with drain and switch times) are published.

A reconfiguration whose sources have not drained after ``reconfig_drain_timeout_s`` is aborted
(``protocol.abort``; a record with the sources ACTIVE again). When ``ack_timeout_s`` pass
without a record while something waits, the plan is resumed: a worker still waiting for rank
acks gets the record re-announced (the same composition under the next epoch), so a lost ack
cannot leave it switching, and an operation whose commit or exposure record failed to write
is committed or exposed again.

Liveness (§5.2 lifecycle): a worker whose last WorkerState is older than ``lease_s`` fails
(``protocol.fail``: UNAVAILABLE in the next record; an uncommitted reconfiguration it is a
source of is aborted, a committed one goes on without it). When it heartbeats again it is
re-admitted (``protocol.recover``: SWITCHING under a fresh record epoch) and becomes ACTIVE in
a further record once all its ranks acknowledged that epoch. A worker that never published a
state is not judged, nor is a worker a commit created by a state its predecessor of the same
id left (a merge back, a split back): a state whose epoch is below the record that created
the worker is ignored (``stale_states``), since worker-state keys expire by TTL, which the
watch is never told. A core built from a stored record (start, lost leadership, following)
keeps the workers that record shows UNAVAILABLE unavailable until they heartbeat again.
Workers a stored record shows draining or switching while this controller's protocol
has them active were left by a controller that stopped mid-reconfiguration; once that record
is older than ``reconfig_drain_timeout_s`` they are failed and re-admitted the same way.

``inspect`` (``{prefix}.controller.inspect``, optional JSON body ``{"decisions": N}``; a
malformed body is a 400 micro error) answers the composition, the protocol and record epochs,
every worker's lifecycle, the schedulable workers, reconfigurations in progress and done (with
drain and switch times), the pending operations, the core's config and the κ it judges with
(× ``kappa_scale``), the open window (its demand, also by the requests' preferred degree), the
last N decisions (each with its ``trigger``, the rule behind it:
:attr:`~services.controller.planner.Decision.trigger`) and counters.
Malformed pub/sub input (reports, acks, states) is counted (``malformed``) and dropped; so is
a report that decodes but cannot be replayed (:func:`report_problem`: stamped in the future,
absurdly many requests, a window index that overflows), and a RequestStats (assignments
mode) stamped more than a window ahead.

Leadership: the epoch record is the only arbiter. Every write is a compare-and-set on the
revision this controller last read or wrote; ``KeyWrongLastSequenceError`` means another
controller changed the record first: this one lost leadership for that change, drops its
core and rebuilds it from the stored record (``cas_lost`` and ``rebuilt`` in ``inspect``).
With ``follow_record`` (default) the controller also watches the key and, while it has
nothing in progress, adopts records written by others (so a passive replica stays current).

A server that comes back without its store has lost the record. A controller that lived
through the loss writes its own again (``ensure_jetstream``, ``records_rewritten``); one
started after it writes its initial composition, which the running workers ignore as older.
A live worker whose state shows an epoch above the record's reveals that: after
``WORKERS_SETTLE_S`` the controller writes a record of every live ACTIVE worker at an epoch
above theirs and rebuilds its core from it (``rebuilt_from_workers``).

A value at the epoch key that is no record of this pool -- bytes that do not decode, or a
record whose workers are no composition of the lattice (a mistaken ``nats kv put``, a
foreign deployment on the same prefix) -- is not another controller's decision: there is
nothing to follow, and left there it would make every compare-and-set fail for good (no
reconfiguration again, no controller able to start). The controller writes its own record
over it by compare-and-set on that value's revision, at an epoch above both (rank daemons
adopt only newer epochs, and may have adopted a decodable one): at once when its watch sees
it with nothing in progress, else on the write that finds it (then its core is rebuilt from
that record, as after a lost compare-and-set), on start and after a reconnect
(``records_repaired``, logged as an error).

Tracing (:mod:`services.controller.tracing`): each operation of a plan is one trace, from its
queue queries to its exposure -- a ``reconfiguration`` root (kind, workers and degrees, the
record epochs, the planner rule and reason) with a span per phase (``queue_query``, ``drain``,
``epoch_commit``, ``switch``, ``expose``). What is done on its behalf runs in its context: the
queue queries carry it to the rank daemons (whose micro handlers join the trace), the
DrainNotice, ReconfigurationEvent and CompositionNotice carry it in their headers, and the log
lines about it carry its ``trace_id`` and ``reconfiguration``. An abort (drain timeout, a
source's lease), an undone drain, a core rebuilt under it or a stop ends it with status ERROR
and the reason. A KV value has no headers, so the drain, commit and exposure records carry
it in their ``traceparent`` field (the context of the phase span that writes each): every
rank daemon's adoption of one (its ``epoch_adopt`` span) is part of the trace, with this
controller's handling of each of the acks it sends (:data:`EPOCH_ACK_SPAN`, a child of the
``epoch_adopt`` span whose context the ack's headers carry), and so is the cache manager's
handling of it (``cachemgr_epoch``, with the scheduler replicas' ``reconciled_apply`` of the
ReconciledNotices it publishes) and of the DrainNotice (``cachemgr_drain``, with its
re-homing commands). So do a drain timeout's abort record (the root's context) and a
re-announcement for a committed operation's targets (its switch phase's); the records of a
failure (lease expiry), a recovery (re-admit, activate), the initial record and a repair
belong to no operation and carry none. Each
operation's trace is kept whatever the sampling ratio (:func:`shared.telemetry.sampler`).

Messages this module defines until they move to shared/ (see the report): DrainNotice,
ReconfigurationEvent, CompositionNotice, InspectQuery. (QueueQuery / QueueReport moved to
:mod:`shared.schemas`, since rankd answers them; re-exported here.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Container, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Final, Literal

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from nats.micro.request import Request
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.calibration import CONTROLLER, KAPPA_SCALE
from services.controller.config_file import (
    FIELD_KINDS,
    config_to_mapping,
    load_controller_config,
)
from services.controller.core import FROM_PROFILE, ControllerCore, FromProfile
from services.controller.lattice import Composition, Lattice
from services.controller.lifecycle import (
    ControlRecord,
    EpochMismatch,
    IllegalTransition,
    Phase,
    Reconfiguration,
    StartResult,
)
from services.controller.metrics import PoolMetrics
from services.controller.planner import ControllerConfig, Decision, Plan
from services.controller.tracing import (
    ReconfStage,
    ReconfTrace,
    ReconfTraces,
    bound,
    bound_all,
    plan_attributes,
)
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DEGREES,
    GPUS_PER_NODE,
    InvalidInput,
    RequestId,
    VertumnusError,
    WorkerId,
    tp_worker_name,
)
from shared.schemas import (
    CompositionNotice,
    DrainNotice,
    EpochAck,
    EpochRecord,
    EpochWorker,
    Message,
    QueueQuery,
    QueueReport,
    ReconfigurationEvent,
    RedirectedRequest,
    RequestStats,
    SchemaError,
    WindowReport,
    WorkerState,
    decode,
    encode,
    to_json,
)
from shared.service import (
    WORKER_LEASE_S,
    Endpoint,
    KvWatch,
    MicroService,
    RemoteError,
    call,
    epoch_kv,
    first_token_of,
    optional_request_model,
    worker_state_kv,
)
from shared.settings import ServiceSettings, json_object_text
from shared.subjects import Subjects, micro_service_name, validate_token
from shared.telemetry import extract, inject, is_sampled, tracer
from shared.worker import GpuGroup, Lifecycle, WorkerKind
from shared.workerstates import worker_state_changes

VERSION: Final[str] = "0.1.0"
INFLIGHT_MARKER: Final[str] = "~in-flight"
"""Request id standing for "whatever runs there" when a source did not list its work."""
STOP_MARKER: Final[str] = "~until-stopped"
"""Request id standing for "whatever a source starts until it stops admitting": awaited on
every source from the drain's start, resolved once the source shows it adopted the drain
record (:meth:`ControllerService._confirm_stopped`). Its queue was asked before the drain
record existed, and it admits and starts requests until it adopts that record."""
WORKERS_SETTLE_S: Final[float] = 2.0
"""How long a controller that finds workers ahead of its record waits for the rest of their
states before rebuilding the record from them (each worker publishes its state again within
about a heartbeat of a server's restart)."""
_WRITE_ERRORS: Final = (nats.errors.Error, TimeoutError)
"""What a record write or read may raise besides a lost compare-and-set (LostLeadership):
JetStream unavailable, no stream, a timeout (nats.js.errors.Error is a nats.errors.Error)."""
MAX_REPORT_REQUESTS: Final[int] = 1 << 20
"""Most requests one WindowReport may count (its replay makes one assignment of each: about
a second of the event loop at this bound); a report above it is rejected as malformed."""
_SEEN_REPORTS_KEPT: Final[int] = 4096
"""Window reports remembered for de-duplication (a copy follows its original by one window)."""
EPOCH_ACK_SPAN: Final[str] = "epoch_ack"
"""The controller's handling of one EpochAck (kind CONSUMER), from its arrival (the wait for
the controller's lock included) to its end -- where the last ack a switch awaited exposes the
targets, their exposure with it: the ack's ``vtm.gpu``, ``vtm.epoch``, ``vtm.worker_id`` and
what it counted for (``vtm.ack.outcome``, :meth:`ControllerService._ack`). A child of the
context in the ack's headers: the rank's ``epoch_adopt`` span of the record it acknowledges,
so in the reconfiguration's trace when the record was written for one. Recorded only when
that context is sampled: an ack without a valid one (an older rank daemon) records none, as
no root per ack is worth keeping. Never the
current span: what the handling writes and publishes keeps the reconfiguration's context
(or none)."""


# -- settings ---------------------------------------------------------------------------------


class ControllerSettings(ServiceSettings):
    """The controller process (environment ``VTM_*``; CLI flags of ``main`` override).

    The planner's thresholds map one-to-one onto :class:`ControllerConfig` (see its docstring
    for what each means). Their defaults, and ``kappa_scale``'s, are the calibrated values of
    ``services/calibration.py`` (``CONTROLLER``, ``KAPPA_SCALE``; the reasons are documented there),
    read from there rather than repeated, so the live controller and the simulator cannot
    drift apart. ``window_s`` must also equal the scheduler replicas' window (their default,
    :data:`~services.controller.windows.DEFAULT_WINDOW_S`, is the calibrated H as well).

    ``controller_file`` (``VTM_CONTROLLER_FILE``) names a controller file, the one
    ``vertumnus simulate --controller`` evaluates (:mod:`services.controller.config_file`): its
    thresholds replace the calibrated ones, and a threshold's own ``VTM_<NAME>`` variable (or
    flag) wins over the file. ``null`` as a variable's value is None: ``VTM_MERGE_SPEEDUP=null``
    turns rule 9 off, as ``false`` does in a file.
    """

    model_config = SettingsConfigDict(env_parse_none_str="null")

    service_name: str = Field(default="vtm-controller", description="Name in logs / traces.")
    num_gpus: int = Field(default=8, ge=1, description="G: GPUs in the prefill pool.")
    degrees: list[int] = Field(
        default_factory=lambda: list(DEFAULT_DEGREES),
        description="Supported CP degrees (powers of two).",
    )
    gpus_per_node: int = Field(default=GPUS_PER_NODE, ge=1, description="GPUs per node.")
    controller_file: Path | None = Field(
        default=None,
        description="A controller file (.toml or .json, as `vertumnus simulate --controller` "
        "takes; `vertumnus controller-config` prints the calibrated one): its thresholds "
        "replace the calibrated ones; a threshold's own variable wins over it.",
    )
    initial_composition: str | None = Field(
        default=None,
        description="Composition written when no epoch record exists yet, in the paper's "
        "notation (e.g. '2CP4' or '2CP2/1CP4'); None: the achievable composition most uniform "
        "at the largest degree (as many GPUs as the lattice allows in workers of the largest "
        "degree, then of the next one, and so on: every worker of the largest degree where "
        "the nodes allow it, e.g. 2CP4 for 8 GPUs, 1CP2/1CP4 for 6). "
        "An existing record always wins (the controller resumes from it).",
    )
    profile_path: Path | None = Field(
        default=None,
        description="Fitted profile (JSON from `vertumnus profile`) with κ_C per degree; "
        "None: the built-in default profile.",
    )
    kappa: dict[int, float] = Field(
        default_factory=dict,
        description="Override of κ_C (seconds of predicted service per window of window_s "
        "one degree-C worker serves within the SLO, as profiled: kappa_scale still applies), "
        'e.g. {"2": 8.0, "4": 14.0}. The profile\'s own κ is per window of the profile\'s '
        "window_s and is rescaled to this window_s.",
    )
    window_s: float = Field(
        default=CONTROLLER.window_s,
        gt=0,
        description="Observation window H (s); must equal the scheduler's window_s.",
    )
    time_scale: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="Wall seconds per modelled second of the rank daemons (their "
        "VTM_TIME_SCALE; 1 on real hardware): a window of window_s wall seconds spans "
        "window_s / time_scale seconds of the profile's clock, which κ is rescaled to.",
    )
    long_threshold_tokens: int = Field(
        default=CONTROLLER.long_threshold_tokens,
        ge=1,
        description="Input length from which a request counts as long (in the windows "
        "mode the scheduler counts them: keep its VTM_LONG_THRESHOLD_TOKENS equal).",
    )
    upper: float = Field(default=CONTROLLER.upper, description="Split when D > upper·capacity.")
    lower: float = Field(default=CONTROLLER.lower, description="Merge when D < lower·capacity.")
    merge_headroom: float = Field(
        default=CONTROLLER.merge_headroom,
        description="A merge must leave D ≤ merge_headroom·capacity after it.",
    )
    long_fraction_delta: float = Field(
        default=CONTROLLER.long_fraction_delta,
        description="Change of the long-request share that signals a mix shift.",
    )
    demand_stability: float = Field(
        default=CONTROLLER.demand_stability,
        description="Relative demand band within which demand counts as stable.",
    )
    persistence: int = Field(
        default=CONTROLLER.persistence,
        ge=1,
        description="Consecutive windows a direction must persist.",
    )
    max_ops: int = Field(
        default=CONTROLLER.max_ops,
        ge=1,
        description="Operations (splits or merges on disjoint workers) one window's plan may "
        "hold; 1 is the paper's one operation at a time. All operations of a plan start "
        "under one drain record (see 'Carrying out a plan').",
    )
    split_target: float = Field(
        default=CONTROLLER.split_target,
        description="A multi-operation split plan adds splits while D > split_target·capacity "
        "(≤ upper).",
    )
    momentum: bool = Field(
        default=CONTROLLER.momentum,
        description="Planner rule 4's momentum: after an operation, the next one in the same "
        "direction needs no fresh persistence.",
    )
    merge_speedup: float | None = Field(
        default=CONTROLLER.merge_speedup,
        description="Merge gate (planner rule 9): a request prefers degree 2C when "
        "Ê_C/Ê_2C ≥ this; a merge into 2C needs that much demand preferring ≥ 2C. None: off. "
        "With demand_input='windows' the scheduler replicas compute the breakdown (their "
        "merge_speedup and degrees must equal these; a report made with another rule counts "
        "as one without a breakdown, which the gate does not hold back).",
    )
    preference_shift: float | None = Field(
        default=CONTROLLER.preference_shift,
        description="Planner rule 10: merge once when the share of demand preferring a larger "
        "degree exceeds that degree's share of GPUs by this much. None: off. Reads the same "
        "per-request breakdown as merge_speedup, so it acts only when the merge gate does.",
    )
    preference_headroom: float | None = Field(
        default=CONTROLLER.preference_headroom,
        description="Planner rule 10: a preference-shift merge is admitted only while the "
        "recent peak demand is at most this × the merged pool's capacity. None: upper.",
    )
    merge_memory: int | None = Field(
        default=CONTROLLER.merge_memory,
        description="Planner rule 11: a rule-10 merge must fit the peak demand of the last this "
        "many windows under upper·capacity. None: the streak's windows only.",
    )
    long_shift: float | None = Field(
        default=CONTROLLER.long_shift,
        description="Planner rule 12: merge once when a window's long-request fraction exceeds "
        "that of the earlier windows on the same composition by this much. None: off.",
    )
    long_shift_persistence: int | None = Field(
        default=CONTROLLER.long_shift_persistence,
        description="Planner rules 12 and 15: windows a long-fraction rise (fall) must last "
        "before its merge (split). "
        "None: persistence.",
    )
    long_drop: float | None = Field(
        default=CONTROLLER.long_drop,
        description="Planner rule 15: split once when a window's long-request fraction is below "
        "that of the earlier windows on the same composition by this much. None: off.",
    )
    long_drop_z: float | None = Field(
        default=CONTROLLER.long_drop_z,
        description="Planner rule 15: the fall must also be at least this many binomial "
        "standard errors of the earlier fraction at the window's request count. None: not asked.",
    )
    long_drop_demand: float | None = Field(
        default=CONTROLLER.long_drop_demand,
        description="Planner rule 15 acts only while the window's demand is at least this "
        "fraction of the pooled capacity (≤ upper). None: at any demand.",
    )
    long_shift_by_degree: bool = Field(
        default=CONTROLLER.long_shift_by_degree,
        description="Planner rule 12: a long-share merge over the demand bound is still "
        "admitted when it lowers the worst per-degree load (demand placed at a degree over "
        "its workers' κ). Needs the windows' demand by degree (both demand_input modes).",
    )
    large_floor: int | None = Field(
        default=CONTROLLER.large_floor,
        description="Planner rule 13: a split never takes the number of larger-degree workers "
        "from at least this many to fewer unless the pool is backlogged. None: off.",
    )
    backlog_s: float | None = Field(
        default=CONTROLLER.backlog_s,
        description="Planner rule 14: the pool is backlogged when the median worker's "
        "outstanding work is at least this many seconds; then no merge, and rule 13 yields. "
        "None: never backlogged.",
    )
    adaptive: bool = Field(
        default=True,
        description="False: hold the composition, as a baseline's fixed deployment runs (the "
        "simulator's non-adaptive policies): windows are still closed and decided, for "
        "inspect, but nothing is planned. Leases and re-admission work as ever.",
    )
    kind: WorkerKind = Field(
        default=WorkerKind.CP,
        description="Kind of every worker: 'cp', or 'tp' (the vLLM-like baseline's "
        "tensor-parallel workers, named w-tp{T}-g{first}; only with adaptive false, since "
        "splits and merges are CP lattice operations).",
    )
    newest_first: bool = Field(
        default=CONTROLLER.newest_first,
        description="Planner rule 6: take first the operation whose sources joined the "
        "composition last (before the drain key).",
    )
    kappa_scale: float = Field(
        default=KAPPA_SCALE,
        gt=0,
        description="Capacity is judged with κ_C × kappa_scale (pooled capacity behind the J "
        "scheduler over single-worker κ; services/calibration.py explains the value). 1.0: κ as "
        "profiled. Unset with a profile whose κ is pooled (kappa_pooled, as `vertumnus "
        "simulate` writes it): 1.0.",
    )
    demand_input: Literal["windows", "assignments"] = Field(
        default="windows",
        description="'windows': WindowReports of the scheduler replicas; 'assignments': one "
        "RequestStats per placement on the cache-stats subject (exact, more messages).",
    )
    block_size: int = Field(
        default=DEFAULT_BLOCK_SIZE,
        ge=1,
        description="Cache block size B in tokens (the scheduler's VTM_BLOCK_SIZE). With "
        "demand_input='assignments' a request's cached part counts whole reused blocks, "
        "min(reused_blocks·B, L − 1), as the simulator and the scheduler's window reports "
        "count it for the preferred degree.",
    )
    tick_s: float = Field(
        default=1.0, gt=0, description="How often windows are closed and decided (wall clock)."
    )
    report_grace_s: float = Field(
        default=2.0,
        ge=0,
        description="A window is closed this long after its end, so the scheduler replicas' "
        "reports for it have arrived (a later one counts in the next window).",
    )
    queue_query_timeout_s: float = Field(
        default=1.0, gt=0, description="Wait for a source's QueueReport before falling back."
    )
    # Not the base setting ``drain_timeout_s`` (10 s, the NATS connection's drain at a stop),
    # which this used to override, stretching the controller's shutdown drain to 120 s.
    reconfig_drain_timeout_s: float = Field(
        default=120.0, gt=0, description="Abort a reconfiguration whose sources have not "
        "drained after this long; also how old a record left mid-reconfiguration by another "
        "controller must be before its workers are re-admitted.",
    )
    ack_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Re-announce the record (a new one, same composition) when a committed "
        "target or re-admitted worker still lacks rank acks this long after the last record: "
        "acks are plain NATS messages, and one lost would leave the worker switching.",
    )
    lease_s: float = Field(
        default=WORKER_LEASE_S,
        gt=0,
        description="Worker-state bucket TTL (must match the other services).",
    )
    follow_record: bool = Field(
        default=True,
        description="Watch the epoch record and adopt records written by another controller "
        "while idle. Off: the record is re-read only at start and after a lost "
        "compare-and-set.",
    )
    decisions_kept: int = Field(default=200, ge=1, description="Recent decisions kept.")

    @model_validator(mode="after")
    def _tp_is_fixed(self) -> ControllerSettings:
        if self.kind is WorkerKind.TP and self.adaptive:
            raise ValueError("kind 'tp' needs adaptive false: TP workers are not split or merged")
        return self

    @field_validator("kappa", mode="before")
    @classmethod
    def _kappa(cls, v: Any) -> Any:
        return json_object_text(v)

    def controller_config(self) -> ControllerConfig:
        """The core's config (raises InvalidInput on inconsistent thresholds).

        A ``controller_file`` is read here (InvalidInput naming it and the key). The same in
        both ``demand_input`` modes. In ``windows`` mode the core never judges a
        replayed assignment's preferred degree from its placeholder length (which would
        refuse every merge of a short-request window): the adapter passes the report's own
        breakdown (WindowReport version 2), or None for each request of a report without one
        — the planner treats "no breakdown" as "nothing gated".
        """
        # The file's setting (else the calibrated one, every field's default here), then each
        # threshold set explicitly (a variable or a flag) over it.
        base = (load_controller_config(self.controller_file) if self.controller_file is not None
                else CONTROLLER)
        given = {name: getattr(self, name) for name in FIELD_KINDS
                 if name in self.model_fields_set}
        try:
            return dataclasses.replace(base, **given)
        except InvalidInput as exc:
            where = f" (with {self.controller_file})" if self.controller_file is not None else ""
            raise InvalidInput(f"{exc}{where}") from None

    def lattice(self) -> Lattice:
        return Lattice(self.num_gpus, self.degrees, self.gpus_per_node)

    def load_profile(self) -> Profile:
        """The fitted profile (or the default one) with its κ per window of ``window_s`` wall
        seconds, i.e. ``window_s / time_scale`` modelled seconds (:meth:`Profile.for_window`),
        then the ``kappa`` overrides (per window too); κ not multiplied by ``kappa_scale``."""
        profile = Profile.load(self.profile_path) if self.profile_path else DEFAULT_PROFILE
        profile = profile.for_window(self.window_s / self.time_scale)
        if self.kappa:
            profile = profile.with_kappa({**profile.kappa, **self.kappa})
        return profile

    def effective_kappa_scale(self, profile: Profile) -> float:
        """``kappa_scale`` as set, or when it is not set, the profile's own answer
        (:meth:`Profile.capacity_scale`: 1 for a pooled κ, the calibrated factor otherwise)."""
        if "kappa_scale" in self.model_fields_set:
            return self.kappa_scale
        return profile.capacity_scale(self.kappa_scale)

    def judging_profile(self, profile: Profile) -> Profile:
        """``profile`` with κ_C × :meth:`effective_kappa_scale`: what the controller judges
        capacity with (the simulator does the same, sim/simulator.py ``controller_profile``).
        Only κ changes; the cost model (and so the merge gate's Ê ratios) is untouched."""
        scale = self.effective_kappa_scale(profile)
        if scale == 1.0 or not profile.kappa:
            return profile
        return profile.with_kappa({c: k * scale for c, k in profile.kappa.items()})


# -- names (built in shared/subjects.py; these keep the adapter's call sites short) ---------


def controller_group(subjects: Subjects) -> str:
    return subjects.service_group("controller")


def drain_subject(subjects: Subjects) -> str:
    """DrainNotice (the redirect message): sources stop admitting, queued work re-placed."""
    return subjects.ctl_drain()


def reconf_subject(subjects: Subjects) -> str:
    """ReconfigurationEvent at every phase change (drain and switch times when exposed)."""
    return subjects.ctl_reconf()


def composition_subject(subjects: Subjects) -> str:
    """CompositionNotice: the schedulable composition after an exposure (and at start)."""
    return subjects.ctl_composition()


def worker_queue_subject(subjects: Subjects, worker_id: str) -> str:
    """Request-reply to a worker leader: QueueQuery → QueueReport (rankd's ``queue``)."""
    return subjects.worker_queue(worker_id)


# -- messages ---------------------------------------------------------------------------------


class InspectQuery(Message):
    """Optional body of ``inspect`` (an empty body means the defaults)."""

    decisions: int = Field(default=20, ge=0, le=10_000, description="recent decisions to list")


# -- pure helpers -------------------------------------------------------------------------------


def default_composition(lattice: Lattice) -> Composition:
    """The initial composition when none is configured: of the achievable worker counts, the
    one with the most GPUs in workers of the largest degree, then of the next largest, and so
    on (ties, which cannot occur since every composition tiles all GPUs, would go to fewer
    workers); laid out by :meth:`Composition.from_counts`. Equal to
    ``Composition.uniform(lattice, max degree)`` whenever that exists; unlike it, it exists
    for every lattice (a node whose GPU count is no multiple of the largest degree, e.g. 6
    GPUs with degrees 2 and 4, has no all-largest composition). Pure."""
    degs = lattice.sorted_degrees

    def largest_first(counts: tuple[int, ...]) -> tuple[int, ...]:
        gpus = tuple(n * c for n, c in zip(counts, degs, strict=True))
        return (*reversed(gpus), -sum(counts))

    best = max(lattice.achievable_counts(), key=largest_first)
    return Composition.from_counts(lattice, dict(zip(degs, best, strict=True)))


def composition_of(record: EpochRecord, lattice: Lattice) -> Composition:
    """The lattice composition a stored record describes (raises InvalidInput if foreign)."""
    return Composition(lattice, tuple(w.group for w in record.workers))


def epoch_record(
    protocol_workers: Sequence[Any], epoch: int, now: float, reason: str,
    kind: WorkerKind = WorkerKind.CP, traceparent: str = "",
) -> EpochRecord:
    """An EpochRecord of the protocol's workers (lifecycle as the protocol has it), all of
    ``kind`` (a TP worker is named ``w-tp{T}-g{first}``; the protocol knows it by its
    group's CP name, :func:`protocol_worker_id`); ``traceparent``: the context of the span
    writing it, if any (EpochRecord)."""
    return EpochRecord(
        epoch=epoch,
        workers=[
            EpochWorker(
                worker_id=(w.worker_id if kind is WorkerKind.CP
                           else tp_worker_name(w.group.degree, w.group.first_gpu)),
                kind=kind,
                first_gpu=w.group.first_gpu,
                degree=w.group.degree,
                lifecycle=w.state,
            )
            for w in protocol_workers
        ],
        committed_at_s=now,
        reason=reason[:500],
        traceparent=traceparent,
    )


def protocol_worker_id(worker_id: str) -> WorkerId:
    """The id the epoch protocol knows a worker by: its lattice group's CP name (a TP
    worker's ``w-tp4-g0`` is ``w-cp4-g0``); an id that names no group is returned as is."""
    try:
        return GpuGroup.from_worker_id(worker_id).worker_id
    except InvalidInput:
        return WorkerId(worker_id)


def replay_report(
    report: WindowReport, long_len: int, *, with_preferred: bool = False
) -> list[tuple[float, float, int, int | None, int | None]]:
    """A WindowReport as ``(time, predicted_s, input_len, preferred, degree)`` assignments for
    ``core.assigned``: ``requests`` of them at the window's middle, the first
    ``long_requests`` long (``long_len`` tokens, the others 1).

    The replayed window has the report's D(k), request count and long count, its demand by
    placed degree (when the report gives one) and, with ``with_preferred`` (the report's rule
    is the controller's), its demand by preferred degree -- each exact. D(k) is laid out as
    one line cut by both breakdowns (the preferred buckets, then demand with no preference;
    the degrees ascending, then demand with no degree): each piece is one assignment, and
    the requests left over carry no demand. Should the pieces outnumber the requests (a
    window of a few requests), the degree breakdown is left out, as is the preferred one
    without ``with_preferred``. Pure."""
    n = report.requests
    if n == 0:
        return []
    t = report.window_start_s + report.window_s / 2.0
    total = report.demand_s
    pref = (sorted(report.demand_by_preferred.items())
            if with_preferred and report.demand_by_preferred else [])
    pieces = _cut(total, pref, sorted(report.demand_by_degree.items()))
    if len(pieces) > n:
        pieces = _cut(total, pref, [])
    if len(pieces) > n:  # every request is in a preferred bucket: the rest is rounding
        s_last, p_last, _ = pieces[n - 1]
        pieces = [*pieces[: n - 1], (s_last + sum(s for s, _, _ in pieces[n:]), p_last, None)]
    out = pieces + [(0.0, None, None)] * (n - len(pieces))
    return [
        (t, s, long_len if i < report.long_requests else 1, p, c)
        for i, (s, p, c) in enumerate(out)
    ]


def _cut(
    total: float, pref: list[tuple[int, float]], deg: list[tuple[int, float]]
) -> list[tuple[float, int | None, int | None]]:
    """[0, total) cut by two breakdowns (label, amount), each followed by a None remainder:
    the pieces (amount, preferred, degree), in order. A sliver a breakdown's rounding makes
    (at most 1e-9 of D(k)) joins the next piece, and the last piece takes what rounding
    leaves, so the amounts sum to ``total``."""
    tol = 1e-9 * (1.0 + total)

    def bounds(parts: list[tuple[int, float]]) -> list[tuple[float, int | None]]:
        out: list[tuple[float, int | None]] = []
        acc = 0.0
        for label, v in parts:
            acc += v
            out.append((min(acc, total), label))
        out.append((total, None))
        return out

    a, b = bounds(pref), bounds(deg)
    pieces: list[tuple[float, int | None, int | None]] = []
    pos, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        end = min(a[i][0], b[j][0])
        if end - pos > tol:
            pieces.append((end - pos, a[i][1], b[j][1]))
            pos = end
        if a[i][0] <= end:
            i += 1
        if b[j][0] <= end:
            j += 1
    if not pieces and total > 0:
        pieces.append((total, None, None))
    if pieces:  # rounding: the amounts must add up to D(k)
        s0, p0, c0 = pieces[-1]
        pieces[-1] = (s0 + (total - sum(s for s, _, _ in pieces)), p0, c0)
    return pieces


def report_problem(report: WindowReport, now: float, window_s: float) -> str | None:
    """Why ``report`` cannot be replayed (:func:`replay_report`) at ``now`` by a controller
    with windows of ``window_s``, or None. Pure.

    * Its window's middle (the replay instant) lies more than one window after ``now``: the
      demand windows would jump there, closing every window in between with D = 0, and stay
      there (they never go backwards) while real reports count as late.
    * More than :data:`MAX_REPORT_REQUESTS` requests: replayed one assignment each.
    * A window so short that its index ``window_start_s / window_s`` is not finite."""
    if report.requests > MAX_REPORT_REQUESTS:
        return f"{report.requests} requests in one window, over {MAX_REPORT_REQUESTS}"
    if not math.isfinite(report.window_start_s / report.window_s):
        return f"window index of start {report.window_start_s} / {report.window_s} s overflows"
    mid = report.window_start_s + report.window_s / 2.0
    if mid > now + window_s:
        return f"window starting at {report.window_start_s} lies in the future (now {now})"
    return None


def report_rule_matches(report: WindowReport, merge_speedup: float | None,
                        degrees: Sequence[int]) -> bool:
    """Whether the report's preferred-degree breakdown was made with the controller's rule
    (same threshold, same degree set): only then may the merge gate read it."""
    if merge_speedup is None or report.preferred_speedup is None:
        return False
    return (
        math.isclose(report.preferred_speedup, merge_speedup, rel_tol=1e-9)
        and list(report.preferred_degrees) == sorted(set(degrees))
    )


def decision_dict(d: Decision) -> dict[str, Any]:
    return {
        "window": d.window.index,
        "window_start_s": d.window.start_s,
        "demand_s": d.window.demand_s,
        "requests": d.window.requests,
        "long_requests": d.window.long_requests,
        "capacity_s": d.capacity_s,
        "capacity_signal": d.capacity_signal.value if d.capacity_signal else None,
        "fraction_signal": d.fraction_signal.value if d.fraction_signal else None,
        "direction": d.direction.value if d.direction else None,
        "trigger": d.trigger,
        "streak": d.streak,
        "composition": d.composition,
        "reason": d.reason,
        "plan": d.plan.to_dict() if d.plan is not None else None,
        "plans": [p.to_dict() for p in d.plans],
    }


# -- the service --------------------------------------------------------------------------------


def reconcile_traffic(states: Mapping[str, WorkerState],
                      composition: Composition) -> dict[WorkerId, float]:
    """The planner's reconciliation-traffic estimate (§6.2's tie-break between operations of
    equal drain): each worker of ``composition`` → the blocks its prefix cache holds, as its
    last WorkerState reported them (a worker that reported none is absent: 0). What the
    simulator passes (the blocks the prefix trie shows each source holding)."""
    return {WorkerId(w): float(st.kv_cached_blocks) for w, st in states.items()
            if st.kv_cached_blocks is not None and w in composition}


def boundary_drain(snapshot: tuple[float, Mapping[WorkerId, float]] | None, t: float,
                   window_s: float, current: dict[WorkerId, float],
                   composition: Container[str]) -> dict[WorkerId, float]:
    """The outstanding work per worker that windows closed up to ``t`` are decided with:
    ``snapshot`` (taken at a window boundary) when that boundary is the end of the last of
    them (``floor(t / window_s) * window_s``) and it names only workers of ``composition``,
    else ``current``. Why: the report grace makes the live controller decide a window some
    time after it ended; the simulator decides it at its end, with the queues of that
    instant, and rule 14's backlog gate was calibrated there (a burst in the grace seconds
    made the live pool refuse a merge the simulator made: docs/evaluation.md "The simulator
    against the live stack"). A worker added or removed since (a reconfiguration) makes the
    snapshot stale: ``current`` then."""
    if snapshot is None:
        return current
    at, drain = snapshot
    if at != math.floor(t / window_s) * window_s or any(w not in composition for w in drain) \
            or len(drain) != len(current):
        return current
    return dict(drain)


class LostLeadership(VertumnusError):
    """Our compare-and-set on the epoch record failed: another controller wrote first."""


class UnreadableRecord(VertumnusError):
    """The epoch key holds a value that is no record of this pool: it does not decode, or its
    workers are no composition of the lattice. ``revision`` is that value's (to write over
    it by compare-and-set), ``epoch`` its epoch if it decoded."""

    def __init__(self, revision: int, epoch: int | None, error: str) -> None:
        super().__init__(f"unreadable epoch record at revision {revision}: {error}")
        self.revision = revision
        self.epoch = epoch
        self.error = error


class ControllerService(MicroService):
    """The live controller. Construct, then ``await run()`` (or ``start(stack)`` in tests)."""

    def __init__(
        self,
        settings: ControllerSettings,
        *,
        profile: Profile | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.instance = settings.instance_id or f"ctl-{uuid.uuid4().hex[:8]}"
        validate_token(self.instance, what="controller instance id")
        super().__init__(
            settings,
            name=micro_service_name("controller"),
            version=VERSION,
            group=controller_group(settings.subjects),
            description="vertumnus reconfiguration controller",
            metadata={"instance": self.instance, "epoch": "0"},
        )
        self.csettings = settings
        self._clock = clock
        self._last_now = 0.0
        self.lattice = settings.lattice()
        # κ as profiled (or passed) × kappa_scale: the planner's capacity (module doc).
        loaded = profile if profile is not None else settings.load_profile()
        self.kappa_scale = settings.effective_kappa_scale(loaded)
        self.profile = settings.judging_profile(loaded)
        self.config = settings.controller_config()
        self.core: ControllerCore | None = None
        self.metrics = PoolMetrics(
            lambda: None if self.core is None else self.core.protocol.composition.counts())
        self.record: EpochRecord | None = None
        self.revision: int = 0
        self._kv: KeyValue | None = None
        self._state_kv: KeyValue | None = None
        self._lock = asyncio.Lock()
        # Adapter books: protocol epoch -> record epoch of its commit; per reconfiguration the
        # drain record epoch and the in-flight ids still awaited per source.
        self._commit_epoch: dict[int, int] = {}
        self._drain_epoch: dict[int, int] = {}
        self._awaiting: dict[int, dict[WorkerId, set[RequestId]]] = {}
        # A source's results seen while it has not shown that it stopped admitting (its
        # STOP_MARKER awaited), by (reconfiguration, source): the queue asked once it stopped
        # may still list them (_confirm_stopped). Only that short while, so a few ids.
        self._done_unconfirmed: dict[tuple[int, WorkerId], set[RequestId]] = {}
        # (reconfiguration, source) -> its _confirm_stopped task while one runs.
        self._confirming: dict[tuple[int, WorkerId], asyncio.Task[None]] = {}
        self._states: dict[str, WorkerState] = {}
        # Worker id -> record epoch of the commit that (last) created a worker of that id. A
        # state of an earlier epoch is its predecessor's (merged back, split back): never the
        # new worker's heartbeat. Keys expire by TTL, which the state watch is never told, so
        # the predecessor's last state would otherwise linger in _states. Bounded by the
        # lattice's groups.
        self._created: dict[WorkerId, int] = {}
        self._decisions: deque[dict[str, Any]] = deque(maxlen=settings.decisions_kept)
        # One trace per operation (services/controller/tracing.py), by reconfiguration id.
        self._traces = ReconfTraces()
        self._floor = 0.0  # latest instant fed to the windows (they never go backwards)
        # The workers' outstanding work as it stood at the latest window boundary (first tick
        # after it): (boundary, drain). The window that ends there is decided report_grace_s
        # later, with this, as the simulator decides it with the queues at the boundary.
        self._boundary_drain: tuple[float, dict[WorkerId, float]] | None = None
        self._reported_until = 0.0  # end of the latest window some replica reported
        # (reporter, window number since the epoch) of the reports counted, oldest first and
        # bounded: each scheduler replica sends every report twice (services/scheduler).
        self._seen_reports: dict[tuple[str, int], None] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._ahead: asyncio.Task[None] | None = None  # _rebuild_from_workers, while pending
        self.counters: dict[str, int] = {
            "reports": 0,
            "duplicate_reports": 0,
            "assignments": 0,
            "malformed": 0,
            "plans": 0,
            "records_written": 0,
            "records_rewritten": 0,  # the record written again after the store lost it
            "records_repaired": 0,  # ours written over a value that was no record of ours
            "rebuilt_from_workers": 0,  # the record made from the workers' states (store lost)
            "cas_lost": 0,
            "rebuilt": 0,
            "followed": 0,
            "acks": 0,
            "acks_ignored": 0,
            "acks_rejected": 0,
            "drain_acks": 0,  # a draining source's acks of its drain record (it stopped)
            "drains_confirmed": 0,  # sources whose work left was asked once they stopped
            "finished": 0,
            "aborted": 0,
            "reannounced": 0,
            "exposed": 0,
            "failed": 0,
            "recovered": 0,
            "readmitted": 0,
            "errors": 0,
            "stale_states": 0,  # states of a worker id's earlier incarnation, ignored
            "drains_abandoned": 0,  # operations undone: their drain record did not write
            "breakdown_mismatch": 0,  # reports whose preferred-degree rule is not ours
        }

    # -- clock ------------------------------------------------------------------------------

    def now(self) -> float:
        """Wall clock, never going backwards (the protocol refuses time travel)."""
        self._last_now = max(self._last_now, self._clock())
        return self._last_now

    def _window_origin(self) -> float:
        """Start of the current window on the grid of multiples of H since the Unix epoch
        (the scheduler replicas' grid), so window k means the same interval everywhere; the
        windows core refuses to close millions of windows at once, hence not 0."""
        h = self.config.window_s
        return math.floor(self.now() / h) * h

    # -- endpoints --------------------------------------------------------------------------

    def endpoints(self) -> Sequence[Endpoint]:
        return [Endpoint("inspect", self._on_inspect)]

    async def _on_inspect(self, request: Request) -> bytes:
        query: InspectQuery = optional_request_model(request, InspectQuery)
        return json.dumps(self.inspect(query.decisions)).encode()

    def inspect(self, decisions: int = 20) -> dict[str, Any]:
        """What ``inspect`` answers (also handy in-process)."""
        core = self.core
        body: dict[str, Any] = {
            "instance": self.instance,
            "record_epoch": self.record.epoch if self.record else None,
            "revision": self.revision,
            "reported_until_s": self._reported_until,
            "counters": dict(self.counters),
        }
        if core is None:
            return body
        proto = core.protocol
        body.update(
            {
                "composition": proto.composition.describe(),
                "protocol_epoch": proto.epoch,
                "workers": [
                    {
                        "worker_id": w.worker_id,
                        "degree": w.group.degree,
                        "first_gpu": w.group.first_gpu,
                        "state": w.state.value,
                        "epoch": w.epoch,
                        "reconfiguration": w.reconfiguration,
                    }
                    for w in proto.workers()
                ],
                "schedulable": list(proto.schedulable()),
                "in_progress": [proto.reconfiguration(r).to_dict() for r in proto.in_progress()],
                "reconfigurations": [r.to_dict() for r in proto.history()],
                "pending_plan": core.pending_plan.to_dict() if core.pending_plan else None,
                "pending_plans": [p.to_dict() for p in core.pending_plans],
                "config": dataclasses.asdict(self.config),
                "kappa_scale": self.kappa_scale,
                "kappa": {str(c): k for c, k in self.profile.kappa.items()},
                "open_window": {
                    "index": core.windows.open_index,
                    "start_s": core.windows.open_start_s,
                    "demand_s": core.windows.open_demand_s,
                    # D of the open window by the requests' preferred degree (the merge
                    # gate's breakdown so far); empty with the gate off.
                    "demand_by_preferred_s": {
                        str(c): d for c, d in core.windows.open_demand_by_preferred_s.items()},
                },
                "decisions": list(self._decisions)[-decisions:] if decisions else [],
            }
        )
        return body

    # -- setup ------------------------------------------------------------------------------

    async def ensure_jetstream(self) -> None:
        """The epoch and worker-state buckets; and the epoch record, if this controller has
        one and the store has none (lost with the server's store: the rank hosts and every
        service follow the record, so the current one is written again)."""
        s = self.subjects
        js = self.jetstream()
        self._kv = await epoch_kv(js, s)
        self._state_kv = await worker_state_kv(js, s, lease_s=self.csettings.lease_s)
        if self.record is None:
            return  # before _bootstrap
        async with self._lock:
            try:
                if await self._get_record() is not None:
                    return
            except UnreadableRecord as bad:
                with contextlib.suppress(LostLeadership):
                    await self._repair(bad)
                return
            try:
                self.revision = await self._kv.create(s.epoch_key(), to_json(self.record))
            except KeyWrongLastSequenceError:
                return  # another controller wrote one first: our next CAS finds it
            self.counters["records_rewritten"] += 1
            self.log.warning("epoch record missing from the store; written again",
                             epoch=self.record.epoch, revision=self.revision)

    async def setup(self, stack: AsyncExitStack) -> None:
        s = self.subjects
        # The thresholds this controller decides by, once (a controller file and the variables
        # over it are easy to get wrong; the log says what was taken).
        self.log.info("planner thresholds", controller_file=(
            None if self.csettings.controller_file is None
            else str(self.csettings.controller_file)), **config_to_mapping(self.config))
        await self.ensure_jetstream()
        await self._bootstrap()
        states = self._state_kv
        assert states is not None
        state_watch = await KvWatch(self.nc, states).start()  # survives a server restart
        subs = []
        if self.csettings.demand_input == "windows":
            # One subscription for reports and their copies, so a copy is handled in order
            # with the report after it (NATS orders one subscription's messages per sender).
            subs.append(await self.nc.subscribe(s.window_demand_with_copies(),
                                                cb=self._on_report))
        else:
            subs.append(await self.nc.subscribe(s.cache_stats_all(), cb=self._on_assignment))
        subs.append(await self.nc.subscribe(s.epoch_ack_all(), cb=self._on_ack))
        subs.append(await self.nc.subscribe(s.result_all(), cb=self._on_result))
        watchers: list[Any] = [state_watch]
        self._tasks = [
            asyncio.create_task(self._watch_states(state_watch), name="ctl-states"),
            asyncio.create_task(self._ticker(), name="ctl-ticker"),
        ]
        if self.csettings.follow_record:
            rec_watch = await KvWatch(self.nc, self._kv, s.epoch_key()).start()
            watchers.append(rec_watch)
            self._tasks.append(
                asyncio.create_task(self._watch_record(rec_watch), name="ctl-record")
            )

        async def teardown() -> None:
            await self.stop_listening([*self._tasks, *self._confirming.values()], watchers, subs)
            # Ended, so that they are exported: a trace left open is never seen.
            self._traces.fail_all("the controller stopped before the reconfiguration ended",
                                  outcome="interrupted")

        stack.push_async_callback(teardown)

    async def _bootstrap(self) -> None:
        """Resume from the stored record, or write the initial one (create = CAS on absence)."""
        assert self._kv is not None
        key = self.subjects.epoch_key()
        replace: UnreadableRecord | None = None
        try:
            entry = await self._get_record()
        except UnreadableRecord as bad:
            entry, replace = None, bad
        if entry is None:
            comp = (
                Composition.parse(self.lattice, self.csettings.initial_composition)
                if self.csettings.initial_composition
                else default_composition(self.lattice)
            )
            # Over an unreadable value: above its epoch, if it has one (ranks may hold it).
            epoch = 0 if replace is None or replace.epoch is None else replace.epoch + 1
            core = ControllerCore(
                comp, self.profile, self.config, start_s=self._window_origin(), epoch=epoch
            )
            rec = epoch_record(core.protocol.workers(), epoch, self.now(),
                               "initial composition", self.csettings.kind)
            try:
                if replace is None:
                    self.revision = await self._kv.create(key, to_json(rec))
                else:
                    self.revision = await self._kv.update(key, to_json(rec),
                                                          last=replace.revision)
                    self.counters["records_repaired"] += 1
                    self.log.error("epoch record unreadable; initial record written over it",
                                   error=replace.error, epoch=epoch)
                self.core, self.record = core, rec
                self._commit_epoch = {epoch: epoch}
                self.counters["records_written"] += 1
                self.log.info("initial epoch record written", composition=comp.describe())
                await self._publish_composition()
                return
            except KeyWrongLastSequenceError:
                entry = await self._get_record()  # another controller created it first
                if entry is None:
                    raise
        record, revision = entry
        self._rebuild(record, revision)

    async def _readmit_leftovers(self) -> None:
        """Workers the stored record shows draining or switching while our protocol has
        them active were left so by another controller (unavailable ones are unavailable in
        a rebuilt protocol too, and come back by heartbeating). Once that record is
        older than ``reconfig_drain_timeout_s`` (its writer stopped mid-reconfiguration; a live
        one rewrites the record at least that often), each is failed and re-admitted through
        the protocol's recovery path: exposed again only after its ranks acknowledge a fresh
        epoch (lock held; called from the tick, so acks are subscribed by then)."""
        core, record = self.core, self.record
        if core is None or record is None or core.pending_plan or core.protocol.in_progress():
            return
        proto = core.protocol
        # The record names workers as the ranks do (``w-tp4-g0``), the protocol by CP name.
        leftovers = [
            pid
            for pid, w in ((self._pid(w.worker_id), w) for w in record.workers)
            if w.lifecycle is not Lifecycle.ACTIVE
            # An UNAVAILABLE worker is the rebuilt protocol's too (_rebuild): it comes back
            # only by heartbeating (_maybe_recover), never by this path.
            and w.lifecycle is not Lifecycle.UNAVAILABLE
            and pid in proto.composition
            and proto.state(pid) is Lifecycle.ACTIVE
        ]
        now = self.now()
        if not leftovers or now - record.committed_at_s < self.csettings.reconfig_drain_timeout_s:
            return
        for wid in leftovers:
            proto.fail(WorkerId(wid), now)
            proto.recover(WorkerId(wid), now)
        self.counters["readmitted"] += len(leftovers)
        self.log.warning("re-admitting workers left mid-reconfiguration", workers=leftovers)
        await self._write_readmission(leftovers)

    async def _write_readmission(self, workers: Sequence[str]) -> None:
        """Record for recovered (switching) workers; remember its epoch for their acks."""
        assert self.core is not None
        record = self._next_record(f"re-admit {', '.join(workers)}")
        try:
            await self._write(record)
        except LostLeadership:
            return
        proto = self.core.protocol
        for wid in workers:
            self._commit_epoch[proto.worker(WorkerId(wid)).epoch] = record.epoch

    async def _get_record(self) -> tuple[EpochRecord, int] | None:
        assert self._kv is not None
        try:
            entry = await self._kv.get(self.subjects.epoch_key())
        except (KeyNotFoundError, NotFoundError):
            return None
        if entry.value is None or not entry.value:
            return None
        return self._readable(entry.value, int(entry.revision or 0))

    def _readable(self, value: bytes, revision: int) -> tuple[EpochRecord, int]:
        """The record in a stored value, checked against the lattice; raises
        :class:`UnreadableRecord`."""
        try:
            record = decode(EpochRecord, value)
        except SchemaError as exc:
            raise UnreadableRecord(revision, None, str(exc)) from None
        try:
            composition_of(record, self.lattice)
        except VertumnusError as exc:
            raise UnreadableRecord(revision, record.epoch, str(exc)) from None
        return record, revision

    async def _repair(self, bad: UnreadableRecord) -> None:
        """Write our record over an unreadable value (lock held; see the module docstring):
        our protocol's workers, at an epoch above ours and the value's. Another write first
        -> :class:`LostLeadership`, after rebuilding from it if it is a record (else the
        next write or watch event tries again)."""
        assert self._kv is not None and self.core is not None and self.record is not None
        epoch = max(self.record.epoch, -1 if bad.epoch is None else bad.epoch) + 1
        record = epoch_record(self.core.protocol.workers(), epoch, self.now(),
                              "written over an unreadable record", self.csettings.kind)
        self.log.error("epoch record unreadable; ours written over it", error=bad.error,
                       revision=bad.revision, epoch=epoch)
        await self._cas(record, bad.revision, repairing=True)
        self.counters["records_repaired"] += 1

    def _rebuild(self, record: EpochRecord, revision: int) -> None:
        """A fresh core from a stored record (start, lost leadership, or following).

        Every worker starts ACTIVE at the record's epoch except those the record shows
        UNAVAILABLE: they stay unavailable (not schedulable, no capacity, never a plan's
        source) until they heartbeat again (:meth:`_maybe_recover`), as the module doc
        promises; made ACTIVE, a dead worker would be written back as active and re-admitted
        without a heartbeat. Workers the record shows draining or switching start ACTIVE:
        :meth:`_readmit_leftovers` deals with them."""
        comp = composition_of(record, self.lattice)
        self.core = ControllerCore(
            comp,
            self.profile,
            self.config,
            start_s=self._window_origin(),
            epoch=record.epoch,
            acknowledged=True,
        )
        now = self.now()
        for w in record.workers:
            if w.lifecycle is Lifecycle.UNAVAILABLE:
                # By its group (the protocol's name), whatever the record calls it.
                self.core.protocol.fail(w.group.worker_id, now)
        # Creation epochs above the record's belong to records that never became the stored
        # one (a lost compare-and-set, a store lost with the server's): forgotten.
        self._created = {w: e for w, e in self._created.items() if e <= record.epoch}
        self.record, self.revision = record, revision
        self._commit_epoch = {record.epoch: record.epoch}
        self._drain_epoch.clear()
        self._awaiting.clear()
        # Reconfiguration ids start over with the new core: a confirmation of the old one's
        # must not settle a new one of the same id (each also checks its core).
        self._done_unconfirmed.clear()
        for task in self._confirming.values():
            task.cancel()
        self._confirming.clear()
        self._floor = 0.0
        # The old core's reconfigurations are forgotten with it (lost leadership, a record
        # followed or rebuilt from the workers): their traces end here, as failed.
        self._traces.fail_all(f"core rebuilt from the stored record of epoch {record.epoch}: "
                              "reconfiguration abandoned", outcome="abandoned")
        self.set_metadata(epoch=str(record.epoch), composition=comp.describe())
        self.log.info(
            "core built from stored record",
            epoch=record.epoch,
            revision=revision,
            composition=comp.describe(),
        )

    # -- record writes (compare-and-set) ------------------------------------------------------

    async def _write(self, record: EpochRecord) -> None:
        """CAS the record on our revision; on loss rebuild from the store and raise."""
        await self._cas(record, self.revision)

    async def _cas(self, record: EpochRecord, last: int, *, repairing: bool = False) -> None:
        """Write ``record`` by compare-and-set on revision ``last``. Another write first ->
        count it, rebuild the core from what the store holds and raise LostLeadership; a
        value there that is no record is written over first (:meth:`_repair`), unless this
        write was that repair (then the next write or watch event tries again)."""
        assert self._kv is not None
        try:
            self.revision = await self._kv.update(
                self.subjects.epoch_key(), to_json(record), last=last
            )
        except KeyWrongLastSequenceError:
            self.counters["cas_lost"] += 1
            self.log.warning(
                "lost the epoch compare-and-set: another controller wrote first",
                attempted_epoch=record.epoch,
                revision=last,
            )
            stored: tuple[EpochRecord, int] | None
            try:
                stored = await self._get_record()
            except UnreadableRecord as bad:
                if repairing:
                    raise LostLeadership(f"epoch {record.epoch} was taken by another "
                                         "writer") from None
                # Nobody's decision: ours goes over it, and the core restarts from it (the
                # write this was is abandoned, as after a lost compare-and-set).
                await self._repair(bad)
                assert self.record is not None
                stored = (self.record, self.revision)
            if stored is not None:
                self._rebuild(*stored)
                self.counters["rebuilt"] += 1
            raise LostLeadership(f"epoch {record.epoch} was taken by another writer") from None
        self.record = record
        self.counters["records_written"] += 1
        self.set_metadata(epoch=str(record.epoch))

    def _next_record(self, reason: str, traceparent: str = "") -> EpochRecord:
        assert self.core is not None and self.record is not None
        return epoch_record(self.core.protocol.workers(), self.record.epoch + 1, self.now(),
                            reason, self.csettings.kind, traceparent)

    # -- inputs -----------------------------------------------------------------------------

    async def _on_report(self, msg: Msg) -> None:
        try:
            report = decode(WindowReport, msg.data, msg.headers)
        except SchemaError as exc:
            self.counters["malformed"] += 1
            self.log.warning("malformed window report ignored", error=str(exc))
            return
        problem = report_problem(report, self.now(), self.config.window_s)
        if problem is not None:
            self.counters["malformed"] += 1
            self.log.warning("window report rejected", reporter=report.reporter, error=problem)
            return
        key = (report.reporter, round(report.window_start_s / report.window_s))
        if key in self._seen_reports:
            self.counters["duplicate_reports"] += 1
            return
        self._seen_reports[key] = None
        if len(self._seen_reports) > _SEEN_REPORTS_KEPT:
            del self._seen_reports[next(iter(self._seen_reports))]
        self.counters["reports"] += 1
        self._reported_until = max(self._reported_until, report.window_start_s + report.window_s)
        use = report_rule_matches(report, self.config.merge_speedup, self.csettings.degrees)
        if not use and report.preferred_speedup is not None and self.config.merge_speedup:
            self.counters["breakdown_mismatch"] += 1
            self.log.warning(
                "window report's preferred-degree rule differs from ours; breakdown ignored",
                reporter=report.reporter, speedup=report.preferred_speedup,
                degrees=report.preferred_degrees, ours=self.config.merge_speedup)
        replay = replay_report(report, self.config.long_threshold_tokens, with_preferred=use)
        for t, s, n, preferred, degree in replay:
            self._assigned(t, s, n, degree, preferred=preferred)

    async def _on_assignment(self, msg: Msg) -> None:
        try:
            st = decode(RequestStats, msg.data, msg.headers)
        except SchemaError as exc:
            self.counters["malformed"] += 1
            self.log.warning("malformed request stats ignored", error=str(exc))
            return
        if st.at_s > self.now() + self.config.window_s:  # as in report_problem
            self.counters["malformed"] += 1
            self.log.warning("request stats rejected: stamped in the future",
                             request_id=st.request_id, at_s=st.at_s)
            return
        # The cached part the preferred degree is judged on: the chosen worker's reused
        # blocks, whole (request_preferred_degree caps it at L − 1), as the simulator feeds
        # its controller core and the scheduler's window reports count it. Not prefix_tokens:
        # a fully cached request has P = L − 1 (R = 1, no degree faster than another), where
        # whole blocks leave its last block to compute.
        self._assigned(st.at_s, st.predicted_s, st.input_len, st.degree,
                       st.reused_blocks * self.csettings.block_size)

    def _assigned(
        self, t: float, s: float, n: int, degree: int | None, cached_tokens: int = 0,
        *, preferred: int | None | Literal[FromProfile.TOKEN] = FROM_PROFILE,
    ) -> None:
        if self.core is None:
            return
        try:
            self.core.assigned(t, s, n, degree, cached_tokens, preferred=preferred)
        except InvalidInput as exc:
            self.counters["malformed"] += 1
            self.log.warning("demand rejected", error=str(exc))
            return
        self.counters["assignments"] += 1
        self._floor = max(self._floor, t)

    async def _watch_states(self, watcher: Any) -> None:
        async for key, state in worker_state_changes(watcher, self.log, self.counters):
            if state is None:
                self._states.pop(self._pid(key), None)
                continue
            if self._predecessor_state(state):
                # e.g. a stopping earlier instance's last word, or the watch's replay of a
                # key that has not expired yet after a reconnect.
                self.counters["stale_states"] += 1
                continue
            self._states[self._pid(state.worker_id)] = state
            try:
                self._note_workers_ahead(state)
                await self._state_drained(state)
                await self._maybe_recover(state)
            except _WRITE_ERRORS as exc:
                # A record write JetStream could not take (a server restart, a leader
                # change): the tick resumes what it left undone (_resume_stalled); the
                # watch must go on, or no heartbeat is seen again and every lease runs out.
                self.counters["errors"] += 1
                self.log.error("worker state not acted on", worker=state.worker_id,
                               error=repr(exc))

    def _note_workers_ahead(self, state: WorkerState) -> None:
        """A live worker at an epoch above our record's: the server lost its store, and the
        record with it, while the workers ran on, and this controller (started after the loss)
        wrote its initial record, which they ignore as older. Their composition is the real
        one: :meth:`_rebuild_from_workers` takes it, once the states have settled."""
        rec = self.record
        if rec is None or state.epoch <= rec.epoch or self._ahead is not None \
                or self.now() - state.heartbeat_s > self.csettings.lease_s:
            return
        self._ahead = asyncio.create_task(self._rebuild_from_workers(), name="ctl-ahead")
        self._tasks.append(self._ahead)

    async def _rebuild_from_workers(self) -> None:
        """After ``WORKERS_SETTLE_S`` (every worker publishes its state again after a loss,
        one by one: a record naming only some of them would make the others leave), write a
        record of every live ACTIVE worker's group at an epoch above all of theirs (CAS on our
        revision) and rebuild the core from it, dropping any plan made from the initial
        composition. Workers that are not ACTIVE (mid-reconfiguration when the store went)
        are left out: they leave, and the planner sees the GPUs they free."""
        try:
            await asyncio.sleep(WORKERS_SETTLE_S)
            async with self._lock:
                rec = self.record
                now = self.now()
                live = sorted((st for st in self._states.values()
                               if now - st.heartbeat_s <= self.csettings.lease_s),
                              key=lambda st: st.gpus[0])
                top = max((st.epoch for st in live), default=-1)
                if rec is None or top <= rec.epoch:
                    return
                new = EpochRecord(
                    epoch=top + 1,
                    workers=[EpochWorker(worker_id=st.worker_id, kind=st.kind,
                                         first_gpu=st.gpus[0], degree=st.degree,
                                         lifecycle=Lifecycle.ACTIVE)
                             for st in live if st.lifecycle is Lifecycle.ACTIVE],
                    committed_at_s=now,
                    reason="rebuilt from the workers' states: the store lost the record",
                )
                try:
                    composition_of(new, self.lattice)
                except VertumnusError as exc:
                    self.log.error("workers ahead of the epoch record, but their groups are "
                                   "no composition of this lattice; record kept",
                                   error=str(exc), record_epoch=rec.epoch, workers_epoch=top)
                    return
                await self._write(new)
                self._rebuild(new, self.revision)
                self.counters["rebuilt_from_workers"] += 1
                self.log.warning("workers ahead of the epoch record (the store lost it): record "
                                 "rebuilt from their states", epoch=new.epoch,
                                 workers=[w.worker_id for w in new.workers])
                await self._publish_composition()
        except LostLeadership:
            pass  # another controller wrote first; our core follows its record
        finally:
            self._ahead = None

    def _predecessor_state(self, state: WorkerState) -> bool:
        """Whether ``state`` was published by an earlier worker of the same id than the one
        the latest commit creating that id made: its epoch is below that commit record's
        (a rank daemon starts at the record that creates its worker, and states carry the
        record epoch its worker adopted). Judged by epochs, not clocks."""
        created = self._created.get(self._pid(state.worker_id))
        return created is not None and state.epoch < created

    def _pid(self, worker_id: str) -> WorkerId:
        """The protocol's id of a worker named ``worker_id`` by its rank daemon."""
        if self.csettings.kind is WorkerKind.CP:
            return WorkerId(worker_id)
        return protocol_worker_id(worker_id)

    async def _state_drained(self, state: WorkerState) -> None:
        """A draining source whose state (under the drain record: it stopped admitting)
        shows nothing left; one that shows work left has its queue asked again
        (:meth:`_confirm_stopped`), unless that was done."""
        if state.lifecycle is Lifecycle.ACTIVE:
            return
        wid = self._pid(state.worker_id)
        async with self._lock:
            for rid, per_worker in list(self._awaiting.items()):
                left = per_worker.get(wid)
                if not left or state.epoch < self._drain_epoch.get(rid, 0):
                    continue
                if state.queue_len > 0:
                    if STOP_MARKER in left:
                        self._confirm(rid, wid)
                    continue
                for req in list(left):
                    await self._finished(wid, req)

    async def _maybe_recover(self, state: WorkerState) -> None:
        """A failed worker heartbeats again: re-admit it under a fresh epoch."""
        if self.now() - state.heartbeat_s > self.csettings.lease_s:
            return
        async with self._lock:
            core = self.core
            wid = self._pid(state.worker_id)
            if core is None or wid not in core.protocol.composition:
                return
            if core.protocol.state(wid) is not Lifecycle.UNAVAILABLE:
                return
            core.protocol.recover(wid, self.now())
            self.counters["recovered"] += 1
            self.log.info("worker re-admitted", worker=wid)
            await self._write_readmission([wid])

    async def _check_leases(self) -> None:
        """Workers whose last state is older than the lease fail (lock held). A worker that
        never published a state is not judged (it may not run a state publisher)."""
        core = self.core
        assert core is not None
        proto = core.protocol
        now = self.now()
        failed: list[str] = []
        for w in proto.workers():
            st = self._states.get(w.worker_id)
            if st is None or w.state is Lifecycle.UNAVAILABLE:
                continue
            if self._predecessor_state(st):
                # A target created by a commit has not published yet: the state is its
                # predecessor's (same id), whose heartbeat says nothing about it (§6.2: a
                # target becomes schedulable once its ranks acknowledge; it never starts
                # UNAVAILABLE). Not judged, as a worker that never published.
                continue
            if now - st.heartbeat_s <= self.csettings.lease_s:
                continue
            part_of = w.reconfiguration
            res = proto.fail(w.worker_id, now)
            failed.append(w.worker_id)
            self.counters["failed"] += 1
            self.log.warning("worker lease expired", worker=w.worker_id)
            if res.aborted is not None:
                self._end_awaiting(res.aborted)
                self.counters["aborted"] += 1
                await self._publish_reconf(proto.reconfiguration(res.aborted))
                with self._traces.current(res.aborted):
                    self.log.warning("reconfiguration aborted: a source failed",
                                     worker=w.worker_id)
                self._traces.failed(res.aborted,
                                    f"source {w.worker_id} failed: its lease expired",
                                    outcome="aborted")
            elif part_of is not None:  # a committed one goes on without this target
                self._traces.event(part_of, "target failed",
                                   **{"vtm.worker_id": str(w.worker_id)})
            if res.ready is not None:
                await self._publish_reconf(proto.reconfiguration(res.ready))
                await self._expose(res.ready)
        if failed:
            try:
                await self._write(self._next_record(f"lease expired: {', '.join(failed)}"))
            except LostLeadership:
                return

    async def _write_activation(self, workers: Sequence[str]) -> None:
        """Recovered workers whose ranks all acked are active: record it (lock held)."""
        try:
            await self._write(self._next_record(f"activate {', '.join(workers)}"))
        except LostLeadership:
            return
        await self._publish_composition()

    async def _on_result(self, msg: Msg) -> None:
        core = self.core
        if core is None or not (self._awaiting or core.pending_plan or core.protocol.in_progress()):
            return  # nothing drains: results are none of our business
        try:
            result = first_token_of(msg.subject.rpartition(".")[2], msg)
        except SchemaError:
            # Undecodable, or another request's result on this one's subject: not ours
            # to judge (the gateway reports malformed results).
            return
        if result.worker_id is None:
            return
        async with self._lock:
            await self._finished(WorkerId(result.worker_id), RequestId(result.request_id),
                                 msg.headers)

    async def _finished(self, worker: WorkerId, request: RequestId,
                        carrier: Mapping[str, str] | None = None) -> None:
        """protocol.finished + commit when the reconfiguration drained (lock held).
        ``carrier``: the headers of the request's result; when they carry its W3C trace
        context, the drain's span links to it."""
        assert self.core is not None
        for rid, per_worker in list(self._awaiting.items()):
            left = per_worker.get(worker)
            if left is None:
                continue
            if STOP_MARKER in left and request != STOP_MARKER:
                # Its queue, asked once it stopped (_confirm_stopped), may still list it: an
                # answer given before this result came. Noted whether it was awaited or not:
                # before, an awaited one was only taken out of ``left``, so that stale answer
                # put it back, and the drain waited for a result that had come (until its
                # timeout aborted the reconfiguration).
                self._done_unconfirmed.setdefault((rid, worker), set()).add(request)
            if request not in left:
                if STOP_MARKER in left:
                    # It ran on the source while the drain waited for it to stop.
                    self._traces.link(rid, carrier, **{"vtm.request_id": str(request),
                                                       "vtm.worker_id": str(worker)})
                continue
            left.discard(request)
            if request == STOP_MARKER:
                # It stopped admitting (its queue asked again, or an empty state): what was
                # noted for that wait is of no more use.
                self._done_unconfirmed.pop((rid, worker), None)
            else:
                self.counters["finished"] += 1
                self._traces.link(rid, carrier, **{"vtm.request_id": str(request),
                                                   "vtm.worker_id": str(worker)})
                self._traces.event(rid, "request done", **{"vtm.request_id": str(request),
                                                           "vtm.worker_id": str(worker)})
            try:
                progress = self.core.protocol.finished(worker, request, self.now())
            except VertumnusError as exc:
                with self._traces.current(rid):
                    self.log.warning("finished event rejected", worker=worker, error=str(exc))
                return
            if progress.drained_reconfiguration is not None:
                await self._commit(progress.drained_reconfiguration)
            return

    async def _on_ack(self, msg: Msg) -> None:
        try:
            ack = decode(EpochAck, msg.data, msg.headers)
        except SchemaError as exc:
            self.counters["malformed"] += 1
            self.log.warning("malformed epoch ack ignored", error=str(exc))
            return
        span = None
        if is_sampled(msg.headers):  # else nothing would be recorded (EPOCH_ACK_SPAN)
            span = tracer().start_span(EPOCH_ACK_SPAN, context=extract(msg.headers),
                                       kind=SpanKind.CONSUMER, attributes={
                                           "vtm.gpu": ack.gpu, "vtm.epoch": ack.epoch,
                                           "vtm.worker_id": ack.worker_id})
        try:
            async with self._lock:
                outcome = await self._ack(ack)
        except BaseException as exc:
            if span is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.end()
            raise
        if span is not None:
            span.set_attribute("vtm.ack.outcome", outcome)
            span.end()

    async def _ack(self, ack: EpochAck) -> str:
        """Count ``ack`` where it counts (a draining source's ack of its drain record, a
        switching target's of its commit); returns what it counted for: ``counted`` (a
        target's rank acknowledged), ``source_stopped``, ``rejected`` (the protocol refused
        it), ``ignored`` (not awaited: every rank acknowledges every record it adopts) or
        ``no_core``. Lock held."""
        core = self.core
        if core is None:
            return "no_core"
        proto = core.protocol
        try:
            wid = proto.worker_of_gpu(ack.gpu)
        except InvalidInput:
            self.counters["acks_ignored"] += 1
            return "ignored"
        w = proto.worker(wid)
        if self._source_stopped(wid, ack):
            return "source_stopped"
        # Ranks acknowledge every record they adopt; only an ack for a target that is still
        # switching counts, naming its commit record or a later one. A later one counts
        # because a rank ready only after the next record was written (another operation of
        # the same plan committed meanwhile; a switch takes up to a second) adopts that record
        # instead: every record from the commit on shows this target switching in the same
        # geometry, so adopting any of them is adopting the commit. Requiring the exact commit
        # epoch left such a target switching for ever. An epoch beyond the last record written
        # is not one of ours.
        commit = self._commit_epoch.get(w.epoch)
        last = self.record.epoch if self.record is not None else -1
        # NOTE: the rank names its worker as the record does (a TP worker ``w-tp4-g0``); the
        # protocol knows it by its group's CP name, so the ack's id is mapped first.
        if (
            w.state is not Lifecycle.SWITCHING
            or wid != self._pid(ack.worker_id)
            or commit is None
            or not commit <= ack.epoch <= last
        ):
            self.counters["acks_ignored"] += 1
            return "ignored"
        try:
            res = proto.ack(ack.gpu, w.epoch, ack.degree)
        except (EpochMismatch, InvalidInput, IllegalTransition) as exc:
            self.counters["acks_rejected"] += 1
            self.log.warning("epoch ack rejected", gpu=ack.gpu, error=str(exc))
            return "rejected"
        self.counters["acks"] += 1
        if w.reconfiguration is not None:
            self._traces.event(w.reconfiguration, "rank acknowledged", **{
                "vtm.gpu": ack.gpu, "vtm.epoch": ack.epoch, "vtm.worker_id": str(wid)})
        if res.activated:
            await self._write_activation(res.activated)
        if res.ready is not None:
            await self._publish_reconf(proto.reconfiguration(res.ready))
            await self._expose(res.ready)
        return "counted"

    def _end_awaiting(self, rid: int) -> None:
        """Reconfiguration ``rid`` awaits nothing more (committed, aborted, abandoned): its
        in-flight books go, and with them the results noted for its sources' stops
        (``_done_unconfirmed``), which no later confirmation would take out. Lock held."""
        per_worker = self._awaiting.pop(rid, None) or {}
        for wid in per_worker:
            self._done_unconfirmed.pop((rid, wid), None)

    def _source_stopped(self, wid: WorkerId, ack: EpochAck) -> bool:
        """Whether ``ack`` is a draining source's for its drain record or a later one, while
        it is awaited until it stopped (STOP_MARKER): ranks acknowledge every record they
        adopt as a member, and a source adopting the drain record stops admitting. Its queue
        is then asked again (:meth:`_confirm_stopped`). Lock held."""
        last = self.record.epoch if self.record is not None else -1
        if wid != self._pid(ack.worker_id) or ack.epoch > last:
            return False
        hit = False
        for rid, per_worker in self._awaiting.items():
            left = per_worker.get(wid)
            if left is not None and STOP_MARKER in left \
                    and ack.epoch >= self._drain_epoch.get(rid, last + 1):
                self._confirm(rid, wid)
                hit = True
        if hit:
            self.counters["drain_acks"] += 1
        return hit

    def _confirm(self, rid: int, wid: WorkerId) -> None:
        """Start :meth:`_confirm_stopped` for source ``wid`` of ``rid`` unless it runs."""
        key = (rid, wid)
        if key not in self._confirming:
            task = asyncio.create_task(self._confirm_stopped(rid, wid), name="ctl-stopped")
            self._confirming[key] = task
            task.add_done_callback(lambda t, k=key: self._forget_confirm(k, t))

    def _forget_confirm(self, key: tuple[int, WorkerId], task: asyncio.Task[None]) -> None:
        if self._confirming.get(key) is task:
            del self._confirming[key]
        if not task.cancelled() and task.exception() is not None:
            self.counters["errors"] += 1
            self.log.error("drained source not confirmed", reconfiguration=key[0],
                           worker=key[1], error=repr(task.exception()))

    async def _confirm_stopped(self, rid: int, wid: WorkerId) -> None:
        """Source ``wid`` of ``rid`` adopted the drain record (its ack or its state says so):
        it admits nothing more, so what executes there now is all that is left of it. Its
        queue is asked again (the lock is not held meanwhile); the requests it lists as in
        flight (but those whose result came meanwhile) are awaited with the ones asked before
        the drain, and its STOP_MARKER is resolved: once all are done, it is drained.
        Unanswered, it is judged from its WorkerState as at the drain's start (one opaque
        marker if its queue is not empty, resolved by an empty state under the drain record).
        Before, the answer given before the drain record was final: a request the source
        started after it was never waited for, and the switch could commit under it."""
        core = self.core
        with self._traces.current(rid):  # the query joins the reconfiguration's trace
            _, found = await self._queues(wid)
        async with self._lock:
            left = self._awaiting.get(rid, {}).get(wid)
            if core is None or self.core is not core or left is None or STOP_MARKER not in left:
                return  # committed, aborted, rebuilt, or confirmed by an empty state meanwhile
            found = found - self._done_unconfirmed.pop((rid, wid), set()) - left
            if found:
                try:
                    core.protocol.in_flight_found(wid, found, self.now())
                except VertumnusError as exc:
                    with self._traces.current(rid):
                        self.log.warning("requests found on a source rejected", worker=wid,
                                         error=str(exc))
                    return
                left |= found
            self.counters["drains_confirmed"] += 1
            waited = sorted(left - {RequestId(STOP_MARKER)})
            self._traces.event(rid, "source stopped admitting",
                               **{"vtm.worker_id": str(wid), "vtm.in_flight": waited})
            with self._traces.current(rid):
                self.log.info("drain source stopped admitting", reconfiguration=rid, worker=wid,
                              in_flight=waited)
            await self._finished(wid, RequestId(STOP_MARKER))

    # -- the tick and the plan ----------------------------------------------------------------

    def _tick_wait(self) -> float:
        """Seconds to the next tick: ``tick_s``, or less so that one comes right after the next
        window boundary (:meth:`tick` records the workers' queues there); never below a tenth
        of ``tick_s`` (a clock that stands still must not make the ticker spin)."""
        tick, h = self.csettings.tick_s, self.config.window_s
        now = self.now()
        to_boundary = (math.floor(now / h) + 1) * h - now + 1e-3
        return max(tick / 10, min(tick, to_boundary))

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self._tick_wait())
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.counters["errors"] += 1
                self.log.exception("controller tick failed")

    async def tick(self) -> list[Decision]:
        """Close and decide the windows that ended; carry out a plan; abort stuck drains."""
        async with self._lock:
            core = self.core
            if core is None:
                return []
            now = self.now()
            drain = {
                WorkerId(w): st.outstanding_s
                for w, st in self._states.items()
                if w in core.protocol.composition
            }
            h = self.config.window_s
            boundary = math.floor(now / h) * h
            if self._boundary_drain is None or self._boundary_drain[0] < boundary:
                self._boundary_drain = (boundary, drain)
            t = now - self.csettings.report_grace_s
            if self.csettings.demand_input == "windows":
                # NOTE: a window closes only once some replica reported it: silence is not
                # zero demand (which would read as "merge everything").
                t = min(t, self._reported_until)
            t = max(t, self._floor, core.windows.open_start_s)
            drain = boundary_drain(self._boundary_drain, t, h, drain, core.protocol.composition)
            decisions = core.tick(t, drain_s=drain, hold=not self.csettings.adaptive,
                                  traffic=reconcile_traffic(self._states,
                                                            core.protocol.composition))
            for d in decisions:
                self._decisions.append(decision_dict(d))
                if d.plan is not None:
                    self.log.info("window decided", **decision_dict(d))
                else:
                    self.log.debug("window decided", **decision_dict(d))
            plans = core.pending_plans
            if plans:
                await self._carry_out(plans)
            await self._abort_stuck()
            if self.core is core:
                await self._resume_stalled()
            if self.core is core:  # not rebuilt by a lost compare-and-set above
                await self._check_leases()
            if self.core is core:
                await self._readmit_leftovers()
            return decisions

    async def _carry_out(self, plans: Sequence[Plan]) -> None:
        """Steps 1-2 of the module doc for every operation of one plan (lock held).

        The operations are disjoint; all of them start under **one** drain record, so every
        source stops admitting (and the scheduler drops every source) in the same record
        before any rank daemon hands its queue back: a redirected request cannot land on a
        worker another operation of the plan drains (the simulator's rule). From there each
        operation is a reconfiguration of its own in the epoch protocol — it commits its own
        epoch once its own sources drained and is exposed once its own targets' ranks all
        acknowledged — which is what EpochProtocol defines for concurrent disjoint
        operations, and the simulator's timing."""
        core = self.core
        assert core is not None
        self.counters["plans"] += 1
        # One trace per operation, from here: the queue queries below run in it.
        epoch_before = self.record.epoch if self.record is not None else None
        traces = {
            plan: ReconfTraces.begin(plan_attributes(
                plan, rule=self._rule_of(plan), epoch_before=epoch_before,
                instance=self.instance))
            for plan in plans
        }
        sources = [(wid, traces[plan]) for plan in plans for wid in plan.source_ids]
        # Asked concurrently: an unanswered query costs queue_query_timeout_s once, not per
        # source.
        try:
            answers = await asyncio.gather(*(self._queues_in(t, wid) for wid, t in sources))
        except BaseException as exc:  # the tick logs it; the traces must not stay open
            for t in traces.values():
                self._traces.failed_trace(t, f"queue query failed: {exc!r}",
                                          outcome="not_started", error=exc)
            raise
        queued = {wid: q for (wid, _), (q, _) in zip(sources, answers, strict=True)}
        in_flight = {wid: f for (wid, _), (_, f) in zip(sources, answers, strict=True)}
        # NOTE: the answers predate the drain record: until a source adopts it, it admits and
        # starts requests. Each source is awaited until it shows it stopped (STOP_MARKER,
        # _confirm_stopped), so no source is drained -- and no commit written -- before then.
        awaited = {wid: {*f, RequestId(STOP_MARKER)} for wid, f in in_flight.items()}
        now = self.now()
        started: list[tuple[Plan, StartResult]] = []
        for plan in plans:
            t = traces[plan]
            try:
                res = core.start(plan, now, queued=queued, in_flight=awaited)
            except VertumnusError as exc:
                with bound(t):
                    self.log.warning("operation could not start", error=str(exc),
                                     plan=plan.to_dict())
                self._traces.failed_trace(t, f"operation could not start: {exc}",
                                          outcome="not_started", error=exc)
                continue
            started.append((plan, res))
            self._traces.started(t, res.reconfiguration, {
                "vtm.reconfiguration.redirected": len(res.redirected),
                "vtm.reconfiguration.in_flight": sum(len(in_flight[w])
                                                     for w in plan.source_ids),
            })
        if core.pending_plans:  # the ones that could not start: the next plan re-judges
            core.discard_plan()
        if not started:
            return
        reason = (
            started[0][0].reason
            if len(started) == 1
            else (f"{len(started)} operations: " + "; ".join(p.reason for p, _ in started))
        )
        # In the first operation's drain span (as the write below is): each rank daemon's
        # adoption joins that trace (one record, one parent).
        record = self._next_record(f"drain: {reason}", traces[started[0][0]].traceparent())
        try:
            with bound_all([traces[p] for p, _ in started]):
                await self._write(record)
        except LostLeadership:
            return  # core rebuilt from the winner's record; nothing of ours was published
        except _WRITE_ERRORS as exc:
            # NOTE: no commit may follow a drain record that was never written (§6.2: the
            # ranks must stop admitting first). A timeout may hide a write that landed: then
            # the plan goes on; else every operation started above is undone.
            if not await self._landed(record):
                await self._abandon([res.reconfiguration for _, res in started], exc)
                return
        rids = [res.reconfiguration for _, res in started]
        for plan, res in started:
            rid = res.reconfiguration
            self._traces.set(rid, **{"vtm.epoch.drain": record.epoch,
                                     "vtm.reconfiguration.plan": rids})
            self._traces.event(rid, "drain record written", **{"vtm.epoch": record.epoch})
            with self._traces.current(rid):
                await self._carried_out(plan, res, record.epoch, rids, awaited, in_flight)

    async def _carried_out(self, plan: Plan, res: StartResult, drain_epoch: int,
                           rids: list[int], awaited: Mapping[WorkerId, set[RequestId]],
                           in_flight: Mapping[WorkerId, set[RequestId]]) -> None:
        """Step 2's end for one operation whose drain record was written: its books, the
        DrainNotice and the ReconfigurationEvent (lock held; in its trace)."""
        core = self.core
        assert core is not None
        rid = res.reconfiguration
        self._drain_epoch[rid] = drain_epoch
        self._awaiting[rid] = {w: set(awaited[w]) for w in plan.source_ids}
        notice = DrainNotice(
            reconfiguration=rid,
            kind=plan.kind.value,
            epoch=drain_epoch,
            sources=list(plan.source_ids),
            targets=list(plan.target_ids),
            redirected=[
                RedirectedRequest(worker_id=w, request_id=r) for w, r in res.redirected
            ],
            in_flight={w: len(in_flight[w]) for w in plan.source_ids},
            plan=rids,
            reason=plan.reason,
            issued_at_s=self.now(),
        )
        await self._publish(drain_subject(self.subjects), notice)
        recon = core.protocol.reconfiguration(rid)
        await self._publish_reconf(recon)
        self.log.info("reconfiguration started", plan=rids, **recon.to_dict())

    def _rule_of(self, plan: Plan) -> str | None:
        """The planner rule behind ``plan``: the trigger of the latest decision that made it
        (None: none said)."""
        core = self.core
        if core is None:
            return None
        for d in reversed(core.decisions):
            if plan in d.plans:
                return d.trigger
        return None

    async def _queues_in(self, t: ReconfTrace,
                         wid: WorkerId) -> tuple[list[RequestId], set[RequestId]]:
        """:meth:`_queues` in operation ``t``'s trace (the query carries its context, so the
        worker's ``queue`` handler joins it); what the source answered goes on the span."""
        with bound(t):
            queued, in_flight = await self._queues(wid)
        if t.phase is not None:
            t.phase.add_event("queue", attributes={
                "vtm.worker_id": str(wid), "vtm.queued": len(queued),
                "vtm.in_flight": sorted(in_flight)})
        return queued, in_flight

    async def _landed(self, record: EpochRecord) -> bool:
        """Whether ``record``, whose write raised a JetStream error (a timeout after the
        server stored it, say), is the stored one; if so it becomes ours (revision, record).
        A read that fails as well says no: the caller undoes the change, and should the
        write have landed after all, its revision is above ours and the record watch (or
        the next compare-and-set, which fails) rebuilds the core from it."""
        if self._kv is None:
            return False
        try:
            stored = await self._get_record()
        except (*_WRITE_ERRORS, UnreadableRecord):
            return False
        if stored is None or stored[0] != record:
            return False
        self.record, self.revision = record, stored[1]
        self.counters["records_written"] += 1
        self.set_metadata(epoch=str(record.epoch))
        return True

    async def _abandon(self, rids: Sequence[int], error: BaseException) -> None:
        """Undo operations started (``core.start``) whose drain record could not be written
        (lock held): each is aborted, its sources ACTIVE again -- as the stored record still
        shows them -- so that no commit record can follow a drain record no rank ever saw,
        and the planner may plan anew (nothing was carried out: the plan's momentum is taken
        back). No record is written: the stored one is right as it is."""
        core = self.core
        assert core is not None
        now = self.now()
        for rid in rids:
            aborted = core.protocol.abort(rid, now)
            self._end_awaiting(rid)
            self._drain_epoch.pop(rid, None)
            self.counters["aborted"] += 1
            self.counters["drains_abandoned"] += 1
            await self._publish_reconf(aborted)
            with self._traces.current(rid):
                self.log.error("drain record not written; operations undone",
                               reconfigurations=list(rids), error=repr(error))
            self._traces.failed(rid, f"drain record not written: {error!r}",
                                outcome="abandoned", error=error)
        core.planner.plan_not_carried_out()
        self.counters["errors"] += 1

    async def _queues(self, wid: WorkerId) -> tuple[list[RequestId], set[RequestId]]:
        """A source's queued and in-flight ids: asked, else judged from its WorkerState."""
        try:
            rep = await call(
                self.nc,
                worker_queue_subject(self.subjects, wid),
                QueueQuery(worker_id=wid),
                QueueReport,
                timeout_s=self.csettings.queue_query_timeout_s,
            )
            return [RequestId(r) for r in rep.queued], {RequestId(r) for r in rep.in_flight}
        except (
            nats.errors.NoRespondersError,
            nats.errors.TimeoutError,
            TimeoutError,
            RemoteError,
            SchemaError,
        ) as exc:
            self.log.info("queue query unanswered; using worker state", worker=wid, error=repr(exc))
        state = self._states.get(wid)
        busy = state is not None and state.queue_len > 0
        return [], ({RequestId(INFLIGHT_MARKER)} if busy else set())

    async def _commit(self, rid: int) -> None:
        """Step 4: every source drained → commit record (lock held; in its trace)."""
        self._traces.phase(rid, ReconfStage.EPOCH_COMMIT)
        with self._traces.current(rid):
            await self._commit_traced(rid)

    async def _commit_traced(self, rid: int) -> None:
        core = self.core
        assert core is not None
        self._end_awaiting(rid)
        await self._publish_reconf(core.protocol.reconfiguration(rid))
        control: ControlRecord = core.protocol.switch_started(rid, self.now())
        t = self._traces.get(rid)
        record = self._next_record(f"commit reconfiguration {rid}",
                                   t.traceparent() if t is not None else "")
        # The targets are new workers from this record on, although an id may have existed
        # before (a merge back, a split back): what we hold for that id is its predecessor's.
        # Set before the write: a failed write leaves the targets in the protocol all the
        # same (_resume_stalled writes their first record), and leases are judged meanwhile.
        for g in core.protocol.reconfiguration(rid).targets:
            self._created[g.worker_id] = record.epoch
            self._states.pop(g.worker_id, None)
        try:
            await self._write(record)
        except LostLeadership:
            return
        except _WRITE_ERRORS as exc:  # _resume_stalled commits it again
            self._traces.event(rid, "commit record not written", error=repr(exc))
            raise
        self._commit_epoch[control.epoch] = record.epoch
        recon = core.protocol.reconfiguration(rid)
        self._traces.set(rid, **{"vtm.epoch.after": record.epoch})
        self._traces.event(rid, "commit record written", **{"vtm.epoch": record.epoch})
        self._traces.phase(rid, ReconfStage.SWITCH, **{
            "vtm.epoch": record.epoch, "vtm.ranks": sum(g.degree for g in recon.targets)})
        await self._publish_reconf(recon)
        self.log.info("epoch committed", record_epoch=record.epoch, **recon.to_dict())

    async def _expose(self, rid: int) -> None:
        """Step 6: all ranks acknowledged → exposure record, then protocol.exposed (lock
        held; in its trace, which ends with it)."""
        self._traces.phase(rid, ReconfStage.EXPOSE)
        with self._traces.current(rid):
            await self._expose_traced(rid)

    async def _expose_traced(self, rid: int) -> None:
        core = self.core
        assert core is not None
        proto = core.protocol
        recon = proto.reconfiguration(rid)
        targets = {g.worker_id for g in recon.targets}
        now = self.now()
        # The record shows the targets as the protocol will have them after `exposed`.
        record = EpochRecord(
            epoch=self.record.epoch + 1 if self.record else 0,
            workers=[
                EpochWorker(
                    worker_id=w.worker_id,
                    first_gpu=w.group.first_gpu,
                    degree=w.group.degree,
                    lifecycle=Lifecycle.ACTIVE
                    if w.worker_id in targets and w.reconfiguration == rid
                    else w.state,
                )
                for w in proto.workers()
            ],
            committed_at_s=now,
            reason=f"expose reconfiguration {rid}",
            traceparent=t.traceparent() if (t := self._traces.get(rid)) is not None else "",
        )
        try:
            await self._write(record)
        except LostLeadership:
            return
        except _WRITE_ERRORS as exc:  # _resume_stalled exposes it again
            self._traces.event(rid, "exposure record not written", error=repr(exc))
            raise
        done = proto.exposed(rid, self.now())
        self.counters["exposed"] += 1
        await self._publish_reconf(done)
        await self._publish_composition()
        self.log.info("reconfiguration exposed", **done.to_dict())
        self._traces.ended(rid, **{"vtm.epoch.exposed": record.epoch,
                                   "vtm.drain_s": done.drain_s, "vtm.switch_s": done.switch_s,
                                   "vtm.reconfiguration.failed_targets":
                                       [str(w) for w in done.failed_targets]})

    async def _abort_stuck(self) -> None:
        core = self.core
        assert core is not None
        proto = core.protocol
        now = self.now()
        for rid in proto.in_progress():
            r = proto.reconfiguration(rid)
            if (r.phase is not Phase.DRAINING
                    or now - r.started_at < self.csettings.reconfig_drain_timeout_s):
                continue
            aborted = proto.abort(rid, now)
            self._end_awaiting(rid)
            self.counters["aborted"] += 1
            reason = (f"drain timeout: sources not drained after "
                      f"{self.csettings.reconfig_drain_timeout_s} s")
            # Its trace ends first, with its own reason (a lost compare-and-set below would
            # end it as abandoned); its context goes on to what is still said about it.
            t = self._traces.get(rid)
            with self._traces.current(rid):
                self.log.warning("reconfiguration aborted: drain timeout", **aborted.to_dict())
            self._traces.failed(rid, reason, outcome="aborted")
            with bound(t, rid) if t is not None else contextlib.nullcontext():
                try:
                    # The abort's own record (its sources admit again): the ranks' adoption
                    # of it is in its trace, under the root (the phases have ended).
                    await self._write(self._next_record(
                        f"abort reconfiguration {rid}: drain timeout",
                        t.traceparent() if t is not None else ""))
                except LostLeadership:
                    return
                await self._publish_reconf(aborted)

    async def _resume_stalled(self) -> None:
        """Steps 4-6's safety net, when no record was written for ``ack_timeout_s``.

        * Ranks acknowledge with plain NATS messages (at most once): an ack lost on the way (a
          reconnect, a slow consumer) would leave its worker switching for ever, its GPUs
          idle. When some worker awaits acks -- a target of a committed reconfiguration, or a
          re-admitted worker -- the record is written again (same composition, next epoch):
          every rank adopts it and acknowledges anew, and an ack of a record after the commit
          counts (:meth:`_ack`). A worker whose commit record never got written (the write
          failed after the protocol committed) has this as its first commit record.
        * A reconfiguration whose sources drained but whose commit never got written (DRAINED:
          an earlier write of the same plan failed) is committed again; one whose ranks all
          acknowledged but whose exposure record failed to write (READY) is exposed again.

        Repeated every ``ack_timeout_s`` while anything waits."""
        core = self.core
        assert core is not None
        if self.record is None or self.now() - self.record.committed_at_s < \
                self.csettings.ack_timeout_s:
            return
        proto = core.protocol
        for rid in proto.in_progress():
            phase = proto.reconfiguration(rid).phase
            if self.core is not core or phase not in (Phase.DRAINED, Phase.READY):
                continue
            with self._traces.current(rid):
                self.log.warning("stalled reconfiguration retried", reconfiguration=rid,
                                 phase=phase.value)
            if phase is Phase.DRAINED:
                await self._commit(rid)
            else:
                await self._expose(rid)
        if self.core is not core:
            return
        waiting = [
            w for w in proto.workers()
            if w.state is Lifecycle.SWITCHING and (
                w.reconfiguration is None
                or proto.reconfiguration(w.reconfiguration).phase is Phase.COMMITTED)
        ]
        if not waiting:
            return
        names = [w.worker_id for w in waiting]
        # Targets of a committed reconfiguration await it in its switch phase: the ranks'
        # adoption of the record is in that trace (the first one's, as a drain record of a
        # plan's several operations). Recovering workers' (no reconfiguration) is in none.
        rids = sorted({w.reconfiguration for w in waiting if w.reconfiguration is not None})
        traced = [t for r in rids if (t := self._traces.get(r)) is not None]
        record = self._next_record(f"re-announce: {', '.join(names)} await rank acks",
                                   traced[0].traceparent() if traced else "")
        try:
            await self._write(record)
        except LostLeadership:
            return
        for r in rids:
            self._traces.event(r, "record re-announced", **{"vtm.epoch": record.epoch})
        for w in waiting:
            self._commit_epoch.setdefault(w.epoch, record.epoch)
        self.counters["reannounced"] += 1
        self.log.warning("record re-announced: rank acks missing", workers=names,
                         record_epoch=record.epoch)

    async def _watch_record(self, watcher: Any) -> None:
        """Follow records written by another controller while we have nothing in flight."""
        async for entry in watcher:
            if entry is None or not entry.value:
                continue
            rev = int(entry.revision or 0)
            if rev <= self.revision:
                continue
            async with self._lock:
                if rev <= self.revision:  # our own write, seen after the CAS returned
                    continue
                core = self.core
                if core is not None and (core.pending_plan or core.protocol.in_progress()):
                    continue  # our next write will fail and rebuild from the store
                try:
                    record, _ = self._readable(entry.value, rev)
                except UnreadableRecord as bad:
                    if core is None or self.record is None:
                        continue
                    try:
                        await self._repair(bad)
                        await self._publish_composition()
                    except LostLeadership:
                        pass
                    except _WRITE_ERRORS as exc:  # the next write or watch event tries again
                        self.counters["errors"] += 1
                        self.log.error("unreadable epoch record not repaired", error=repr(exc))
                    continue
                self._rebuild(record, rev)
                self.counters["followed"] += 1

    # -- publications ---------------------------------------------------------------------------

    async def _publish(self, subject: str, msg: Message) -> None:
        data, headers = encode(msg)
        # The current trace context (a reconfiguration's, when it is about one), so that
        # whoever acts on the message can join that trace.
        inject(headers)
        try:
            await self.nc.publish(subject, data, headers=headers)
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError) as exc:
            self.log.warning("publish failed", subject=subject, error=str(exc))

    async def _publish_reconf(self, r: Reconfiguration) -> None:
        assert self.core is not None
        if r.phase is Phase.EXPOSED or r.phase is Phase.ABORTED:  # each is published once
            self.metrics.ended(r)
        with self._traces.current(r.id):
            await self._publish_reconf_event(r)

    async def _publish_reconf_event(self, r: Reconfiguration) -> None:
        assert self.core is not None
        await self._publish(
            reconf_subject(self.subjects),
            ReconfigurationEvent(
                reconfiguration=r.id,
                kind=r.kind.value,
                phase=r.phase.value,
                sources=[g.worker_id for g in r.sources],
                targets=[g.worker_id for g in r.targets],
                epoch=self._commit_epoch.get(r.epoch) if r.epoch is not None else None,
                started_at_s=r.started_at,
                drained_at_s=r.drained_at,
                switch_started_at_s=r.switch_started_at,
                exposed_at_s=r.exposed_at,
                aborted_at_s=r.aborted_at,
                drain_s=r.drain_s,
                switch_s=r.switch_s,
                redirected=r.redirected,
                composition=self.core.protocol.composition.describe(),
                controller=self.instance,
            ),
        )

    async def _publish_composition(self) -> None:
        assert self.core is not None and self.record is not None
        proto = self.core.protocol
        await self._publish(
            composition_subject(self.subjects),
            CompositionNotice(
                epoch=self.record.epoch,
                composition=proto.composition.describe(),
                workers=list(self.record.workers),
                schedulable=list(proto.schedulable()),
                at_s=self.now(),
            ),
        )


__all__ = [
    "CompositionNotice",
    "ControllerService",
    "ControllerSettings",
    "DrainNotice",
    "InspectQuery",
    "LostLeadership",
    "QueueQuery",
    "QueueReport",
    "ReconfigurationEvent",
    "RedirectedRequest",
    "composition_of",
    "composition_subject",
    "controller_group",
    "default_composition",
    "drain_subject",
    "epoch_record",
    "reconf_subject",
    "replay_report",
    "report_problem",
    "worker_queue_subject",
]
