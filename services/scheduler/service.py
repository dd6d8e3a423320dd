"""The scheduler's NATS adapter: intake → SchedulerCore placement → the chosen worker.

One asyncio process, micro service ``vtm-scheduler`` (endpoint ``{prefix}.scheduler.status``).
Every placement decision comes from :class:`~services.scheduler.core.SchedulerCore` with the
policy named in settings (``make_policy``), so the baselines run live exactly as in the
simulator. This module only moves messages:

=====================================  ===========================================================
input                                  what the adapter does
=====================================  ===========================================================
intake (durable pull consumer          decode IntakeRequest; idempotency check against the
``scheduler`` on ``VTM_INTAKE``,       assignment-record KV bucket; ``trie.match`` →
explicit ack, ack_wait, max_deliver)   ``core.place``; record; dispatch the JSON Assignment
                                       (request-reply) to ``{prefix}.worker.assign.{wid}``;
                                       ack; send RequestStats (cachemgr) and WindowReport
                                       (controller, when a window closes; each report goes
                                       out again just ahead of the next one)
worker-state KV (watch all keys)       rebuild the ClusterView (lease: a state whose heartbeat
                                       is older than ``lease_s`` is UNAVAILABLE); register new
                                       workers in the replica PrefixTrie
``{prefix}.cache.events.*``            ``trie.apply``; a gap (or a worker first seen mid-stream)
                                       marks the worker stale in the trie and the adapter asks
                                       ``{prefix}.cache.snapshot.{wid}`` for a snapshot, which
                                       it applies
``{prefix}.cache.pending.*``           with ``pending_credit`` (and J's pull credit): the cache
(ReconciledNotice)                     manager's reconcile of a worker a split or merge made:
                                       ``mark_reconciled`` marks its pending and donor pages in
                                       the replica trie (kept until the worker's state registers
                                       it; a worker registered with none is asked of the cache
                                       manager, ``{prefix}.cachemgr.pending``), and
                                       ``core.place`` gets ``pending_reach``: J may count a
                                       pending prefix as a copy to its worker
``{prefix}.result.*`` (FirstToken)     ``core.finish``: release the reservation; the worker's
                                       next queued request started when this prefill ended
                                       (``core.start``, FIFO order)
the worker's AssignmentAck             ``queue_position == 0`` (nothing ahead on the FIFO
                                       worker) → ``core.start``: its prefill starts now
=====================================  ===========================================================

Intake deliveries are requested ahead (``fetch_batch``) and each is handled the moment it
arrives (:class:`shared.service.PullConsumer`), never held for the rest of a batch: a fetch
that waits for a full batch or its timeout showed up as intake waits of up to its timeout.
Placement is sequential, in intake order; the round trips after it (record store, the
worker's AssignmentAck, the intake ack) of up to ``max_inflight`` requests overlap, so the
rate is bounded by CPU, not by one request's round-trip latency (see ``handle_intake``).

Idempotency (at-least-once intake, at-most-once dispatch per intake message): the record in
the ``{STEM}_ASSIGNMENTS`` KV bucket, key = request id, holds the intake *stream sequence* (and
``Nats-Msg-Id``) of the message that produced the assignment. Duplicate publishes never get
here (the stream drops a repeated ``Nats-Msg-Id`` within its duplicate window). A delivery
whose request id has a ``dispatched`` record with the *same* stream sequence is a redelivery:
never dispatched again (a restarted scheduler sees the same record; see "Held intake
messages" for what it does instead). A new message under
the same request id (a redirect from a draining worker, which rankd republishes with
``Nats-Msg-Id`` ``{source}>{worker}``, or a client reusing its id after the duplicate window) is
placed again, the old reservation released. A ``dispatching`` record (we crashed
between recording and the worker's ack) is re-sent to the *same* worker; rankd's admission is
idempotent on request id. The assignment carries the message's ``Nats-Msg-Id`` (header
``Vtm-Intake-Msg-Id``): if the worker had admitted it and handed it back to intake meanwhile,
it answers 410 (the redirect is stored: this message is acked, nothing placed) or 425 (the
redirect is in flight: NAK, record kept). A redelivery whose record names a *newer* stream
sequence was superseded by such a redirect (already placed) and is acked without placement.

Failure handling: no eligible worker, or the worker refused (a micro error: it does not hold
the request) → the reservation is released, the record deleted and the message NAK'ed with
``retry_delay_s``. A worker that refused (an error other than 410 / 425) is avoided by the
request's retries on this replica while another worker is eligible (``_refused_by``); the only
eligible one is tried again. So is the worker that handed a request back (its hand-back's
message id names it): this replica may not yet know that it drains or stops.
A request longer than the ``max_seq_len`` of every worker in the view
(each worker's: the setting, lowered to the limit its WorkerState publishes, see
:func:`worker_view`; :class:`~services.scheduler.errors.SequenceTooLong`: no worker can ever
serve it, whatever their lifecycle) is neither held nor NAK'ed: it gets a FirstToken whose
error starts with ``not servable`` (the gateway answers 422) and the message is terminated,
on that delivery.
An empty view refuses nothing (the workers still to come may take it): the request is held
and retried as above, and refused as soon as a view with workers shows it too long.
A dispatch whose outcome is *unknown* — it timed out (the worker may have admitted it and only
its answer was lost), or a re-send of a recorded assignment got "no responders" (the worker may
have admitted an earlier send) — keeps the ``dispatching`` record and NAKs: the next delivery
re-sends to the *same* worker under the same intake message id (rankd answers idempotently: its
queue position, or 410 / 425 if it handed the request back), until the worker answers or is
known gone. A first send that gets "no responders" reached no worker and is re-placed. *Known
gone* (only once the worker-state view has loaded): no state (lease expired out of the bucket),
a heartbeat older than ``lease_s``, or UNAVAILABLE with nothing queued, running or being
redirected — whatever it had is finished (its result went out first) or handed back to intake —
and the worker's ``queue`` endpoint does not list the request (a view that lags a live worker
is overruled). The request is then handed back on the worker's behalf: published to intake
under the id the worker would have used for it (:func:`services.rankd.core.handback_msg_id`),
so if the worker did hand it back, intake de-duplicates the two (within its duplicate window),
and the old message is acked; a request whose result this replica saw is acked without either.
On its last delivery (``max_deliver``) a message that still failed gets a FirstToken with an
error (so the client is not left waiting) and is terminated -- unless its outcome is unknown
and the worker, asked on its ``queue`` endpoint, lists the request as queued or running: then
its own first token answers the client and the message is acked (``unknown_held``), or the
results stream already keeps a first token of it (finished after it arrived: the worker ran it
while every answer about it was lost): an error would only replace that answer there, so the
message is acked (``fail_found_answered``). A malformed intake message is terminated at once:
one whose body does not decode, or whose header block could not be read
(:data:`shared.natsclient.MALFORMED_HEADERS`, whatever its body), counted in ``malformed``.

Lost workers (:mod:`services.scheduler.ledger`): every request this replica dispatched stays
in its ledger until a result for it arrives. A worker whose state names a new *incarnation*
(its rank daemon was restarted under the same id) lost what the old one held; a worker whose
heartbeat is older than ``lease_s`` and whose ``queue`` endpoint has no responder (the process
died) lost everything. Housekeeping (and a restart, at once) hands those requests back to
intake under the worker's own hand-back id, releasing their reservations, so they are placed
again instead of leaving their clients to the gateway's result timeout; a restarted worker's
replica-trie view is also reset (its cache is empty and its event ids start again). A first
send that finds no responder marks the worker unreachable: not eligible until its state
changes (a new ``seq`` or incarnation), so retries go to another worker. A hand-back of a
request whose first token this replica saw is acked unplaced.

Held intake messages (``hold_intake``, the default): a dispatched request's intake message
is acked only when its result arrives or the request is handed back, and marked in progress
every ``ack_wait_s / 3`` meanwhile; a replica that stops NAKs what it holds. So when a replica
dies or restarts, its dispatched requests are redelivered (after ``ack_wait``, or at once after
a NAK) to a replica -- another one, or its next process -- which *adopts* each one the
worker still lists (or that it cannot ask yet while the worker's state is fresh): it enters
its ledger, and a worker lost afterwards is recovered as above. Before, a restarted replica
started with an empty ledger, and a worker dying after that lost its requests for good (the
client got a 504). A redelivery whose first token is out (``_served``, or kept in the results
stream) is acked, and so is a re-sent "dispatching" assignment its worker had served already
(it answers position 0 and runs nothing; the kept result, read once the message is held,
says so); one whose worker is gone, or restarted since it admitted the request
(``AssignmentRecord.incarnation``), is handed back; one that a live worker no longer lists
(it ran it, or handed it back itself) is acked. The consumer's ``max_ack_pending`` must
cover every replica's dispatched-but-unanswered requests. A replica with a fixed instance id
that starts NAKs, before taking any delivery, the messages its dead predecessor held (the
records name the holder and keep its delivery's reply subject; an adoption makes the adopter
the holder), so after a crash and restart they come back at once rather than after
``ack_wait``. A request its predecessor placed is reserved in the adopter's core when adopted
(the worker reports it as this replica's work, which ``_note_foreign`` leaves to the core).
A replica that dies for good is noticed by the others (``$SRV.PING`` every ``peer_check_s``;
unlisted for ``peer_gone_s``), and the live one with the smallest id gives back what it held
the same way. A replica that starts also notes every other holder its walk of the unacked
messages finds: one that never answers its listing (dead before this process started, which
the others may never have seen) is found gone after ``peer_gone_s`` and given back by it.
A server that comes back without its store loses the intake with every message in it; the
gateway sends its waiting requests again (``REPUBLISHED_HEADER``), and a replica adopts such
a message where a worker lists the request, acks it if its first token is out, and places it
otherwise (``_republished_known``): the ones dispatched before the loss are still answered by
their workers (and recovered if those die), the ones never delivered would otherwise be lost.

Tracing (conventions.md: one root per request at the gateway, one child per TTFT stage): two
stage spans per delivery, each a child of the gateway's root span (context from the intake
message's headers, else its ``trace_context``), timed by the same stamps as the FirstToken's
breakdown, so that the stage spans do not overlap and cover the TTFT. ``intake_wait`` ends at
the placement's dequeue stamp (``Assignment.dequeued_at_s``): a request held for an eligible
worker (``hold_s``) waits in intake in both, the span saying how long it was held
(``vtm.held_s``). It starts at the gateway's arrival stamp on a first delivery; at this
replica's NAK of the delivery before on a retry (``vtm.retry``: the ``retry_delay_s`` wait,
intake wait in the breakdown too); at the hand-back's publish on a hand-back
(``vtm.handed_back``, ``vtm.handed_back_by``, ``vtm.handback_cause``); on a redelivery after a
replica that took the message stopped or died without acking, NAKing or holding it
(``vtm.redelivered``, ``vtm.delivery``) at ``max(first, dequeue - ack_wait)`` -- ``first``
the arrival (a hand-back's publish), ``ack_wait`` the intake consumer's own. JetStream
redelivers such a message ``ack_wait`` after the delivery before (or its last in-progress
ack), so the bound is no earlier than that delivery: the span covers the wait from there,
which the breakdown (``vtm.request.stage{intake_wait}``: dequeue - arrival) counts as intake
wait too, and does not overlap the stage spans of the deliveries before it -- a replica
records those only once it placed (a ``dispatching`` record then names the message: a
redelivery of it re-sends that assignment, ``vtm.resumed``, and records no intake wait, as
the worker most likely admitted the first send and the time since is its queue wait) or
NAK'ed (which this replica remembers only for its own NAK; another replica's NAK is told from
a lapse by the message's age: stored less than ``ack_wait`` before the dequeue, no delivery
of it can have lapsed). What can stay uncovered: the lapsed delivery's own wait, from the
arrival to about when the dead replica received it (its spans die with it); the time from
another replica's retry NAK to a redelivery here (its hold only is recorded); for a re-sent
``dispatching`` assignment whose worker had not admitted the first send, the time from that
send to the re-send. A message older than ``ack_wait`` that another replica NAK'ed is taken
for a lapsed one (its span may then overlap that replica's last attempt), and a scheduler
clock behind the server's by more than the first delivery's latency can miss a lapse (hold
only, as before). A request this replica hands back for a lost or gone worker gets a
``handed_back`` span (``vtm.worker_id``, ``vtm.cause``) from its assignment there to that
publish. A held message that a replica gives back by a NAK -- its holder as it stops, or the
replica that finds the holder gone -- has that NAK's stamp in its record
(``AssignmentRecord.naked_at_s``, sampled traces only), and the replica that takes it over
records the wait from there to its delivery as :data:`REDELIVERY_WAIT_SPAN` (``vtm.naked_by``,
``vtm.holder``, ``vtm.worker_id``, ``vtm.delivery``); not a stage span, as its worker most
likely runs the request meanwhile. ``schedule`` starts where the intake wait ends and
carries the chosen worker, P, R, s, the J terms, and every candidate's terms
(``vtm.candidate.{wid}.{q,s,extra_gpu,score,P,R,excluded}``, as conventions.md asks) plus
the whole decision as JSON (``vtm.decision``); it ends at ``assigned_at_s`` (event
``assigned``), where the breakdown's schedule stage ends. The dispatch is its child
``dispatch`` (a client span from ``assigned_at_s`` to the worker's ack,
``vtm.queue_position``; in the breakdown it is queue wait), and the worker's
``vtm-rankd.assign`` server span is the dispatch's child. A failed attempt has ERROR status on
its own span -- ``schedule`` with ``vtm.no_eligible_worker`` or ``vtm.refused``, ``dispatch``
with ``vtm.dispatch_error`` -- never on the root: a retry that succeeds has spans of its own.
A NAK'ed delivery's spans end at the NAK, where its retry's intake wait starts. The worker's
own stage spans are the root's children too, not the assign span's: the root's context
travels in the assignment (:func:`with_trace_context`). Spans only for a sampled trace (the
``traceparent`` flag; a message without any trace context starts a root, sampled by ratio):
an unsampled request builds no span and no attributes, and its carrier is passed on to the
worker unchanged. A ReconciledNotice applied to the replica trie is a
:data:`RECONCILED_APPLY_SPAN` span, a child of the context its headers carry (the cache
manager's ``cachemgr_epoch`` span whose reconcile made it, in the reconfiguration's trace),
when that context is sampled; a notice without one records none. Metrics:
services/scheduler/metrics.py.

It publishes RequestStats (shared/schemas.py) on ``{prefix}.cache.stats.{reporter}`` and
keeps AssignmentRecord (defined here) in the assignment bucket.

Replicas: several schedulers share the intake's consumer. Each reserves what it places; the
others' work on a worker reaches its q_w from the worker's state (``outstanding_by``, by
``Assignment.scheduler_id``) and, between two states, from the others' placements (their
RequestStats: ``WorkerLoad.add_foreign``), which also count as in-flight prefixes until their
results (:meth:`SchedulerCore.note_foreign`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Any, Final, Literal

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.micro.request import Request
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import Field, ValidationError, field_validator, model_validator

from services import calibration
from services.cachemgr.events import MalformedEvent, event_from_json, snapshot_reply
from services.cachemgr.reconcile import mark_reconciled, pending_reach
from services.cachemgr.trie import ApplyOutcome, PrefixTrie
from services.controller.core import request_preferred_degree
from services.controller.windows import DEFAULT_WINDOW_S, DemandWindows, WindowSummary
from services.rankd.core import (
    FINISHED_MEMORY,
    HANDBACK_AT_HEADER,
    HANDBACK_CAUSE_HEADER,
    HANDED_BACK_CODE,
    HANDED_BACK_SPAN,
    INTAKE_MSG_HEADER,
    JOINED_MARK,
    REDIRECTING_CODE,
    attempt_mark,
    handback_msg_id,
    is_handback_msg_id,
)
from services.scheduler.core import SchedulerCore
from services.scheduler.decision import CandidateTerms, Decision
from services.scheduler.errors import NoEligibleWorker, SequenceTooLong, UnknownRequest
from services.scheduler.ledger import LEDGER_LIMIT, DispatchLedger, Loss, LostWorker, Sent
from services.scheduler.metrics import RetryReason, SchedulerMetrics
from services.scheduler.placement import PullCredit, pull_copy_s
from services.scheduler.policies.vertumnus import JPolicy
from services.scheduler.registry import make_policy
from services.scheduler.view import UNLIMITED, ClusterView, RequestInfo, WorkerView
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DEGREES,
    BlockHash,
    InvalidInput,
    VertumnusError,
    WorkerId,
)
from shared.logging import bind_request
from shared.natsclient import MALFORMED_HEADERS
from shared.schemas import (
    NOT_SCHEDULED,
    NOT_SERVABLE,
    SCHEMA_VERSION,
    Assignment,
    AssignmentAck,
    FirstToken,
    Id,
    IntakeRequest,
    Message,
    NonNegFloat,
    NonNegInt,
    PendingQuery,
    PendingReply,
    PlacementTerms,
    QueueQuery,
    QueueReport,
    ReconciledNotice,
    RequestStats,
    SchemaError,
    TtftStages,
    WallTime,
    WindowReport,
    WorkerState,
    decode,
    encode,
    from_json,
    to_json,
)
from shared.service import (
    REPUBLISHED_HEADER,
    WORKER_LEASE_S,
    Endpoint,
    KvWatch,
    MicroService,
    PullConsumer,
    RemoteError,
    call,
    ensure_intake_stream,
    ensure_key_value,
    ensure_results_stream,
    every_answer,
    first_token_of,
    latest_result,
    publish_result,
    request_in_parts,
    while_connected,
    worker_state_kv,
)
from shared.settings import ServiceSettings, json_object_text
from shared.subjects import Subjects, micro_service_name, validate_token
from shared.tasks import cancel_and_wait, spawn_once, spawn_tracked
from shared.telemetry import (
    Stage,
    extract,
    inject,
    is_sampled,
    record_span,
    span_attribute_limit,
    trace_id_of,
    traceparent_of,
    tracer,
)
from shared.worker import Lifecycle, worker_restarted

VERSION: Final[str] = "0.1.0"
REPUBLISHED_POLL_S: Final[float] = 0.05
"""How often a gateway's re-send after a store loss looks for the worker view to load."""
MSG_ID_HEADER: Final[str] = "Nats-Msg-Id"
HANDED_BACK: Final[int] = int(HANDED_BACK_CODE)
REDIRECTING: Final[int] = int(REDIRECTING_CODE)
ASSIGNMENT_TTL_S: Final[float] = 3600.0
_BUFFERED: Final[int] = 64
"""Most workers whose ReconciledNotice waits for their first state (SchedulerService
``on_reconciled``): a reconfiguration makes at most a few at a time."""
_BUFFERED_PARTS: Final[int] = 128
"""Most parts kept for one of them (128 × 8,192 entries: a worker's whole cache index can be
at most 2^20 blocks, shared/schemas.py MAX_BLOCKS_PER_EVENT)."""
_BUFFERED_ENTRIES: Final[int] = 1 << 21
"""Most entries kept in all of them together (a part may hold up to 2^20 by the schema: the
bound on what notices for workers that never register can hold; a few hundred MB at most)."""
_REFUSALS_KEPT: Final[int] = 4096
"""Most requests whose refusing workers a replica remembers for their retries
(SchedulerService ``_refused_by``; the oldest are forgotten first)."""
_NAKS_KEPT: Final[int] = 4096
"""Most NAK'ed intake messages whose NAK stamp a replica remembers for the ``intake_wait``
span of their redelivery (SchedulerService ``_naked``; the oldest are forgotten first)."""
DISPATCH_SPAN: Final[str] = "dispatch"
"""The span of an assignment's request-reply to its worker: a child of ``schedule`` (not a
TTFT stage: the breakdown counts it in the worker's queue wait)."""
REDELIVERY_WAIT_SPAN: Final[str] = "intake_redelivery_wait"
"""The wait of a held intake message from the NAK that gave it back (its holder stopping, or
a replica giving back a gone holder's: :attr:`AssignmentRecord.naked_at_s`) to its delivery
to the replica that takes it over: a child of the gateway's root. Not a TTFT stage: the worker
most likely runs the request meanwhile (the span then overlaps its stage spans); when the
worker is gone too, it is time the request waited before its hand-back."""
RECONCILED_APPLY_SPAN: Final[str] = "reconciled_apply"
"""A replica's marking of one ReconciledNotice in its trie (kind CONSUMER): ``vtm.worker_id``,
``vtm.epoch``, ``vtm.part``, ``vtm.entries`` (the notice's), ``vtm.buffered`` (it waited for
the worker's state), and what was marked (``vtm.pending``, ``vtm.donors``, ``vtm.skipped``);
ERROR when the trie refused it. A child of the context in the notice's headers (the cache
manager's ``cachemgr_epoch`` span that reconciled the worker), recorded only when that is
sampled: without a context there is no span (no root per notice), so the replicas' adoption
shows in the reconfiguration's trace, which is always sampled."""


class HandBackCause(StrEnum):
    """Why a replica handed a request back on its worker's behalf (span attribute
    ``vtm.cause``, header :data:`HANDBACK_CAUSE_HEADER`, metric ``vtm.scheduler.handbacks``)."""

    LOST_RESTARTED = "lost_restarted"  # the worker restarted under the same id (ledger.Loss)
    LOST_SILENT = "lost_silent"  # its lease ran out and its queue endpoint does not answer
    GONE = "gone"  # a redelivery or re-send found its recorded worker gone
    WORKER = "worker"  # a worker's own hand-back without a cause header (an older rankd)


def handback_worker(msg_id: str) -> str:
    """The worker a hand-back's intake message id (:func:`handback_msg_id`: ``{source}>{worker}``,
    a joined attempt's with ``@a{stamp}`` after it) names as the one handing back. Pure."""
    return msg_id.rpartition(">")[2].split(JOINED_MARK, 1)[0]


def _end_span(span: Any, at_s: float | None = None) -> None:
    """End ``span`` (if any and not ended yet) at ``at_s`` (Unix seconds; None: now)."""
    if span is not None and span.is_recording():
        span.end(end_time=None if at_s is None or not math.isfinite(at_s * 1e9)
                 else int(at_s * 1e9))


def _fail_span(span: Any, attribute: str, what: str) -> None:
    """Mark one attempt's span failed: ``attribute`` = ``what`` and ERROR status (the attempt
    failed, not the request: the root is not touched, and a retry has its own spans)."""
    if span is not None:
        span.set_attribute(attribute, what)
        span.set_status(Status(StatusCode.ERROR, what[:256]))


# -- settings ---------------------------------------------------------------------------------


class SchedulerSettings(ServiceSettings):
    """The scheduler process (environment ``VTM_*``, ``__`` for nesting; CLI flags override).

    Example: ``VTM_POLICY=vllm VTM_POLICY_PARAMS='{"alpha": 0.5}' VTM_PROFILE_PATH=prof.json``.
    """

    service_name: str = Field(default="vtm-scheduler", description="Service name in logs/traces.")
    policy: str = Field(
        default="vertumnus",
        description="Placement policy, a name in the registry (services.scheduler.registry): "
        "vertumnus, homo, homo_cp2, static, vllm, sglang, dynamo, llmd, round_robin.",
    )
    policy_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword parameters of the policy (JSON object in the environment), e.g. "
        '{"beta": 1.5, "lam": 0.5} for vertumnus; unknown names are rejected at start. Unset '
        "weights of vertumnus default to the calibrated ones (services/calibration.py BETA, LAM, "
        "BETA_BUSY_POWER; {\"beta_busy_power\": 0} gives the paper's fixed β).",
    )
    profile_path: Path | None = Field(
        default=None,
        description="Fitted cost-model profile (JSON from `vertumnus profile`); None: the "
        "built-in default profile. Never the simulator's ground truth.",
    )
    seed: int = Field(default=0, description="Seed of the policy's random generator.")
    block_size: int = Field(
        default=DEFAULT_BLOCK_SIZE, ge=1, description="Cache block size B in tokens."
    )
    degrees: list[int] = Field(
        default_factory=lambda: list(DEFAULT_DEGREES),
        description="The pool's supported CP degrees (the controller's): the replica prefix "
        "trie keeps statistics for them and the demand breakdown uses them; a worker of "
        "another degree is scheduled but its cache is not tracked.",
    )
    max_seq_len: int = Field(
        default=UNLIMITED,
        ge=1,
        description="Longest input any worker serves (tokens); every worker's view gets it, "
        "lowered to the worker's own limit where its WorkerState publishes one "
        "(max_seq_len: e.g. the torch engine's model positions). A request longer than "
        "every worker's limit is refused at once (an error starting 'not servable': HTTP 422 "
        "at the gateway) rather than held and retried; one that fits some workers goes to "
        "one of them; with no worker in the view yet it waits.",
    )
    lease_s: float = Field(
        default=WORKER_LEASE_S,
        gt=0,
        description="A worker state whose heartbeat is older than this counts as UNAVAILABLE.",
    )
    ack_wait_s: float = Field(
        default=30.0, gt=0, description="Intake consumer ack_wait: redelivery after this long."
    )
    max_deliver: int = Field(
        default=5, ge=1, description="Intake deliveries before a request fails for good."
    )
    hold_intake: bool = Field(
        default=True,
        description="Ack a dispatched request's intake message only when its result arrives "
        "(or it is handed back), keeping it in progress meanwhile: a replica that dies or "
        "restarts leaves its dispatched requests to be redelivered to a replica that adopts "
        "them, so a worker lost after that is still recovered. False: ack at dispatch.",
    )
    peer_check_s: float = Field(
        default=2.0, gt=0,
        description="How often a replica lists the scheduler replicas ($SRV.PING) to notice "
        "one that is gone (hold_intake).",
    )
    peer_gone_s: float = Field(
        default=10.0, gt=0,
        description="A replica that answered no listing for this long is gone: the live one "
        "with the smallest id NAKs the intake messages it held, so they come back before "
        "ack_wait (too late to matter once ack_wait * 2/3 has passed since it was seen). A "
        "replica known only as the holder of messages found at start, and never listed, is "
        "given back by every replica that found it.",
    )
    max_ack_pending: int = Field(
        default=LEDGER_LIMIT, ge=1,
        description="Intake consumer max_ack_pending (when the scheduler creates the "
        "consumer): unacked deliveries of all replicas together; with hold_intake every "
        "dispatched request awaiting its result counts.",
    )
    retry_delay_s: float = Field(
        default=0.5,
        ge=0,
        description="NAK delay when no worker is eligible or the worker refused.",
    )
    hold_s: float = Field(
        default=2.0,
        ge=0,
        description="When no worker is eligible (e.g. every one is switching during a "
        "reconfiguration), keep the message and place it as soon as the worker view changes, "
        "for up to this long; only then NAK it with retry_delay_s (which counts against "
        "max_deliver). 0: NAK at once.",
    )
    republished_listing_s: float = Field(
        default=1.0, ge=0,
        description="How long one listing of every worker's queue answers the gateways' "
        "re-sends after a store loss: they come in a burst (every waiting request of every "
        "gateway), and a listing taken after the loss is as good as a later one for them -- "
        "their lost messages cannot be dispatched again meanwhile -- so each worker is asked "
        "about once per burst, not once per message. 0: a listing per message.")
    fetch_batch: int = Field(
        default=16, ge=1,
        description="Intake deliveries requested ahead (shared.service.PullConsumer); each "
        "is handled as it arrives.")
    max_inflight: int = Field(
        default=256,
        ge=1,
        description="Intake messages placed and dispatched but not yet acknowledged by their "
        "worker. Placement stays strictly sequential (message order); only the waits for the "
        "worker's AssignmentAck and the record store overlap.",
    )
    dispatch_timeout_s: float = Field(
        default=5.0, gt=0, description="Wait for the worker's AssignmentAck."
    )
    snapshot_timeout_s: float = Field(
        default=5.0, gt=0, description="Wait for a worker's cache snapshot reply."
    )
    time_scale: float = Field(
        default=1.0, gt=0,
        description="Wall seconds per predicted second of the workers' times: 1 in a real "
        "deployment; `vertumnus up`'s simulated ranks sleep the modelled time × its time scale, "
        "and q_w then takes the time a request has run in modelled seconds.",
    )
    window_s: float = Field(
        default=DEFAULT_WINDOW_S,
        gt=0,
        description="Controller window H in seconds; windows are aligned on multiples of H "
        "since the Unix epoch so every replica's windows coincide.",
    )
    long_threshold_tokens: int = Field(
        default=calibration.CONTROLLER.long_threshold_tokens,
        ge=1,
        description="Input length from which a request counts as long in the WindowReports' "
        "long_requests (the controller's rules 12 and 15 read the share): keep it equal to "
        "the controller's long_threshold_tokens.",
    )
    merge_speedup: float | None = Field(
        default=calibration.CONTROLLER.merge_speedup,
        ge=1.0,
        description="§6.1 rule 1's threshold for the demand-by-preferred-degree breakdown of "
        "WindowReports (a request prefers 2C over C when Ê_C ≥ this · Ê_2C, climbing over "
        "`degrees`); the controller's merge gate reads it and ignores a breakdown made with "
        "another threshold or degree set, so keep both equal to the controller's "
        "merge_speedup and degrees. None: no breakdown (the gate then admits every merge).",
    )
    pull: bool = Field(
        default=True,
        description="The cache manager's route-time pull is on (the same VTM_PULL as the "
        "cache manager's: keep them equal). With it, J's pull credit may count on the copy "
        "(pull_credit_blocks); off: J counts only what is held.",
    )
    pull_min_blocks: int = Field(
        default=calibration.PULL.min_blocks, ge=1,
        description="The cache manager's pull_min_blocks (the same VTM_PULL_MIN_BLOCKS: keep "
        "them equal): a shorter gap is not copied, so J gives it no credit.",
    )
    pull_credit_blocks: int = Field(
        default=calibration.PULL_CREDIT_BLOCKS, ge=0,
        description="J's pull credit (services/scheduler/placement.py PullCredit): a worker "
        "whose queue covers the copy's estimated time is priced as holding the longest held "
        "prefix, for copies of pull_min_blocks up to this many blocks. 0: no credit. J "
        "policies only (vertumnus, homo, homo_cp2).",
    )
    pull_displace_block_s: float = Field(
        default=calibration.PULL_DISPLACE_BLOCK_S, ge=0, allow_inf_nan=False,
        description="With the pull credit: J's price (seconds of its cost) for each block a "
        "credited copy moves, which takes a block of the destination's cache.",
    )
    pending_credit: bool = Field(
        default=calibration.PENDING_CREDIT,
        description="With the pull credit: J also counts a prefix pending at a worker after a "
        "split or merge (the cache manager's ReconciledNotice marks it in this replica's "
        "trie) as a copy to it (services/scheduler/placement.py \"A pending prefix\").",
    )
    pull_wait: bool = Field(
        default=calibration.PULL_WAIT,
        description="With the pull credit: it also goes to a worker whose queue is shorter "
        "than the copy, and the worker holds a request J counted a pull for until the copy "
        "has landed (Assignment.pull_copy_s; the rank daemon's pull_hold_slack bounds it).",
    )
    assignment_ttl_s: float = Field(
        default=ASSIGNMENT_TTL_S,
        gt=0,
        description="How long assignment records (idempotency) are kept; must exceed the "
        "intake duplicate window and the longest redelivery horizon.",
    )

    peer_ttl_s: float = Field(
        default=120.0,
        gt=0,
        description="Another replica's placement counts for the in-flight prefix affinity "
        "until its result, at most this long (wall seconds; bounds what a missed result "
        "leaves behind).",
    )

    @field_validator("policy_params", mode="before")
    @classmethod
    def _params(cls, v: Any) -> Any:
        return json_object_text(v)

    @model_validator(mode="after")
    def _credit(self) -> SchedulerSettings:
        if self.pull and self.pull_credit_blocks and self.pull_credit_blocks < self.pull_min_blocks:
            raise ValueError(f"pull_credit_blocks ({self.pull_credit_blocks}) must be 0 or at "
                             f"least pull_min_blocks ({self.pull_min_blocks})")
        return self

    def pull_credit(self) -> PullCredit | None:
        """J's pull credit for these settings, or None (pull off, or no credit)."""
        if not self.pull or not self.pull_credit_blocks:
            return None
        return PullCredit(min_blocks=self.pull_min_blocks, max_blocks=self.pull_credit_blocks,
                          displace_block_s=self.pull_displace_block_s, wait=self.pull_wait)


# -- names (built in shared/subjects.py) -------------------------------------------------------


Listing = dict[str, frozenset[float] | None]
"""A worker's queue report as this adapter reads it: each request id it lists (queued or
running) → the arrival stamps of the attempts of it the worker holds (None: a worker that
does not tell, taken to hold every attempt)."""


def listing_of(report: QueueReport) -> Listing:
    """The :data:`Listing` of ``report``. Pure."""
    ids = (*report.in_flight, *report.queued)
    if not report.arrivals:
        return dict.fromkeys(ids)
    out: dict[str, frozenset[float]] = {}
    for rid, stamps in zip(ids, report.arrivals, strict=True):  # aligned (QueueReport)
        out[rid] = out.get(rid, frozenset()) | frozenset(stamps)
    return dict(out)


def lists_attempt(listing: Listing | None, rid: str, arrival_s: float) -> bool:
    """Whether ``listing`` holds the attempt of ``rid`` that arrived at ``arrival_s`` (False
    for None: a worker that did not answer). The stamp matters after a store loss: a later
    attempt under the id (a client retry the intake took as new) is not held by a worker
    that lists the id for the first attempt only, and adopting it there would leave it
    unanswered (that worker answers the first attempt, stamped for it). Pure."""
    if listing is None or rid not in listing:
        return False
    stamps = listing[rid]
    return stamps is None or arrival_s in stamps


def assignment_bucket(subjects: Subjects) -> str:
    """KV bucket of AssignmentRecord, key = request id (``VTM_ASSIGNMENTS``)."""
    return subjects.assignment_bucket()


def scheduler_group(subjects: Subjects) -> str:
    return subjects.service_group("scheduler")


# -- messages this adapter defines --------------------------------------------------------------


class AssignmentRecord(Message):
    """Idempotency record of one request's assignment (KV, key = request id)."""

    request_id: Id
    stream_seq: NonNegInt = Field(
        description="intake stream sequence of the message placed (a redelivery has the same)"
    )
    msg_id: str = Field(min_length=1, description="Nats-Msg-Id of that message")
    worker_id: Id
    epoch: NonNegInt
    degree: int = Field(ge=1)
    predicted_s: NonNegFloat
    state: Literal["dispatching", "dispatched"]
    scheduler: str
    assigned_at_s: WallTime
    incarnation: str = Field(
        default="", description="the worker incarnation that admitted it (its AssignmentAck; "
        "set on a ``dispatched`` record): a restart of the worker since then lost it")
    holder: str = Field(
        default="", max_length=256,
        description="the replica holding the intake message (empty: ``scheduler``; another "
        "one after it adopted the request)")
    ack_subject: str = Field(
        default="", max_length=512,
        description="reply subject of the holder's intake delivery (empty: not known). The "
        "next process of a replica with a fixed instance id NAKs it at start, so what its "
        "predecessor held comes back at once, not after ack_wait.")

    naked_at_s: WallTime | None = Field(
        default=None,
        description="when a replica gave the held intake message back (a NAK: its holder as "
        "it stopped, or a replica for a gone holder), stamped for a sampled trace only: "
        "where the redelivery's ``intake_redelivery_wait`` span starts. Cleared by the "
        "replica that reads it for that span, and by every later write of the record (an "
        "adoption, a new placement), so a stamp is never taken for a later delivery's")
    naked_by: str = Field(default="", max_length=256,
                          description="the replica that sent that NAK (empty: none stamped)")

    @field_validator("ack_subject")
    @classmethod
    def _ack_subject(cls, v: str) -> str:
        # A NAK is published to it: only ever a JetStream acknowledgement subject.
        if v and (not v.startswith("$JS.ACK.") or any(c.isspace() for c in v)):
            raise ValueError(f"not a JetStream ack subject: {v[:80]!r}")
        return v




# -- pure helpers (no IO) ---------------------------------------------------------------------


def worker_view(state: WorkerState, *, now: float, lease_s: float, block_size: int,
                max_seq_len: int, reachable: bool = True) -> WorkerView:
    """The scheduler's view of one worker-state record (lease expiry, or ``reachable``
    False: a send to it found no responder since this state → UNAVAILABLE).

    ``max_seq_len`` is the scheduler's setting; the view's limit is the smaller of it and the
    worker's published ``state.max_seq_len`` (None: the setting alone). So the refusal of a
    prompt longer than every worker, and the exclusion of a worker too short for it, follow
    what each engine actually serves, not one number for the whole pool."""
    lifecycle = state.lifecycle
    if now - state.heartbeat_s > lease_s or not reachable:
        lifecycle = Lifecycle.UNAVAILABLE
    return WorkerView(
        worker_id=WorkerId(state.worker_id),
        degree=state.degree,
        kind=state.kind,
        lifecycle=lifecycle,
        epoch=state.epoch,
        max_seq_len=(max_seq_len if state.max_seq_len is None
                     else min(max_seq_len, state.max_seq_len)),
        kv_capacity_tokens=max(1, state.kv_total_blocks) * block_size,
    )


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def placement_terms(decision: Decision, policy: object, candidates: int) -> PlacementTerms | None:
    """The chosen worker's J terms as a wire message (None when the policy has none)."""
    c = decision.chosen
    q, s = _finite(c.q), _finite(c.s)
    if q is None or s is None:
        return None
    score = _finite(c.score)
    return PlacementTerms(
        policy=decision.policy,
        q_s=max(0.0, q),
        s_s=max(0.0, s),
        gpu_cost_s=_finite(c.extra_gpu) or 0.0,
        # The β the score used (a load-following β differs from the policy's setting).
        beta=decision.beta if decision.beta is not None else float(getattr(policy, "beta", 0.0)),
        lam=float(getattr(policy, "lam", 0.0)),
        j=score if score is not None else 0.0,
        candidates=candidates,
    )


SCHEDULE_SPAN_RESERVED: Final[int] = 8
"""Attributes of the schedule span set outside :func:`decision_attributes` (request id,
scheduler, delivery, resumed, a failure, ...; the queue position and a dispatch error are the
``dispatch`` span's): kept free of candidate terms."""

_CANDIDATE_TERMS: Final[tuple[str, ...]] = ("q", "s", "extra_gpu", "score", "P", "R")


def decision_attributes(decision: Decision, limit: int | None = None) -> dict[str, Any]:
    """Span attributes: the choice and the candidates' terms (OTel primitives only).

    At most ``limit`` attributes (None: no bound). The choice, ``vtm.candidates`` (eligible
    workers), ``vtm.decision`` (the whole decision as JSON, every candidate included) and
    ``vtm.candidates_shown`` always fit; then each candidate's
    ``vtm.candidate.{wid}.{degree,q,s,extra_gpu,score,P,R | excluded}`` as a whole, the chosen
    worker first, then eligible ones from the best score, then excluded ones, while they fit.
    ``vtm.candidates_shown`` says how many got theirs, so a large pool's span is never cut by
    the SDK's limit (which would drop the oldest attributes: the choice itself).
    """
    attrs: dict[str, Any] = {
        "vtm.policy": decision.policy,
        "vtm.request_id": decision.request_id,
        "vtm.input_len": decision.length,
        "vtm.worker_id": decision.worker,
        "vtm.degree": decision.degree,
        "vtm.epoch": decision.epoch,
        "vtm.prefix_tokens": decision.prefix_tokens,
        "vtm.recompute_tokens": decision.uncached_tokens,
        "vtm.predicted_s": decision.predicted_s,
        "vtm.reused_blocks": decision.reused_blocks,
        "vtm.pulled_blocks": decision.pulled_blocks,
        "vtm.pull_wait_s": decision.pull_wait_s,
        "vtm.preferred_degree": decision.preferred_degree,
        "vtm.preferred_worker": decision.preferred_worker,
        "vtm.objective": f"{decision.objective} {decision.score_label}",
    }
    chosen = decision.chosen
    if chosen.score is not None and math.isfinite(chosen.score):
        attrs["vtm.j"] = chosen.score
    cands = decision.candidates
    attrs["vtm.candidates"] = sum(1 for c in cands if c.excluded is None)
    attrs["vtm.decision"] = json.dumps(decision.to_dict(), default=str)
    attrs["vtm.candidates_shown"] = 0
    sign = -1.0 if decision.objective == "max" else 1.0

    def rank(c: CandidateTerms) -> tuple[int, float, str]:
        if c.worker == decision.worker:
            return (0, 0.0, c.worker)
        if c.excluded is not None:
            return (3, 0.0, c.worker)
        score = c.score
        if score is None or not math.isfinite(score):
            return (2, 0.0, c.worker)
        return (1, sign * score, c.worker)

    room = math.inf if limit is None else limit - len(attrs)
    shown = 0
    for c in sorted(cands, key=rank):
        key = f"vtm.candidate.{c.worker}"
        group: dict[str, Any] = {f"{key}.degree": c.degree}
        if c.excluded is not None:
            group[f"{key}.excluded"] = str(c.excluded)
        else:
            for name, value in zip(_CANDIDATE_TERMS, (c.q, c.s, c.extra_gpu, c.score,
                                                      c.prefix_tokens, c.uncached_tokens),
                                   strict=True):
                if value is not None and (not isinstance(value, float) or math.isfinite(value)):
                    group[f"{key}.{name}"] = value
        if len(group) > room:
            break  # later candidates rank lower: the shown ones are a prefix of the ranking
        attrs.update(group)
        room -= len(group)
        shown += 1
    attrs["vtm.candidates_shown"] = shown
    return attrs


def trace_carrier(headers: Mapping[str, str] | None, req: IntakeRequest) -> dict[str, str]:
    """The W3C carrier of an intake message: its headers when they hold a valid trace
    context, else the one the gateway put in the message (rankd's redirects copy it).

    NOTE: a carrier (a plain dict), not an extracted ``Context``: ``Context`` subclasses dict,
    so shared.telemetry's ``stage_span``/``record_span`` would take it for headers.
    """
    # NOTE: not extract(): this runs per request.
    kept = _trace_headers(headers)
    return kept if kept is not None else dict(req.trace_context)


def _trace_headers(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """The W3C trace headers (``traceparent``, ``tracestate``) of ``headers`` when they hold
    a valid context, else None: what a message kept for later needs of its headers."""
    if traceparent_of(headers) is None:
        return None
    assert headers is not None
    return {k: v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}


def with_trace_context(req: IntakeRequest, carrier: Mapping[str, str]) -> IntakeRequest:
    """``req`` with ``carrier`` (:func:`trace_carrier`: the context this delivery's spans hang
    from, the gateway's root) as its ``trace_context``: the assignment carries the root to the
    worker, whose TTFT stage spans are its direct children (services/rankd/service.py,
    ``stage_carrier``) -- also for an intake message whose publisher put the context in the
    headers only.

    NOTE: ``req`` itself, no copy, when it carries that context already (every gateway's and
    hand-back's message: the hot path), when ``carrier`` is empty, or when the schema refuses
    the headers' values (the worker's spans then hang under its assign span, as without a
    context in the request)."""
    ctx = {k.lower(): v for k, v in carrier.items()}
    if not ctx or ctx == req.trace_context:
        return req
    try:
        return IntakeRequest.model_validate({**req.model_dump(), "trace_context": ctx})
    except ValidationError:
        return req


# -- the service --------------------------------------------------------------------------------


@dataclass
class SchedulerStats:
    """Counters for the status endpoint and tests."""

    placed: int = 0
    dispatched: int = 0
    redelivered_acked: int = 0
    superseded_acked: int = 0  # an older message of a request placed again under a newer one
    handed_back_acked: int = 0  # a re-sent assignment the worker had handed back to intake
    redirected: int = 0
    retried: int = 0
    failed: int = 0
    refused: int = 0  # longer than every worker's max_seq_len: answered at once, not retried
    malformed: int = 0
    finished: int = 0
    events_applied: int = 0
    gaps: int = 0
    snapshots_applied: int = 0
    windows_reported: int = 0
    snapshots_unanswered: int = 0  # asked again by housekeeping while the worker is known
    snapshots_failed: int = 0  # ... after an unexpected error (asked again the same way)
    housekeeping_rounds: int = 0
    windows_resent: int = 0  # previous window's report sent again before the next one
    starts_inferred: int = 0
    dispatch_unknown: int = 0  # dispatches whose outcome was unknown (record kept, NAK)
    resent: int = 0  # recorded assignments re-sent to their worker
    gone_handed_back: int = 0  # handed back to intake on behalf of a worker known gone
    gone_in_intake: int = 0  # ... and intake already held that hand-back (de-duplicated)
    finished_acked: int = 0  # a redelivery of a request whose result was seen: acked
    resent_served: int = 0  # a re-sent assignment its worker had served already: acked
    unknown_held: int = 0  # last delivery, outcome unknown, but the worker lists it: acked
    lost_handed_back: int = 0  # dispatched to a worker that died or restarted: handed back
    lost_in_intake: int = 0  # ... and intake already held that hand-back (de-duplicated)
    workers_restarted: int = 0  # a worker's state named a new incarnation
    unreachable_marked: int = 0  # a first send found no responder: worker excluded for now
    worker_refusals: int = 0  # a worker refused a dispatch (a micro error, not 410/425)
    refusals_avoided: int = 0  # ... (or handed it back), ACTIVE, and the placement went elsewhere
    handbacks_steered: int = 0  # a hand-back placed with its worker to avoid (as a refusal)
    peer_placements: int = 0  # another replica's placement noted (in-flight prefix affinity)
    peer_expired: int = 0  # ... forgotten without its result (peer_ttl_s)
    adopted: int = 0  # a held message redelivered (its replica gone): its worker holds it
    adopted_lost: int = 0  # ... its worker is gone and does not hold it: handed back
    held_renewals: int = 0  # rounds that marked the held intake messages in progress
    predecessor_naked: int = 0  # held by this replica's previous process: NAKed at start
    peers_gone: int = 0  # other replicas that stopped answering the replica listing
    peer_naked: int = 0  # held by a gone replica: NAKed by this one (the smallest live id)
    adopted_reserved: int = 0  # adopted requests placed by that process: reserved in the core
    holders_found: int = 0  # other replicas holding intake messages at this one's start
    fail_found_answered: int = 0  # a failure (or refusal) not sent: its first token was out
    other_attempt_results: int = 0  # an answer of another attempt than the one dispatched
    republished_held: int = 0  # a gateway's re-send after a store loss: a worker holds it
    republished_answered: int = 0  # ... its first token is out already
    republished_placed: int = 0  # ... neither: placed (it was lost with the store)
    republished_listings: int = 0  # listings of every worker's queue those checks took
    reconciled_applied: int = 0  # ReconciledNotice parts marked in the replica trie
    reconciled_buffered: int = 0  # ... that came before their worker's state (applied later)
    reconciled_dropped: int = 0  # ... buffered and never applied (superseded, or too many)
    reconciled_asked: int = 0  # a registered worker's reconcile asked of the cache manager
    pending_credited: int = 0  # placements J made counting on a worker's pending prefix
    nodes_collected: int = 0  # replica-trie nodes no worker holds any more, dropped


class SchedulerService(MicroService):
    """The live scheduler. Construct, then ``await run()`` (or ``start(stack)`` in tests)."""

    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        profile: Profile | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        subjects = settings.subjects
        self.reporter = settings.instance_id or f"sched-{uuid.uuid4().hex[:8]}"
        validate_token(self.reporter, what="scheduler instance id")
        super().__init__(
            settings,
            name=micro_service_name("scheduler"),
            version=VERSION,
            group=scheduler_group(subjects),
            description="vertumnus request scheduler",
            metadata={"policy": settings.policy, "reporter": self.reporter, "epoch": "0"},
        )
        self.ssettings = settings
        self.clock = clock
        if profile is None:
            profile = Profile.load(settings.profile_path) if settings.profile_path else \
                DEFAULT_PROFILE
        self.profile = profile
        policy = make_policy(
            settings.policy,
            profile=profile,
            rng=random.Random(settings.seed),
            # The calibrated weights unless the operator set them (services/calibration.py).
            **{**calibration.policy_params(settings.policy), **settings.policy_params},
        )
        credit = settings.pull_credit()
        if credit is not None and isinstance(policy, JPolicy):
            policy = policy.with_pull(credit)
        else:
            credit = None
        self._credit = credit  # the pull credit J places with (None: none)
        # J's credit of a pending prefix (needs the pull credit): the replica trie marks what
        # the cache manager's ReconciledNotices say is pending.
        self._pending_on = credit is not None and settings.pending_credit
        # Workers whose lease has lapsed: no copy source for pending_reach (the replica keeps
        # them, the KV not telling of a TTL expiry; the cache manager drops them). Kept by
        # _rebuild_view.
        self._lapsed: frozenset[str] = frozenset()
        # Notices of workers not in the replica yet (their state comes after the reconcile):
        # worker -> (epoch, part index -> (part, its trace carrier)), applied by _track_cache;
        # at most _BUFFERED workers and _BUFFERED_PARTS parts each.
        self._reconciled: OrderedDict[
            str, tuple[int, dict[int, tuple[ReconciledNotice, Mapping[str, str] | None]]]] = \
            OrderedDict()
        self.core = SchedulerCore(policy, ClusterView((), block_size=settings.block_size),
                                  time_scale=settings.time_scale)
        self.trie = PrefixTrie(settings.degrees, block_size=settings.block_size)
        # Windows aligned on multiples of H since the Unix epoch: every replica's coincide.
        start = math.floor(clock() / settings.window_s) * settings.window_s
        self.windows = DemandWindows(window_s=settings.window_s,
                                     long_threshold_tokens=settings.long_threshold_tokens,
                                     start_s=start)
        self._last_report: WindowReport | None = None  # re-sent with the next (_report_window)
        # §6.1 rule 1 over the pool's degree set (the controller's lattice degrees).
        self._rule_degrees: tuple[int, ...] = tuple(sorted(set(settings.degrees)))
        self.stats = SchedulerStats()
        self.metrics = SchedulerMetrics()
        self._states: dict[str, WorkerState] = {}
        self._states_loaded = False  # the watcher delivered the bucket's initial values
        # Request ids whose first token this replica saw (bounded), with the arrival stamps
        # of the attempts those tokens answered (None: one without a stamp, from an older
        # producer, which answers every attempt): a recorded dispatch of an attempt answered
        # is not sent again, nor handed back for a gone worker (_served_for).
        self._served: OrderedDict[str, tuple[float, ...] | None] = OrderedDict()
        # The workers' queues as last listed for re-sent messages (taken at, worker -> ids or
        # None: no answer; republished_listing_s), and the lock one listing is taken under.
        self._listing: tuple[float, dict[str, Listing | None]] | None = None
        self._listing_lock = asyncio.Lock()
        # Dispatched requests whose result this replica has not seen (see ledger.py): what a
        # worker that dies or restarts takes with it, handed back to intake.
        self.ledger = DispatchLedger()
        # hold_intake: the unacked intake message of each dispatch in the ledger, by request
        # id (NOTE: invariant -- a held message's request is in the ledger under that
        # message's stream sequence; _keep_held acks any other).
        self._held: dict[str, Msg] = {}
        self._recovering: set[str] = set()  # workers whose loss is being handled
        # Scheduler replicas (reporter ids, this one included) -> when last listed
        # (loop time; _watch_peers).
        self._peers: dict[str, float] = {}
        # Replicas known only as holders of intake messages found at start, never listed
        # (dead before this process started, perhaps): found gone, this replica gives back
        # what they held whatever its rank -- the others may never have seen them.
        self._unlisted: set[str] = set()
        self._restarts: dict[str, int] = {}  # restarts seen per worker (snapshot replies)
        # Worker id -> (incarnation, seq) of its state when a first send found no responder:
        # not eligible until a newer state shows it is back (see _rebuild_view).
        self._unreachable: dict[str, tuple[str, int]] = {}
        # Request id -> the workers that refused its dispatch with a micro error other than
        # 410 / 425 (a failing engine, a core refusal): its retries avoid them while another
        # worker is eligible (_place). Forgotten when it is dispatched or fails; bounded.
        self._refused_by: OrderedDict[str, frozenset[str]] = OrderedDict()
        # Request id -> (stream sequence, delivery count, when this replica NAK'ed that
        # delivery): where the ``intake_wait`` span of the next delivery starts (the retry's
        # wait). Bounded.
        self._naked: OrderedDict[str, tuple[int, int, float]] = OrderedDict()
        # The intake consumer's ack_wait (the durable's own, read when this replica binds to
        # it: an existing consumer keeps the setting it was made with): the bound on when a
        # redelivery's previous delivery ran out (_lapsed_since).
        self._ack_wait_s: float = settings.ack_wait_s
        # The most deliveries of an intake message (_retry_or_fail: the last one answers the
        # client): the setting, or the intake consumer's own max_deliver when that is lower
        # -- an existing durable keeps the one it was made with, and the server delivers no
        # more than that: a NAK of its last delivery lost the request (no answer, ever).
        self._max_deliver: int = settings.max_deliver
        self._snapshotting: set[str] = set()
        # Workers whose snapshot request went unanswered (asked again by housekeeping).
        self._snapshot_retry: set[str] = set()
        self._js: JetStreamContext | None = None
        self._records: KeyValue | None = None
        self._state_kv: KeyValue | None = None
        self._records_prefix = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(settings.max_inflight)
        # Resolved (and dropped) when the worker view changes; made by the first held request.
        self._view_changed: asyncio.Future[None] | None = None

    # -- endpoints ----------------------------------------------------------------------------

    def endpoints(self) -> Sequence[Endpoint]:
        return [Endpoint("status", self._on_status)]

    def stats_data(self) -> dict[str, Any]:
        """:class:`SchedulerStats` of this replica, in ``$SRV.STATS`` (every replica answers)."""
        return dict(vars(self.stats))

    async def _on_status(self, request: Request) -> bytes:
        now = self.clock()
        body = {
            "policy": self.ssettings.policy,
            "reporter": self.reporter,
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "degree": w.degree,
                    "kind": str(w.kind),
                    "lifecycle": str(w.lifecycle),
                    "epoch": w.epoch,
                    "queue_delay_s": self.core.loads[w.worker_id].queue_delay(now)
                    if w.worker_id in self.core.loads else 0.0,
                    "stale_cache_view": w.worker_id in self.trie.workers()
                    and self.trie.is_stale(w.worker_id),
                    # Pages a split or merge left pending there (ReconciledNotice): what J's
                    # pending credit may count on.
                    "pending_blocks": len(self.trie.pending_blocks(w.worker_id))
                    if w.worker_id in self.trie.workers() else 0,
                }
                for w in self.core.view.workers
            ],
            "trie_nodes": len(self.trie),
            "stats": {k: v for k, v in vars(self.stats).items()},
        }
        return json.dumps(body).encode()

    # -- setup --------------------------------------------------------------------------------

    async def ensure_jetstream(self) -> None:
        s = self.subjects
        js = self._js = self.jetstream()
        await ensure_intake_stream(js, s)
        await ensure_results_stream(js, s)  # read when a held message comes back (_redelivered)
        self._records = await ensure_key_value(
            js, assignment_bucket(s), ttl_s=self.ssettings.assignment_ttl_s,
            description="vertumnus assignment records (idempotency)",
        )
        self._state_kv = await worker_state_kv(js, s, lease_s=self.ssettings.lease_s)
        await self._ensure_consumer(js)

    async def setup(self, stack: AsyncExitStack) -> None:
        s = self.subjects
        self._records_prefix = f"$KV.{assignment_bucket(s)}."
        await self.ensure_jetstream()
        js, states = self._js, self._state_kv
        assert js is not None and states is not None
        watcher = await KvWatch(self.nc, states).start()  # survives a server restart
        puller = PullConsumer(self.nc, stream=s.intake_stream(), consumer=s.intake_consumer(),
                              handler=self._on_intake, batch=self.ssettings.fetch_batch)
        events = await self.nc.subscribe(s.cache_events_all(), cb=self._on_cache_event)
        # The cache manager's reconcile of each new worker (J's credit of a pending prefix):
        # subscribed with the events, before the worker states are watched.
        reconciled = await self.nc.subscribe(s.cache_pending_all(), cb=self._on_reconciled) \
            if self._pending_on else None
        results = await self.nc.subscribe(s.result_all(), cb=self._on_result)
        # Every replica's placement statistics: the others' placements are in-flight prefixes.
        peers = await self.nc.subscribe(s.cache_stats_all(), cb=self._on_peer_stats)
        found: set[str] | None = None  # holders of the unacked messages (_watch_peers)
        if self.ssettings.hold_intake and self.ssettings.instance_id:
            # Before this process takes any delivery: none of its own can be mistaken for
            # its predecessor's.
            found = set()
            self.stats.predecessor_naked += await self._give_back_holds(
                js, self.reporter, why="this replica's previous process", holders=found)
        await puller.start()
        self._tasks = [
            asyncio.create_task(self._watch_states(watcher), name="sched-states"),
            asyncio.create_task(self._housekeeping(), name="sched-housekeeping"),
            asyncio.create_task(self._keep_held(), name="sched-keep-held"),
        ]
        if self.ssettings.hold_intake:
            self._tasks.append(asyncio.create_task(self._watch_peers(js, found),
                                                   name="sched-peers"))

        async def teardown() -> None:
            # No new intake (a message being handed over finishes first); dispatches already
            # sent may complete.
            await puller.stop()
            await self._finish_inflight(self.ssettings.dispatch_timeout_s)
            # Held messages go back at once (a NAK, not ack_wait later) to a replica that
            # adopts them -- another one, or this one's next process.
            held, self._held = self._held, {}
            # Each sampled one's record says when (before the NAK: the replica that takes it
            # over reads the record on that delivery), for its intake_redelivery_wait span.
            with contextlib.suppress(Exception):
                await while_connected(self.nc, self._stamp_give_back(held),
                                      timeout_s=self.ssettings.dispatch_timeout_s)
            for m in held.values():
                with contextlib.suppress(Exception):
                    await m.nak()
            # Records sent without waiting (``dispatched``): stored before we go, so a
            # restarted scheduler finds them (bounded; each is also cancelled on its own).
            # Given up, like the dispatches, as soon as the connection is lost: no store
            # acknowledgement can come then.
            with contextlib.suppress(Exception):
                await while_connected(self.nc, js.publish_async_completed(),
                                      timeout_s=self.ssettings.dispatch_timeout_s)
            await self.stop_listening(self._tasks, [watcher], (events, results, peers, reconciled))

        stack.push_async_callback(teardown)

    async def _stamp_give_back(self, held: Mapping[str, Msg]) -> int:
        """Stamp the NAK about to give back each held message of a sampled trace in its record
        (:attr:`AssignmentRecord.naked_at_s`, ``naked_by`` this replica); returns how many.
        Only a record that names this replica as the holder of that very message is touched
        (one another replica adopted since is not its to stamp). Unsampled requests cost no
        read: the stamp is only ever read for a span. Stored before this returns (the NAKs
        wait for it): the replica that gets a redelivery reads the record at once, and might
        otherwise read it before the stamp."""
        sampled = [(rid, m) for rid, m in held.items()
                   if (sent := self.ledger.get(rid)) is not None and is_sampled(sent.carrier)]
        if not sampled:
            return 0
        at = self.clock()  # the NAKs follow at once: the wait is taken to start here
        # One read failing (a timeout) costs its own stamp only, not the others'.
        records = await asyncio.gather(*(self._get_record(rid) for rid, _ in sampled),
                                       return_exceptions=True)
        stores = [await self._put_stamped(rec, at)
                  for (_, m), rec in zip(sampled, records, strict=True)
                  if isinstance(rec, AssignmentRecord) and rec.stream_seq == self._stream_seq(m)
                  and (rec.holder or rec.scheduler) == self.reporter]
        done = await asyncio.gather(*stores, return_exceptions=True)
        return sum(1 for d in done if not isinstance(d, BaseException))

    async def _put_stamped(self, rec: AssignmentRecord, naked_at_s: float) -> asyncio.Future[Any]:
        """Send ``rec`` stamped with this replica's NAK at ``naked_at_s``; returns the future
        of its store acknowledgement."""
        assert self._js is not None
        return await self._js.publish_async(
            f"{self._records_prefix}{rec.request_id}", to_json(rec.model_copy(update={
                "naked_at_s": naked_at_s, "naked_by": self.reporter})))

    # -- worker state ---------------------------------------------------------------------------

    async def _watch_states(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is None:  # end of the initial values
                self._states_loaded = True
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._states.pop(entry.key, None)
            else:
                try:
                    state = decode(WorkerState, entry.value)
                    if state.worker_id != entry.key:
                        raise SchemaError("WorkerState", "worker_id",
                                          f"{state.worker_id!r} stored under key {entry.key!r}")
                except SchemaError as exc:
                    self.log.error("bad worker state ignored", key=entry.key, error=str(exc))
                    continue
                old = self._states.get(entry.key)
                self._states[entry.key] = state
                if old is not None and worker_restarted(old.incarnation, state.incarnation):
                    self._worker_restarted(entry.key, old, state)
            self._rebuild_view()
            if entry.key in self._states:
                self._note_foreign(self._states[entry.key])

    def _note_foreign(self, state: WorkerState) -> None:
        """The worker's outstanding work that other scheduler replicas placed (its report
        less this replica's share) goes into its q_w (:meth:`WorkerLoad.set_foreign`); 0 with
        one replica."""
        ld = self.core.loads.get(WorkerId(state.worker_id))
        if ld is None:
            return
        foreign = state.outstanding_s - state.outstanding_by.get(self.reporter, 0.0)
        ld.set_foreign(max(0.0, foreign), min(state.heartbeat_s, self.clock()))

    def _worker_restarted(self, wid: str, old: WorkerState, new: WorkerState) -> None:
        """A new incarnation runs under ``wid``: its cache is empty and its event ids start
        again, so the replica trie forgets the old one's blocks (``_rebuild_view`` registers
        it afresh and asks for its snapshot); the requests the old one held are recovered."""
        self.stats.workers_restarted += 1
        self._restarts[wid] = self._restarts.get(wid, 0) + 1
        self.ledger.retire(wid, old.incarnation)
        self.log.warning("worker restarted", worker=wid, old=old.incarnation,
                         new=new.incarnation)
        if wid in self.trie.workers():
            self.trie.remove_worker(WorkerId(wid))
            if new.degree in self.trie.degrees:  # as _rebuild_view registers workers
                self._track_cache(new)
        self._unreachable.pop(wid, None)
        self._recover_lost()

    def _reachable(self, state: WorkerState) -> bool:
        """False while the worker's state is the one it had when a send found no responder."""
        mark = self._unreachable.get(state.worker_id)
        if mark is None:
            return True
        if mark == (state.incarnation, state.seq):
            return False
        del self._unreachable[state.worker_id]  # a newer state: it published since
        return True

    def _rebuild_view(self) -> None:
        now = self.clock()
        st = self.ssettings
        views = tuple(
            worker_view(state, now=now, lease_s=st.lease_s, block_size=st.block_size,
                        max_seq_len=st.max_seq_len, reachable=self._reachable(state))
            for _, state in sorted(self._states.items())
        )
        self._lapsed = frozenset(w for w, state in self._states.items()
                                 if now - state.heartbeat_s > st.lease_s)
        if views == self.core.view.workers:
            return
        self.core.set_view(ClusterView(views, block_size=st.block_size))
        # Wake requests held for an eligible worker (see _place_held).
        changed, self._view_changed = self._view_changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)
        # conventions.md: micro metadata carries the epoch; the newest its workers acknowledged.
        self.set_metadata(workers=str(len(views)),
                          epoch=str(max((w.epoch for w in views), default=0)))
        known = set(self.trie.workers())
        for w in views:
            if w.worker_id in known or w.degree not in self.trie.degrees:
                continue
            self._track_cache(self._states[w.worker_id])
        for wid in known - {w.worker_id for w in views}:
            self.trie.remove_worker(wid)

    def _track_cache(self, state: WorkerState) -> None:
        """Register the worker in the replica trie with an empty cache and ask for its index
        (it may have cached blocks already: we started after it, or it was re-created); mark
        what the cache manager's reconcile of it left pending, if that came first."""
        self.trie.add_worker(WorkerId(state.worker_id), state.degree,
                             max(1, state.kv_total_blocks))
        buffered = self._reconciled.pop(state.worker_id, None)
        if buffered is not None:
            for _, (notice, carrier) in sorted(buffered[1].items(), key=lambda kv: kv[0]):
                self._mark_reconciled(notice, carrier, buffered=True)  # parents: earlier parts
        elif self._pending_on:
            # None came (this replica started after the split or merge, or the worker is an
            # old one): ask the cache manager to publish it again; usually nothing is pending.
            self._spawn(self._ask_reconciled(state.worker_id, state.incarnation),
                        f"pending-{state.worker_id}")
        self._request_snapshot(state.worker_id)

    def _spawn(self, coro: Any, name: str) -> None:
        spawn_tracked(self._tasks, coro, name)

    async def _ask_reconciled(self, worker: str, incarnation: str = "") -> None:
        """Ask the cache manager's ``pending`` endpoint to publish ``worker``'s reconcile; the
        notices come on the subscription (:meth:`on_reconciled`). ``incarnation`` (the state
        registered) keeps a manager that has not yet handled the worker's restart from
        publishing its former life's pages (PendingQuery). Without an answer (no cache
        manager in this deployment, or it is restarting) J does without the credit there."""
        try:
            reply = await call(self.nc, self.subjects.cache_pending_ask(),
                               PendingQuery(worker_id=worker, incarnation=incarnation),
                               PendingReply,
                               timeout_s=self.ssettings.snapshot_timeout_s)
            self.stats.reconciled_asked += 1
            if reply.parts:
                self.log.info("reconcile asked for", worker=worker, parts=reply.parts)
        except (RemoteError, SchemaError, nats.errors.Error, TimeoutError) as exc:
            # No responder, a timeout, or the connection closing under us: do without.
            self.log.debug("reconcile not asked for: no answer", worker=worker, error=repr(exc))

    # -- the cache manager's reconcile (J's credit of a pending prefix) -------------------------

    async def _on_reconciled(self, msg: Msg) -> None:
        try:
            notice = decode(ReconciledNotice, msg.data, msg.headers)
        except SchemaError as exc:
            self.log.warning("reconciled notice rejected", subject=msg.subject, error=str(exc))
            return
        try:
            own = self.subjects.cache_pending(notice.worker)
        except InvalidInput:
            own = None
        if msg.subject != own:
            # Each worker's notices come on its own subject: one elsewhere is not the manager's.
            self.log.warning("reconciled notice rejected", subject=msg.subject,
                             error=f"names worker {notice.worker!r}, not the subject's")
            return
        self.on_reconciled(notice, msg.headers)

    def on_reconciled(self, notice: ReconciledNotice,
                      carrier: Mapping[str, str] | None = None) -> None:
        """Mark a new worker's pending and donor pages in the replica trie (reconcile.py
        ``mark_reconciled``), or keep the notice until the worker's state registers it
        (:meth:`_track_cache`): the cache manager reconciles at the epoch record, usually
        before the new worker runs. Only the latest epoch's parts are kept for a worker (a
        part sent again replaces its copy; at most :data:`_BUFFERED_PARTS`), and only for the
        :data:`_BUFFERED` workers heard of last. ``carrier``: the notice's headers, whose W3C
        context is the parent of its :data:`RECONCILED_APPLY_SPAN` (kept with it)."""
        wid = notice.worker
        if wid in self.trie.workers():
            self._mark_reconciled(notice, carrier)
            return
        kept = self._reconciled.get(wid)
        if kept is not None and kept[0] > notice.epoch:
            self.stats.reconciled_dropped += 1  # an older reconcile, overtaken
            return
        if kept is None or kept[0] < notice.epoch:
            if kept is not None:
                self.stats.reconciled_dropped += len(kept[1])
            kept = (notice.epoch, {})
            self._reconciled[wid] = kept
        self._reconciled.move_to_end(wid)
        parts = kept[1]
        if notice.part not in parts and (
                len(parts) >= _BUFFERED_PARTS
                or self._buffered_entries() + len(notice.blocks) > _BUFFERED_ENTRIES):
            self.stats.reconciled_dropped += 1
            if not parts:  # nothing kept: at registration the replica asks the manager
                del self._reconciled[wid]
            return
        if notice.part in parts:
            self.stats.reconciled_dropped += 1  # the copy it replaces
        # Only the trace context is kept of the headers (a notice's may hold anything).
        parts[notice.part] = (notice, _trace_headers(carrier))
        self.stats.reconciled_buffered += 1
        while len(self._reconciled) > _BUFFERED:
            _, (_, old) = self._reconciled.popitem(last=False)
            self.stats.reconciled_dropped += len(old)

    def _buffered_entries(self) -> int:
        return sum(len(n.blocks) for _, parts in self._reconciled.values()
                   for n, _ in parts.values())

    def _mark_reconciled(self, notice: ReconciledNotice,
                         carrier: Mapping[str, str] | None = None, *,
                         buffered: bool = False) -> None:
        """Mark ``notice`` in the replica trie, under a :data:`RECONCILED_APPLY_SPAN` span
        (a child of ``carrier``'s context, when that is sampled; ``buffered``: the notice
        waited for its worker's state)."""
        wid = WorkerId(notice.worker)
        span: trace.Span | None = None
        if is_sampled(carrier):  # else nothing would be recorded (parent-based sampling)
            # NOTE: started, never made current: nothing this does should join the trace.
            span = tracer().start_span(RECONCILED_APPLY_SPAN, context=extract(carrier),
                                       kind=SpanKind.CONSUMER, attributes={
                                           "vtm.worker_id": str(wid), "vtm.epoch": notice.epoch,
                                           "vtm.part": notice.part,
                                           "vtm.entries": len(notice.blocks),
                                           "vtm.buffered": buffered})
        try:
            marked = mark_reconciled(self.trie, wid, [
                (BlockHash(h), None if p is None else BlockHash(p), role,
                 None if src is None else WorkerId(src))
                for h, p, role, src in notice.blocks])
        except VertumnusError as exc:
            self.log.warning("reconciled notice not applied", worker=wid, error=str(exc))
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, f"not applied: {exc}"[:500]))
                span.end()
            return
        if span is not None:
            span.set_attributes({"vtm.pending": marked.pending, "vtm.donors": marked.donors,
                                 "vtm.skipped": marked.skipped})
            span.end()
        self.stats.reconciled_applied += 1
        self.log.info("reconciled pages marked", worker=wid, epoch=notice.epoch,
                      part=notice.part, pending=marked.pending, donors=marked.donors,
                      skipped=marked.skipped)

    async def _housekeeping(self) -> None:
        """Lease expiry (KV watchers are not told about TTL expiry), window closing, the
        replica trie's unreferenced nodes (``collect_unreferenced``), snapshots
        of stale workers and of workers whose snapshot request went unanswered -- only while
        their lease holds: a worker gone for good (its state expired; the KV is not told) keeps
        its last state here and would be asked every round for ever. Its next state, if it
        comes back, makes it asked again."""
        period = min(1.0, self.ssettings.lease_s / 4, self.ssettings.window_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                self._rebuild_view()
                for summary in self.windows.advance(self.clock()):
                    await self._report_window(summary)
                self._recover_lost()
                self.stats.peer_expired += self.core.expire_foreign(
                    self.clock() - self.ssettings.peer_ttl_s)
                # Blocks no worker holds any more leave the replica (it keeps no statistics:
                # nothing else would ever remove them).
                self.stats.nodes_collected += self.trie.collect_unreferenced()
                registered = set(self.trie.workers())
                self._snapshot_retry &= registered  # workers gone meanwhile
                for wid in {*self.trie.stale_workers(), *self._snapshot_retry}:
                    if self._leased(wid):
                        self._request_snapshot(wid)
                self.stats.housekeeping_rounds += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # housekeeping must survive one bad round
                self.log.warning("housekeeping failed", error=str(exc))

    # -- cache events -----------------------------------------------------------------------------

    async def _on_cache_event(self, msg: Msg) -> None:
        try:
            event = event_from_json(msg.data)
            if event.worker not in self.trie.workers():
                return  # not (yet) in the worker-state view; its first state brings a snapshot
            outcome = self.trie.apply(event)
        except (MalformedEvent, InvalidInput, VertumnusError) as exc:
            self.log.warning("cache event rejected", subject=msg.subject, error=str(exc))
            return
        if outcome is ApplyOutcome.APPLIED:
            self.stats.events_applied += 1
        elif outcome is ApplyOutcome.GAP:
            self.stats.gaps += 1
            if self._leased(event.worker):  # else housekeeping asks once it is back
                self._request_snapshot(event.worker)

    def _leased(self, wid: str) -> bool:
        """The worker's last state is within its lease (it may answer a snapshot request)."""
        state = self._states.get(wid)
        return state is not None and self.clock() - state.heartbeat_s <= self.ssettings.lease_s

    def _request_snapshot(self, worker: str) -> None:
        spawn_once(self._tasks, self._snapshotting, worker, partial(self._fetch_snapshot, worker),
                   f"snapshot-{worker}")

    async def _fetch_snapshot(self, worker: str) -> None:
        restarts = self._restarts.get(worker, 0)
        try:
            # A full worker's index is several MiB: it may come in parts.
            data, _ = await request_in_parts(
                self.nc, self.subjects.cache_snapshot(worker), b"{}",
                timeout_s=self.ssettings.snapshot_timeout_s, headers=inject({}),
            )
            event = snapshot_reply(worker, data)
            if self._restarts.get(worker, 0) != restarts:
                # Asked before the worker restarted: it may list the old process's cache.
                self._snapshot_retry.add(worker)
                return
            self._snapshot_retry.discard(worker)
            if worker in self.trie.workers():
                self.trie.apply(event)
                self.stats.snapshots_applied += 1
                self.log.info("cache snapshot applied", worker=worker,
                              last_event_id=event.last_event_id, blocks=len(event.blocks))
        except (RemoteError, nats.errors.NoRespondersError, nats.errors.TimeoutError,
                TimeoutError) as exc:
            # An error answer (a worker failing, or stopping) is asked again as no answer is.
            # Typically a worker just created by a split or merge whose endpoint is not up
            # yet: without its index the trie would miss the prefixes it kept (reconcile)
            # until its first event, so housekeeping asks again while it is in the trie.
            self.stats.snapshots_unanswered += 1
            if worker in self.trie.workers():
                self._snapshot_retry.add(worker)
            self.log.warning("cache snapshot unavailable; will ask again", worker=worker,
                             error=repr(exc))
        except (MalformedEvent, InvalidInput, VertumnusError) as exc:
            self.log.warning("cache snapshot rejected", worker=worker, error=str(exc))
        except Exception as exc:
            # Anything else (the connection closed, draining, or unable to send or buffer
            # the request while it reconnects; a defect): the fetch runs in a task of its
            # own, so an escaping exception ended it unretrieved and -- the worker neither
            # stale nor in the retry set -- a new worker's index was never asked again.
            # Asked again as an unanswered request is.
            self.stats.snapshots_failed += 1
            if worker in self.trie.workers():
                self._snapshot_retry.add(worker)
            self.log.warning("cache snapshot request failed; will ask again", worker=worker,
                             error=repr(exc), exc_info=exc)

    # -- completions --------------------------------------------------------------------------

    async def _on_peer_stats(self, msg: Msg) -> None:
        """Another replica placed a request (its RequestStats): the request's prefix is in
        flight on that worker until its result (:meth:`SchedulerCore.note_foreign`)."""
        if msg.subject.rpartition(".")[2] == self.reporter:
            return  # our own (the subject's last token is the reporter): not even decoded
        try:
            st = decode(RequestStats, msg.data, msg.headers)
            if st.reporter == self.reporter:
                return
            info = RequestInfo(st.request_id, st.input_len, tuple(st.block_hashes))
            now = self.clock()
            if self.core.note_foreign(info, WorkerId(st.worker_id), now):
                self.stats.peer_placements += 1
                # Its work counts at once, not only from the worker's next report (which
                # replaces the figure, this request included).
                ld = self.core.loads.get(WorkerId(st.worker_id))
                if ld is not None:
                    ld.add_foreign(st.predicted_s, now)
        except (SchemaError, VertumnusError) as exc:
            self.log.warning("peer placement ignored", subject=msg.subject, error=str(exc))

    async def _on_result(self, msg: Msg) -> None:
        rid = msg.subject.rpartition(".")[2]
        try:
            # Undecodable, or another request's result on this one's subject: bad input,
            # not news.
            result = first_token_of(rid, msg)
        except SchemaError:
            return
        worker = await self._result_seen(rid, served=result.error is None,
                                         arrival_s=result.arrival_s)
        if worker is None:
            return  # placed by another replica, or already released
        # The worker was free again when the prefill ended: the KV handoff and the first
        # decode that follow it in TTFT run off its FIFO (as in the simulator).
        st = result.stages
        self._infer_next_start(worker, result.finished_at_s - st.kv_transfer_s
                               - st.first_decode_s)

    def _served_for(self, rid: str, arrival_s: float) -> bool:
        """Whether a first token of ``rid`` this replica saw answers the attempt that arrived
        at ``arrival_s``: one stamped with it, or one without a stamp. Another attempt's
        does not: a gateway takes only the answer of the attempt it waits for (its
        ``_Waiter``), and the worker answers each attempt of a job separately."""
        if rid not in self._served:
            return False
        stamps = self._served[rid]
        return stamps is None or arrival_s in stamps

    async def _result_seen(self, rid: str, *, served: bool,
                           arrival_s: float | None = None) -> WorkerId | None:
        """``rid``'s result is out (``served``: a first token, not an error, answering the
        attempt that arrived at ``arrival_s``; None: not known which): it leaves the ledger,
        its held intake message is acked, and its reservation in the core ends. Returns the
        worker it was reserved on, None when the core had none (placed by another replica,
        or already released).

        An answer stamped for another attempt than the one this replica dispatched last
        under the id (the ledger's) releases nothing: each attempt is answered on its own
        (rankd answers each one that joined a job, stamped for it), and that dispatch still
        waits for its own. Before, an earlier attempt's answer let go of a later one's
        dispatch, and when that one's worker then died nobody handed it back (its client got
        a 504)."""
        sent = self.ledger.get(rid)
        if arrival_s is not None and sent is not None and sent.request.arrival_s != arrival_s:
            self.stats.other_attempt_results += 1
            with bind_request(rid, trace_id_of(sent.carrier)):  # a result, not a delivery
                self.log.info("result of another attempt; this one's dispatch waits for its "
                              "own", arrival_s=arrival_s,
                              dispatched_arrival_s=sent.request.arrival_s)
            self._note_served(rid, served, arrival_s)
            return None
        self.core.forget_foreign(rid)
        self.ledger.pop(rid)
        await self._release_held(rid)
        self._note_served(rid, served, arrival_s)
        try:
            worker = self.core.worker_of(rid)
            self.core.finish(rid, self.clock())
        except UnknownRequest:
            return None
        self.stats.finished += 1
        return worker

    def _note_served(self, rid: str, served: bool, arrival_s: float | None) -> None:
        """Remember that a first token answered ``rid``'s attempt stamped ``arrival_s`` (every
        attempt when None) for :meth:`_served_for`; an error answer (not ``served``) is not
        remembered."""
        if served:
            known = self._served.get(rid, ())
            # An answer without a stamp (None) answers every attempt, from then on.
            self._served[rid] = None if arrival_s is None or known is None else \
                known if arrival_s in known else (*known, arrival_s)
            self._served.move_to_end(rid)
            if len(self._served) > FINISHED_MEMORY:
                self._served.popitem(last=False)

    def _infer_next_start(self, worker: WorkerId, at_s: float) -> None:
        """A worker serves its queue in order: when one request's result is out and nothing
        else runs there, the oldest waiting request started when that one finished.

        Without this, a request admitted behind others (AssignmentAck position > 0) would count
        its *whole* prediction in q_w until its own result arrived, and the scheduler would see
        every busy worker as fuller than it is — the simulator, which sees starts directly,
        does not. The instant is when the worker's previous prefill ended (its clock: same
        host), never before the request was placed. Estimates: with several scheduler
        replicas a worker's FIFO also holds their requests, and a backend that keeps the
        worker through the KV handoff starts the next one that much later; the next result
        corrects either.
        """
        ld = self.core.loads.get(worker)
        if ld is None or ld.running or not ld.waiting:
            return
        nxt = ld.queued()[0]
        at = max(at_s, ld.assignment(nxt).reserved_at)
        try:
            self.core.start(nxt, min(at, self.clock()))
        except VertumnusError:
            return
        self.stats.starts_inferred += 1

    # -- intake ---------------------------------------------------------------------------------

    async def _ensure_consumer(self, js: JetStreamContext) -> None:
        """The durable intake consumer (created when missing; an existing one is kept, as
        every replica shares it)."""
        s = self.subjects
        try:
            info = await js.consumer_info(s.intake_stream(), s.intake_consumer())
        except NotFoundError:
            pass
        else:
            self._note_ack_wait(info.config.ack_wait)
            self._note_max_deliver(info.config.max_deliver)
            return
        info = await js.add_consumer(s.intake_stream(), ConsumerConfig(
            durable_name=s.intake_consumer(),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ssettings.ack_wait_s,
            max_deliver=self.ssettings.max_deliver,
            max_ack_pending=self.ssettings.max_ack_pending,
            filter_subject=s.intake_requests(),
        ))
        self._note_ack_wait(info.config.ack_wait)
        self._note_max_deliver(info.config.max_deliver)

    def _note_ack_wait(self, ack_wait: float | None) -> None:
        """Keep the intake consumer's ack_wait (seconds; None or nonsense: the setting's)."""
        if ack_wait is not None and math.isfinite(ack_wait) and ack_wait > 0:
            self._ack_wait_s = float(ack_wait)

    def _note_max_deliver(self, max_deliver: int | None) -> None:
        """Bound this replica's deliveries by the intake consumer's ``max_deliver`` (None, 0
        or -1: unlimited, the setting's bound alone)."""
        if isinstance(max_deliver, int) and max_deliver > 0:
            self._max_deliver = min(self.ssettings.max_deliver, max_deliver)

    async def _on_intake(self, msg: Msg) -> None:
        """One intake delivery, as it arrives (shared.service.PullConsumer, delivery order)."""
        # NOTE: one task per message, started in message order. handle_intake does not
        # suspend between its start and the moment the assignment is in the connection's
        # write buffer (the rare redelivery path excepted: it reads the record first), so
        # placements — and dispatches to any one worker — keep intake order, while the
        # round trips of many requests overlap instead of adding up. Waiting for a slot here
        # holds back the next delivery (back-pressure).
        await self._slots.acquire()
        task = asyncio.create_task(self._handle_guarded(msg), name="sched-dispatch")
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _handle_guarded(self, msg: Msg) -> None:
        try:
            await self.handle_intake(msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Unexpected: leave it for redelivery (ack_wait) rather than lose it.
            self.log.exception("intake handling failed")
        finally:
            self._slots.release()

    async def _finish_inflight(self, timeout_s: float) -> None:
        """At shutdown: let dispatches already sent complete (bounded by ``timeout_s``, and
        given up as soon as the connection is lost), then cancel the rest (an unacked message
        is redelivered; its record makes the re-send idempotent).

        Why not wait out ``timeout_s`` with the server gone: nats-py forgets a request whose
        connection drops rather than failing it, so a dispatch in flight when the server went
        away (``vertumnus up`` killed: the server and the services get SIGTERM at once) waited
        for its whole ``dispatch_timeout_s`` before the stop went on
        (shared.service.while_connected)."""
        pending = set(self._inflight)
        if pending:
            await while_connected(self.nc, asyncio.wait(pending, timeout=timeout_s),
                                  timeout_s=timeout_s)
            await cancel_and_wait([t for t in pending if not t.done()], self.log)

    async def handle_intake(self, msg: Msg) -> None:
        """One intake delivery: idempotency, placement, dispatch, ack (see module docstring).

        Sequence (each step on the same NATS connection, so the server sees them in order):
        place; send the ``dispatching`` record; send the Assignment to the worker; await the
        worker's AssignmentAck and then the record's store acknowledgement; send the
        ``dispatched`` record; ack the intake message. The record is sent *before* the
        assignment without waiting for its store acknowledgement: bytes leave the connection
        in order, so if the assignment reached the worker the record reached the server (a
        SIGKILL after that cannot lose it). The ``dispatched`` record is not awaited either:
        the intake ack right behind it is what stops redelivery; the record only narrows the
        window in which a redelivery re-sends to the same worker (whose admission is
        idempotent on request id).
        """
        dequeued = self.clock()
        if msg.headers and MALFORMED_HEADERS in msg.headers:
            # Its header block could not be read (or a sender forged the marker): whatever
            # the body, what the headers said -- Content-Type, Nats-Msg-Id, the trace
            # context, a hand-back's marks -- is lost, so it is not placed; terminated, not
            # left to come back at every ack_wait until max_deliver.
            self.stats.malformed += 1
            self.log.warning("intake message with a malformed header block terminated",
                             subject=msg.subject, stream_seq=self._stream_seq(msg),
                             error=msg.headers[MALFORMED_HEADERS])
            await msg.term()
            return
        try:
            req = decode(IntakeRequest, msg.data, msg.headers)
        except SchemaError as exc:
            self.stats.malformed += 1
            self.log.error("malformed intake message terminated", error=str(exc),
                           subject=msg.subject, stream_seq=self._stream_seq(msg))
            await msg.term()
            return
        # Every log line of this delivery carries its request and trace ids (conventions.md):
        # the trace context its spans hang from (the headers', else the request's).
        with bind_request(req.request_id, trace_id_of(trace_carrier(msg.headers, req))):
            if req.block_size != self.ssettings.block_size:
                await self._refuse_block_size(msg, req)
                return
            await self._handle_request(msg, req, dequeued)

    async def _refuse_block_size(self, msg: Msg, req: IntakeRequest) -> None:
        """A request whose block hashes were cut at another block size than this scheduler's
        (a gateway with another VTM_BLOCK_SIZE): its hashes cannot be matched against the
        workers' caches, and P would be wrong, so it is failed at once (the gateway answers
        502, naming both sizes) and its message terminated, nothing reserved."""
        reason = (f"the request's block hashes are of {req.block_size}-token blocks, this "
                  f"scheduler's of {self.ssettings.block_size} (VTM_BLOCK_SIZE must be the "
                  "same on every service)")
        if await self._answered_already(msg, req, reason):
            return
        self.stats.refused += 1
        self.log.error("request refused: block size mismatch", request_id=req.request_id,
                       block_size=req.block_size, expected=self.ssettings.block_size)
        await self._send_failure(msg, req, reason)

    async def _handle_request(self, msg: Msg, req: IntakeRequest, dequeued: float) -> None:
        """:meth:`handle_intake` once the delivery decoded."""
        rid = req.request_id
        msg_id = (msg.headers or {}).get(MSG_ID_HEADER) or rid
        seq = self._stream_seq(msg)
        delivery = self._deliveries(msg)
        naked_at: float | None = None  # when this replica NAK'ed the delivery before this one
        if delivery > 1:
            self.metrics.redelivered()
            naked_at = self._retry_started(rid, seq, delivery)
        if REPUBLISHED_HEADER in (msg.headers or {}):
            # A gateway's re-send after the server lost its store. Checked before the ledger
            # lets go of an earlier dispatch of this request (which a worker may still hold),
            # and on a redelivery too unless this very message was placed since.
            rec = await self._get_record(rid) if delivery > 1 else None
            if (rec is None or rec.stream_seq != seq) and await self._republished_known(msg, req):
                return
        self.ledger.supersede(rid, seq)
        # NOTE: only a redelivery can match a record (a record names the stream sequence of a
        # message that was delivered before), so a first delivery skips the KV read.
        record = await self._get_record(rid) if delivery > 1 else None
        if record is not None and record.stream_seq == seq and record.naked_at_s is not None:
            self._record_redelivery_wait(msg, req, record, delivery, dequeued)
            # The stamp times this delivery only: cleared now, not left to a later write of
            # the record -- a path that keeps the record as it is (a re-send whose outcome is
            # unknown, a hand-back that failed) NAKs it for a retry, and that delivery would
            # time a second wait from the same NAK, overlapping this one and its own spans.
            record = await self._clear_stamp(record)
        if record is not None and record.stream_seq == seq and record.state == "dispatched":
            await self._redelivered(msg, req, record)
            return
        if record is not None and record.stream_seq > seq \
                and attempt_mark(record.msg_id) == attempt_mark(msg_id):
            # A newer message of this request was placed: a worker admitted this one and
            # handed it back (its redirect is that message), so the request lives on there.
            # Placing this one too would run it twice. Not when the two are hand-backs of
            # different attempts (a worker hands back each later attempt that joined the
            # job with it, rankd's joined_handback_msg_id): one placed first does not carry
            # the other, which was refused, say, and comes back later.
            self.stats.superseded_acked += 1
            self.log.info("superseded intake message acked", request_id=rid,
                          stream_seq=seq, newer_seq=record.stream_seq)
            await msg.ack()
            return
        if is_handback_msg_id(msg_id) and self._served_for(rid, req.arrival_s):
            # A hand-back (by a worker, or by a replica for a lost worker) of a request whose
            # first token is out: placing it would run it a second time for nobody. Not one
            # of a later attempt (a worker hands back each attempt that joined the job it
            # handed back): the first attempt's answer does not answer that one's gateway.
            self.stats.finished_acked += 1
            self.log.info("hand-back of a served request acked", request_id=rid)
            await msg.ack()
            return
        parent = trace_carrier(msg.headers, req)
        # The root's context travels in the assignment too: the worker's stage spans are its
        # children (with_trace_context; the same object for every gateway message).
        req = with_trace_context(req, parent)
        # Unsampled (the usual case at a 1% ratio): no span objects or attributes at all; the
        # carrier still travels with the assignment so the worker keeps the decision.
        sampled = is_sampled(parent) or not parent
        if record is not None and record.stream_seq != seq:
            record = None  # a record of an earlier message of this request id
        if record is None and self._placed(rid):
            # A new message for a request this replica placed before (a redirect from a
            # draining worker, or a client reusing its id after the duplicate window), or one
            # placed but never recorded as dispatched: release it and place afresh.
            if delivery == 1:
                self.stats.redirected += 1
                self.metrics.redirected()
            self._release(rid)

        # Placed before any span opens: a hold (no eligible worker yet, _place_held) is intake
        # wait in the FirstToken's breakdown (dequeued_at_s is when it is finally placed), so
        # it is in the intake_wait span too and the schedule span starts where the breakdown's
        # schedule stage does. ``until``: the end of the intake wait.
        placed: tuple[Assignment, Decision] | None = None
        failure: SequenceTooLong | NoEligibleWorker | None = None
        until = dequeued
        if record is None:
            if is_handback_msg_id(msg_id):
                self._avoid_hander(rid, handback_worker(msg_id))
            try:
                placed = self._place(req, dequeued)
            except SequenceTooLong as exc:
                failure = exc
            except NoEligibleWorker as first:
                try:
                    placed = await self._place_held(req, first)
                except (SequenceTooLong, NoEligibleWorker) as exc:
                    failure = exc
                    if self.ssettings.hold_s > 0:  # held to the end: its last try was now
                        until = self.clock()
                else:
                    until = placed[0].dequeued_at_s or dequeued
        if sampled:
            self._record_intake_wait(msg, req, parent, msg_id=msg_id, delivery=delivery,
                                     dequeued=dequeued, until=until, naked_at=naked_at,
                                     resumed=record is not None)

        # ``schedule`` runs from the end of the intake wait to the assignment stamp
        # (assigned_at_s, where the breakdown's schedule stage ends), or to the NAK / answer of
        # a delivery that placed nothing; the dispatch (request-reply to the worker, which the
        # breakdown counts in the worker's queue wait) is its child ``dispatch``, so the stage
        # spans never overlap. Ended explicitly (not a ``with``): its end is a stamp.
        span: Any = tracer().start_span(
            str(Stage.SCHEDULE), context=extract(parent), start_time=int(until * 1e9),
            attributes={"vtm.request_id": rid, "vtm.scheduler": self.reporter,
                        "vtm.delivery": delivery}) if sampled else None
        dispatch_span: Any = None
        # Current while the delivery is handled: what goes out from here (a queue query, a
        # failure's result, the dispatch's own span) belongs to the schedule attempt.
        with trace.use_span(span, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False) \
                if span is not None else contextlib.nullcontext():
            try:
                stored: Any = None
                if record is not None:  # "dispatching": a crash or an unknown dispatch outcome
                    if self._served_for(rid, req.arrival_s):
                        self.stats.finished_acked += 1
                        self.log.info("redelivery of a served request acked", request_id=rid)
                        await msg.ack()
                        return
                    # "Gone" is judged from the worker-state view, which can lag; a worker that
                    # still lists the request is alive and will run it: re-send, do not hand back.
                    if self.worker_gone(record.worker_id) and \
                            not await self._worker_holds(record.worker_id, rid, req.arrival_s):
                        await self._hand_back_for_gone(msg, req, record, parent)
                        return
                    assignment, decision = await self._resume(req, record, dequeued), None
                    self.stats.resent += 1
                    if span is not None:
                        span.set_attribute("vtm.resumed", True)
                elif isinstance(failure, SequenceTooLong):
                    # Permanent: holding or NAKing it would only delay the client's answer
                    # (by hold_s + retry_delay_s per delivery) and end in a misleading 503.
                    self.metrics.refused()
                    _fail_span(span, "vtm.refused", str(failure))
                    await self._refuse(msg, req, failure)
                    return
                elif failure is not None:
                    self.metrics.no_worker()
                    _fail_span(span, "vtm.no_eligible_worker", str(failure))
                    await self._retry_or_fail(msg, req, str(failure),
                                              kind=RetryReason.NO_ELIGIBLE_WORKER)
                    return
                else:
                    assert placed is not None
                    assignment, decision = placed
                    self.metrics.placed(decision)
                    if span is not None:
                        limit = span_attribute_limit()
                        span.set_attributes(decision_attributes(
                            decision, None if limit is None else limit - SCHEDULE_SPAN_RESERVED))
                    stored = await self._put_record(assignment, seq, msg_id, "dispatching",
                                                    ack_subject=msg.reply)
                if span is not None:
                    # Where the breakdown's schedule stage ends (assigned_at_s): the span too.
                    at_ns = int(assignment.assigned_at_s * 1e9)
                    span.add_event("assigned", timestamp=at_ns)
                    _end_span(span, assignment.assigned_at_s)
                    dispatch_span = tracer().start_span(
                        DISPATCH_SPAN, context=trace.set_span_in_context(span),
                        kind=SpanKind.CLIENT, start_time=at_ns,
                        attributes={"vtm.request_id": rid, "vtm.worker_id": assignment.worker_id,
                                    "vtm.delivery": delivery})
                # The intake message's id lets the worker recognise a re-send of a message it
                # has handed back (services/rankd/core.py, "Exactly once across a scheduler
                # crash").
                hdrs = {INTAKE_MSG_HEADER: msg_id} if sampled \
                    else {**parent, INTAKE_MSG_HEADER: msg_id}
                # In the ledger before the send: a result that overtakes the worker's ack finds
                # it there (and takes it out); added after the ack, it would outlive its result.
                self.ledger.add(Sent(rid, assignment.worker_id, "", msg_id, seq, req,
                                     dict(parent), assignment.assigned_at_s))
                try:
                    # The dispatch span is current while the assignment goes out: the worker's
                    # ``vtm-rankd.assign`` server span is its child (shared.service.call injects).
                    with trace.use_span(dispatch_span, end_on_exit=False, record_exception=False,
                                        set_status_on_exception=False) \
                            if dispatch_span is not None else contextlib.nullcontext():
                        ack = await self._dispatch(assignment, hdrs)
                except asyncio.CancelledError:
                    # A stop gave the dispatch up (_finish_inflight: its server gone). Nobody
                    # waits for the record's store acknowledgement now: retrieved all the same (a
                    # failure is logged, not left to "Future exception was never retrieved").
                    self._store_unawaited(stored)
                    raise
                except (RemoteError, SchemaError, nats.errors.NoRespondersError,
                        nats.errors.TimeoutError, TimeoutError) as exc:
                    self.ledger.pop(rid)
                    _fail_span(dispatch_span, "vtm.dispatch_error", repr(exc))
                    if isinstance(exc, RemoteError) and exc.code in (HANDED_BACK, REDIRECTING):
                        await self._handed_back(msg, req, exc.code, stored, own=record is None)
                        return
                    unknown = isinstance(exc, (nats.errors.TimeoutError, TimeoutError)) or (
                        isinstance(exc, nats.errors.NoRespondersError) and record is not None)
                    if unknown:
                        await self._outcome_unknown(msg, req, assignment, seq, msg_id, stored, exc)
                        return
                    if isinstance(exc, nats.errors.NoRespondersError):
                        self._mark_unreachable(assignment.worker_id)
                        kind = RetryReason.WORKER_UNREACHABLE
                    else:
                        if isinstance(exc, RemoteError):
                            self._note_refusal(rid, assignment.worker_id)
                        kind = RetryReason.WORKER_REFUSED
                    self._release(rid)
                    await self._settle(stored, rid)
                    await self._delete_record(rid)
                    await self._retry_or_fail(
                        msg, req, f"worker {assignment.worker_id} did not accept: {exc}", kind=kind)
                    return
                self.ledger.adopted(rid, ack.incarnation)  # the incarnation that admitted it
                if self._refused_by:
                    self._refused_by.pop(rid, None)  # accepted: its refusals are history
                if ack.queue_position == 0:
                    # Nothing ahead of it on a FIFO worker: its prefill starts now, so q_w counts
                    # only its remaining predicted time from here on.
                    with contextlib.suppress(VertumnusError):
                        self.core.start(rid, self.clock())
                await self._settle(stored, rid)
                done = await self._put_record(assignment, seq, msg_id, "dispatched",
                                              ack.incarnation, msg.reply)
                self._store_unawaited(done)  # not awaited (see above)
                self.stats.dispatched += 1
                if dispatch_span is not None:
                    dispatch_span.set_attribute("vtm.queue_position", ack.queue_position)
                    _end_span(dispatch_span)
            finally:
                # A delivery NAK'ed ends its spans at the NAK's stamp, where its redelivery's
                # intake wait starts (_record_intake_wait): no gap, no overlap.
                nak = self._naked.get(rid)
                end_at = nak[2] if nak is not None and nak[:2] == (seq, delivery) else None
                _end_span(span, end_at)
                _end_span(dispatch_span, end_at)
        await self._ack_or_hold(msg, rid, seq)
        if decision is None and rid in self._held and \
                await self._result_kept(rid, since_s=req.arrival_s):
            # A re-sent assignment its worker had already served (a replica died between the
            # dispatch and its record): the worker runs nothing and answers position 0, and
            # the first token went out before this replica held the message, so no result
            # would ever come to release it (it was held, renewed, for good). Read after the
            # hold: a result published later reaches _on_result.
            self.stats.resent_served += 1
            self.log.info("re-sent assignment was served already; acked", request_id=rid)
            await self._result_seen(rid, served=True, arrival_s=req.arrival_s)
        if decision is not None:
            await self._after_dispatch(req, assignment, decision,
                                       in_demand=not is_handback_msg_id(msg_id))

    def _retry_started(self, rid: str, seq: int, delivery: int) -> float | None:
        """When this replica NAK'ed delivery ``delivery - 1`` of ``rid``'s intake message
        ``seq`` (forgotten now): where the retry's wait began. None when it did not (another
        replica did, or the delivery before ran out its ``ack_wait``; or this replica's NAK
        was of an earlier delivery, and another one came in between, whose spans a wait from
        that NAK would overlap): see :meth:`_record_intake_wait`."""
        nak = self._naked.pop(rid, None)
        return nak[2] if nak is not None and nak[:2] == (seq, delivery - 1) else None

    @staticmethod
    def _record_redelivery_wait(msg: Msg, req: IntakeRequest, record: AssignmentRecord,
                                delivery: int, dequeued: float) -> None:
        """The :data:`REDELIVERY_WAIT_SPAN` of a held message given back by a NAK its record
        stamps (``naked_at_s``): from that NAK to this delivery's dequeue, a child of the
        gateway's root, for a sampled trace only (the stamp is written only for one). Before,
        that wait -- a replica stopping with messages held, or giving back a gone one's --
        was in no span of the trace (this replica's own NAKs aside: ``vtm.retry``). A stamp
        after the dequeue (clock skew between replicas) is an empty wait."""
        parent = trace_carrier(msg.headers, req)
        if not parent or not is_sampled(parent):
            return
        assert record.naked_at_s is not None
        record_span(REDELIVERY_WAIT_SPAN, start_s=min(record.naked_at_s, dequeued),
                    end_s=dequeued, parent=parent,
                    attributes={"vtm.request_id": req.request_id, "vtm.delivery": delivery,
                                "vtm.naked_by": record.naked_by,
                                "vtm.worker_id": record.worker_id,
                                "vtm.holder": record.holder or record.scheduler})

    async def _clear_stamp(self, rec: AssignmentRecord) -> AssignmentRecord:
        """``rec`` without its give-back stamp (``naked_at_s``, ``naked_by``), sent to the
        store (not awaited: this replica's later writes of it follow on the same connection,
        and only a span ever reads the stamp). Tracing never fails the delivery: a failed send
        only leaves the stamp, as before."""
        cleared = rec.model_copy(update={"naked_at_s": None, "naked_by": ""})
        assert self._js is not None
        with contextlib.suppress(Exception):
            self._store_unawaited(await self._js.publish_async(
                f"{self._records_prefix}{rec.request_id}", to_json(cleared)))
        return cleared

    def _lapsed_since(self, msg: Msg, dequeued: float) -> float | None:
        """For a redelivery: ``dequeued - ack_wait`` (the intake consumer's) when the delivery
        before may have ended by running out its ``ack_wait`` (a replica that took it died or
        was stopped before it acked, NAK'ed or held it) -- JetStream redelivers such a message
        ``ack_wait`` after that delivery (or its holder's last in-progress ack), so the
        delivery before was no later than that bound (a replica that recorded stage spans of
        it placed it, and its record makes this a re-send, or NAK'ed it: see
        :meth:`_record_intake_wait`). None when the message is younger than ``ack_wait``
        (stored, at the server, less than ``ack_wait`` before this dequeue): no delivery of it
        can have lapsed, so a replica NAK'ed the one before (not this one: that is a retry),
        and its spans may reach up to that NAK."""
        try:
            stored = float(msg.metadata.timestamp.timestamp())
        except Exception:  # not a JetStream message
            return None
        bound = dequeued - self._ack_wait_s
        return bound if math.isfinite(bound) and bound >= stored else None

    def _record_intake_wait(self, msg: Msg, req: IntakeRequest, parent: Mapping[str, str], *,
                            msg_id: str, delivery: int, dequeued: float, until: float,
                            naked_at: float | None, resumed: bool = False) -> None:
        """The delivery's ``intake_wait`` span, ending at ``until`` (the placement's dequeue
        stamp, after any hold). It starts at

        * the gateway's arrival, on a first delivery;
        * the hand-back's publish (:meth:`_handed_back_at`), on a first delivery of
          a hand-back (``vtm.handed_back``, ``vtm.handed_back_by``: the worker,
          ``vtm.handback_cause``): the time on that worker before is not intake wait (a
          replica that handed it back for a lost worker recorded it as ``handed_back``);
        * this replica's NAK of the delivery before (``vtm.retry``): the retry's wait, which
          the FirstToken's breakdown (``vtm.request.stage{stage="intake_wait"}``) counts as
          intake wait too;
        * ``dequeued - ack_wait`` (:meth:`_lapsed_since`), but not before the first
          delivery's start (the arrival, or a hand-back's publish), on a redelivery this
          replica did not NAK whose delivery before may have lapsed (``vtm.redelivered``,
          ``vtm.delivery``): the wait after a replica that took it stopped or died, which the
          breakdown counts as intake wait too. Not for a re-sent ``dispatching`` assignment
          (``resumed``): its worker most likely admitted the first send, and the time since
          is its queue wait;
        * the dequeue, otherwise (another replica NAK'ed the delivery before): only its hold.

        An arrival after the dequeue (clock skew, or a bogus far-future stamp: any finite
        WallTime decodes, and 1e300 s would overflow the span's nanoseconds) is an empty wait,
        not a failed delivery."""
        held_s = until - dequeued
        attrs: dict[str, Any] = {"vtm.request_id": req.request_id}
        if held_s > 0:
            attrs["vtm.held_s"] = held_s
            attrs["vtm.delivery"] = delivery
        first = req.arrival_s  # where the message's first delivery's wait starts
        if is_handback_msg_id(msg_id):
            stored = self._handed_back_at(msg)
            if stored is not None:
                first = max(first, stored)
        if delivery == 1:
            start = first
            if is_handback_msg_id(msg_id):
                attrs["vtm.handed_back"] = True
                attrs["vtm.handed_back_by"] = handback_worker(msg_id)
                attrs["vtm.handback_cause"] = str(
                    (msg.headers or {}).get(HANDBACK_CAUSE_HEADER) or HandBackCause.WORKER)
        elif naked_at is not None:
            start = naked_at
            attrs["vtm.retry"] = True
            attrs["vtm.delivery"] = delivery
        elif not resumed and (lapsed := self._lapsed_since(msg, dequeued)) is not None:
            start = max(first, lapsed)
            attrs["vtm.redelivered"] = True
            attrs["vtm.delivery"] = delivery
        elif held_s > 0:
            start = dequeued
        else:
            return
        record_span(Stage.INTAKE_WAIT, start_s=min(start, until), end_s=until, parent=parent,
                    attributes=attrs)

    @staticmethod
    def _handed_back_at(msg: Msg) -> float | None:
        """When a hand-back was published (Unix seconds): the stamp a replica put in its
        header (:data:`HANDBACK_AT_HEADER`), else when the intake stream stored the message;
        None when neither is known (not a JetStream message)."""
        try:
            at = float((msg.headers or {})[HANDBACK_AT_HEADER])
            if math.isfinite(at):
                return at
        except (KeyError, ValueError):
            pass
        try:
            return float(msg.metadata.timestamp.timestamp())
        except Exception:
            return None

    async def _dispatch(self, a: Assignment, headers: dict[str, str]) -> AssignmentAck:
        """Send the assignment to its worker and return the worker's AssignmentAck (raises
        what :func:`shared.service.call` raises)."""
        return await call(self.nc, self.subjects.worker_assign(a.worker_id), a, AssignmentAck,
                          timeout_s=self.ssettings.dispatch_timeout_s, headers=headers)

    def _mark_unreachable(self, wid: str) -> None:
        """A first send to ``wid`` found no responder: nobody serves its subject (the process
        died, or its endpoint is not up yet). Until its state changes it is not eligible, so
        the retry goes elsewhere instead of to the same absent worker."""
        state = self._states.get(wid)
        if state is None:
            return
        self._unreachable[wid] = (state.incarnation, state.seq)
        self.stats.unreachable_marked += 1
        self.log.warning("worker unreachable; not eligible until its state changes", worker=wid)
        self._rebuild_view()

    def _note_refusal(self, rid: str, wid: str) -> None:
        """``wid`` refused ``rid``'s dispatch with a micro error other than 410 / 425 (it does
        not hold the request: an internal error, a refusal of its core, a proxy's 503). The
        worker may serve others, so it stays eligible; only this request's retries avoid it
        while another worker is eligible (:meth:`_place`). Before, the retry was placed
        afresh and J, seeing nothing changed, chose the refusing worker again, delivery after
        delivery, until max_deliver failed the request while another worker was free. Kept
        by this replica only (a redelivery to another one places it afresh)."""
        self.stats.worker_refusals += 1
        self._avoid(rid, wid)

    def _avoid_hander(self, rid: str, wid: str) -> None:
        """A hand-back of ``rid`` by ``wid`` (its intake message id names it): placed
        elsewhere while another worker is eligible, as after a refusal (:meth:`_place`).
        The worker handed it back because it drains, stops, failed or was lost; this replica
        may not have seen that yet (the epoch record or the state that says so can arrive
        after the hand-back), and placing it there again cost a refusal and a
        ``retry_delay_s`` NAK before it went where it should. Not counted as a refusal."""
        self.stats.handbacks_steered += 1
        self._avoid(rid, wid)

    def _avoid(self, rid: str, wid: str) -> None:
        """``rid``'s placements on this replica avoid ``wid`` while another worker is
        eligible (:meth:`_place`); the oldest requests' are forgotten first."""
        self._refused_by[rid] = self._refused_by.get(rid, frozenset()) | {wid}
        self._refused_by.move_to_end(rid)
        while len(self._refused_by) > _REFUSALS_KEPT:
            self._refused_by.popitem(last=False)

    def _recover_lost(self) -> None:
        """Start recovering the requests of every worker the ledger finds lost (ledger.py);
        one task per worker at a time."""
        if not len(self.ledger):
            return
        for lost in self.ledger.lost(self._states, now=self.clock(),
                                     lease_s=self.ssettings.lease_s,
                                     loaded=self._states_loaded):
            spawn_once(self._tasks, self._recovering, lost.worker_id,
                       partial(self._recover, lost), f"recover-{lost.worker_id}")

    async def _recover(self, lost: LostWorker) -> None:
        """Hand back to intake the requests ``lost`` lists that its worker does not hold.

        The worker's ``queue`` endpoint decides: a SILENT worker that answers is alive (its
        heartbeats are what is missing) and keeps everything; a RESTARTED one keeps what its
        new incarnation lists (a re-send reached it). A request answered meanwhile is left
        alone (its result removed it from the ledger)."""
        wid = lost.worker_id
        try:
            listed = await self._queue_of(wid)
            if lost.loss is Loss.SILENT and listed is not None:
                return
            for sent in lost.requests:
                if self.ledger.get(sent.request_id) is not sent:
                    continue  # answered, superseded or already handed back
                if lists_attempt(listed, sent.request_id, sent.request.arrival_s):
                    self.ledger.adopted(sent.request_id, lost.incarnation)
                    continue
                await self._hand_back_lost(sent, lost.loss)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the next housekeeping round tries again
            self.log.warning("recovering a lost worker's requests failed", worker=wid,
                             error=repr(exc))

    async def _queue_of(self, wid: str) -> Listing | None:
        """The requests (and their attempts) the worker lists, queued or running; None when
        it does not answer."""
        rep = await self._report_of(wid)
        return None if rep is None else listing_of(rep)

    async def _report_of(self, wid: str) -> QueueReport | None:
        """The worker's queue report; None when it does not answer."""
        try:
            return await call(self.nc, self.subjects.worker_queue(wid),
                              QueueQuery(worker_id=wid), QueueReport,
                              timeout_s=self.ssettings.dispatch_timeout_s)
        except (RemoteError, SchemaError, nats.errors.NoRespondersError,
                nats.errors.TimeoutError, TimeoutError):
            return None

    async def _hand_back_lost(self, sent: Sent, loss: Loss) -> None:
        """Publish ``sent``'s request to intake under the id its worker's own hand-back would
        have (so the two are one message), release its reservation and forget it. A failed
        publish leaves it in the ledger for the next round."""
        assert self._js is not None
        rid, wid = sent.request_id, sent.worker_id
        cause = HandBackCause.LOST_RESTARTED if loss is Loss.RESTARTED \
            else HandBackCause.LOST_SILENT
        # Housekeeping, not an intake delivery: its log lines get the request's ids here.
        with bind_request(rid, trace_id_of(sent.carrier)):
            data, headers = encode(sent.request)
            headers.update(sent.carrier)
            headers[MSG_ID_HEADER] = handback_msg_id(rid, sent.msg_id, wid, 0)
            headers[HANDBACK_CAUSE_HEADER] = str(cause)
            published = self.clock()
            headers[HANDBACK_AT_HEADER] = repr(published)
            pub = await self._js.publish(self.subjects.intake_requests(), data,
                                         headers=headers,
                                         timeout=self.ssettings.dispatch_timeout_s)
            # Answered while the publish was out (rare): handle_intake acks that hand-back
            # unplaced, as the result is in _served.
            self.ledger.pop(rid)
            await self._release_held(rid)
            with contextlib.suppress(UnknownRequest):
                if self.core.worker_of(rid) == wid:
                    self.core.finish(rid, self.clock())
            self.stats.lost_handed_back += 1
            self.stats.lost_in_intake += bool(pub.duplicate)
            self.metrics.handed_back(cause)
            self._record_handed_back(sent.request, sent.carrier, wid, cause,
                                     sent.assigned_at_s, published, bool(pub.duplicate))
            self.log.warning("request handed back: its worker was lost", request_id=rid,
                             worker=wid, loss=str(loss), duplicate=bool(pub.duplicate))

    def _record_handed_back(self, req: IntakeRequest, carrier: Mapping[str, str], wid: str,
                            cause: HandBackCause, since_s: float | None, published_s: float,
                            duplicate: bool) -> None:
        """The ``handed_back`` span of a request this replica handed back on ``wid``'s behalf:
        the time it spent there, lost, from its assignment (``since_s``; None: not known, the
        span is then empty, at the publish) to the hand-back's publish, where the hand-back
        delivery's ``intake_wait`` starts. A child of the request's root, for a sampled trace
        only, and only when this replica's publish was the one intake stored (not a
        ``duplicate``): a worker that handed the request back itself under the same id
        recorded the span of its own (services/rankd/service.py), one per hand-back."""
        if duplicate or not carrier or not is_sampled(carrier):  # the stored one's publisher's
            return
        start = published_s if since_s is None else min(since_s, published_s)
        record_span(HANDED_BACK_SPAN, start_s=start, end_s=published_s, parent=carrier,
                    attributes={"vtm.request_id": req.request_id, "vtm.worker_id": wid,
                                "vtm.cause": str(cause)})

    async def _outcome_unknown(self, msg: Msg, req: IntakeRequest, a: Assignment, seq: int,
                               msg_id: str, stored: Any, exc: BaseException) -> None:
        """The worker may have admitted the assignment (see "Failure handling"): keep the
        ``dispatching`` record, so the next delivery re-sends it to the same worker, and NAK.
        The record must be stored for that: a failed store is tried once more."""
        rid = req.request_id
        self.stats.dispatch_unknown += 1
        self._release(rid)  # re-sent without a reservation, as after a crash
        if stored is not None and not await self._settle(stored, rid):
            again = await self._put_record(a, seq, msg_id, "dispatching")
            await self._settle(again, rid)
        self.log.warning("dispatch outcome unknown; record kept", request_id=rid,
                         worker=a.worker_id, error=repr(exc))
        if self._deliveries(msg) >= self._max_deliver:
            if await self._worker_holds(a.worker_id, rid, req.arrival_s):
                # No delivery is left to re-send it, but the worker has it queued or running:
                # its first token will answer the client, so no error FirstToken goes out.
                # In the ledger (and held), as a dispatch the worker acknowledged: should
                # that worker be lost before it answers, the request is handed back.
                self.stats.unknown_held += 1
                self.log.info("last delivery: the worker holds the request", request_id=rid,
                              worker=a.worker_id)
                state = self._states.get(a.worker_id)
                self.ledger.add(Sent(rid, a.worker_id, state.incarnation if state else "",
                                     msg_id, seq, req, trace_carrier(msg.headers, req),
                                     a.assigned_at_s))
                await self._ack_or_hold(msg, rid, seq)
                return
        delay = None
        if isinstance(exc, nats.errors.NoRespondersError):
            # Nobody serves the worker's subjects: most likely it is gone, which its lease
            # tells. Re-sent before then, every delivery would meet "no responders" and the
            # last one answer the client with an error while other workers are free; once
            # the lease is out, the next delivery hands the request back instead.
            delay = self._until_lease_out(a.worker_id)
        await self._retry_or_fail(msg, req, f"worker {a.worker_id} did not answer: {exc!r}",
                                  kind=RetryReason.OUTCOME_UNKNOWN, delay=delay)

    def _until_lease_out(self, worker_id: str) -> float:
        """Seconds until ``worker_id``'s lease runs out (:meth:`worker_gone`), and a retry
        delay more; at least the retry delay."""
        retry = self.ssettings.retry_delay_s
        state = self._states.get(worker_id)
        if state is None:
            return retry
        left = self.ssettings.lease_s - (self.clock() - state.heartbeat_s)
        return max(retry, left + retry)

    async def _worker_holds(self, worker_id: str, request_id: str, arrival_s: float) -> bool:
        """Whether the worker lists the request's attempt that arrived at ``arrival_s`` as
        queued or running (its ``queue`` endpoint, :func:`lists_attempt`); False when it does
        not answer."""
        return lists_attempt(await self._queue_of(worker_id), request_id, arrival_s)

    def worker_gone(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is known gone (see "Failure handling"); never before the
        worker-state view has loaded (a restarted scheduler knows nothing yet)."""
        if not self._states_loaded:
            return False
        state = self._states.get(worker_id)
        if state is None:
            return True
        if self.clock() - state.heartbeat_s > self.ssettings.lease_s:
            return True
        return state.lifecycle is Lifecycle.UNAVAILABLE and state.queue_len == 0

    async def _hand_back_for_gone(self, msg: Msg, req: IntakeRequest, rec: AssignmentRecord,
                                  parent: Mapping[str, str]) -> None:
        """The recorded worker is gone: publish the request to intake under the id of the
        worker's own hand-back (de-duplicated against it), then ack the old message."""
        assert self._js is not None
        rid = req.request_id
        data, headers = encode(req)
        headers.update(parent)
        headers[MSG_ID_HEADER] = handback_msg_id(rid, rec.msg_id, rec.worker_id, rec.epoch)
        headers[HANDBACK_CAUSE_HEADER] = str(HandBackCause.GONE)
        published = self.clock()
        headers[HANDBACK_AT_HEADER] = repr(published)
        try:
            pub = await self._js.publish(self.subjects.intake_requests(), data,
                                         headers=headers,
                                         timeout=self.ssettings.dispatch_timeout_s)
        except (nats.errors.Error, TimeoutError) as exc:
            await self._retry_or_fail(msg, req, f"hand-back for gone worker {rec.worker_id} "
                                                f"failed: {exc!r}",
                                      kind=RetryReason.HANDBACK_FAILED)
            return
        self._release(rid)
        self.stats.gone_handed_back += 1
        self.stats.gone_in_intake += bool(pub.duplicate)
        self.metrics.handed_back(HandBackCause.GONE)
        self._record_handed_back(req, parent, rec.worker_id, HandBackCause.GONE,
                                 rec.assigned_at_s, published, bool(pub.duplicate))
        self.log.info("handed back for a gone worker", request_id=rid, worker=rec.worker_id,
                      duplicate=bool(pub.duplicate))
        await msg.ack()

    async def _handed_back(self, msg: Msg, req: IntakeRequest, code: int, stored: Any, *,
                           own: bool) -> None:
        """The worker had admitted this message's assignment before and handed it back to
        intake (410: its redirect, a newer message, is stored there: ack this one) or is
        handing it back now (425: retry, *keeping* the record so the next delivery asks the
        same worker again). Deleting the record or placing afresh could run it twice.
        ``own``: this delivery placed it (else it re-sent a recorded assignment and the core
        holds no reservation of this delivery)."""
        rid = req.request_id
        if own:
            self._release(rid)
        await self._settle(stored, rid)
        if code == HANDED_BACK:
            self.stats.handed_back_acked += 1
            self.log.info("re-sent assignment had been handed back; acked", request_id=rid)
            await msg.ack()
            return
        await self._retry_or_fail(msg, req, "the worker is handing it back to intake",
                                  kind=RetryReason.HANDING_BACK)

    # -- held intake messages (hold_intake) ---------------------------------------------------

    async def _ack_or_hold(self, msg: Msg, rid: str, seq: int) -> None:
        """The dispatch of ``msg`` is done: ack it, or with ``hold_intake`` keep it unacked
        while the ledger holds the dispatch (until its result or its hand-back; see
        "Held intake messages"). A result that came before this point is acked at once."""
        sent = self.ledger.get(rid)
        if not self.ssettings.hold_intake or sent is None or sent.stream_seq != seq:
            await msg.ack()
            return
        old = self._held.get(rid)
        self._held[rid] = msg
        if old is not None and old is not msg:
            with contextlib.suppress(Exception):  # an older message of the request
                await old.ack()

    async def _give_back_holds(self, js: JetStreamContext, holder: str | None, *, why: str,
                               holders: set[str] | None = None) -> int:
        """NAK the intake messages that replica ``holder``, now gone, held; returns how many.
        ``holder=None`` NAKs nothing; ``holders``, if given, gets the holder of every unacked
        message's record that the walk read (for :meth:`setup`).

        Called for this replica's own id at start when the id is fixed (``VTM_INSTANCE_ID``:
        the records naming it as the holder were written by an earlier process of this
        replica, which is gone -- two live processes must not share an id), and by
        :meth:`_watch_peers` for a replica that stopped answering. The intake is a work
        queue, so the messages it still has up to the consumer's last delivery are the
        unacked ones: for each whose record names ``holder`` as holder, this message and its
        delivery's reply subject (``AssignmentRecord.ack_subject``), a NAK makes the server
        deliver it again at once -- to a replica that adopts it or hands it back
        (_redelivered) -- instead of after ``ack_wait``. Best effort, bounded by
        ``max_ack_pending`` messages and ``ack_wait_s / 3`` seconds: anything missed still
        comes back after ``ack_wait``.

        NOTE: the server applies a NAK to the message's current delivery, whatever delivery
        the reply subject names; if the gone replica's hold already expired and another one
        took the message, the NAK sends it on once more and the next replica adopts it too
        (each acks it on the result; their hand-backs of it share one id).
        """
        s = self.subjects
        stream = s.intake_stream()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._give_back_budget_s()
        seen = naked = 0
        what = "intake holders" if holder is None else "gone replica's held messages"
        try:
            info = await js.consumer_info(stream, s.intake_consumer())
            last = info.delivered.stream_seq if info.delivered is not None else 0
            seq = 1
            while seq <= last and seen < self.ssettings.max_ack_pending:
                if loop.time() >= deadline:
                    self.log.warning(f"{what}: scan cut short", holder=holder, seen=seen,
                                     given_back=naked)
                    break
                try:
                    m = await js.get_msg(stream, seq, subject=s.intake_requests(), next=True)
                except NotFoundError:
                    break
                if m.seq is None or m.seq > last:
                    break
                seq, seen = m.seq + 1, seen + 1
                try:
                    req = decode(IntakeRequest, m.data or b"", m.headers)
                except SchemaError:
                    continue  # malformed: its delivery terminates it
                rid = req.request_id
                rec = await self._get_record(rid)
                if rec is None or rec.stream_seq != m.seq:
                    continue
                if holders is not None:
                    holders.add(rec.holder or rec.scheduler)
                if (rec.holder or rec.scheduler) == holder and rec.ack_subject:
                    if is_sampled(trace_carrier(m.headers, req)):
                        # For the redelivery's intake_redelivery_wait span (as at a stop):
                        # stored before the NAK, so that its next reader finds it.
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(await self._put_stamped(rec, self.clock()),
                                                   max(0.0, deadline - loop.time()))
                    await self.nc.publish(rec.ack_subject, b"-NAK")
                    naked += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never keeps the replica from starting or serving
            self.log.warning(f"{what}: scan failed", holder=holder,
                             error=repr(exc), given_back=naked)
        if naked:
            self.log.info("gone replica's held intake messages given back", holder=holder,
                          why=why, count=naked)
        return naked

    async def _watch_peers(self, js: JetStreamContext, found: set[str] | None) -> None:
        """Every ``peer_check_s``: list the scheduler replicas of this deployment (their micro
        metadata ``reporter``). One not listed for ``peer_gone_s`` is gone; the live replica
        with the smallest id (the same one in every replica's view, barring a listing that
        missed someone: then two give back, which is harmless) NAKs what the gone one held
        (:meth:`_give_back_holds`), unless ``ack_wait * 2/3`` has passed since it was last
        seen (its holds expire about then: they come back by themselves). A holder found at
        start and never listed (:meth:`setup`; "seen" at this replica's start) is given back
        by every replica that found it: the others may never have known it.

        ``found``: the holders :meth:`setup` read; None: read them first (a replica without
        a fixed id walks in the background, so as not to hold up its start)."""
        name = micro_service_name("scheduler")
        loop = asyncio.get_running_loop()
        if found is None:
            found = set()
            await self._give_back_holds(js, None, why="", holders=found)
        found.discard(self.reporter)  # (its own, before this process or since it started)
        for r in found:
            self._peers.setdefault(r, loop.time())
        self._unlisted |= found
        self.stats.holders_found += len(found)
        period = self.ssettings.peer_check_s
        while True:
            await asyncio.sleep(period)
            try:
                answers = await every_answer(self.nc, f"$SRV.PING.{name}",
                                             prefix=self.subjects.prefix,
                                             window_s=min(0.25, period / 2))
                now = loop.time()
                live = {str((a.get("metadata") or {}).get("reporter") or "")
                        for a in answers} - {""}
                live.add(self.reporter)
                for r in live:
                    self._peers[r] = now
                self._unlisted -= live
                for r, seen_at in list(self._peers.items()):
                    if now - seen_at <= self.ssettings.peer_gone_s:
                        continue
                    del self._peers[r]
                    unlisted = r in self._unlisted
                    self._unlisted.discard(r)
                    self.stats.peers_gone += 1
                    self.log.warning("scheduler replica gone", replica=r,
                                     unseen_s=round(now - seen_at, 1), never_listed=unlisted)
                    if (min(live) != self.reporter and not unlisted) \
                            or now - seen_at >= self._ack_wait_s * 2 / 3:
                        continue
                    self.stats.peer_naked += await self._give_back_holds(
                        js, r, why="replica gone")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the next round again
                self.log.warning("scheduler replicas not listed", error=repr(exc))

    def _give_back_budget_s(self) -> float:
        """How long :meth:`_give_back_holds` may take (at start, the replica waits)."""
        return self._ack_wait_s / 3

    async def _release_held(self, rid: str) -> None:
        """The ledger let go of ``rid`` (its result came, or it was handed back): ack its
        held intake message. A failed ack only means a redelivery, which finds the result."""
        msg = self._held.pop(rid, None)
        if msg is not None:
            with contextlib.suppress(Exception):
                await msg.ack()

    async def _keep_held(self) -> None:
        """Every ack_wait / 3: mark each held message in progress (no redelivery while this
        replica lives), and ack those whose dispatch left the ledger some other way (a newer
        message superseded it, the ledger's bound dropped it).

        ``ack_wait`` is the intake consumer's own (``_ack_wait_s``, read when this replica
        bound to it), not this replica's setting: a durable made by another replica keeps the
        ack_wait it was made with, and a period from a longer setting let held messages be
        redelivered while this replica still held them."""
        while True:
            await asyncio.sleep(self._ack_wait_s / 3)
            for rid, msg in list(self._held.items()):
                sent = self.ledger.get(rid)
                try:
                    if sent is None or sent.stream_seq != self._stream_seq(msg):
                        if self._held.get(rid) is msg:
                            del self._held[rid]
                        await msg.ack()
                    else:
                        await msg.in_progress()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the connection is down: the next round again
                    with bind_request(rid, trace_id_of(sent.carrier) if sent else None):
                        self.log.debug("held intake message not renewed", error=repr(exc))
            if self._held:
                self.stats.held_renewals += 1

    async def _redelivered(self, msg: Msg, req: IntakeRequest, rec: AssignmentRecord) -> None:
        """A message dispatched before (its ``dispatched`` record names this stream sequence)
        is delivered again: the replica that held it died or stopped (or, with hold_intake
        off, died between the record and the ack). Its first token out → ack. Else the
        worker decides: it lists the request → adopt it (the ledger and this replica's hold
        take over, so a later loss of that worker is still recovered); it answers without it
        and is the incarnation that admitted it → it ran it (or handed it back) → ack; it is
        gone, or restarted since → hand the request back to intake. A worker that does not
        answer yet while its state is fresh is adopted too: the ledger finds it if it died."""
        rid = req.request_id
        # Without hold_intake nothing is held: this is the crash-before-ack case.
        if self._served_for(rid, req.arrival_s) or not self.ssettings.hold_intake \
                or await self._result_kept(rid, since_s=req.arrival_s):
            self.stats.redelivered_acked += 1
            self.log.info("redelivered intake acked without dispatch", request_id=rid)
            await msg.ack()
            return
        wid = rec.worker_id
        report = await self._report_of(wid)
        listed = None if report is None else listing_of(report)
        holds = lists_attempt(listed, rid, req.arrival_s)  # this message's attempt
        state = self._states.get(wid)
        restarted = state is not None and bool(rec.incarnation) \
            and state.incarnation != rec.incarnation
        carrier = trace_carrier(msg.headers, req)
        if (listed is None and self.worker_gone(wid)) or \
                (listed is not None and not holds and restarted):
            self.stats.adopted_lost += 1
            await self._hand_back_for_gone(msg, req, rec, carrier)
            return
        if listed is not None and not holds:
            self.stats.redelivered_acked += 1
            self.log.info("redelivered intake acked: its worker no longer holds it",
                          request_id=rid, worker=wid)
            await msg.ack()
            return
        seq = self._stream_seq(msg)
        inc = state.incarnation if state is not None and listed is not None else rec.incarnation
        self.ledger.add(Sent(rid, wid, inc, rec.msg_id, seq, req, carrier, rec.assigned_at_s))
        self.stats.adopted += 1
        if rec.scheduler == self.reporter:
            # Placed by this replica's previous process: the worker reports it as this
            # replica's work, which _note_foreign leaves to the core, so the core reserves it.
            with contextlib.suppress(VertumnusError):
                self.stats.adopted_reserved += self.core.adopt(
                    RequestInfo(rid, req.input_len, tuple(req.block_hashes), req.arrival_s),
                    WorkerId(wid), rec.predicted_s, self.clock(),
                    running=report is not None and rid in report.in_flight)
        self.log.info("dispatched request adopted", request_id=rid, worker=wid,
                      listed=listed is not None)
        # The record names the new holder and its delivery, so that this replica's own next
        # process (or a survivor, if this replica dies) can give it back at once (_give_back_holds).
        assert self._js is not None
        self._store_unawaited(await self._js.publish_async(
            f"{self._records_prefix}{rid}", to_json(rec.model_copy(update={
                "holder": self.reporter, "ack_subject": msg.reply or "",
                "incarnation": inc, "naked_at_s": None, "naked_by": ""}))))
        await self._ack_or_hold(msg, rid, seq)

    async def _republished_known(self, msg: Msg, req: IntakeRequest) -> bool:
        """A gateway sent ``req`` again because the intake stream was made anew (the server
        lost its store, ``REPUBLISHED_HEADER``): the lost message may have been dispatched
        already -- schedulers pull eagerly, so most were -- and its worker will answer it, or
        it may never have been delivered. A worker of this replica's view (every one not known
        gone, asked at once) that lists the request holds it → adopt it (:meth:`_redelivered`
        with a record made from what is known: this replica holds the message and recovers
        the request if that worker is lost, whoever dispatched it); else its first token is
        out already (the results stream keeps one finished after this request's arrival --
        not an earlier one, which a retry's client never got; looked up *after* the workers,
        so one that finished in between counts) → ack; else it was lost with the store:
        False, and the caller places it like any new message. A live replica that placed
        it before keeps its own ledger entry too: if the worker is lost both hand it back under
        the one id the worker's own hand-back would have (one intake message). A worker that
        does not answer counts as not holding it (at worst the request runs twice; its client
        gets one answer)."""
        rid = req.request_id
        # NOTE: not `rid in self._served`: that answer may be an earlier one which this
        # message's client (a retry after the loss) never got; see the results check below.
        # A replica that has just started may not know the workers yet (the others' states
        # come back after the loss too): who to ask is the question here, so wait for them.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ssettings.hold_s
        while not (self._states_loaded and self._states) and loop.time() < deadline:
            await asyncio.sleep(REPUBLISHED_POLL_S)
        listing = await self._worker_listing()
        holder = next((w for w, ids in listing.items()
                       if lists_attempt(ids, rid, req.arrival_s) and not self.worker_gone(w)),
                      None)
        if holder is not None:
            # Adopted like a held message redelivered: the replica that dispatched it may be
            # gone with its ledger (its record and held message went with the store), and
            # then nobody would hand the request back if this worker died too.
            self.stats.republished_held += 1
            self.log.info("re-sent request held by a worker; adopting it", request_id=rid,
                          worker=holder)
            state = self._states.get(holder)
            degree = state.degree if state is not None else 1
            mine = rid in self.ledger
            await self._redelivered(msg, req, AssignmentRecord(
                request_id=rid, stream_seq=self._stream_seq(msg),
                msg_id=(msg.headers or {}).get(MSG_ID_HEADER) or rid, worker_id=holder,
                epoch=state.epoch if state is not None else 0, degree=degree,
                predicted_s=self.profile.predict(req.input_len, 0, degree),
                state="dispatched", scheduler=self.reporter if mine else "",
                assigned_at_s=req.arrival_s,
                incarnation=state.incarnation if state is not None else ""))
            return True
        if await self._result_kept(rid, since_s=req.arrival_s):
            self.stats.republished_answered += 1
            self.log.info("re-sent request already answered; acked", request_id=rid)
            await msg.ack()
            return True
        self.stats.republished_placed += 1
        self.log.info("re-sent request lost with the store; placing it", request_id=rid)
        return False

    async def _worker_listing(self) -> dict[str, Listing | None]:
        """Every worker's listing (:data:`Listing`: its requests and their attempts; None: no
        answer), asked of every worker not known gone at once; one listing answers for
        ``republished_listing_s``, and callers that come while it is taken wait for it. A
        worker the view gained since makes a new one."""
        loop = asyncio.get_running_loop()
        async with self._listing_lock:
            wids = [w for w in self._states if not self.worker_gone(w)]
            known = self._listing
            if known is not None \
                    and loop.time() - known[0] <= self.ssettings.republished_listing_s \
                    and all(w in known[1] for w in wids):
                return known[1]
            taken = loop.time()
            listed = await asyncio.gather(*(self._queue_of(w) for w in wids))
            self.stats.republished_listings += 1
            self._listing = (taken, dict(zip(wids, listed, strict=True)))
            return self._listing[1]

    async def _result_kept(self, rid: str, *, since_s: float | None = None) -> bool:
        """Whether the results stream keeps a first token (not an error) for ``rid``, one
        that answers an attempt that arrived at or after ``since_s`` if given (the request's
        ``arrival_s``: not an earlier request that used the same id).

        Both stamps are the gateway's: a FirstToken echoes the ``arrival_s`` of the request
        it answers. One without it (an older producer) is judged by when it finished, a
        stamp from the worker's host instead: there a clock skew larger than the request's
        time in the system makes its own answer not count, and the caller then does what it
        did before this check (the request is placed again; its worker sends the answer it
        kept)."""
        assert self._js is not None
        try:
            kept = await latest_result(self._js, self.subjects, rid)
        except Exception:  # none kept (NotFoundError), or the stream did not answer
            return False
        if kept is None or kept[0].error is not None:
            return False
        ft = kept[0]
        return since_s is None or (ft.finished_at_s if ft.arrival_s is None
                                   else ft.arrival_s) >= since_s

    async def _settle(self, stored: Any, rid: str) -> bool:
        """Wait for a record's store acknowledgement; a failure is logged, not fatal (the
        assignment itself went through; only a crash-restart would have needed the record).
        True: stored (or nothing to wait for)."""
        if stored is None:
            return True
        try:
            # NOTE: publish_async futures have no timeout of their own; wait_for cancels a
            # late one, which also frees its slot in nats-py's pending-publish semaphore.
            await asyncio.wait_for(stored, self.ssettings.dispatch_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # TimeoutError included
            self.log.warning("assignment record not stored", request_id=rid, error=repr(exc))
            return False
        return True

    def _store_unawaited(self, done: asyncio.Future[Any] | None) -> None:
        """A record's store acknowledgement nobody waits for: logged if it fails, cancelled
        after ``dispatch_timeout_s`` (bounded all the same)."""
        if done is not None:
            done.add_done_callback(self._log_store_failure)
            asyncio.get_running_loop().call_later(self.ssettings.dispatch_timeout_s, done.cancel)

    def _log_store_failure(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            self.log.warning("dispatched record not acknowledged in time")
        elif fut.exception() is not None:
            self.log.warning("dispatched record not stored", error=repr(fut.exception()))

    async def _place_held(self, req: IntakeRequest, why: NoEligibleWorker
                          ) -> tuple[Assignment, Decision]:
        """No worker is eligible now: keep the message and try again at each change of the
        worker view, for up to ``hold_s``; raise NoEligibleWorker after that.

        A NAK would put the request back for ``retry_delay_s`` whatever happens meanwhile, so
        a request arriving while every worker switches (a multi-op reconfiguration) would wait
        up to that much *after* a worker is back; the simulator places it the moment one is.
        The wait counts as intake wait (``dequeued_at_s`` is when it is finally placed), in
        the FirstToken's breakdown and in the ``intake_wait`` span alike (handle_intake
        places before it opens the ``schedule`` span).
        Raises the last NoEligibleWorker (its reason names every worker's exclusion), and
        :class:`SequenceTooLong` at once when a new view shows the request too long for every
        worker (the first failure may have come from a view without workers)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ssettings.hold_s
        while (left := deadline - loop.time()) > 0:
            if self._view_changed is None:
                self._view_changed = loop.create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._view_changed), left)
            try:
                return self._place(req, self.clock())
            except SequenceTooLong:
                raise
            except NoEligibleWorker as exc:
                why = exc
        raise why

    def _place(self, req: IntakeRequest, dequeued: float) -> tuple[Assignment, Decision]:
        hashes = tuple(req.block_hashes)
        match = self.trie.match(hashes)
        info = RequestInfo(req.request_id, req.input_len, hashes, req.arrival_s)
        now = self.clock()
        pending = pending_reach(self.trie, hashes, match.held_blocks, gone=self._lapsed) \
            if self._pending_on else None
        avoid = self._refused_by.get(req.request_id) if self._refused_by else None
        if avoid:
            # A retry of a request workers refused: elsewhere when another worker is
            # eligible; else (only those may take it) where the policy chooses, as before --
            # the retry rules (max_deliver) bound how often.
            # Counted only where an avoided worker was a candidate (ACTIVE in the view, as
            # SchedulerCore.place's avoidance reads it): else nothing was steered away.
            steered = any(w.lifecycle is Lifecycle.ACTIVE and w.worker_id in avoid
                          for w in self.core.view.workers)
            try:
                decision = self.core.place(info, match.held_blocks, now, pending=pending,
                                           avoid=avoid)
                if steered:
                    self.stats.refusals_avoided += 1
            except NoEligibleWorker:
                decision = self.core.place(info, match.held_blocks, now, pending=pending)
        else:
            decision = self.core.place(info, match.held_blocks, now, pending=pending)
        self.stats.placed += 1
        if pending and decision.worker in pending \
                and decision.reused_blocks > match.held(decision.worker):
            self.stats.pending_credited += 1
        eligible = sum(1 for e in decision.columns.excluded if e is None)
        assignment = Assignment(
            request=req,
            worker_id=decision.worker,
            epoch=decision.epoch,
            degree=decision.degree,
            prefix_tokens=decision.prefix_tokens,
            recompute_tokens=decision.uncached_tokens,
            predicted_s=decision.predicted_s,
            dequeued_at_s=dequeued,
            assigned_at_s=self.clock(),
            terms=placement_terms(decision, self.core.policy, eligible),
            scheduler_id=self.reporter,
            pull_copy_s=pull_copy_s(self._credit, decision.pulled_blocks),
        )
        return assignment, decision

    async def _resume(self, req: IntakeRequest, rec: AssignmentRecord,
                      dequeued: float) -> Assignment:
        """Rebuild the recorded assignment to re-send it to the same worker (P from the trie)."""
        held = self.trie.match(tuple(req.block_hashes)).held(WorkerId(rec.worker_id))
        p = min(held * self.ssettings.block_size, req.input_len - 1)
        return Assignment(
            request=req, worker_id=rec.worker_id, epoch=rec.epoch, degree=rec.degree,
            prefix_tokens=p, recompute_tokens=req.input_len - p, predicted_s=rec.predicted_s,
            dequeued_at_s=dequeued, assigned_at_s=self.clock(), scheduler_id=self.reporter,
        )

    def _placed(self, rid: str) -> bool:
        try:
            self.core.worker_of(rid)
        except UnknownRequest:
            return False
        return True

    def _release(self, rid: str) -> None:
        with contextlib.suppress(UnknownRequest):
            self.core.finish(rid, self.clock())

    @staticmethod
    def _stream_seq(msg: Msg) -> int:
        try:
            return int(msg.metadata.sequence.stream)
        except Exception:  # not a JetStream message (tests driving handle_intake directly)
            return 0

    @staticmethod
    def _deliveries(msg: Msg) -> int:
        try:
            return int(msg.metadata.num_delivered)
        except Exception:
            return 1

    async def _retry_or_fail(self, msg: Msg, req: IntakeRequest, reason: str, *,
                             kind: RetryReason, delay: float | None = None) -> None:
        """NAK for another delivery after ``delay`` (default ``retry_delay_s``); on the last
        one (``max_deliver``, bounded by the intake consumer's own) answer the client with a
        ``not scheduled`` error instead (:meth:`_send_failure`). ``kind``: the retry's
        reason, for the metric ``vtm.scheduler.retries``. The NAK's stamp is remembered: the
        redelivery's ``intake_wait`` span starts there, and this delivery's spans end there."""
        if self._deliveries(msg) < self._max_deliver:
            self.stats.retried += 1
            self.metrics.retried(kind)
            self.log.info("intake retry", request_id=req.request_id, reason=reason,
                          retry_reason=str(kind))
            self._naked[req.request_id] = (self._stream_seq(msg), self._deliveries(msg),
                                           self.clock())
            self._naked.move_to_end(req.request_id)
            while len(self._naked) > _NAKS_KEPT:
                self._naked.popitem(last=False)
            await msg.nak(delay=self.ssettings.retry_delay_s if delay is None else delay)
            return
        self._refused_by.pop(req.request_id, None)  # its last delivery: no retry to steer
        if await self._answered_already(msg, req, reason):
            return
        self.stats.failed += 1
        self.log.error("request failed", request_id=req.request_id, reason=reason)
        await self._send_failure(msg, req, f"{NOT_SCHEDULED}: {reason}")

    async def _refuse(self, msg: Msg, req: IntakeRequest, exc: SequenceTooLong) -> None:
        """Answer a request no worker can ever serve with a ``not servable`` error on this
        delivery, whichever it is, and terminate its message. Nothing was reserved: the core
        refuses before placing."""
        reason = str(exc)
        if await self._answered_already(msg, req, reason):
            return
        self.stats.refused += 1
        self.log.warning("request refused", request_id=req.request_id, reason=reason,
                         input_len=exc.length, max_seq_len=exc.max_seq_len)
        await self._send_failure(msg, req, f"{NOT_SERVABLE}: {reason}")

    async def _answered_already(self, msg: Msg, req: IntakeRequest, reason: str) -> bool:
        """Before failing a request: True, acking its message, when the results stream
        already keeps a first token of it (then no error may be sent)."""
        rid = req.request_id
        if await self._result_kept(rid, since_s=req.arrival_s):
            # Its first token is out already (a worker ran it while every answer about the
            # dispatch was lost, say): an error now would follow the client's answer and
            # replace it in the results stream, where a client that asks again reads it.
            # (Not ``_served``: it may remember an earlier request that used the same id.)
            self.stats.fail_found_answered += 1
            self.log.info("failure of an answered request not sent; acked", request_id=rid,
                          reason=reason)
            await msg.ack()
            return True
        return False

    async def _send_failure(self, msg: Msg, req: IntakeRequest, error: str) -> None:
        """Publish a FirstToken carrying ``error`` for the request's client, then terminate
        the intake message (the counters are the caller's, counted before: a test or client
        that has the answer sees them)."""
        now = self.clock()
        fail = FirstToken(
            request_id=req.request_id, token=None, error=error,
            stages=TtftStages(total_s=max(0.0, now - req.arrival_s)), finished_at_s=now,
            arrival_s=req.arrival_s,
        )
        data, headers = encode(fail)
        # Stored by the results stream (sent again across a broker blip), as workers' results
        # are: a gateway cut off meanwhile finds it there.
        await publish_result(self.nc, self.subjects.result(req.request_id), data,
                             inject(headers), timeout_s=self.ssettings.dispatch_timeout_s,
                             log=self.log)
        await msg.term()

    async def _after_dispatch(self, req: IntakeRequest, a: Assignment, d: Decision, *,
                              in_demand: bool = True) -> None:
        """Publish the placement's cache statistics and count it in the demand window.

        A hand-back (a request a draining worker returned, ``in_demand`` False) was counted
        when it was first placed; counting it again would inflate D(k) in exactly the windows
        of a reconfiguration, so it only advances the windows (the simulator does the same)."""
        now = self.clock()
        stats = RequestStats.model_construct(  # every field from validated messages
            request_id=req.request_id, reporter=self.reporter, worker_id=a.worker_id,
            degree=a.degree, input_len=req.input_len, block_hashes=list(req.block_hashes),
            reused_blocks=d.reused_blocks, prefix_tokens=d.prefix_tokens,
            preferred_degree=d.preferred_degree, preferred_worker=d.preferred_worker,
            predicted_s=d.predicted_s, policy=d.policy, at_s=now,
        )
        data, headers = encode(stats)
        # The request's root context (the assignment's): a copy the cache manager starts
        # for this placement (a route-time pull) links its span to the request's trace.
        headers.update({k: v for k, v in a.request.trace_context.items()
                        if k.lower() in ("traceparent", "tracestate")})
        try:
            await self.nc.publish(self.subjects.cache_stats(self.reporter), data,
                                  headers=headers)
            closed = (self.account(now, req.input_len, d) if in_demand
                      else self.windows.advance(now))
            for summary in closed:
                await self._report_window(summary)
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError,
                InvalidInput) as exc:
            self.log.warning("stats publish failed", error=str(exc))

    def account(self, now: float, input_len: int, d: Decision) -> list[WindowSummary]:
        """Count one placement in the open window (D(k), degree, preferred degree); returns
        the windows it closed, for :meth:`window_report`. Pure (no IO)."""
        return self.windows.record(now, d.predicted_s, input_len, d.degree,
                                   self.preferred_degree(input_len, d))

    def preferred_degree(self, input_len: int, d: Decision) -> int | None:
        """The request's preferred degree for the window report (§6.1 rule 1 on the fitted
        profile; None when ``merge_speedup`` is off). Its cached part is what the chosen
        worker reuses in whole blocks — the simulator's definition (sim/simulator.py feeds
        the controller core ``min(reused_blocks·B, L − 1)``)."""
        speedup = self.ssettings.merge_speedup
        if speedup is None:
            return None
        cached = d.reused_blocks * self.ssettings.block_size
        return request_preferred_degree(self.profile, self._rule_degrees, speedup, input_len,
                                        cached)

    def window_report(self, summary: WindowSummary) -> WindowReport:
        """The WindowReport of one closed window (pure: no IO)."""
        epoch = max((w.epoch for w in self.core.view.workers), default=0)
        speedup = self.ssettings.merge_speedup
        return WindowReport(
            reporter=self.reporter, window_index=summary.index,
            window_start_s=max(0.0, summary.start_s), window_s=self.windows.window_s,
            epoch=epoch, demand_s=summary.demand_s, requests=summary.requests,
            long_requests=summary.long_requests,
            demand_by_degree=dict(summary.demand_by_degree),
            demand_by_preferred=dict(summary.demand_by_preferred),
            preferred_degrees=list(self._rule_degrees) if speedup is not None else [],
            preferred_speedup=speedup,
        )

    async def _report_window(self, summary: WindowSummary) -> None:
        """Publish the report of a closed window, preceded by the previous window's again.

        Reports are plain NATS messages (at most once). A lost one would not just lose its
        window's demand: the controller closes a window once a later report shows it ended,
        so the window would read as D = 0 -- "merge everything". Sending each report twice,
        the second time just ahead of the next one (on ``window_demand_again``, so that a
        subscriber that does not de-duplicate never sees copies), closes that gap for any
        single loss; the controller counts a window's report once (by reporter and window)
        and ignores the copy it already has.
        """
        if self._last_report is not None:
            data, headers = encode(self._last_report)
            await self.nc.publish(self.subjects.window_demand_again(self.reporter), data,
                                  headers=headers)
            self.stats.windows_resent += 1
        report = self.window_report(summary)
        data, headers = encode(report)
        await self.nc.publish(self.subjects.window_demand(self.reporter), data,
                              headers=headers)
        self._last_report = report
        self.stats.windows_reported += 1

    # -- assignment records -------------------------------------------------------------------

    async def _get_record(self, rid: str) -> AssignmentRecord | None:
        assert self._records is not None
        try:
            entry = await self._records.get(rid)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value:
            return None
        try:
            return from_json(AssignmentRecord, entry.value)
        except SchemaError:
            return None

    async def _put_record(self, a: Assignment, seq: int, msg_id: str, state: str,
                          incarnation: str = "", ack_subject: str | None = ""
                          ) -> asyncio.Future[Any] | None:
        """Send the record (in the connection's write buffer on return) and return the future
        of its store acknowledgement; the caller decides whether to wait for it."""
        assert self._js is not None and self._records is not None
        # AssignmentRecord's JSON straight from validated values (two per request: a model
        # instance per record cost more than the rest of the record path); every reader
        # decodes it with from_json(AssignmentRecord, ...), which checks it.
        rec = json.dumps({
            "schema_version": SCHEMA_VERSION, "request_id": a.request.request_id,
            "stream_seq": seq, "msg_id": msg_id, "worker_id": a.worker_id, "epoch": a.epoch,
            "degree": a.degree, "predicted_s": a.predicted_s, "state": state,
            "scheduler": self.reporter, "assigned_at_s": a.assigned_at_s,
            "incarnation": incarnation, "ack_subject": ack_subject or "",
        }, separators=(",", ":")).encode()
        # The KV bucket's subject for the key (what KeyValue.put publishes to), asynchronously.
        return await self._js.publish_async(f"{self._records_prefix}{a.request.request_id}", rec)

    async def _delete_record(self, rid: str) -> None:
        assert self._records is not None
        with contextlib.suppress(Exception):
            await self._records.delete(rid)


__all__ = [
    "AssignmentRecord",
    "RequestStats",
    "SchedulerService",
    "SchedulerSettings",
    "SchedulerStats",
    "assignment_bucket",
    "decision_attributes",
    "placement_terms",
    "scheduler_group",
    "worker_view",
]
