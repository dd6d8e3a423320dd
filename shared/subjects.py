"""Every NATS subject, stream, consumer and key-value bucket name of the live system.

All names hang under one configurable prefix (default ``vtm``) so two deployments can share a
server. Builders are pure functions of their arguments (methods of the frozen :class:`Subjects`);
nothing else in the code base spells a subject.

Rules (conventions.md): lowercase dot hierarchy, ids last, at most 16 tokens, ``$`` reserved for
the server (``$JS``, ``$KV``, ``$SRV``). A *token* here is ``[a-z0-9][a-z0-9_-]*``: no spaces,
no wildcards (``*``, ``>``), no dots inside an id. Builders that return a filter with a wildcard
say so in their name (``..._all``). Any violation raises :class:`SubjectError` and builds
nothing.

Map (prefix ``vtm``):

=================================  =====================================================
``vtm.intake.requests``            durable intake, JetStream work-queue stream ``VTM_INTAKE``
``vtm.gateway.completions``        gateway's NATS request subject (CompletionRequest)
``vtm.worker.assign.{wid}``        Assignment to one worker's leader rank (micro endpoint)
``vtm.worker.queue.{wid}``         request-reply: QueueQuery -> the worker's running and queued ids
``vtm.rank.ctl.{gpu}``             epoch / geometry control to one rank daemon
``vtm.epoch.ack.{gpu}``            EpochAck from a rank
``vtm.cache.events.{wid}``         CacheEvent stream of one worker
``vtm.cache.snapshot.{wid}``       request-reply: ask a worker for a snapshot of its index (a
                                   reply over max_payload comes in ``Vtm-Part: i/n`` parts)
``vtm.cache.cmd.{wid}``            CacheCommand (replicate / reclaim / reconcile / demote)
``vtm.cache.pending.{wid}``        ReconciledNotice: a new worker's pending and donor pages
``vtm.cachemgr.pending``           request-reply: PendingQuery -> PendingReply (publish it again)
``vtm.window.demand.{src}``        WindowReport from one scheduler replica
``vtm.window.demand.again.{src}``  the replica's copy of its previous WindowReport
``vtm.ctl.drain``                  DrainNotice: a reconfiguration's sources stop admitting
``vtm.ctl.reconf``                 ReconfigurationEvent at every phase of a reconfiguration
``vtm.ctl.composition``            CompositionNotice: the schedulable composition
``vtm.{component}.…``              a service's micro endpoint group (``vtm.scheduler``, …)
``vtm.result.{rid}``               FirstToken (first-token result) of one request
``vtm.kv.{rid}``                   KV handoff chunks of one request (binary, ``Content-Type``)
KV ``VTM_WORKERS``                 WorkerState per worker (key = worker id)
KV ``VTM_EPOCH``, key current      EpochRecord, updated by compare-and-set
KV ``VTM_ASSIGNMENTS``             AssignmentRecord per request (key = request id)
KV ``VTM_IDEMPOTENCY``             the gateways' IdempotencyRecord per client request id
=================================  =====================================================

NOTE: "ids last" means a per-id subject ends in its id with its kind just before it
(``vtm.worker.assign.{wid}``, never ``vtm.worker.{wid}.assign``), so one trailing ``*``
selects one kind. Where one kind extends another's tokens (the copies
``vtm.window.demand.again.{src}`` under the reports' ``vtm.window.demand.{src}``) it is one
token longer: ``vtm.window.demand.*`` matches the reports alone (a reporter named ``again``
sends a 4-token report, never a copy), ``vtm.window.demand.again.*`` the copies alone and
``vtm.window.demand.>`` both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from shared.ids import InvalidInput

DEFAULT_PREFIX: Final[str] = "vtm"
# The version of the bus contract: this map and the messages on it (shared/schemas.py). Every
# service reports it as its micro metadata ``protocol`` ($SRV.PING/INFO) and `vertumnus status`
# warns when one deployment's services report different ones. Raise it when a subject, stream,
# bucket or message changes so that a service of the previous release would miss or misread
# it: services of different protocols do not understand each other (an old scheduler's
# assignments reach no new rank daemon), so a deployment upgrades every service together
# across a raise, never one by one. History: "2" -- ids last in every per-id subject
# (``vtm.worker.assign.{wid}``, was ``vtm.worker.{wid}.assign``), 2026-12-06; services older
# than that report no protocol. "3" -- QueueReport names the attempts a worker holds
# (``arrivals``; a scheduler of "2" refuses the field), 2026-12-06.
BUS_PROTOCOL: Final[str] = "3"
MAX_TOKENS: Final[int] = 16
_TOKEN_RE: Final[re.Pattern[str]] = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
# Stream, consumer and bucket names: JetStream allows no dots, spaces, wildcards or separators.
_NAME_RE: Final[re.Pattern[str]] = re.compile(r"^[A-Za-z0-9_-]+$")


class SubjectError(InvalidInput):
    """A subject token or name breaks the naming rules."""


_TOKEN_RULE: Final[str] = ("lowercase letters, digits, '-' or '_', starting with a letter or "
                           "digit (no dots, spaces, wildcards or '$')")


def validate_token(token: str, *, what: str = "token") -> str:
    """Return ``token`` if it is a legal single subject token, else raise :class:`SubjectError`
    (``what``: how the message names the token, e.g. ``worker id``; the value follows it)."""
    if not isinstance(token, str) or not _TOKEN_RE.match(token):
        raise SubjectError(f"{what} {token!r} is not a subject token: {_TOKEN_RULE}")
    return token


def validate_subject(subject: str, *, allow_wildcards: bool = False) -> str:
    """Check a whole subject (every token legal, ≤ 16 tokens); return it unchanged.

    With ``allow_wildcards``, a token may be ``*`` and the last token may be ``>``.
    """
    if not isinstance(subject, str) or not subject:
        raise SubjectError(f"subject must be a non-empty string, got {subject!r}")
    tokens = subject.split(".")
    if len(tokens) > MAX_TOKENS:
        raise SubjectError(f"subject {subject!r} has {len(tokens)} tokens (max {MAX_TOKENS})")
    for i, tok in enumerate(tokens):
        if allow_wildcards and (tok == "*" or (tok == ">" and i == len(tokens) - 1)):
            continue
        if not isinstance(tok, str) or not _TOKEN_RE.match(tok):
            # Each value once: a one-token subject is that token, so naming it as both the
            # subject and its token 0 repeated it ("token 0 of subject 'a b' 'a b' ...").
            where = (f"subject {subject!r} is not a legal subject" if len(tokens) == 1 else
                     f"token {i} ({tok!r}) of subject {subject!r} is not a subject token")
            raise SubjectError(f"{where}: {_TOKEN_RULE}")
    return subject


def _id(value: object, what: str) -> str:
    # Ids arrive as NewType'd str (WorkerId, RequestId) or int (GPU index); normalise to str.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise SubjectError(f"{what} must be a str or int, got {type(value).__name__}")
    if isinstance(value, int) and value < 0:
        raise SubjectError(f"{what} must be >= 0, got {value}")
    return validate_token(str(value), what=what)


def validate_filter(subject: str) -> str:
    """Check a NATS subscription filter of any origin (a tap's): non-empty tokens without
    white space, ``*`` only as a whole token, ``>`` only as the whole last token. Unlike
    :func:`validate_subject` it admits the server's own subjects (``$KV.VTM_WORKERS.>``,
    ``$JS.API.>``, ``_INBOX.>``): reading them is how an operator sees the KV buckets and
    JetStream at work. Returns ``subject``; :class:`SubjectError` names the first fault."""
    if not isinstance(subject, str) or not subject:
        raise SubjectError(f"subject must be a non-empty string, got {subject!r}")
    tokens = subject.split(".")
    for i, tok in enumerate(tokens):
        if not tok:
            raise SubjectError(f"subject {subject!r} has an empty token (at {i})")
        if any(ch.isspace() for ch in tok):
            raise SubjectError(f"subject {subject!r} has white space in token {i}")
        if tok == ">" and i != len(tokens) - 1:
            raise SubjectError(f"subject {subject!r}: '>' may only be the last token")
        if tok not in ("*", ">") and ("*" in tok or ">" in tok):
            raise SubjectError(f"subject {subject!r}: wildcards must be whole tokens ({tok!r})")
    return subject


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject and name builders under ``prefix`` (one or more dot-separated tokens).

    Construct once per process from settings (``Subjects(settings.subject_prefix)``); every
    method is pure and raises :class:`SubjectError` on an illegal id.
    """

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        validate_subject(self.prefix)
        # Leave room for the longest builder below (prefix + 3 tokens + id).
        if len(self.prefix.split(".")) > MAX_TOKENS - 4:
            raise SubjectError(f"prefix {self.prefix!r} is too deep")

    def _join(self, *tokens: str) -> str:
        return validate_subject(".".join((self.prefix, *tokens)), allow_wildcards=True)

    @property
    def _name_stem(self) -> str:
        # "vtm" -> "VTM", "dev.vtm" -> "DEV_VTM": names for streams and buckets.
        return self.prefix.replace(".", "_").replace("-", "_").upper()

    # -- intake (JetStream work queue) ------------------------------------------------------

    def intake_requests(self) -> str:
        """Subject the gateway publishes IntakeRequest on (``Nats-Msg-Id`` = request id)."""
        return self._join("intake", "requests")

    def intake_stream(self) -> str:
        """Name of the work-queue stream capturing :meth:`intake_requests`."""
        return f"{self._name_stem}_INTAKE"

    def intake_consumer(self) -> str:
        """Durable pull consumer shared by all scheduler replicas."""
        return "scheduler"

    def gateway_completions(self) -> str:
        """The gateway's NATS request subject (CompletionRequest in, FirstToken out)."""
        return self._join("gateway", "completions")

    # -- workers and ranks ------------------------------------------------------------------

    def worker_group(self) -> str:
        """The micro endpoint group of the rank daemons (``vtm.worker``). Its endpoints take
        the absolute subjects :meth:`worker_assign` and :meth:`worker_queue`: the worker id
        comes last, so no per-worker group prefixes them."""
        return self._join("worker")

    def worker_assign(self, worker_id: str) -> str:
        """Assignments to the worker's leader rank (request-reply micro endpoint)."""
        return self._join("worker", "assign", _id(worker_id, "worker id"))

    def worker_queue(self, worker_id: str) -> str:
        """The worker leader's queue listing (request-reply: QueueQuery → QueueReport)."""
        return self._join("worker", "queue", _id(worker_id, "worker id"))

    def worker_assign_all(self) -> str:
        """Filter over every worker's assign subject (for taps)."""
        return self._join("worker", "assign", "*")

    def worker_queue_all(self) -> str:
        """Filter over every worker's queue-listing subject (for taps)."""
        return self._join("worker", "queue", "*")

    def rank_ctl(self, gpu: int) -> str:
        """Control (epoch / geometry) messages to the rank daemon of ``gpu``."""
        return self._join("rank", "ctl", _id(gpu, "gpu"))

    def epoch_ack(self, gpu: int) -> str:
        """EpochAck published by the rank daemon of ``gpu``."""
        return self._join("epoch", "ack", _id(gpu, "gpu"))

    def epoch_ack_all(self) -> str:
        return self._join("epoch", "ack", "*")

    def worker_state_bucket(self) -> str:
        """KV bucket of WorkerState, one key per worker id (heartbeat = liveness lease)."""
        return f"{self._name_stem}_WORKERS"

    def epoch_bucket(self) -> str:
        """KV bucket holding the EpochRecord (compare-and-set on :meth:`epoch_key`)."""
        return f"{self._name_stem}_EPOCH"

    def epoch_key(self) -> str:
        return "current"

    def assignment_bucket(self) -> str:
        """KV bucket of the scheduler's AssignmentRecord, key = request id."""
        return f"{self._name_stem}_ASSIGNMENTS"

    def idempotency_bucket(self) -> str:
        """KV bucket of the gateways' IdempotencyRecord (a client request id's content digest),
        key = the request id (encoded where it is no legal key:
        ``services.gateway.idempotency.kv_key``), TTL = the intake's de-duplication window."""
        return f"{self._name_stem}_IDEMPOTENCY"

    def service_group(self, component: str) -> str:
        """The micro endpoint group of a service (``vtm.scheduler``, ``vtm.gateway``, …)."""
        return self._join(validate_token(component, what="component"))

    # -- controller notices -------------------------------------------------------------------

    def ctl_drain(self) -> str:
        """DrainNotice: a reconfiguration's sources stop admitting; queued work is re-placed."""
        return self._join("ctl", "drain")

    def ctl_reconf(self) -> str:
        """ReconfigurationEvent at every phase change (drain and switch times when exposed)."""
        return self._join("ctl", "reconf")

    def ctl_composition(self) -> str:
        """CompositionNotice: the schedulable composition after an exposure (and at start)."""
        return self._join("ctl", "composition")

    # -- prefix cache -------------------------------------------------------------------------

    def cache_events(self, worker_id: str) -> str:
        """CacheEvent stream of one worker (stored / removed / cleared / snapshot)."""
        return self._join("cache", "events", _id(worker_id, "worker id"))

    def cache_events_all(self) -> str:
        return self._join("cache", "events", "*")

    def cache_snapshot(self, worker_id: str) -> str:
        """Request-reply: ask a worker for a snapshot of its cache index."""
        return self._join("cache", "snapshot", _id(worker_id, "worker id"))

    def cache_cmd(self, worker_id: str) -> str:
        """CacheCommand to one worker."""
        return self._join("cache", "cmd", _id(worker_id, "worker id"))

    def cache_pending(self, worker_id: str) -> str:
        """ReconciledNotice: the cache manager's reconcile of a worker a split or merge made
        (its pending and donor pages), for the scheduler replicas' tries."""
        return self._join("cache", "pending", _id(worker_id, "worker id"))

    def cache_pending_all(self) -> str:
        return self._join("cache", "pending", "*")

    def cache_pending_ask(self) -> str:
        """Request-reply: PendingQuery -> PendingReply, the cache manager's ``pending``
        endpoint (its micro group's): publish a worker's reconcile again."""
        return self._join("cachemgr", "pending")

    # -- controller ---------------------------------------------------------------------------

    def window_demand(self, reporter: str) -> str:
        """WindowReport (per-window demand D(k)) from one scheduler replica."""
        return self._join("window", "demand", _id(reporter, "reporter"))

    def window_demand_all(self) -> str:
        return self._join("window", "demand", "*")

    def window_demand_again(self, reporter: str) -> str:
        """The second copy of a replica's WindowReport, sent just ahead of its next one
        (``vtm.window.demand.again.{src}``: a subject of its own, one token longer than a
        report's, so a subscriber of :meth:`window_demand_all` that does not de-duplicate
        never sees the copies, and :meth:`window_demand_with_copies` sees both)."""
        return self._join("window", "demand", "again", _id(reporter, "reporter"))

    def window_demand_again_all(self) -> str:
        """Filter over every replica's copies (and none of the reports)."""
        return self._join("window", "demand", "again", "*")

    def window_demand_with_copies(self) -> str:
        """Every replica's reports and their copies, on one subscription (so a copy is
        handled in order with the report its sender published after it)."""
        return self._join("window", "demand", ">")

    def cache_stats(self, reporter: str) -> str:
        """RequestStats (Algorithm 1's inputs, one per placement) from one scheduler replica."""
        return self._join("cache", "stats", _id(reporter, "reporter"))

    def cache_stats_all(self) -> str:
        return self._join("cache", "stats", "*")

    # -- results and data plane ---------------------------------------------------------------

    def result(self, request_id: str) -> str:
        """FirstToken result of one request (the gateway subscribes before publishing)."""
        return self._join("result", _id(request_id, "request id"))

    def result_all(self) -> str:
        return self._join("result", "*")

    def results_stream(self) -> str:
        """Name of the stream keeping the latest :meth:`result` of each request for a while,
        so a client's retry of a request id already answered gets that answer."""
        return f"{self._name_stem}_RESULTS"

    def kv_handoff(self, request_id: str) -> str:
        """KV handoff data chunks (binary, ``Content-Type`` header) of one request."""
        return self._join("kv", _id(request_id, "request id"))

    def everything(self) -> str:
        """``vtm.>``: every subject of this deployment (for taps)."""
        return self._join(">")


def micro_service_name(component: str) -> str:
    """NATS micro service name for a component, e.g. ``vtm-rankd`` (name regex of nats.micro)."""
    validate_token(component, what="component")
    name = f"vtm-{component}"
    if not _NAME_RE.match(name):
        raise SubjectError(f"illegal service name {name!r}")
    return name
