"""rankd: the NATS adapter of one worker's leader rank.

Per process (one worker, its leader rank, for now):

* micro service ``vtm-rankd`` with endpoint ``{prefix}.worker.assign.{wid}``: an Assignment
  in, an AssignmentAck out (queue position) or a micro error (400 malformed, 404 wrong worker,
  409 not ACTIVE / epoch ahead / queue full; for a re-sent assignment of a request this worker
  handed back: 425 while the redirect is unsettled, 410 once intake holds it — see
  :mod:`services.rankd.core`). Admission is instant; execution is FIFO in a background task
  through an :class:`~services.rankd.backend.ExecutionBackend`. Endpoint
  ``{prefix}.worker.queue.{wid}``: a QueueQuery in, a QueueReport out (the running request
  and the FIFO in order, with the arrival stamps of the attempts each holds; 400 malformed,
  404 another worker's id) -- the controller's first step of a split or merge, and a
  scheduler's check that a worker holds an attempt.
* after each request, a FirstToken on ``{prefix}.result.{rid}`` with TTFT stage timings
  (wall seconds, see :mod:`services.rankd.backend`), the predicted prefill (modelled seconds)
  and the worker's ``time_scale``, and the TTFT stage spans ``queue_wait``, ``prefill``
  (with one ``prefill_rank`` child per rank: rank, GPU, share of the new tokens),
  ``kv_transfer`` and ``first_decode``, each a direct child of the request's root span at the
  gateway (conventions.md: one root per request, one child per stage), whose context travels
  in the assignment (``Assignment.request.trace_context``; :func:`stage_carrier`) -- not of
  the ``vtm-rankd.assign`` server span, which is the dispatch's (a child of the scheduler's
  ``schedule`` span) and ends at the admission. Predicted and modelled times on them; the
  queue wait from the scheduler's ``assigned_at_s`` (where the breakdown's starts) to the
  prefill's start as the backend measured it (``PrefillResult.started_at_s``, where the
  breakdown's ends), the last three from the backend's measured instants -- ``kv_transfer``
  and ``first_decode`` as the first token went out, a late handoff timer's lateness in
  ``first_decode`` (``RankdService._answer``) -- so the spans and the FirstToken's breakdown
  agree. Inside ``queue_wait``: ``vtm.pull_hold_s`` and a ``cache_pull_wait`` child span
  for the time the request was held at the head of the FIFO for the route-time pull it was
  priced with (linked to the ``cache-cmd`` spans of the copies, replicate or reconcile, that
  brought its blocks meanwhile, which link back to the request's root), and
  ``vtm.epoch_switch_s`` and an ``epoch_switch`` child span for a lazy split or merge the
  backend made before the prefill (the ``prefill`` span starts after it). Units on
  ``prefill``:
  ``vtm.predicted_s`` and ``vtm.modelled_prefill_s`` modelled seconds,
  ``vtm.actual_prefill_s`` wall seconds, ``vtm.actual_prefill_model_s`` the same in modelled
  seconds (÷ ``vtm.time_scale``, wall seconds per modelled second), so prediction and
  measurement compare like with like at any time scale.
* WorkerState in the worker-state KV bucket (key = worker id) on every change, coalesced, and
  at least every ``heartbeat_s`` (the liveness lease); its ``max_seq_len`` is the backend's
  prompt limit when it has one (:func:`backend_max_seq_len`).
* the worker's prefix cache (LRU, :mod:`services.rankd.blockcache`) decides the P actually
  reused; its events (stored / removed / cleared, per-worker monotonic ids) are published as
  JSON on ``{prefix}.cache.events.{wid}`` in order. An event whose publish raises (the
  connection down with nats-py's reconnect buffer full, a closing connection) is kept with
  every later one and sent again, in order and under its own id, by the next publication or
  by a task of its own (after :data:`EVENTS_RETRY_S`, doubling to
  :data:`EVENTS_RETRY_MAX_S`; :meth:`RankdService._resend_cache_events`) -- before, the
  events were lost, and a quiet worker, whose next event would have shown the cache manager
  the gap, left the global index wrong for as long as it stayed quiet.
  ``{prefix}.cache.snapshot.{wid}`` answers a CacheSnapshot (after publishing every earlier
  event it can; in parts when it is over the server's max_payload, shared/service.py
  ``respond_in_parts``) and
  ``{prefix}.cache.cmd.{wid}`` executes a CacheCommand (replicate / reclaim / reconcile /
  demote: the last only reorders the LRU, no event follows); its server span, a child of the
  cache manager's span of the command, carries the op, the source and destination workers,
  the block count and the outcome (services/cachemgr/tracing.py).
* the epoch record is watched; a newer record is adopted (lifecycle from it) and one EpochAck
  per GPU of the worker is published on ``{prefix}.epoch.ack.{gpu}``. An ack whose publish
  raises (e.g. OutboundBufferLimitError: the outbound buffer is full while the connection is
  down; a closing connection) is logged and re-sent by a task of its own (after
  :data:`ACK_RETRY_S`, doubling to :data:`ACK_RETRY_MAX_S`) until it goes out, a newer
  adoption supersedes it (its own acks replace it) or the worker faults; neither the epoch
  watcher nor a worker's start (which adopts the current record) ends on it. The controller
  re-announces the record when acks stay missing (``ack_timeout_s``): the re-send makes that
  safety net rarely needed, not unnecessary. Each adoption is an ``epoch_adopt`` span
  (:data:`EPOCH_ADOPT_SPAN`: epoch, worker, lifecycle after it, whether requests were
  redirected) in the trace of the record's ``traceparent``; a malformed one is logged as a
  warning and the record adopted all the same, the span then a root. Its EpochAcks carry
  the span's W3C context in their headers (every re-send the same), so that the controller's
  handling of each (``epoch_ack``) is its child. Queued requests of a
  worker leaving ACTIVE are redirected to intake (``Nats-Msg-Id`` =
  :func:`~services.rankd.core.handback_msg_id`: ``{source}>{worker}``, one id per hop, so the
  redirect is not de-duplicated against the original publish nor against another source's
  redirect of the same request, but every publish of *this* hand-back is). Every publish of
  a hand-back carries its stamp and cause (``Vtm-Handed-Back-At``, Unix seconds;
  ``Vtm-Handback-Cause``: ``draining``, ``unavailable``, ``stopping``, ``worker_fault``;
  :data:`~services.rankd.core.HANDBACK_AT_HEADER`), the same on every try and re-send, as a
  scheduler's hand-back for a lost worker does: the scheduler starts the hand-back delivery's
  ``intake_wait`` there. A sampled request gets a ``handed_back`` span (a child of its root,
  ``vtm.worker_id``, ``vtm.cause``) from its acceptance here to that stamp, once intake
  acknowledged the message this worker published (one answered as a duplicate before any
  try of ours may have stored it is a scheduler's publish for this worker, that scheduler's
  span). Before, a worker's own hand-back carried neither, its intake wait started at the
  stream's stored stamp, and the time it spent here was in no span.
* redirects run in their own tasks (not inside the epoch watcher, which a stop cancels) and
  are pipelined (up to :data:`REDIRECT_WINDOW` publishes awaiting their acks at once). A
  request stays this worker's (counted in ``queue_len``) until intake acknowledges it; a
  publish whose ack does not come, or that meets a transient error (a 5xx answer such as
  JetStream "temporarily unavailable", the connection closed or reconnecting, its outbound
  buffer full), is retried with the same ``Nats-Msg-Id`` (de-duplicated by the stream, so a
  retry never stores it twice) until ``redirect_timeout_s``, classified as the gateway's
  intake publish is (:meth:`RankdService._publish_handback`). A redirect that definitely
  failed (no intake stream, refused below 500, nothing any try can have stored) is answered
  to the client with an error FirstToken; one whose outcome is unknown (a timed-out publish,
  a 5xx answer, a closed connection: it may have been stored) is
  logged, never answered twice, and remembered by the core: a re-sent assignment of its
  source is settled by publishing the hand-back again under its id (stored at most once) and
  answered 410 once intake acknowledges it, 425 otherwise. A later attempt that joined a
  handed-back job is handed back as its own intake message and answered alike: 425 to a
  re-sent assignment of it while its hand-back is under way, and, its outcome unknown,
  remembered by the core (by source and arrival stamp) and settled by a re-send in the same
  way -- never forgotten, so never run here beside a hand-back intake may hold. That comes
  before answering a re-sent assignment from what the worker kept (a request finished here
  since, as another attempt: admitted as done, its kept answer sent again), and so does the
  410 of one whose hand-back intake acknowledged (remembered by source and arrival stamp):
  before, such an attempt was answered here too, beside its hand-back intake may hold (or
  holds: a scheduler whose 410 was lost re-sends it). So does a job's own hand-back, for a
  re-sent assignment of the job (its source and arrival stamp) once another attempt of the
  request finished here: before, the kept answer went to the job's attempt while intake's
  hand-back answered it too (:meth:`WorkerCore.check_handback
  <services.rankd.core.WorkerCore.check_handback>`). Attempts without an intake message id
  (only tests and schedulers older than the header send none) are remembered by nothing
  (:mod:`services.rankd.core`).
* a backend error is answered by its kind. :class:`~shared.ids.InvalidInput` (the request's
  fault: nothing ran) and any other unexpected exception: an error FirstToken
  (``prefill failed: ...``) for that request, and the worker serves on; so is an
  ``asyncio.CancelledError`` the backend raises while nothing cancels the executor (e.g. an
  internal future of its cancelled under it): only a stop's cancel ends the executor.
  :class:`~shared.ids.WorkerFault` (the worker's fault: a rank process died, the torch world
  is broken — :class:`~services.rankd.torch_world.WorldBroken`): no answer to anyone; the
  worker hands back the request that met it (it becomes a redirect, not a finish) and every
  queued one, exactly as a drain does, becomes UNAVAILABLE for good (published at once;
  admission answers 409, a newer epoch record cannot make it ACTIVE again, no EpochAck), logs
  one error line naming the cause, and stops; once the hand-backs are settled (bounded by
  ``redirect_timeout_s``) :meth:`RankdService.run` raises the fault, so the process exits
  non-zero and its supervisor restarts it as a new incarnation (the scheduler and the cache
  manager re-admit it). A cache command whose engine step meets one does the same (and is
  answered 409), and so does a fault reported by the backend's optional ``health()`` probe
  (every :data:`HEALTH_PERIOD_S`; the running request, if any, then finishes or meets the
  fault itself), and so does the end of any background task the worker serves with
  (:data:`SERVING_TASKS`: the request executor, the state publisher, the epoch watcher, the
  ack re-sender, the health probe) while the service is not stopping (e.g. a BaseException
  out of the backend, or out of an adoption; the executor's end hands back the running
  request too; :meth:`RankdService._task_ended`) -- before, the worker went on admitting
  and heartbeating with nothing left to run its queue (executor), without heartbeats
  (publisher) or without adopting later epoch records, so a controller's drain waited for
  an ack until it aborted (watcher). In a rank host every worker of the host follows
  (:mod:`services.rankd.host`).
* shutdown (SIGINT/SIGTERM): stop admitting, redirect queued requests and wait for every
  outstanding redirect (bounded by ``redirect_timeout_s``) while the running request finishes
  (bounded by ``drain_timeout_s``), publish a final UNAVAILABLE state, drain. The waits come
  before the connection drains: a JetStream publish on a draining connection never gets its
  ack (the reply subscription is gone) and would sit out its whole timeout.

No policy lives here: admission rules and bookkeeping are in :mod:`services.rankd.core`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any, Final, NoReturn

import msgpack
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import KeyValue
from nats.micro.request import Request, ServiceError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, Status, StatusCode

from services.cachemgr.events import CacheEvent
from services.cachemgr.tracing import LINK_REASON, command_attributes
from services.rankd.backend import ExecutionBackend, PrefillResult
from services.rankd.core import (
    HANDBACK_AT_HEADER,
    HANDBACK_CAUSE_HEADER,
    HANDED_BACK_CODE,
    HANDED_BACK_SPAN,
    INTAKE_MSG_HEADER,
    REDIRECTING_CODE,
    Adoption,
    HandBackCause,
    HandBackUnknown,
    HandedBack,
    Job,
    Redirecting,
    WorkerCore,
    handback_msg_id,
    joined_handback_msg_id,
    rank_shares,
)
from services.rankd.metrics import WorkerMetrics
from services.rankd.settings import RankdSettings
from shared.ids import InvalidInput, UnknownWorker, WorkerFault
from shared.logging import bind_request
from shared.publish import publish_refused, publish_transient
from shared.schemas import (
    CONTENT_TYPE,
    JSON,
    MAX_TOKENS,
    SCHEMA_VERSION,
    Assignment,
    AssignmentAck,
    CacheCommand,
    CacheCommandResult,
    CacheSnapshot,
    EpochAck,
    EpochRecord,
    FirstToken,
    IntakeRequest,
    QueueQuery,
    QueueReport,
    ReconcileCommand,
    ReplicateCommand,
    SchemaError,
    TtftStages,
    WorkerState,
    decode,
    encode,
    to_json,
)
from shared.service import (
    Endpoint,
    KvWatch,
    MicroService,
    ensure_results_stream,
    epoch_kv,
    publish_result,
    request_model,
    respond_in_parts,
    while_connected,
    worker_state_kv,
)
from shared.subjects import micro_service_name
from shared.tasks import cancel_and_wait
from shared.tasks import cancel_requested as _cancel_requested
from shared.telemetry import (
    Stage,
    extract,
    inject,
    is_sampled,
    record_span,
    trace_id_of,
    traceparent_of,
    tracer,
)
from shared.worker import Lifecycle

VERSION: Final[str] = "0.1.0"
WATCH_TASK: Final[str] = "rankd-epochs"
EXECUTOR_TASK: Final[str] = "rankd-executor"
STATE_TASK: Final[str] = "rankd-state"
ACKS_TASK: Final[str] = "rankd-epoch-acks"
HEALTH_TASK: Final[str] = "rankd-health"
EVENTS_TASK: Final[str] = "rankd-cache-events"
SERVING_TASKS: Final[dict[str, str]] = {
    EXECUTOR_TASK: "request executor",
    STATE_TASK: "state publisher",
    WATCH_TASK: "epoch watcher",
    ACKS_TASK: "epoch ack re-sender",
    HEALTH_TASK: "health probe",
    EVENTS_TASK: "cache event re-sender",
}
"""The background tasks a worker serves with (name -> what it is, as a fault names it): each
ending while the service is not stopping is a worker fault
(:meth:`RankdService._task_ended`)."""
REDIRECT_WINDOW: Final[int] = 64
"""Redirect publishes awaiting their JetStream acks at once (pipelined, queue order kept)."""
REDIRECT_ATTEMPT_S: Final[float] = 2.0
"""Ack timeout of one redirect publish attempt (then retried, same ``Nats-Msg-Id``)."""
REDIRECT_PAUSE_S: Final[float] = 0.05
"""Pause before the first retry of a redirect publish that failed other than by a timeout (a
transient 5xx, the connection down); doubling per retry up to :data:`REDIRECT_PAUSE_MAX_S`,
drawn at random in its upper half."""
REDIRECT_PAUSE_MAX_S: Final[float] = 0.5
"""Longest pause between two tries of a redirect publish."""
_HANDBACK_RETRIED: Final = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    # The connection down at this moment and nats-py's reconnect buffer full: nothing sent.
    nats.errors.OutboundBufferLimitError,
)
"""Connection errors of a redirect publish tried again until its deadline (a closed or
draining connection ends it at the next try: :meth:`RankdService._publish_handback`); of a
cache event's publish, kept to send again (:meth:`RankdService._publish_cache_events_locked`)."""
ANSWER_MEMORY: Final[int] = 8_192
"""First tokens a worker keeps to send again when a later attempt (another arrival, the same
content) of a request it answered is assigned to it (~0.7 KB each). A failure is not kept: a
later attempt of a failed request runs again."""
ERROR_REASON_MAX: Final[int] = 500
"""Longest error reason an error FirstToken carries for an unexpected exception (a pydantic
validation error's text runs long)."""
HEALTH_PERIOD_S: Final[float] = 0.5
"""Period of the backend's optional health probe (a rank dying under an idle worker is noticed
within it; the probe is a non-blocking check, e.g. ``waitpid`` on the rank processes)."""
STATE_MIN_INTERVAL_S: Final[float] = 0.05
"""Least time between two WorkerState publications that change neither lifecycle nor epoch."""
FINAL_STATE_TIMEOUT_S: Final[float] = 5.0
"""Bound on the final (UNAVAILABLE) state publication of a stop, given up at once should the
connection lose its server (shared.service.while_connected)."""
ACK_RETRY_S: Final[float] = 0.2
"""Delay before an EpochAck that failed to publish is sent again (then doubling per failed
round up to :data:`ACK_RETRY_MAX_S`): a switching worker is schedulable only once every rank
acknowledged, so a lost ack costs GPU time until the controller re-announces the record."""
ACK_RETRY_MAX_S: Final[float] = 2.0
"""Longest delay between two re-send rounds of unsent EpochAcks (e.g. while reconnecting)."""
EVENTS_RETRY_S: Final[float] = 0.2
"""Delay before cache events whose publish failed are sent again (then doubling per failed
round up to :data:`EVENTS_RETRY_MAX_S`): until they reach the cache manager, it routes and
plans on a stale view of this worker's cache."""
EVENTS_RETRY_MAX_S: Final[float] = 2.0
"""Longest delay between two re-send rounds of unsent cache events (e.g. while reconnecting)."""
PULL_WAIT_SPAN: Final[str] = "cache_pull_wait"
"""Span of a request's pull hold (:meth:`WorkerCore.pull_hold`), a child of its
``queue_wait``: from when the head of the FIFO began waiting for the route-time pull its
assignment was priced with to its start. Linked to the ``vtm-rankd.cache-cmd`` spans of the
copies of its blocks that arrived meanwhile (and they to the request's root)."""
EPOCH_SWITCH_SPAN: Final[str] = "epoch_switch"
"""Span of a lazy epoch switch the backend made before a request's prefill
(``PrefillResult.switch_s``), a child of its ``queue_wait``: the stage breakdown counts it in
``queue_wait_s``, and the ``prefill`` span starts where it ends."""
EPOCH_ADOPT_SPAN: Final[str] = "epoch_adopt"
"""Span of this worker's adoption of a newer epoch record, from the record's arrival to its
acks' publish: a child of the record's ``traceparent`` (the controller's phase span that wrote
it: the reconfiguration's trace), a root without a valid one (sampled then by the ratio). The
acks carry its context in their headers (the parent of the controller's ``epoch_ack``)."""
UNSENT_EVENTS_MAX: Final[int] = 65_536
"""Cache events kept unsent at most (a long outage with requests finishing); beyond, the
oldest are dropped: the first one sent after them shows the cache manager the gap, and it asks
for a snapshot."""


def _wire_json(wire: dict[str, object]) -> bytes:
    """JSON bytes of a core event's wire dict, in shared.schemas' CacheEvent form.

    NOTE: not validated again through the wire schema: the core's events are checked when
    built (services/cachemgr/events.py) and this runs for every event of every request;
    tests/live decode what is published with ``decode(CacheEvent, ...)``."""
    return json.dumps({"schema_version": SCHEMA_VERSION, **wire}, separators=(",", ":")).encode()


_JSON_HEADERS: Final[dict[str, str]] = {CONTENT_TYPE: JSON}


def _ns(t_s: float) -> int:
    """Unix seconds → OpenTelemetry nanoseconds."""
    return int(t_s * 1e9)


def _finite_ns(t_s: float) -> int | None:
    """:func:`_ns` of a stamp, None when its nanoseconds are no finite number (a bogus stamp
    of a message, e.g. 1e300 s: a trace must never fail the work it describes)."""
    ns = t_s * 1e9
    return int(ns) if math.isfinite(ns) else None


def _record(name: str, *, start_s: float, end_s: float, parent: otel_context.Context,
            attributes: dict[str, Any], links: Sequence[Link] = (),
            error: tuple[BaseException, str] | None = None) -> Span | None:
    """A finished span (Unix seconds, measured already), returned so that children can hang
    under it (``shared.telemetry.record_span`` returns none and takes no links). ``error``:
    the exception it failed with and the ERROR status's description. Nothing for a stamp
    that is no finite time."""
    start_ns, end_ns = _finite_ns(start_s), _finite_ns(max(end_s, start_s))
    if start_ns is None or end_ns is None:
        return None
    span = tracer().start_span(name, context=parent, attributes=attributes, links=links,
                               start_time=start_ns)
    if error is not None:
        span.record_exception(error[0], timestamp=end_ns)
        span.set_status(Status(StatusCode.ERROR, error[1]))
    span.end(end_time=end_ns)
    return span


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Ack:
    """An EpochAck with the headers it is published with: its adoption's ``epoch_adopt``
    span's W3C context, the same on every send (:meth:`RankdService._publish_ack`). Compared
    by identity: a re-send drops the entry only if no newer adoption replaced it."""

    ack: EpochAck
    headers: Mapping[str, str]


@dataclasses.dataclass(slots=True)
class _PullHold:
    """The head of the FIFO held for its route-time pull (:meth:`RankdService._next_job`):
    since when, the full blocks of its prompt (a copy that names one of them is its pull),
    the ``cache-cmd`` spans of those copies (``copies``, for its ``cache_pull_wait`` span's
    links) and, once it started, when (``until_s``)."""

    job: Job
    since_s: float
    wanted: frozenset[int]
    copies: list[SpanContext] = dataclasses.field(default_factory=list)
    until_s: float | None = None


_RESULT_TIMES: Final[tuple[str, ...]] = (
    "started_at_s", "prefill_s", "kv_transfer_s", "first_decode_s", "finished_at_s",
    "modelled_prefill_s", "modelled_handoff_s", "switch_s")


def check_result_times(result: PrefillResult) -> None:
    """Raise ValueError naming the first of a backend's ``result`` times that is not a finite
    number (NaN, infinite, not a number at all): the span ends, the stage breakdown and the
    metrics are computed from them. Signs are not checked: durations measured across
    processes may be off by a clock's disagreement (``_nonneg`` guards the stages)."""
    for name in _RESULT_TIMES:
        x = getattr(result, name)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"the backend's result has {name}={x!r}, not a finite number")
    for i, x in enumerate(result.rank_compute_s):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"the backend's result has rank_compute_s[{i}]={x!r}, "
                             "not a finite number")


def _request_context(job: Job) -> otel_context.Context | None:
    """The context a result of ``job`` carries in its headers: its request's root (the job's
    trace carrier), so that whoever waits on the result can link to the request's trace (the
    controller's drain span links the requests it waited on); None (the current context)
    when the job came without one."""
    return _carrier_context(job.trace_carrier)


def _carrier_context(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context of a stage ``carrier`` (:func:`stage_carrier`: a request's root); None
    (the current context) without a valid one."""
    return extract(carrier) if carrier and traceparent_of(carrier) else None


def _traced(job: Job) -> bool:
    """Whether ``job``'s stage spans are recorded. job.trace_carrier is the root's context
    (:func:`stage_carrier`): every stage span is its direct child. Unsampled (the usual
    case at a 1% ratio): no span objects or attributes. No valid context at all: spans as
    before (roots, by ratio)."""
    return is_sampled(job.trace_carrier) or traceparent_of(job.trace_carrier) is None


def _ids(job: Job) -> dict[str, str]:
    """The request and worker attributes on every stage span of ``job``."""
    a = job.executed or job.assignment
    return {"vtm.request_id": a.request.request_id, "vtm.worker_id": a.worker_id}


def _nonneg(x: float) -> float:
    # Stages span processes on one host; guard against tiny clock disagreements.
    return max(0.0, x)


def request_content(req: IntakeRequest) -> bytes:
    """A digest of what a worker computes a request's first token from (its prompt, as
    tokens or block hashes, and ``max_tokens``): equal for every attempt of one request,
    whatever its arrival stamp or trace context. Never raises: a field msgpack cannot carry
    (an integer of 2**64 or more: ``max_tokens`` and ``block_size`` have no upper bound in the
    schema) is digested from its JSON form instead, the same for every attempt. Before, it
    raised OverflowError after the request had run, and the request went unanswered."""
    fields = [req.input_len, req.block_size, req.max_tokens, req.tokens, req.block_hashes]
    try:
        packed = msgpack.packb(fields)
    except (OverflowError, ValueError, TypeError):
        packed = b"json:" + json.dumps(fields, separators=(",", ":")).encode()
    return hashlib.blake2b(packed, digest_size=16).digest()


def restamped(data: bytes, headers: dict[str, str], arrival_s: float,
              now: float, carrier: Mapping[str, str] | None = None
              ) -> tuple[bytes, dict[str, str]]:
    """A kept FirstToken (``data``, ``headers``) as the answer of a later attempt of its
    request, the one that arrived at ``arrival_s``: that stamp, and the attempt's stages as
    far as known (its total to ``now``); the trace context is the later attempt's:
    ``carrier`` (its stage carrier, :func:`stage_carrier`), else (None, or one without a
    valid context) the current one -- the later attempt's where its assignment is answered
    (:meth:`RankdService._assign`). A joined attempt's copy is made where the job's answer
    is (the executor, a hand-back's task), whose context is no attempt's: before its carrier
    was passed, such a copy carried no trace context at all."""
    first = decode(FirstToken, data, headers)
    again = first.model_copy(update={"arrival_s": arrival_s,
                                     "stages": TtftStages(total_s=_nonneg(now - arrival_s))})
    out, headers = encode(again)
    return out, inject(headers, _carrier_context(carrier))


JoinedAnswer = tuple[float, Mapping[str, str]]
"""A later attempt that joined a job, as the job's answer goes to it: its arrival stamp and
its trace carrier (:func:`stage_carrier`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class JoinedAttempt:
    """A later attempt of ``job``'s request (the same content) that joined the job here: the
    attempt's own request (its arrival stamp, its trace context), the ``Nats-Msg-Id`` of
    the intake message whose assignment brought it (None: an assignment without one), when
    this worker accepted it and the carrier its spans hang from (:func:`stage_carrier`)."""

    job: Job
    request: IntakeRequest
    source: str | None
    accepted_at_s: float | None = None
    trace_carrier: Mapping[str, str] = dataclasses.field(default_factory=dict)


def kv_capacity(settings: RankdSettings, backend: ExecutionBackend) -> int:
    """The worker's KV-cache capacity in blocks: ``VTM_KV_TOTAL_BLOCKS`` when it was set,
    else the backend's own (a modelled worker's HBM budget, ``kv_capacity_blocks``), else the
    setting's default."""
    own = getattr(backend, "kv_capacity_blocks", None)
    if "kv_total_blocks" in settings.model_fields_set or own is None:
        return settings.kv_total_blocks
    return int(own)


def backend_max_seq_len(backend: ExecutionBackend) -> int | None:
    """The prompt limit (tokens) to publish as ``WorkerState.max_seq_len``: the backend's
    optional ``max_seq_len`` (services/rankd/backend.py), None when it has none or it is not
    known yet (< 1, e.g. a torch world not started). Capped at ``MAX_TOKENS``: no valid request
    is longer, and a larger value (a model with huge position tables) would fail the schema
    and with it the state publication, i.e. the worker's liveness heartbeat."""
    limit = getattr(backend, "max_seq_len", None)
    if limit is None or isinstance(limit, bool) or int(limit) < 1:
        return None
    return min(int(limit), MAX_TOKENS)


def stage_carrier(a: Assignment) -> dict[str, str]:
    """The W3C carrier the request's TTFT stage spans hang from: the root's.

    The assignment's ``request.trace_context`` is the gateway's root span context (the
    gateway puts it in the IntakeRequest; the scheduler copies into it whatever context the
    intake message's headers carried, and hand-backs keep it), so every stage is a direct
    child of the root wherever the request ran. Only when the request carries none (an
    assignment sent by hand: tests, tools) the current context is taken -- inside the
    assignment handler its server span's, or an unsampled caller's -- and the stages hang
    under the assign server span, as they all did before the root travelled with the
    assignment.
    """
    own = a.request.trace_context
    return dict(own) if traceparent_of(own) is not None else inject({})


def ttft_stages(job: Job, result: PrefillResult) -> TtftStages:
    """Stage breakdown of one finished request from the instants the pipeline recorded."""
    a = job.assignment
    arrival = a.request.arrival_s
    dequeued = a.dequeued_at_s if a.dequeued_at_s is not None else arrival
    return TtftStages(
        intake_wait_s=_nonneg(dequeued - arrival),
        schedule_s=_nonneg(a.assigned_at_s - dequeued),
        queue_wait_s=_nonneg(result.started_at_s - a.assigned_at_s),
        prefill_s=_nonneg(result.prefill_s),
        kv_transfer_s=_nonneg(result.kv_transfer_s),
        first_decode_s=_nonneg(result.first_decode_s),
        total_s=_nonneg(result.finished_at_s - arrival),
    )


class RankdService(MicroService):
    """One worker leader. Construct, then ``await run()`` (or ``start(stack)`` in tests)."""

    def __init__(
        self,
        settings: RankdSettings,
        backend: ExecutionBackend,
        *,
        clock: Callable[[], float] = time.time,
        on_fault: Callable[[WorkerFault], None] | None = None,
    ) -> None:
        """``on_fault``: called once, synchronously, when this worker meets a
        :class:`~shared.ids.WorkerFault` itself (a rank host stops its other workers)."""
        subjects = settings.subjects
        super().__init__(
            settings,
            name=micro_service_name("rankd"),
            version=VERSION,
            # Every endpoint below has an absolute subject ending in the worker id (ids last,
            # shared/subjects.py); the group only names the service's endpoint family.
            group=subjects.worker_group(),
            description="vertumnus rank daemon (worker leader)",
            metadata={"worker_id": settings.worker_id, "backend": backend.name},
        )
        self.rsettings = settings
        self.backend = backend
        self.clock = clock
        self.core = WorkerCore(
            settings.worker_id,
            kind=settings.kind,
            epoch=settings.epoch,
            kv_total_blocks=kv_capacity(settings, backend),
            max_queue=settings.max_queue,
            time_scale=getattr(backend, "time_scale", 1.0),
            pull_hold_slack=settings.pull_hold_slack,
            pull_hold_grace_s=settings.pull_hold_grace_s,
            # A new token per start: a restart under the same worker id is then visible to
            # the scheduler and the cache manager (its queue and cache are gone).
            incarnation=uuid.uuid4().hex[:16],
        )
        self.metrics = WorkerMetrics(self.core)
        bind = getattr(backend, "bind_cache", None)
        if callable(bind):  # a real engine keeps its KV in lockstep with this worker's cache
            bind(self.core.cache)
        self._js: JetStreamContext | None = None
        self._state_kv: KeyValue | None = None
        self._epochs: KeyValue | None = None
        self._work = asyncio.Event()  # something to start
        # A cache command ended (a pull may have landed), or the queue was handed back (the
        # held head may be gone): the executor weighs its pull hold again (_next_job).
        self._cache_changed = asyncio.Event()
        # Blocks of the copies being executed -- replicate commands and reconcile commands
        # with a source (a split's or merge's pending prefix arriving): WorkerCore.pull_hold
        # waits for them past its bound (see _on_cache_cmd).
        self._incoming: dict[int, frozenset[int]] = {}
        # The same copies with their cache-cmd spans: a held request's cache_pull_wait links
        # to each that brings its blocks (_link_hold).
        self._copies: dict[int, tuple[frozenset[int], Span]] = {}
        # The head of the FIFO held for its pull, if any (_next_job), until _run takes it.
        self._holding: _PullHold | None = None
        self._dirty = asyncio.Event()  # state changed; publish soon
        self._idle = asyncio.Event()  # nothing running
        self._idle.set()
        # GPU -> the EpochAck of the adopted epoch whose publish failed, with the headers it
        # goes out with (its adoption's epoch_adopt context: every re-send carries the same);
        # _resend_acks sends them again. Only the current adoption's: a newer one replaces
        # them (_adopt_payload).
        self._unsent_acks: dict[int, _Ack] = {}
        self._acks_unsent = asyncio.Event()
        # Set once the endpoints answer (serving()): no state or ack goes out before.
        self._reachable = asyncio.Event()

        self._events_lock = asyncio.Lock()  # cache events leave in event-id order
        # Cache events taken from the core whose publish failed (and every later one), oldest
        # first: sent before any newer one, by the next publication or _resend_cache_events.
        self._unsent_events: deque[CacheEvent] = deque()
        self._events_unsent = asyncio.Event()  # some are; wakes _resend_cache_events
        # Redirect tasks in flight: separate from the epoch watcher so a stop does not cancel
        # them; _shutdown waits for them (bounded).
        self._redirects: set[asyncio.Task[None]] = set()
        # First tokens still in their KV handoff after the worker moved on (a backend with
        # handoff_off_worker); _shutdown waits for them.
        self._handoffs: set[asyncio.Task[None]] = set()
        # request id -> (its content's digest (request_content), subject, data, headers) of
        # its first token, the latest ANSWER_MEMORY (the attempt answered: the core's
        # finished_arrival)
        self._answers: OrderedDict[str, tuple[bytes, str, bytes, dict[str, str]]] = \
            OrderedDict()
        self.answers_resent = 0
        # The executor's job whose answer went out (or a task of its own sends it, a KV
        # handoff's): anything that fails after it in the job's bookkeeping answers nobody
        # again (_executor).
        self._answered: Job | None = None
        # request id -> the later attempts of it (the same content) assigned while its job was
        # queued or running here, arrival stamp -> (its request, its source: the intake message
        # id, when it was accepted here, its stage carrier) of each: its answer goes to each
        # (_assign), a hand-back of the job takes each along (_hand_back).
        self._attempts: dict[str, dict[float, tuple[IntakeRequest, str | None, float,
                                                   dict[str, str]]]] = {}
        # Those attempts whose hand-back is under way (_hand_back until _redirect_joined
        # settles it), by (request id, arrival stamp): counted in the published queue_len
        # (the worker is not empty until they are in intake), and each one a stop cancelled
        # is logged as the core's redirecting jobs are (_settle_redirects).
        self._joined_out: dict[tuple[str, float], JoinedAttempt] = {}
        self._on_fault = on_fault
        self._tearing_down = False  # the setup's undoing began (_task_ended)
        self.fault: WorkerFault | None = None
        """The worker fault that stopped this worker (:meth:`fail`); :meth:`run` raises it."""
        self._update_metadata()

    # -- endpoints ----------------------------------------------------------------------------

    def endpoints(self) -> Sequence[Endpoint]:
        wid = self.core.worker_id
        return [
            Endpoint("assign", self._on_assign, subject=self.subjects.worker_assign(wid),
                     absolute=True),
            Endpoint("queue", self._on_queue, subject=self.subjects.worker_queue(wid),
                     absolute=True),
            Endpoint(
                "cache-snapshot",
                self._on_snapshot,
                subject=self.subjects.cache_snapshot(wid),
                absolute=True,
            ),
            Endpoint(
                "cache-cmd", self._on_cache_cmd, subject=self.subjects.cache_cmd(wid), absolute=True
            ),
        ]

    async def _on_queue(self, request: Request) -> QueueReport:
        """The controller's step 1 (and a scheduler unsure of a dispatch): this worker's FIFO
        in order and what executes now. 400 malformed, 404 for another worker's id."""
        q = request_model(request, QueueQuery)
        if q.worker_id != self.core.worker_id:
            raise UnknownWorker(f"queue query for {q.worker_id} reached {self.core.worker_id}")
        running = self.core.running
        listed = [*([running] if running is not None else []), *self.core.queued]
        return QueueReport(
            worker_id=self.core.worker_id,
            queued=[j.request_id for j in self.core.queued],
            in_flight=[running.request_id] if running is not None else [],
            # Each job's attempts: a scheduler holding a later attempt's dispatch must not
            # take the id listed for the first attempt as that one held here.
            arrivals=[[j.assignment.request.arrival_s,
                       *sorted(self._attempts.get(j.request_id, {}))] for j in listed],
        )

    async def _on_snapshot(self, request: Request) -> None:
        """The cache's whole index after the events published so far, answered in as many
        parts as the server's max_payload needs (shared/service.py ``respond_in_parts``): a
        full cache of the default size is several MiB of JSON."""
        async with self._events_lock:
            await self._publish_cache_events_locked()
            snap = self.core.cache_snapshot()
        data, headers = encode(CacheSnapshot(
            worker=snap.worker, last_event_id=snap.last_event_id, blocks=list(snap.blocks)
        ))
        await respond_in_parts(self.nc, request, data, headers)

    async def _on_cache_cmd(self, request: Request) -> CacheCommandResult:
        """Execute a cache command. Its server span (a child of the cache manager's span of
        the command, whose context the command's headers carry) says what it was
        (:func:`~services.cachemgr.tracing.command_attributes`) and how it ended
        (``vtm.cache_ok``, ``vtm.blocks_done``); a copy (a replicate command, or a reconcile
        command with a source) that brings a held request's blocks is linked to that
        request's root (:meth:`_link_hold`)."""
        cmd = request_model(request, CacheCommand)
        span = trace.get_current_span()  # the handler's (shared/service.py wrap_handler)
        if span.is_recording():
            span.set_attributes(command_attributes(cmd))
        # Refused (another worker's, a newer epoch's, no cache) before anything else: a
        # refused copy brings nothing, so it is neither counted as arriving nor linked to a
        # held request (below), and a real engine moves no KV for it. Before, it was
        # registered and linked first: a held request's trace showed it as its copy.
        self.core.check_command(cmd)
        key = id(cmd)
        copies = isinstance(cmd, ReplicateCommand) or (
            isinstance(cmd, ReconcileCommand) and cmd.source_worker is not None)
        if copies:
            blocks = frozenset(cmd.blocks)
            # A reconcile copy with a source counts as arriving, as a replicate copy does:
            # WorkerCore.pull_hold holds the head of the FIFO past its bound while either
            # brings its first missing block. J credits a prefix pending here after a split
            # or merge as a copy (placement.py "A pending prefix"), and a credited pull of
            # pending blocks is sent as reconcile copies alone (on_reuse first; the pull then
            # sends none): the simulator's request waits for every copy in flight to its
            # worker with a part of its credited prefix, reconcile ones included
            # (sim/simulator.py _place, _arriving). Before, the live one started at the
            # bound and recomputed what a reconcile copy was about to bring. One without a
            # source brings nothing (WorkerCore.apply_command: the pending part becomes a
            # miss) and is not waited for, nor is a copy that never comes (the bound).
            self._incoming[key] = blocks
            self._copies[key] = (blocks, span)
            if self._holding is not None:
                self._link_hold(self._holding, blocks, span)
        try:
            prepare = getattr(self.backend, "prepare_cache_command", None)
            if callable(prepare):  # a real engine moves the KV first; cmd shrinks to what it holds
                try:
                    cmd = await prepare(cmd)
                except WorkerFault as exc:  # the engine is gone: so is the worker (answered 409)
                    self.fail(exc)
                    raise
            result = self.core.apply_command(cmd)
        finally:
            self._incoming.pop(key, None)
            self._copies.pop(key, None)
            self._cache_changed.set()
        if span.is_recording():
            span.set_attributes({"vtm.cache_ok": result.ok, "vtm.blocks_done": result.blocks_done})
        await self._publish_cache_events()
        self._dirty.set()
        return result

    def stats_data(self) -> dict[str, Any]:
        return {"served": self.core.served, "answers_resent": self.answers_resent}

    async def _on_assign(self, request: Request) -> AssignmentAck:
        a = request_model(request, Assignment)
        with bind_request(a.request.request_id):  # the trace id: the handler's span's
            return await self._assign(a, request)

    async def _assign(self, a: Assignment, request: Request) -> AssignmentAck:
        """:meth:`_on_assign` once the assignment decoded, its request id bound."""
        # An empty header is none, as the scheduler takes an empty Nats-Msg-Id for none: kept,
        # every such request's hand-back had the one id ">{worker}" (handback_msg_id), and
        # intake dropped all but the first as duplicates -- taken for acknowledgements.
        source = (request.headers or {}).get(INTAKE_MSG_HEADER) or None
        rid = a.request.request_id
        if (rid, a.request.arrival_s) in self._joined_out:
            # This attempt joined a job here and its own hand-back is under way: as for a
            # job being handed back (the core's Redirecting), the scheduler retries and keeps
            # its record. Before, it was refused as "not ACTIVE" (placed afresh beside a
            # hand-back intake may be storing) or, with the worker ACTIVE, admitted.
            raise ServiceError(code=REDIRECTING_CODE,
                               description=f"{rid} (arrival {a.request.arrival_s!r}) is being "
                                           f"handed back by {self.core.worker_id}")
        try:
            # A joined attempt whose hand-back's outcome is unknown, or that intake holds,
            # before anything answered from what this worker kept: the request may have
            # finished here since (another attempt), which says nothing of this attempt's
            # hand-back -- intake may hold it (425 / 410), or does (410), to run and answer
            # it elsewhere. Before, the kept answer was sent to this attempt and it was acked
            # as done: answered twice. So for the job's own hand-back (its source and stamp)
            # once another attempt finished here: the kept answer went to the job's attempt,
            # which intake's hand-back answers too.
            self.core.check_handback(a, source=source)
        except HandBackUnknown as exc:
            await self._settle_unknown(exc)
        except HandedBack as exc:
            raise ServiceError(code=HANDED_BACK_CODE, description=str(exc)) from exc
        again = False
        done = self.core.finished_arrival(rid)
        if done is not None and done != a.request.arrival_s:
            # Assigned again after it was answered, as a later attempt under the same id (a
            # client retry the intake took as new: the server lost its store, or the
            # de-duplication window had passed; the same attempt -- the same arrival, a
            # scheduler re-sending its assignment after a crash -- had its answer: nothing to
            # do). The results stream may have lost the answer it kept. The same content is
            # not run twice (the core admits it as done): the kept answer is sent again,
            # stamped with this attempt's arrival -- a gateway takes only the results of the
            # attempt it waits for (services/gateway/adapter.py _Waiter), and one that lost
            # the id's claim with the store, or was restarted, waits for this attempt's
            # alone. Before, the answer went out with the first attempt's stamp and that
            # gateway waited out its result timeout (504). Other content under the id (a
            # new request reusing it once its claim had expired), a failed request's retry
            # or an answer no longer kept runs again: before, it was admitted as done and
            # never answered.
            kept = self._answers.get(rid)
            if kept is not None and kept[0] == request_content(a.request):
                self.answers_resent += 1
                self.log.info("request answered before assigned again; answer sent again",
                              request_id=rid)
                self._send_result(kept[1], *restamped(kept[2], kept[3], a.request.arrival_s,
                                                      self.clock()))
            else:
                again = True
                self.log.info("request id answered before assigned again with other content "
                              "or no kept answer; run again", request_id=rid)
        joins = False
        job = self.core.job(rid)
        if job is not None and job.assignment.request.arrival_s != a.request.arrival_s:
            # A later attempt under the id while an earlier one is queued or running here
            # (a client retry the intake took as new: the server lost its store). The same
            # content joins that job, which the core admits once: its answer goes to this
            # attempt too, stamped for it (a gateway waiting for this attempt takes no other
            # stamp). Other content waits until that job is answered (the scheduler tries
            # again; then it runs, above).
            if request_content(job.assignment.request) != request_content(a.request):
                raise ServiceError(code=REDIRECTING_CODE,
                                   description=f"{rid} runs here with other content; try "
                                               "again once it is answered")
            joins = True
        accepted = self.clock()
        carrier = stage_carrier(a)
        try:
            position = self.core.admit(a, accepted, trace_carrier=carrier, source=source,
                                       again=again)
        except HandBackUnknown as exc:  # settle it now: publish the hand-back again
            await self._settle_unknown(exc)
        except HandedBack as exc:  # the scheduler acks its old message (core module rules)
            raise ServiceError(code=HANDED_BACK_CODE, description=str(exc)) from exc
        except Redirecting as exc:  # the scheduler retries and keeps its record
            raise ServiceError(code=REDIRECTING_CODE, description=str(exc)) from exc
        if joins:
            # Only once admitted: a job being handed back is refused (Redirecting), and an
            # attempt noted for it would outlive its hand-back, to be answered twice when its
            # retry runs here (or kept for ever when it runs elsewhere).
            self._attempts.setdefault(rid, {})[a.request.arrival_s] = (a.request, source,
                                                                       accepted, carrier)
            self.log.info("later attempt joins the request's job here", request_id=rid,
                          arrival_s=a.request.arrival_s)
        self._work.set()
        self._dirty.set()
        self.log.debug("admitted", request_id=a.request.request_id, position=position)
        return AssignmentAck(
            request_id=a.request.request_id,
            worker_id=self.core.worker_id,
            epoch=self.core.epoch,
            queue_position=position,
            incarnation=self.core.incarnation,
        )

    # -- setup and teardown -------------------------------------------------------------------

    async def run(self, nc: Client | None = None, *, handle_signals: bool = True) -> None:
        """Serve until stopped (see :meth:`MicroService.run`). After a worker fault the stop
        is the usual graceful one (hand-backs settled first) and then the fault is raised, so
        a process ends non-zero and its supervisor restarts it."""
        await super().run(nc, handle_signals=handle_signals)
        if self.fault is not None:
            raise self.fault

    def fail(
        self, exc: WorkerFault, *, running: Job | None = None, cause_logged: bool = False
    ) -> None:
        """This worker can no longer compute (module docstring): stop admitting (UNAVAILABLE,
        for good), hand back ``running`` (the job whose execution raised ``exc``; None: leave
        the running one to finish or fail on its own) and every queued job through the same
        redirects as a drain, and stop; :meth:`run` then raises the first fault.

        ``cause_logged``: the caller (a rank host) already logged the cause as an error.
        Synchronous, no await between the core's hand-back and the redirect task (see
        :meth:`_hand_back`); idempotent except that a later call may hand back ``running``."""
        first = self.fault is None
        if first:
            self.fault = exc
        self._hand_back(self.core.fault(running.request_id if running is not None else None),
                        HandBackCause.WORKER_FAULT)
        self._update_metadata()
        self._dirty.set()  # UNAVAILABLE goes out at once: schedulers stop placing here
        if first:
            if cause_logged:
                self.log.warning("worker stops: its rank host faulted", worker=self.core.worker_id,
                                 cause=str(exc))
            else:
                self.log.error("worker fault: requests handed back to intake, exiting for a "
                               "restart", worker=self.core.worker_id, cause=str(exc),
                               request_id=running.request_id if running is not None else None)
            if self._on_fault is not None:
                self._on_fault(exc)
        self.request_stop()

    async def ensure_jetstream(self) -> None:
        self._js = self.jetstream()
        self._state_kv = await worker_state_kv(
            self._js, self.subjects, lease_s=self.rsettings.lease_s
        )
        self._epochs = await epoch_kv(self._js, self.subjects)
        await ensure_results_stream(self._js, self.subjects)  # publish_result stores into it
        self._dirty.set()  # this worker's state at once (it may have gone with the store)

    async def setup(self, stack: AsyncExitStack) -> None:
        try:
            await self._setup(stack)
        except BaseException:
            # Its teardown, which closes the backend, is registered last: a setup that fails
            # before it releases the backend here, so that a rank host starting the worker
            # again does not leave one backend behind per attempt.
            with contextlib.suppress(Exception):
                await self.backend.close()
            raise

    async def _setup(self, stack: AsyncExitStack) -> None:
        await self.ensure_jetstream()
        epochs = self._epochs
        assert epochs is not None
        # Adopt the current record before serving, so the first admission uses it.
        try:
            entry = await epochs.get(self.subjects.epoch_key())
        except NotFoundError:  # no record yet (dev runs): keep the configured epoch
            entry = None
        if entry is not None and entry.value:
            await self._adopt_payload(entry.value)
        watcher = await KvWatch(self.nc, epochs, self.subjects.epoch_key()).start()

        tasks = [
            asyncio.create_task(self._executor(), name=EXECUTOR_TASK),
            asyncio.create_task(self._publisher(), name=STATE_TASK),
            asyncio.create_task(self._watch_epochs(watcher), name=WATCH_TASK),
            # Acks that failed during the adoption above are waiting for it already.
            asyncio.create_task(self._resend_acks(), name=ACKS_TASK),
            asyncio.create_task(self._resend_cache_events(), name=EVENTS_TASK),
        ]
        health = getattr(self.backend, "health", None)
        if callable(health):  # optional backend method (services/rankd/backend.py)
            tasks.append(asyncio.create_task(self._probe_health(health), name=HEALTH_TASK))
        for task in tasks:  # no await since they were made: none can have ended unseen
            task.add_done_callback(self._task_ended)

        async def teardown() -> None:
            # From here every task's end is the undoing's, even where no stop was requested
            # (a start that failed after this setup: the watcher's stop ends its task).
            self._tearing_down = True
            await watcher.stop()
            await self._shutdown(tasks)

        stack.push_async_callback(teardown)

    async def serving(self) -> None:
        """The endpoints answer: the first WorkerState, and the EpochAcks of an adoption made
        before (held until now: either sends others to the endpoints)."""
        self._reachable.set()
        await self._publish_state()
        for gpu, unsent in list(self._unsent_acks.items()):
            try:
                await self._publish_ack(unsent)
            except Exception as exc:  # re-sent (module docstring)
                self.log.warning("epoch ack not sent; will retry", gpu=gpu,
                                 epoch=unsent.ack.epoch, error=repr(exc))
                self._acks_unsent.set()
                continue
            if self._unsent_acks.get(gpu) is unsent:
                del self._unsent_acks[gpu]

    async def _probe_health(self, health: Callable[[], WorkerFault | None]) -> None:
        """Fail the worker as soon as its backend reports a fault, even with nothing running."""
        while not _cancel_requested():
            try:
                fault = health()
            except Exception:  # a broken probe must not pass for a healthy worker silently
                self.log.exception("health probe failed; no longer probing")
                return
            if fault is not None:
                self.fail(fault)
                return
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        # No epoch is adopted from here on (the watcher may still hold entries): cancelling it
        # cannot split an adoption from its hand-back, which happen without an await between.
        await cancel_and_wait([t for t in tasks if t.get_name() == WATCH_TASK], self.log)
        self._hand_back(self.core.set_lifecycle(Lifecycle.UNAVAILABLE), HandBackCause.STOPPING)

        async def running_done() -> None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.drain_timeout_s):
                    await self._idle.wait()

        # Both bounded, concurrently: the stop takes max(redirects, running request).
        await asyncio.gather(self._settle_redirects(), running_done())
        # A running request that met a worker fault meanwhile was handed back while the wait
        # above may already have ended: settle its redirect too (bounded likewise).
        await self._settle_redirects()
        if self._handoffs:
            # Each ends at its finished_at_s once the results stream stored its FirstToken: a
            # short wait, bounded, and given up as soon as the connection is lost. No result
            # can be stored then, and publish_result waits for a reconnect (up to its
            # within_s): with the server gone (``vertumnus up`` killed) the stop waited out
            # the whole drain_timeout_s, 10 s, with nothing left to do.
            stored, _ = await while_connected(
                self.nc, asyncio.wait(set(self._handoffs),
                                      timeout=self.settings.drain_timeout_s),
                timeout_s=self.settings.drain_timeout_s)
            if not stored and self._handoffs:
                self.log.warning("results not stored at stop (no connection to the server)",
                                 worker=self.core.worker_id, results=len(self._handoffs))
        await cancel_and_wait(tasks, self.log)
        running = self.core.running
        if running is not None:  # drain timed out mid-request
            self.core.finish(running.request_id, ok=False)
            self._publish_failure(running, "worker stopped during prefill")
        try:
            # The final UNAVAILABLE state, unless the server is gone: a put on a connection
            # that lost it waited for its whole JetStream timeout, then raised past
            # backend.close (the state expires with its lease anyway).
            published, _ = await while_connected(self.nc, self._publish_state(),
                                                 timeout_s=FINAL_STATE_TIMEOUT_S)
            if not published:
                self.log.warning("final state not published (no connection to the server)",
                                 worker=self.core.worker_id)
        except Exception as exc:  # a KV error: the stop goes on
            self.log.warning("final state publish failed", worker=self.core.worker_id,
                             error=repr(exc))
        finally:
            await self.backend.close()

    # -- execution ----------------------------------------------------------------------------

    async def _executor(self) -> None:
        while not _cancel_requested():
            await self._work.wait()
            self._work.clear()
            while (job := await self._next_job()) is not None:
                self._idle.clear()
                self._dirty.set()
                # Every log line of the job carries its request and trace ids (conventions.md).
                with bind_request(job.request_id, trace_id_of(job.trace_carrier)):
                    self._answered = None
                    try:
                        await self._run(job)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # e.g. a publish on a closing connection
                        self.log.exception("request bookkeeping failed")
                        if self.core.running is job:  # never leave the slot occupied
                            self.core.finish(job.request_id, ok=False)
                        self._bookkeeping_failed(job, exc)
                    finally:
                        self._idle.set()
                        self._dirty.set()

    def _bookkeeping_failed(self, job: Job, exc: Exception) -> None:
        """``job``'s run raised ``exc`` outside the backend's prefill (its span, its metrics,
        its answer's making): the core finished it (or handed it back, a fault's). Unless its
        answer went out already (``_answered``) or it was handed back, it is answered with
        an error FirstToken, and so is each later attempt that joined it, as for a prefill
        that failed; the worker serves on. Before, the job ended unanswered -- its client
        waited out its timeout, and a re-sent assignment was acked as done and never ran.
        The attempts noted under its id are this job's: no job of the id is admitted while it
        runs (a later attempt joins it), and from the core's finish to the answer's making the
        executor does not await."""
        if self._answered is job or any(j is job for j in self.core.redirecting):
            return
        reason = f"request bookkeeping failed: {type(exc).__name__}: {exc}"
        try:
            self._publish_failure(job, reason[:ERROR_REASON_MAX])
        except Exception:  # the worker serves on; logged, as the failure above
            self.log.exception("error answer not sent")
            # Unanswered with the job (a note kept would later answer another request under
            # the id with this one's stamp).
            self._attempts.pop(job.request_id, None)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A background task the worker serves with ended (the done callback of each of
        :data:`SERVING_TASKS`). Only a stop ends them: before, one that died on its own left
        the worker admitting requests and publishing ACTIVE while part of it was gone, its
        failure seen at the stop at best -- the executor (an exception out of
        :meth:`_next_job`, a BaseException out of a backend that the per-request handling
        does not take): nothing ran the queue any more; the state publisher (a BaseException
        out of a publication, e.g. from the backend's ``max_seq_len``): no heartbeat, the
        scheduler placing on a stale state until the lease expired; the epoch watcher (a
        BaseException out of an adoption): no later record adopted, so a controller's drain
        waited for an EpochAck that never came until it aborted; the ack re-sender, the
        health probe (a BaseException out of ``health()``): lost acks, rank deaths under an
        idle worker, unnoticed. Now, while the service is not stopping, it is a worker fault
        (:meth:`fail`): the queued requests are handed back, the worker becomes UNAVAILABLE
        and stops, and :meth:`run` raises the fault so the supervisor restarts the process.
        The executor's end hands back the running request too (it will never finish here);
        after any other task's end the executor still runs it to its end (the stop waits for
        it). During a stop (or the undoing of a failed start) it is only logged (the stop
        fails a request still running, ``_shutdown``).

        A cancelled task (``cancelling()`` counts the cancels requested, and stays so once
        it ended) ended as it should: :meth:`_shutdown` cancels them (and so does the event
        loop's end). A CancelledError nobody requested, raised inside one, does not count.
        The health probe alone may return on its own: after it reported a fault (a stop
        then) or when ``health()`` raised an Exception -- a broken probe, not a broken
        worker: it stops probing (logged) and the worker serves on, rather than restarting
        for ever on a probe bug."""
        if task.cancelling() > 0:
            return
        name = task.get_name()
        what = SERVING_TASKS.get(name, name)
        cause: BaseException | None = (
            asyncio.CancelledError(f"raised in the {what}, which nobody cancelled")
            if task.cancelled() else task.exception())
        if cause is None and name == HEALTH_TASK:
            return  # its own end (docstring)
        if self.stopping or self._tearing_down:
            if cause is not None:
                self.log.error(f"{what} ended during the stop", worker=self.core.worker_id,
                               error=repr(cause))
            return
        self.log.error(f"{what} ended while serving; failing the worker",
                       worker=self.core.worker_id, task=name, error=repr(cause),
                       exc_info=cause if cause is not None else False)
        reason = repr(cause) if cause is not None else "returned"
        self.fail(WorkerFault(f"{what} ended: {reason}"),
                  running=self.core.running if name == EXECUTOR_TASK else None)

    async def _next_job(self) -> Job | None:
        """The next job to run (None: nothing to start now), once the pull its assignment
        counted on has landed or was waited for long enough (:meth:`WorkerCore.pull_hold`).

        A job held so is noted (``_holding``: since when, the copies of its blocks that
        arrived) for :meth:`_run`, which records the hold as ``vtm.pull_hold_s`` on its
        ``queue_wait`` span and a ``cache_pull_wait`` child span. Before, the hold was hidden
        inside the queue wait. A head handed back while held (a drain) is forgotten -- the
        hand-back wakes the wait (:meth:`_hand_back`) -- and the next head's hold counts from
        when it began."""
        while (hold := self._pull_hold()) > 0.0:
            head = self.core.queued[0]  # a hold is always the head's
            if self._holding is None or self._holding.job is not head:
                self._holding = self._hold_of(head)
            self._cache_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cache_changed.wait(),
                                       None if math.isinf(hold) else hold)
        job = self.core.start_next(self.clock())
        held = self._holding
        if held is not None and (job is None or held.job is not job):
            self._holding = None  # not the job that starts (handed back meanwhile)
        elif held is not None and job is not None:
            held.until_s = job.started_at_s  # no await since start_next: no copy links now
        return job

    def _hold_of(self, job: Job) -> _PullHold:
        """A hold of ``job`` beginning now, linked with the copies of its blocks already
        arriving (a copy sent before the request was assigned; replicate and reconcile
        copies, ``_copies``)."""
        req = job.assignment.request
        full = min(len(req.block_hashes), req.input_len // req.block_size)
        held = _PullHold(job, self.clock(), frozenset(req.block_hashes[:full]))
        for blocks, span in self._copies.values():
            self._link_hold(held, blocks, span)
        return held

    def _link_hold(self, held: _PullHold, blocks: frozenset[int], span: Span) -> None:
        """A copy of ``blocks`` executing under the ``cache-cmd`` ``span`` while ``held``
        waits (a replicate or a reconcile copy): when it brings some of the held request's
        blocks, link the two traces both ways -- the copy's span to the request's root, the
        request's ``cache_pull_wait`` (made at its start) to the copy's span. The pull's own
        trace is the cache manager's, not the request's: without the links nothing led from
        one to the other."""
        if held.until_s is not None or held.wanted.isdisjoint(blocks):
            return
        ctx = span.get_span_context()
        if not ctx.is_valid or not ctx.trace_flags.sampled:
            return
        held.copies.append(ctx)
        if span.is_recording() and is_sampled(held.job.trace_carrier):
            root = trace.get_current_span(extract(held.job.trace_carrier)).get_span_context()
            span.add_link(root, {LINK_REASON: "pull_hold",
                                 "vtm.request_id": held.job.request_id})

    def _pull_hold(self) -> float:
        """:meth:`WorkerCore.pull_hold` now, with the blocks of the copies arriving
        (``_incoming``: replicate commands and reconcile commands with a source, see
        :meth:`_on_cache_cmd`)."""
        incoming: set[int] = set()
        for blocks in self._incoming.values():
            incoming |= blocks
        return self.core.pull_hold(self.clock(), incoming)

    async def _run(self, job: Job) -> None:
        a = job.executed or job.assignment  # P, R as this worker's cache found them
        assert job.started_at_s is not None
        held, self._holding = self._holding, None
        if held is not None and held.job is not job:  # never so (_next_job); no stale hold
            held = None
        sampled = _traced(job)  # the stage spans below are the root's children
        ids = _ids(job)
        root = extract(job.trace_carrier)
        attrs = {
            **ids,
            "vtm.degree": a.degree,
            "vtm.epoch": a.epoch,
            "vtm.prefix_tokens": a.prefix_tokens,
            "vtm.recompute_tokens": a.recompute_tokens,
            "vtm.assigned_prefix_tokens": job.assignment.prefix_tokens,
            "vtm.predicted_s": a.predicted_s,  # modelled seconds
            "vtm.time_scale": self.core.time_scale,
            "vtm.backend": self.backend.name,
        }

        def failed_span() -> Span:
            """The prefill span of a prefill that raised (from the job's start: where the
            prefill began inside the backend is not known), its queue wait before it."""
            if not sampled:
                return trace.INVALID_SPAN
            self._record_queue_wait(job, job.started_at_s, ids, held, None)
            return tracer().start_span(str(Stage.PREFILL), context=root, attributes=attrs,
                                       start_time=_ns(job.started_at_s))

        # The root's context is current while the backend runs (a non-recording span when
        # unsampled: anything the backend traces keeps the decision). The prefill span is made
        # once the backend said where the prefill began (``result.started_at_s``): after a lazy
        # epoch switch, which is queue wait in the breakdown (ttft_stages) and in the trace
        # (an ``epoch_switch`` span in ``queue_wait``). Before, it began at the job's start and
        # the switch showed inside it.
        with trace.use_span(trace.get_current_span(root), end_on_exit=False,
                            record_exception=False, set_status_on_exception=False):
            try:
                result = await self.backend.prefill(a)
            except asyncio.CancelledError as exc:
                if _cancel_requested():  # this task was cancelled: the worker stops
                    span = failed_span()
                    span.set_status(Status(StatusCode.ERROR, "cancelled (worker stopping)"))
                    span.end()
                    raise
                # Nobody cancelled this task: the backend raised it (e.g. an internal future
                # of its was cancelled under it). The request's failure, as any exception of
                # one prefill; re-raised, it would end the executor (a worker fault,
                # _task_ended).
                self._prefill_failed(job, failed_span(), exc,
                                     "prefill failed: cancelled in the backend")
                return
            except WorkerFault as exc:
                # Not the request's fault: it goes back to intake (with the queue), no answer.
                span = failed_span()
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"worker fault, handed back: {exc}"))
                span.end()
                self.fail(exc, running=job)
                return
            except Exception as exc:
                self._prefill_failed(job, failed_span(), exc, f"prefill failed: {exc}")
                return
            except BaseException as exc:  # nothing a request answers: the executor ends
                span = failed_span()
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.end()
                raise
        try:
            check_result_times(result)
        except ValueError as exc:
            # A backend's bug, not the request's: answered as a failed prefill rather than
            # published with times no stage, span or metric can hold.
            self._prefill_failed(job, failed_span(), exc, f"prefill failed: {exc}")
            return
        prefilled = result.started_at_s + result.prefill_s
        if sampled:
            self._record_queue_wait(job, result.started_at_s, ids, held, result)
            # Ends where the backend measured the prefill's end: the KV handoff and the
            # first decode that follow get spans of their own.
            span = _record(str(Stage.PREFILL), start_s=result.started_at_s, end_s=prefilled,
                           parent=root, attributes={
                               **attrs,
                               "vtm.modelled_prefill_s": result.modelled_prefill_s,
                               "vtm.actual_prefill_s": result.prefill_s,  # wall
                               # In the unit of vtm.predicted_s: the wall figure alone is
                               # time_scale × off.
                               "vtm.actual_prefill_model_s":
                                   result.prefill_s / self.core.time_scale,
                           })
            if span is not None and span.get_span_context().trace_flags.sampled:
                self._record_rank_spans(job, result, prefilled, span, ids)
            # kv_transfer and first_decode: once the first token is sent (_answer), from
            # the stamps it carries.
        # Both in modelled seconds (the measured wall time ÷ the time scale).
        self.metrics.prefilled(a.degree, result.prefill_s / self.core.time_scale, a.predicted_s)
        self.core.finish(job.request_id, ok=True)
        await self._deliver_result(job, result)
        await self._publish_cache_events()

    def _record_queue_wait(self, job: Job, end_s: float, ids: dict[str, str],
                           held: _PullHold | None, result: PrefillResult | None) -> None:
        """The ``queue_wait`` span, from the scheduler's ``assigned_at_s`` to ``end_s`` (the
        prefill's start: where the breakdown's ``queue_wait_s`` ends), with what it holds as
        child spans and attributes: the pull hold (``vtm.pull_hold_s``, a
        :data:`PULL_WAIT_SPAN` span linked to the copies that arrived for it) and a lazy
        epoch switch the backend made first (``vtm.epoch_switch_s``, an
        :data:`EPOCH_SWITCH_SPAN` span ending at the prefill's start). Both 0 when there was
        none. Sampled requests only (the caller's check)."""
        a = job.executed or job.assignment
        started = job.started_at_s
        assert started is not None
        hold_s = _nonneg(started - held.since_s) if held is not None else 0.0
        switch_s = _nonneg(result.switch_s) if result is not None else 0.0
        wait = _record(str(Stage.QUEUE_WAIT), start_s=job.assignment.assigned_at_s,
                       end_s=end_s, parent=extract(job.trace_carrier),
                       attributes={**ids, "vtm.pull_hold_s": hold_s,
                                   "vtm.epoch_switch_s": switch_s})
        if wait is None:
            return
        inside = trace.set_span_in_context(wait)
        if held is not None:
            _record(PULL_WAIT_SPAN, start_s=held.since_s, end_s=started, parent=inside,
                    attributes={**ids,
                                "vtm.pull_copy_s": job.assignment.pull_copy_s,  # modelled
                                "vtm.assigned_prefix_tokens": job.assignment.prefix_tokens,
                                "vtm.prefix_tokens": a.prefix_tokens,
                                # Whether the cache gave the prefix J priced it with.
                                "vtm.pull_landed":
                                    a.prefix_tokens >= job.assignment.prefix_tokens,
                                "vtm.pull_copies": len(held.copies)},
                    links=[Link(c, {LINK_REASON: "pull_hold"}) for c in held.copies])
        if result is not None and switch_s > 0.0:
            _record(EPOCH_SWITCH_SPAN, start_s=result.started_at_s - switch_s,
                    end_s=result.started_at_s, parent=inside,
                    attributes={**ids, "vtm.epoch": a.epoch, "vtm.degree": a.degree,
                                "vtm.backend": self.backend.name})

    def _prefill_failed(self, job: Job, span: Span, exc: BaseException, reason: str) -> None:
        """``job``'s prefill raised ``exc``, the request's failure (not a worker fault): end
        its span, answer it with an error FirstToken (``reason``); the worker serves on."""
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        span.end()
        if not isinstance(exc, InvalidInput):
            self.log.exception("prefill failed", request_id=job.request_id)  # in its except
        self.core.finish(job.request_id, ok=False)
        self._publish_failure(job, reason)
        self._answered = job

    async def _deliver_result(self, job: Job, result: PrefillResult) -> None:
        """Publish the first token now, or at ``result.finished_at_s`` when the backend freed
        the worker at the prefill's end (SimBackend ``handoff_off_worker``: the KV handoff
        and first decode run off this worker's FIFO, as in the simulator) — then from a task
        of its own, so the next request starts meanwhile. The later attempts that joined the
        job are taken now, with the job just finished in the core: a new job under the id
        admitted during the wait (other content) keeps its own. Before, the late answer went
        to the attempts that had joined that new job as well.

        Should the answer's making fail (:meth:`_publish_result` sends nothing then), the job
        and those attempts get an error answer instead: here by the executor
        (:meth:`_bookkeeping_failed`, the attempts still noted), later by the handoff's task.
        Before, nobody was answered.

        The ``kv_transfer`` and ``first_decode`` spans are recorded with the answer, from the
        result it was made of (:meth:`_answer`)."""
        rid = job.request_id
        joined = self._joined_answers(rid)
        delay = result.finished_at_s - self.clock()
        if not delay > 0:  # NaN too: answered now, not by a task sleeping for ever
            self._answer(job, result, joined)
            self._attempts.pop(rid, None)
            self._answered = job
            return

        async def at_first_token() -> None:
            await asyncio.sleep(delay)
            # Measured, as a blocking backend's stages are: a late timer lengthens the last
            # stage (as a late sleep inside the backend would), not the control plane's share.
            late = max(0.0, self.clock() - result.finished_at_s)
            done = dataclasses.replace(result, first_decode_s=result.first_decode_s + late,
                                       finished_at_s=result.finished_at_s + late)
            try:
                self._answer(job, done, joined)
            except Exception as exc:  # nothing sent (_publish_result): an error answer
                self.log.exception("first token publish failed", request_id=rid)
                reason = f"first token not sent: {type(exc).__name__}: {exc}"
                try:
                    self._publish_failure(job, reason[:ERROR_REASON_MAX], joined)
                except Exception:
                    self.log.exception("error answer not sent", request_id=rid)

        task = asyncio.create_task(at_first_token(), name="rankd-handoff")
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)
        self._attempts.pop(rid, None)  # the task answers them (no await since the get)
        self._answered = job

    def _record_rank_spans(self, job: Job, result: PrefillResult, prefilled: float,
                           prefill_span: Span, ids: dict[str, str]) -> None:
        """One ``prefill_rank`` span per rank of the worker, children of ``prefill``: rank
        index, GPU and the rank's share of the R new tokens (zigzag, :func:`rank_shares`).

        Recorded by the leader on behalf of every rank: only the leader sees the request (in
        the sim the other ranks are not processes at all; with the torch engine they follow
        the leader's broadcast). Where the backend measured each rank's compute
        (``PrefillResult.rank_compute_s``, the torch engine) a rank's span lasts that long from
        the step's start (``vtm.rank_measured`` true, ``vtm.rank_compute_s``), so a straggler
        rank shows; otherwise (sim) the ranks run in lockstep by construction and each span
        covers the worker's measured prefill."""
        a = job.executed or job.assignment
        parent = trace.set_span_in_context(prefill_span)
        shares = rank_shares(a.recompute_tokens, a.degree)
        measured = len(result.rank_compute_s) == len(shares)
        for rank, tokens in enumerate(shares):
            attrs = {**ids, "vtm.rank": rank, "vtm.gpu": self.core.group.first_gpu + rank,
                     "vtm.degree": a.degree, "vtm.rank_tokens": tokens,
                     "vtm.rank_share": tokens / a.recompute_tokens,
                     "vtm.recompute_tokens": a.recompute_tokens,
                     "vtm.prefix_tokens": a.prefix_tokens, "vtm.backend": self.backend.name,
                     "vtm.rank_measured": measured}
            end = prefilled
            if measured:
                compute = result.rank_compute_s[rank]
                attrs["vtm.rank_compute_s"] = compute
                end = min(prefilled, result.started_at_s + compute)
            record_span(Stage.PREFILL_RANK, start_s=result.started_at_s, end_s=end,
                        parent=parent, attributes=attrs)

    def _answer(self, job: Job, result: PrefillResult, joined: Sequence[JoinedAnswer]) -> None:
        """Send ``job``'s first token (:meth:`_publish_result`) made of ``result`` -- the
        backend's, or with the first decode lengthened by a late handoff timer
        (:meth:`_deliver_result`) -- and record its ``kv_transfer`` and ``first_decode``
        spans from that same result, so they agree with the FirstToken's breakdown
        (``stages.kv_transfer_s``, ``stages.first_decode_s``). Before, they were recorded
        from the backend's result before the timer fired: a late timer's first decode was
        longer in the FirstToken (and ``vtm.request.stage``) than its span.

        When no FirstToken could be made of it (whatever :meth:`_publish_result` raises,
        re-raised: the caller answers with an error instead), the spans are recorded all the
        same, ``first_decode`` ERROR with the exception: the handoff ran, its first token
        never went out."""
        try:
            self._publish_result(job, result, joined)
        except Exception as exc:
            self._record_handoff_spans(job, result, error=exc)
            raise
        try:
            self._record_handoff_spans(job, result)
        except Exception:  # the answer went out: no error answer may follow it
            self.log.exception("handoff spans not recorded", request_id=job.request_id)

    def _record_handoff_spans(self, job: Job, result: PrefillResult,
                              error: Exception | None = None) -> None:
        """``kv_transfer`` (KV handoff to decode) and ``first_decode`` (first decode iteration
        → first token) spans from ``result``'s instants (the FirstToken's, :meth:`_answer`),
        siblings of ``prefill`` under the request's root span (:func:`stage_carrier`);
        ``first_decode`` ERROR when ``error`` kept the first token from being sent. Sampled
        requests only."""
        if not _traced(job):
            return
        ids = _ids(job)
        root = extract(job.trace_carrier)
        prefilled = result.started_at_s + result.prefill_s
        transferred = prefilled + result.kv_transfer_s
        _record(str(Stage.KV_TRANSFER), start_s=prefilled, end_s=transferred, parent=root,
                attributes={**ids, "vtm.degree": job.assignment.degree,
                            "vtm.total_tokens": job.assignment.request.input_len,
                            "vtm.modelled_handoff_s": result.modelled_handoff_s,
                            "vtm.backend": self.backend.name})
        failed = None if error is None else (
            error, f"first token not sent: {type(error).__name__}: {error}"[:ERROR_REASON_MAX])
        _record(str(Stage.FIRST_DECODE), start_s=transferred,
                end_s=transferred + result.first_decode_s, parent=root,
                attributes={**ids, "vtm.token": result.token, "vtm.backend": self.backend.name},
                error=failed)

    def _publish_result(self, job: Job, result: PrefillResult,
                        joined: Sequence[JoinedAnswer]) -> None:
        """Send ``job``'s FirstToken (kept to send again, :meth:`_keep_answer`) and a copy to
        each later attempt that joined it (``joined``: their arrival stamps and trace
        carriers, :meth:`_joined_answers`). All or nothing:
        whatever raises (the backend's result does not make a FirstToken, say) raises before
        anything is sent or kept, so the caller may answer them all with an error instead."""
        a = job.assignment
        msg = FirstToken(
            request_id=a.request.request_id,
            token=result.token,
            worker_id=a.worker_id,
            epoch=a.epoch,
            predicted_prefill_s=a.predicted_s,
            time_scale=self.core.time_scale,
            prefix_tokens=(job.executed or a).prefix_tokens,
            stages=ttft_stages(job, result),
            finished_at_s=result.finished_at_s,
            arrival_s=a.request.arrival_s,
        )
        data, headers = encode(msg)
        subject = self.subjects.result(a.request.request_id)
        headers = inject(headers, _request_context(job))
        copies = self._attempt_copies(data, headers, joined)
        self._keep_answer(a.request, subject, data, headers)
        for copy in copies:
            self._send_result(subject, *copy)

    def _failure(self, job: Job, reason: str) -> tuple[str, bytes, dict[str, str]]:
        """The error FirstToken of ``job``'s request (``reason``): its subject, data and
        headers."""
        a = job.assignment
        now = self.clock()
        msg = FirstToken(
            request_id=a.request.request_id,
            token=None,
            error=reason,
            worker_id=a.worker_id,
            epoch=a.epoch,
            predicted_prefill_s=a.predicted_s,
            time_scale=self.core.time_scale,
            stages=TtftStages(total_s=_nonneg(now - a.request.arrival_s)),
            finished_at_s=now,
            arrival_s=a.request.arrival_s,
        )
        data, headers = encode(msg)
        headers = inject(headers, _request_context(job))
        return self.subjects.result(a.request.request_id), data, headers

    def _publish_failure(self, job: Job, reason: str,
                         joined: Sequence[JoinedAnswer] | None = None) -> None:
        """Send ``job``'s error FirstToken (``reason``) and a copy to each later attempt that
        joined it (``joined``: as :meth:`_joined_answers` took them already; None: take them
        now from the attempts noted). All or nothing, as :meth:`_publish_result`."""
        subject, data, headers = self._failure(job, reason)
        rid = job.request_id
        copies = self._attempt_copies(data, headers,
                                      self._joined_answers(rid) if joined is None else joined)
        if joined is None:
            self._attempts.pop(rid, None)
        # Not kept to send again: a later attempt of a failed request (a client's retry)
        # runs again rather than get this failure (_assign).
        self._answers.pop(rid, None)
        self._send_result(subject, data, headers)
        for copy in copies:
            self._send_result(subject, *copy)

    def _attempt_copies(self, data: bytes, headers: dict[str, str],
                        joined: Sequence[JoinedAnswer]) -> list[tuple[bytes, dict[str, str]]]:
        """A request's answer (``data``) as the answer of each later attempt that joined its
        job here (:meth:`_assign`; ``joined``: their arrival stamps and trace carriers), each
        copy stamped with its attempt's arrival, under its attempt's trace context: made all
        before any is sent."""
        now = self.clock()
        return [restamped(data, headers, arrival, now, carrier) for arrival, carrier in joined]

    def _joined_answers(self, rid: str) -> tuple[JoinedAnswer, ...]:
        """The later attempts noted as joining ``rid``'s job (:meth:`_assign`), as its answer
        goes to them: each one's arrival stamp and trace carrier, in arrival order."""
        return tuple((arrival, attempt[3])
                     for arrival, attempt in sorted(self._attempts.get(rid, {}).items()))

    def _keep_answer(self, req: IntakeRequest, subject: str, data: bytes,
                     headers: dict[str, str]) -> None:
        """Send a request's FirstToken and keep it (the latest ``ANSWER_MEMORY``) to send
        again if a later attempt of the request is assigned here (:meth:`_on_assign`)."""
        rid = req.request_id
        content = request_content(req)
        self._answers[rid] = (content, subject, data, headers)
        self._answers.move_to_end(rid)
        if len(self._answers) > ANSWER_MEMORY:
            self._answers.popitem(last=False)
        self._send_result(subject, data, headers)

    def _send_result(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Publish a FirstToken from a task of its own (:func:`publish_result`: stored by the
        results stream, sent again across a broker blip), so the worker's next request does
        not wait for the stream's acknowledgement; shutdown waits for it (``_handoffs``)."""
        task = asyncio.create_task(
            publish_result(self.nc, subject, data, headers, log=self.log), name="rankd-result")
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)

    def _hand_back(self, jobs: Sequence[Job], cause: HandBackCause) -> None:
        """Start redirecting ``jobs`` (just handed back by the core, for ``cause``) in a task
        of their own, with the later attempts that joined them here (:meth:`_assign`), each as
        an intake message of its own: the hand-back of a job carries its first attempt, and a
        gateway that waits for a later one takes no other attempt's answer. Before, a joined
        attempt of a handed-back job was never answered (its gateway waited out its timeout).

        Called right after the core call that handed them back, with no await in between, so
        no cancellation can fall between the two."""
        if not jobs:
            return
        joined = [JoinedAttempt(job, *attempt) for job in jobs
                  for _, attempt in sorted(self._attempts.pop(job.request_id, {}).items())]
        for j in joined:
            self._joined_out[j.request.request_id, j.request.arrival_s] = j
        task = asyncio.create_task(self._redirect(jobs, joined, cause), name="rankd-redirect")
        self._redirects.add(task)
        task.add_done_callback(self._redirects.discard)
        # The head of the FIFO may have left with them while held for its pull (_next_job):
        # the executor weighs the hold again now. Before, it waited out the handed-back
        # request's hold (up to its bound) before the next request, admitted once the worker
        # was ACTIVE again, could start.
        self._cache_changed.set()
        self._dirty.set()

    async def _settle_unknown(self, unknown: HandBackUnknown) -> NoReturn:
        """Answer a re-sent assignment whose hand-back's outcome is unknown: publish that
        hand-back again (:meth:`_confirm_handback`), then 410 once intake acknowledged it
        (the scheduler acks its old message), 425 otherwise (it keeps its record and tries
        again)."""
        if await self._confirm_handback(unknown):
            raise ServiceError(code=HANDED_BACK_CODE, description=str(unknown)) from unknown
        raise ServiceError(code=REDIRECTING_CODE, description=str(unknown)) from unknown

    async def _confirm_handback(self, unknown: HandBackUnknown) -> bool:
        """Publish a hand-back of unknown outcome (``unknown.job``: a job, or a later attempt
        that joined one, ``unknown.joined``) again, under its own id (so intake stores it at
        most once), one attempt; True once intake acknowledged it (the core then answers its
        source HandedBack). The id does not depend on the epoch: the core remembers only
        hand-backs with a source."""
        assert self._js is not None
        job = unknown.job
        req = job.assignment.request
        data, headers = encode(req)
        headers.update(req.trace_context)  # first: never over the id set here
        wid, epoch = self.core.worker_id, self.core.epoch
        headers["Nats-Msg-Id"] = (
            joined_handback_msg_id(req.request_id, job.source, wid, epoch, req.arrival_s)
            if unknown.joined else handback_msg_id(req.request_id, job.source, wid, epoch))
        # The stamp and cause of the hand-back it publishes again (one message, one stamp).
        if job.handed_back_at_s is not None:
            headers[HANDBACK_AT_HEADER] = repr(job.handed_back_at_s)
        if job.handback_cause is not None:
            headers[HANDBACK_CAUSE_HEADER] = job.handback_cause
        try:
            ack = await self._js.publish(self.subjects.intake_requests(), data, headers=headers,
                                         timeout=REDIRECT_ATTEMPT_S)
        except (TimeoutError, nats.errors.Error) as exc:
            self.log.warning("hand-back of unknown outcome still unsettled",
                             request_id=req.request_id, error=repr(exc))
            return False
        with contextlib.suppress(InvalidInput):  # settled meanwhile by a concurrent re-send
            if unknown.joined:
                self.core.joined_handback_confirmed(job)
            else:
                self.core.handback_confirmed(req.request_id, source=job.source,
                                             arrival_s=req.arrival_s)
            # Only by the re-send that settled it: one span for one hand-back. An earlier try
            # of it may have stored it (its outcome was unknown): a duplicate is still its own.
            if job.handed_back_at_s is not None and job.handback_cause is not None:
                self._record_handed_back(req, job.trace_carrier, job.accepted_at_s,
                                         job.handed_back_at_s, job.handback_cause,
                                         joined=unknown.joined,
                                         assigned_s=None if unknown.joined
                                         else job.assignment.assigned_at_s)
        self.log.info("hand-back of unknown outcome settled", request_id=req.request_id,
                      arrival_s=req.arrival_s, joined=unknown.joined,
                      duplicate=bool(ack.duplicate))
        return True

    async def _settle_redirects(self) -> None:
        """Stop: wait for outstanding redirects (each bounds itself by ``redirect_timeout_s``;
        the wait adds one attempt's slack), then give up on any left, logging each id."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        cancelled = 0
        waited = False
        # A loop: a worker fault of the running request may start a redirect while we wait.
        while pending := {t for t in self._redirects if not t.done()}:
            waited = True
            _, left = await asyncio.wait(
                pending, timeout=self.rsettings.redirect_timeout_s + REDIRECT_ATTEMPT_S
            )
            await cancel_and_wait(list(left), self.log)
            cancelled += len(left)
        if waited:
            self.log.info("redirects settled at stop", waited_s=round(loop.time() - t0, 4),
                          cancelled_tasks=cancelled)
        # No await since the loop ended: every job still redirecting lost its task.
        for job in self.core.redirecting:  # only after a cancelled publish: outcome unknown
            self.core.redirect_settled(job.request_id)
            self.log.error("redirect outcome unknown at stop", request_id=job.request_id,
                           worker=self.core.worker_id)
        # Likewise every joined attempt whose hand-back was cancelled (before, unlogged).
        for (rid, arrival), _ in sorted(self._joined_out.items()):
            self.log.error("redirect outcome unknown at stop", request_id=rid,
                           worker=self.core.worker_id, arrival_s=arrival)
        if self._joined_out:
            self._joined_out.clear()
            self._dirty.set()

    async def _redirect(self, jobs: Sequence[Job], joined: Sequence[JoinedAttempt],
                        cause: HandBackCause) -> None:
        """Send handed-back requests to intake for re-placement (§6.2), in queue order, then
        the later attempts that joined them (``joined``), :data:`REDIRECT_WINDOW` publishes in
        flight at a time; settle each job in the core (a joined attempt is not the core's).
        Each carries its stamp and ``cause`` (:meth:`_publish_handback`).

        ``Nats-Msg-Id`` = :func:`handback_msg_id`: unique per hop (two sources of one merge
        drain under the same epoch, and a request may be redirected by both), the same for
        every publish of one hand-back. A joined attempt's is its own source's
        (:func:`~services.rankd.core.joined_handback_msg_id`)."""
        epoch = self.core.epoch
        deadline = asyncio.get_running_loop().time() + self.rsettings.redirect_timeout_s
        sends: list[Callable[[], Awaitable[None]]] = [
            *(functools.partial(self._redirect_one, j, epoch, deadline, cause) for j in jobs),
            *(functools.partial(self._redirect_joined, j, epoch, deadline, cause)
              for j in joined)]
        for i in range(0, len(sends), REDIRECT_WINDOW):
            if _cancel_requested():  # a cancel swallowed inside a publish (cancel_and_wait)
                raise asyncio.CancelledError
            await asyncio.gather(*(send() for send in sends[i : i + REDIRECT_WINDOW]))

    async def _redirect_one(self, job: Job, epoch: int, deadline: float,
                            cause: HandBackCause) -> None:
        """Publish one redirect until intake acknowledges it or ``deadline`` (loop time)
        passes; then settle it in the core. Never raises but CancelledError (the job then
        stays *redirecting*; :meth:`_settle_redirects` deals with it).

        The job keeps the hand-back's stamp and cause (a re-send of unknown outcome,
        :meth:`_confirm_handback`, carries the same); its ``handed_back`` span is recorded
        once intake holds the message this worker published (:meth:`_record_handed_back`)."""
        req = job.assignment.request
        if job.handed_back_at_s is None:
            job.handed_back_at_s = self.clock()
            job.handback_cause = str(cause)
        with bind_request(req.request_id, trace_id_of(req.trace_context)):
            error, maybe_stored, ours = await self._publish_handback(
                req, handback_msg_id(req.request_id, job.source, self.core.worker_id, epoch),
                epoch, deadline, at=job.handed_back_at_s, cause=job.handback_cause)
            self.core.redirect_settled(req.request_id, in_intake=error is None,
                                       unknown=error is not None and maybe_stored)
            self._dirty.set()
            if ours:
                self._record_handed_back(req, job.trace_carrier, job.accepted_at_s,
                                         job.handed_back_at_s, job.handback_cause,
                                         assigned_s=job.assignment.assigned_at_s)
            if error is not None and not maybe_stored:
                with contextlib.suppress(Exception):  # the connection may be closing
                    self._publish_failure(job, f"redirect failed: {error}")

    async def _redirect_joined(self, joined: JoinedAttempt, epoch: int, deadline: float,
                               cause: HandBackCause) -> None:
        """Publish a later attempt that joined a handed-back job (its own request: its
        arrival stamp and trace context) as :meth:`_redirect_one` does the job; a definite
        failure is answered to that attempt, an unknown outcome remembered by the core
        (:meth:`WorkerCore.joined_handback_unknown`: a re-sent assignment of the attempt
        publishes it again, :meth:`_confirm_handback`), as the job's is. Never raises but
        CancelledError (an attempt cancelled unsettled is not answered here: its outcome is
        unknown)."""
        req = joined.request
        at = self.clock()
        accepted = joined.accepted_at_s if joined.accepted_at_s is not None \
            else joined.job.accepted_at_s
        with bind_request(req.request_id, trace_id_of(req.trace_context)):
            error, maybe_stored, ours = await self._publish_handback(
                req, joined_handback_msg_id(req.request_id, joined.source, self.core.worker_id,
                                            epoch, req.arrival_s), epoch, deadline,
                at=at, cause=str(cause))
            # Settled (not after a cancel: then _settle_redirects logs it as unknown).
            self._joined_out.pop((req.request_id, req.arrival_s), None)
            self._dirty.set()
            if ours:
                self._record_handed_back(req, joined.trace_carrier, accepted, at, str(cause),
                                         joined=True)
            if error is None and joined.source is not None:
                # A scheduler re-sending this attempt's assignment (it crashed before its
                # record, or its 410 was lost) is told HandedBack, as for a job: before, it
                # ran here too. By its arrival stamp too: so even once the request finished
                # here since (another attempt), not answered from the kept answer.
                self.core.remember_handed_back(req.request_id, joined.source,
                                               arrival_s=req.arrival_s)
            elif error is not None and maybe_stored:
                # Intake may hold it: a re-sent assignment of this attempt must publish it
                # again (425 / 410), not be refused as "not ACTIVE", admitted, or taken as in
                # intake on the strength of the job's own hand-back. Before, it was forgotten.
                self.core.joined_handback_unknown(Job(
                    joined.job.assignment.model_copy(update={"request": req}),
                    accepted_at_s=accepted, trace_carrier=dict(joined.trace_carrier),
                    source=joined.source, handed_back_at_s=at, handback_cause=str(cause)))
            if error is not None and not maybe_stored:
                with contextlib.suppress(Exception):  # the connection may be closing
                    subject, data, headers = self._failure(joined.job,
                                                           f"redirect failed: {error}")
                    self._send_result(subject, *restamped(data, headers, req.arrival_s,
                                                          self.clock(), joined.trace_carrier))

    async def _publish_handback(self, req: IntakeRequest, msg_id: str, epoch: int,
                                deadline: float, *, at: float | None = None,
                                cause: str | None = None) -> tuple[str | None, bool, bool]:
        """Publish ``req`` to intake under ``msg_id`` until intake acknowledges it or
        ``deadline`` (loop time) passes. Returns (the error, None once acknowledged; whether
        some try may have stored it all the same; whether the message intake acknowledged is
        this worker's own), logging the outcome.

        Every try carries the hand-back's stamp ``at`` (:data:`HANDBACK_AT_HEADER`, where the
        scheduler starts the hand-back delivery's ``intake_wait``) and ``cause``
        (:data:`HANDBACK_CAUSE_HEADER`), so whichever try is stored says the same. The
        message is this worker's own unless intake answered it as a duplicate before any try
        of this worker's may have stored it: then another's publish under the same id (a
        scheduler handing the request back on this worker's behalf, with its own stamp and
        its own ``handed_back`` span) was stored first.

        Classified as the gateway's intake publish is (:func:`publish_transient`,
        :func:`publish_refused`): a try that timed out, a connection closed or reconnecting,
        a full outbound buffer (the connection is down: nothing sent) or a 5xx answer that may
        go away within seconds (JetStream "temporarily unavailable" during a leader election)
        is tried again, the same ``Nats-Msg-Id`` de-duplicating a repeat that lands, after a
        short pause that grows (:data:`REDIRECT_PAUSE_S` to :data:`REDIRECT_PAUSE_MAX_S`;
        none after a timeout, which waited already), until ``deadline``. An answer that
        retrying cannot change -- below 500 (the stream refused the message on a check before
        storing), a failed store or a full stream -- no intake stream at all (no responders)
        and any other nats-py error end it at once. Whether intake may hold it is
        :func:`publish_refused`'s: every try that may have stored it (a timeout, a connection
        closed, any 5xx: in a cluster the write may have been replicated) makes the outcome
        unknown, never a definite failure. Before, only a timeout was retried: one transient
        503, say, failed the hand-back at once and answered the client with an error,
        although intake might hold it (then answered twice)."""
        assert self._js is not None
        loop = asyncio.get_running_loop()
        rid = req.request_id
        data, headers = encode(req)
        headers.update(req.trace_context)  # first: never over the headers set here
        headers["Nats-Msg-Id"] = msg_id
        if at is not None:
            headers[HANDBACK_AT_HEADER] = repr(at)
        if cause is not None:
            headers[HANDBACK_CAUSE_HEADER] = cause
        ours = False
        maybe_stored = False  # some try may have stored it without our ack
        error: str | None = None
        last: str | None = None  # the latest retried try's failure, for the log
        retries = 0
        while True:
            left = deadline - loop.time()
            if left <= 0:
                error = (f"not acknowledged by intake within {self.rsettings.redirect_timeout_s}"
                         f" s (last: {last})")
                break
            if self.nc.is_closed or self.nc.is_draining:
                error = "connection closing"  # its ack could never arrive (module docstring)
                break
            try:
                ack = await self._js.publish(self.subjects.intake_requests(), data,
                                             headers=headers,
                                             timeout=min(left, REDIRECT_ATTEMPT_S))
            except TimeoutError:  # nats.errors.TimeoutError too
                maybe_stored = True  # retry at once: the same Nats-Msg-Id is de-duplicated
                last = "timeout"
                continue
            except APIError as exc:  # the stream answered, refusing it
                maybe_stored = maybe_stored or not publish_refused(exc)
                last = f"{type(exc).__name__}: {exc}"
                if not publish_transient(exc):  # the same message gets the same answer
                    error = last
                    break
            except _HANDBACK_RETRIED as exc:  # the connection down, lost or going
                maybe_stored = maybe_stored or not publish_refused(exc)
                last = f"{type(exc).__name__}: {exc}"
            except nats.errors.Error as exc:
                # No intake stream (no responders: nothing stored), or what nats-py raises
                # before it sends anything (a payload over max_payload, a bad header): as
                # before, a definite failure unless an earlier try may have stored it.
                error = f"{type(exc).__name__}: {exc}"
                break
            else:
                ours = not ack.duplicate or maybe_stored
                if ack.duplicate:
                    # A retry after a lost ack, or a de-duplicated hop: in intake either way.
                    self.log.warning("redirect de-duplicated by the intake stream",
                                     request_id=rid, worker=self.core.worker_id, epoch=epoch)
                else:
                    self.log.info("redirected", request_id=rid, worker=self.core.worker_id,
                                  epoch=epoch, arrival_s=req.arrival_s, retries=retries)
                break
            # Only the first retry is news; many redirects retry at once during an outage.
            say = self.log.info if not retries else self.log.debug
            say("redirect publish failed; trying again", request_id=rid, error=last,
                retries=retries)
            # Drawn at random: the redirects of a drain (REDIRECT_WINDOW at once) do not ask
            # a JetStream electing a leader all together, nor in a tight loop.
            pause = min(REDIRECT_PAUSE_MAX_S, REDIRECT_PAUSE_S * (1 << min(retries, 16)))
            retries += 1
            await asyncio.sleep(min(random.uniform(pause / 2, pause),
                                    max(0.0, deadline - loop.time())))
        if error is not None and maybe_stored:
            # Intake may serve it: an error answer now could contradict its real first token.
            self.log.error("redirect outcome unknown", request_id=rid,
                           worker=self.core.worker_id, error=error)
        elif error is not None:
            self.log.error("redirect failed", request_id=rid, worker=self.core.worker_id,
                           error=error)
        return error, maybe_stored, ours

    def _record_handed_back(self, req: IntakeRequest, carrier: Mapping[str, str],
                            accepted_s: float, at_s: float, cause: str, *,
                            joined: bool = False, assigned_s: float | None = None) -> None:
        """The ``handed_back`` span of a request (or of a later attempt that joined its job,
        ``joined``) this worker handed back to intake: the time it spent here, from its
        assignment (``assigned_s``, the scheduler's stamp, where its ``schedule`` span ends
        and its ``queue_wait`` would start; None: from its acceptance, ``accepted_s``) to the
        hand-back's stamp (``at_s``, its :data:`HANDBACK_AT_HEADER`: where the scheduler
        starts the hand-back delivery's ``intake_wait``), ``vtm.cause`` why -- so the
        request's stage spans follow each other through the hand-back, as the scheduler's
        own ``handed_back`` span (from the assignment) does. A child of the request's root
        (``carrier``, :func:`stage_carrier`) as the other stage spans, for a sampled trace
        only."""
        if not is_sampled(carrier):
            return
        if assigned_s is not None and math.isfinite(assigned_s):
            accepted_s = min(accepted_s, assigned_s)
        attrs: dict[str, Any] = {"vtm.request_id": req.request_id,
                                 "vtm.worker_id": self.core.worker_id, "vtm.cause": cause,
                                 "vtm.epoch": self.core.epoch}
        if joined:
            attrs["vtm.joined"] = True
        record_span(HANDED_BACK_SPAN, start_s=min(accepted_s, at_s), end_s=at_s,
                    parent=carrier, attributes=attrs)

    # -- cache events ---------------------------------------------------------------------------

    async def _publish_cache_events(self) -> bool:
        """:meth:`_publish_cache_events_locked` under the events lock."""
        async with self._events_lock:
            return await self._publish_cache_events_locked()

    async def _publish_cache_events_locked(self) -> bool:
        """Publish the cache events still unsent, then the core's new ones, oldest first
        (event-id order, each under its own id); True once none is left unsent. Never raises
        but CancelledError (the event being published then stays unsent: sent twice at worst,
        which the cache manager ignores as a duplicate id). Hold ``_events_lock``.

        An event whose publish fails for the connection's sake (down with its reconnect
        buffer full, reconnecting, closed or draining) is kept with every later one, the
        re-sender woken (:meth:`_resend_cache_events`), and False returned: a cache command
        that was applied is still answered as done, and a request's bookkeeping goes on.
        Before, the events taken from the core were lost with the exception: the next event
        sent showed the cache manager a gap (it then asks for a snapshot), but a worker that
        went quiet sent none, and the global index kept the blocks it lost and missed the
        ones it gained. One that fails for its own sake (nats-py refuses it, e.g. over the
        server's max_payload) would fail every time: it is dropped (logged) rather than hold
        back every later one, and the next one sent shows the gap. Beyond
        :data:`UNSENT_EVENTS_MAX` the oldest are dropped likewise."""
        pending = self._unsent_events
        pending.extend(self.core.take_cache_events())
        if len(pending) > UNSENT_EVENTS_MAX:
            dropped = len(pending) - UNSENT_EVENTS_MAX
            for _ in range(dropped):
                pending.popleft()
            self.log.error("unsent cache events dropped (the cache manager sees a gap)",
                           worker=self.core.worker_id, dropped=dropped)
        subject = self.subjects.cache_events(self.core.worker_id)
        while pending:
            ev = pending[0]
            try:
                await self.nc.publish(subject, _wire_json(ev.to_wire()), headers=_JSON_HEADERS)
            except _HANDBACK_RETRIED as exc:  # the connection down, lost or going: nothing sent
                if not self._events_unsent.is_set():  # once per outage, not per try
                    self.log.warning("cache events not sent; will retry",
                                     worker=self.core.worker_id, event_id=ev.event_id,
                                     unsent=len(pending), error=repr(exc))
                self._events_unsent.set()
                return False
            except Exception as exc:
                pending.popleft()
                self.log.error("cache event that cannot be published dropped (the cache "
                               "manager sees a gap)", worker=self.core.worker_id,
                               event_id=ev.event_id, error=repr(exc))
                continue
            # Only once it is out: a failure (or a cancel) above leaves it first in line.
            pending.popleft()
        return True

    async def _resend_cache_events(self) -> None:
        """Send again the cache events whose publish failed (module docstring), in order, with
        a growing delay while they keep failing; idle while none is unsent. A worker that
        gets nothing more to do still brings the cache manager's view of it up to date once
        its connection allows."""
        delay = EVENTS_RETRY_S
        while not _cancel_requested():
            await self._events_unsent.wait()
            await asyncio.sleep(delay)
            if not await self._publish_cache_events():
                delay = min(2 * delay, EVENTS_RETRY_MAX_S)
                continue
            # No await since the publication ended (the lock's release does not yield): a
            # failure of another publication cannot fall between it and the clear.
            self._events_unsent.clear()
            delay = EVENTS_RETRY_S
            self.log.info("unsent cache events published", worker=self.core.worker_id)

    # -- state and epochs ---------------------------------------------------------------------

    def current_state(self) -> WorkerState:
        """The WorkerState to publish now: the core's bookkeeping plus the backend's prompt
        limit, read each time (a backend may learn it after construction). Advances the
        state's ``seq``."""
        return self.core.state(self.clock(), max_seq_len=backend_max_seq_len(self.backend),
                               handing_back=len(self._joined_out))

    async def _publish_state(self) -> None:
        assert self._state_kv is not None
        await self._state_kv.put(self.core.worker_id, to_json(self.current_state()))

    async def _publisher(self) -> None:
        loop = asyncio.get_running_loop()
        last_key: tuple[Lifecycle, int] | None = None
        last_t = -math.inf
        await self._reachable.wait()  # serving() publishes the first state
        while not _cancel_requested():
            # NOTE: asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
            # races with the event being set, and shutdown would then wait forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.rsettings.heartbeat_s):
                    await self._dirty.wait()
            # Coalesce under load: every admit/start/finish marks the state dirty, and each
            # publication is fanned out to every watcher (scheduler, controller, cache
            # manager). Queue-length changes go out at most every STATE_MIN_INTERVAL_S; a
            # lifecycle or epoch change goes out at once.
            key = (self.core.lifecycle, self.core.epoch)
            wait = last_t + STATE_MIN_INTERVAL_S - loop.time()
            if key == last_key and wait > 0:
                await asyncio.sleep(wait)
            last_key, last_t = (self.core.lifecycle, self.core.epoch), loop.time()
            self._dirty.clear()
            try:
                await self._publish_state()
            except Exception as exc:  # a KV hiccup must not stop the heartbeat
                self.log.warning("state publish failed", error=str(exc))

    async def _watch_epochs(self, watcher: KvWatch) -> None:
        async for entry in watcher:
            if _cancel_requested():
                return
            if entry is None or not entry.value:  # end of initial values / delete marker
                continue
            try:
                await self._adopt_payload(entry.value)
            except Exception:
                # Safety net: whatever went wrong with this record, the worker must still
                # follow the later ones (a dead watcher never adopts another epoch).
                self.log.exception("epoch record handling failed; watching on")

    async def _adopt_payload(self, payload: bytes) -> None:
        try:
            record = decode(EpochRecord, payload)
        except SchemaError as exc:
            self.log.error("bad epoch record ignored", error=str(exc))
            return
        arrived_s = self.clock()
        adoption = self.core.adopt(record)
        if not adoption.adopted:
            return
        # Checked only for a record adopted: one warning per record, however often it is seen.
        parent = self._record_parent(record)
        # NOTE: started now (its context goes out in the acks' headers: the controller's
        # handling of each is its child) and ended below, but never the current span: the
        # redirects started meanwhile (tasks copy the context) must not join the
        # reconfiguration's trace.
        start_ns = _finite_ns(arrived_s)
        span = tracer().start_span(
            EPOCH_ADOPT_SPAN, context=parent, start_time=start_ns,
            attributes={"vtm.epoch": adoption.epoch, "vtm.worker_id": self.core.worker_id,
                        "vtm.lifecycle": adoption.lifecycle.value,
                        "vtm.member": adoption.member,
                        "vtm.redirected": bool(adoption.redirected),
                        "vtm.redirected_count": len(adoption.redirected)})
        ack_headers = inject({}, trace.set_span_in_context(span))
        try:
            await self._adopted(adoption, ack_headers)
        except BaseException as exc:
            # Still recorded: a failed adoption is what a reader of the trace looks for.
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            end_ns = _finite_ns(max(self.clock(), arrived_s))
            span.end(end_time=end_ns if start_ns is not None else None)

    async def _adopted(self, adoption: Adoption, ack_headers: Mapping[str, str]) -> None:
        """What follows the core's adoption of a record: hand back what it redirected,
        republish the metadata and send its EpochAcks (with ``ack_headers``: the
        ``epoch_adopt`` span's context) or keep them for the re-sender."""
        self.log.info(
            "epoch adopted",
            epoch=adoption.epoch,
            lifecycle=adoption.lifecycle.value,
            member=adoption.member,
        )
        # No suspension since core.adopt (awaiting this coroutine runs it at once; see
        # _hand_back).
        self._hand_back(adoption.redirected, HandBackCause.DRAINING
                        if adoption.lifecycle is Lifecycle.DRAINING else HandBackCause.UNAVAILABLE)
        self._update_metadata()
        # Acks still unsent are for an older epoch: this adoption's acks supersede them (the
        # controller counts an ack of any record from a target's commit on), and a worker
        # that left the composition or faulted acknowledges nothing.
        self._unsent_acks.clear()
        if adoption.member and not self.core.faulted:  # a faulted worker serves no geometry
            now = self.clock()
            for gpu in self.core.group.gpus:
                ack = _Ack(EpochAck(
                    gpu=gpu,
                    epoch=adoption.epoch,
                    degree=self.core.degree,
                    worker_id=self.core.worker_id,
                    adopted_at_s=now,
                ), ack_headers)
                if not self._reachable.is_set():  # sent by serving() once the endpoints are up
                    self._unsent_acks[gpu] = ack
                    continue
                try:
                    await self._publish_ack(ack)
                except Exception as exc:  # never ends the watcher: re-sent (module docstring)
                    self.log.warning("epoch ack not sent; will retry", gpu=gpu,
                                     epoch=adoption.epoch, error=repr(exc))
                    self._unsent_acks[gpu] = ack
                    self._acks_unsent.set()
        self._dirty.set()

    def _record_parent(self, record: EpochRecord) -> otel_context.Context:
        """The context of ``record``'s ``traceparent`` (an empty one: none, or malformed, which
        is logged as a warning: the record is adopted all the same)."""
        if not record.traceparent:
            return otel_context.Context()
        carrier = {"traceparent": record.traceparent}
        if traceparent_of(carrier) is None:
            self.log.warning("epoch record's traceparent malformed; its adoption is traced "
                             "without a parent", epoch=record.epoch,
                             traceparent=record.traceparent[:80])
            return otel_context.Context()
        return extract(carrier)

    async def _publish_ack(self, unsent: _Ack) -> None:
        data, headers = encode(unsent.ack)
        headers.update(unsent.headers)
        await self.nc.publish(self.subjects.epoch_ack(unsent.ack.gpu), data, headers=headers)

    async def _resend_acks(self) -> None:
        """Re-send the EpochAcks whose publish failed (module docstring), oldest failure
        first, with a growing delay while they keep failing; idle while none is unsent."""
        delay = ACK_RETRY_S
        while not _cancel_requested():
            await self._acks_unsent.wait()
            await asyncio.sleep(delay)
            if self.core.faulted:  # a faulted worker acknowledges nothing
                self._unsent_acks.clear()
            for gpu, unsent in list(self._unsent_acks.items()):
                try:
                    await self._publish_ack(unsent)
                except Exception as exc:
                    self.log.debug("epoch ack still not sent", gpu=gpu,
                                   epoch=unsent.ack.epoch, error=repr(exc))
                    continue
                # Unless a newer adoption replaced it while this one was being published.
                if self._unsent_acks.get(gpu) is unsent:
                    del self._unsent_acks[gpu]
                self.log.info("epoch ack sent on retry", gpu=gpu, epoch=unsent.ack.epoch)
            if self._unsent_acks:
                delay = min(2 * delay, ACK_RETRY_MAX_S)
            else:  # no await since the check: a failure added meanwhile is not lost
                self._acks_unsent.clear()
                delay = ACK_RETRY_S

    def _update_metadata(self) -> None:
        g = self.core.group
        self.set_metadata(
            epoch=str(self.core.epoch),
            lifecycle=self.core.lifecycle.value,
            degree=str(g.degree),
            gpus=f"{g.first_gpu}-{g.first_gpu + g.degree - 1}",
        )
