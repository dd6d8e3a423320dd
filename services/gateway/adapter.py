"""The gateway's NATS side: a completion in, an IntakeRequest on the durable intake, the
first token back.

:class:`GatewayService` is micro service ``vtm-gateway`` (endpoint ``completions`` on
``{prefix}.gateway.completions``: a CompletionRequest JSON in, a FirstToken out) and, when an
HTTP port is configured, also runs the HTTP API of :mod:`services.gateway.app` in the same
process and event loop.

One completion (:meth:`GatewayService.complete`):

1. validate and enforce limits (:func:`check_limits`; a typed :class:`GatewayError` carries the
   HTTP status it maps to: 400 malformed, 409 a request id reused with another request, 413
   too large, 422 semantically impossible, 503 no NATS / intake, 504 no first token in time,
   502 the worker failed). The gateway does not
   know the workers' limits: a prompt within its own ``max_seq_len`` but longer than every
   worker's is refused by the scheduler at once, also 422 (:func:`result_error`);
2. compute the chained hashes of the prompt's *full* blocks (``chain_hashes``, shared with
   rankd, so equal hash ⇔ equal prefix across the system);
3. open the root span ``request`` and register the request with the gateway's one
   subscription to ``{prefix}.result.*`` *before* publishing, so the result cannot be missed
   (one wildcard subscription instead of a subscribe/unsubscribe pair per request: each of
   those is a protocol round of interest changes on the server and an asyncio task here);
4. publish the IntakeRequest to the JetStream work queue with ``Nats-Msg-Id`` = request id
   and the trace context in the headers (and in the message, for rankd's redirects). A client
   retry with the same ``request_id`` (at this gateway or another, e.g. after a gateway crash
   cut the client off) is de-duplicated by the stream and answered with the original's result:
   the one still to come, or the one the results stream kept (``ensure_results_stream``: each
   request's latest result for as long as the intake de-duplicates). A retry of a request the
   scheduler gave up on (503, "not scheduled") or refused (422, "not servable": the workers
   may have changed since) is a new attempt instead, published again under an id derived from
   that answer's. The same id with *other* content (prompt tokens, ``max_tokens``) is no
   retry: 409 Conflict naming the id, before anything is published, at whichever gateway
   replica it comes to (:mod:`services.gateway.idempotency`: each client id's content digest
   for the de-duplication window plus the publish's bound, claimed in a JetStream KV bucket
   all replicas share, with a per-gateway memory in front; every request under an id
   restarts its claim's timer before it publishes; a bucket that does not answer fails open;
   a claim is withdrawn only after a publish that was definitely refused, by the last request
   here that holds it, when none of theirs may have been stored; the limits are stated
   there);
5. wait for the FirstToken; answer with the token, the TTFT measured here (received → first
   token here) and the worker's stage breakdown. An HTTP client that closes its connection
   first stops the wait (:class:`ClientClosed`, 499, recorded but sent to nobody): its
   waiter is dropped at once rather than held to the result or ``result_timeout_s``. The
   request itself is in the intake already and still runs; a retry under its id gets the
   result the results stream keeps.

Errors of the NATS endpoint are answered from a task of their own (the endpoint's handler
returned long before), so they are counted in the endpoint's ``$SRV.STATS`` (``num_errors``,
``last_error``) explicitly, as nats.micro counts a handler's raised error
(:meth:`MicroService.count_endpoint_error`).

A server that comes back without its store (no persistent volume, a new node) has lost the
intake with every message in it, some never delivered. The gateway notices an intake stream
born after the one it knew (``ensure_jetstream``, after every reconnect) and sends each
waiting request's message again under its ``Nats-Msg-Id`` (a duplicate of one already in the
new stream is dropped), marked ``REPUBLISHED_HEADER``: a scheduler adopts it where a worker
holds it and places it otherwise. Counters (``$SRV.STATS``): ``intake_remade``, ``republished``.

Idempotency counters (``$SRV.STATS``): ``conflicts`` (409s), ``conflicts_shared`` (those only
the shared bucket knew of: the id was first used at another replica or before a restart),
``idempotency_store_failed`` (claims the bucket did not decide: checked at this gateway only),
``idempotency_release_failed`` (withdrawals the bucket did not decide: tried again once it
answers, ``idempotency_withdrawn_late`` those done then),
``idempotency_contended`` (claims whose key kept changing under them: refused with 503, since
the bucket holds someone's claim and failing open could run the request twice),
``idempotency_bucket_remade`` (the bucket created again after claims found it missing: one
for any number of claims that found it missing at once; a making that found it there -- a
brief "no responders" is taken for a missing bucket -- or that failed is not counted),
``idempotency_shared_late`` (claims the
bucket did not decide, written there once it answered again) and ``idempotency_split`` (such
claims found claimed there with other content meanwhile: both requests ran).

No scheduling happens here; the gateway does not know the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Final

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import (
    APIError,
    KeyDeletedError,
    KeyNotFoundError,
    NoStreamResponseError,
    NotFoundError,
)
from nats.js.kv import KeyValue
from nats.micro.request import Request, ServiceError
from opentelemetry import trace

from services.gateway.grace import affordable_grace, finish_within
from services.gateway.idempotency import Claim, Fingerprints, RequestDigest, request_digest
from services.gateway.idempotency_kv import (
    ClaimContended,
    SharedClaim,
    SharedClaims,
    StoreFailed,
    claim_ttl_s,
    idempotency_kv,
    open_idempotency_kv,
)
from services.gateway.metrics import RequestMetrics
from services.gateway.settings import GatewaySettings
from shared.blockhash import chain_hashes
from shared.logging import bind_request, current_trace_id
from shared.publish import publish_refused, publish_transient
from shared.schemas import (
    NOT_SCHEDULED,
    NOT_SERVABLE,
    CompletionRequest,
    FirstToken,
    IntakeRequest,
    SchemaError,
    TtftStages,
    UnsupportedContentType,
    WorkerState,
    decode,
    encode,
    from_json,
)
from shared.service import (
    INTAKE_DUPLICATE_WINDOW_S,
    REPUBLISHED_HEADER,
    STOPPING_CODE,
    STOPPING_DESCRIPTION,
    Endpoint,
    MicroService,
    bucket_keys,
    ensure_intake_stream,
    ensure_results_stream,
    first_token_of,
    latest_result,
    message_size,
    worker_state_kv,
)
from shared.stopping import stop_time_left
from shared.subjects import micro_service_name
from shared.tasks import cancel_and_wait
from shared.telemetry import Stage, extract, inject, traceparent_of, tracer

VERSION: Final[str] = "0.1.0"
MAX_TRACESTATE_CHARS: Final[int] = 512
"""A client's W3C ``tracestate`` longer than this is not forwarded (the spec's minimum that
every vendor propagates; a longer one may be truncated)."""
INTAKE_HEADROOM_BYTES: Final[int] = 4096
"""Room an intake message leaves under the server's ``max_payload``: the scheduler sends the
request on inside an assignment (a few more fields) or again with other headers (a hand-back's
message id), and either must still fit."""
MSG_ID_HEADER: Final[str] = "Nats-Msg-Id"
INT32_MAX: Final[int] = (1 << 31) - 1
SWEEP_PERIOD_S: Final[float] = 0.25
"""How often the gateway checks whether its NATS connection was re-established."""
STREAM_NOT_FOUND: Final[int] = 10059
"""JetStream API error code of a request naming a stream that does not exist."""
COMPLETIONS_ENDPOINT: Final[str] = "completions"
"""The micro endpoint's name (subject ``{prefix}.gateway.completions``)."""
SHARE_PAUSE_S: Final[float] = 0.5
"""The pause before a claim the bucket did not decide is offered to it again while it still
fails (:meth:`GatewayService._share_claims`), doubled each time up to
:data:`SHARE_PAUSE_MAX_S`."""
SHARE_PAUSE_MAX_S: Final[float] = 10.0
PUBLISH_PAUSE_S: Final[float] = 0.05
"""The pause before an intake publish is tried again (:meth:`GatewayService._publish_intake`),
doubled for each further try up to :data:`PUBLISH_PAUSE_MAX_S`, each drawn between half and
all of it."""
PUBLISH_PAUSE_MAX_S: Final[float] = 1.0


# -- errors -----------------------------------------------------------------------------------


class GatewayError(Exception):
    """An expected failure of one completion; ``status`` is its HTTP status (and micro code)."""

    status: int = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def to_service_error(self) -> ServiceError:
        return ServiceError(code=str(self.status), description=" ".join(self.message.split()))


class BadRequest(GatewayError):
    status = 400


class Conflict(GatewayError):
    status = 409


class TooLarge(GatewayError):
    status = 413


class Unprocessable(GatewayError):
    status = 422


class WorkerFailed(GatewayError):
    status = 502


class Unavailable(GatewayError):
    status = 503


class IntakeRefused(Unavailable):
    """The intake definitely did not store the request: every try of its publish was refused
    (:func:`publish_refused`). Only then is its request id's claim withdrawn; a plain
    :class:`Unavailable` from the publish may have been stored all the same."""


class FirstTokenTimeout(GatewayError):
    status = 504


class ClientClosed(GatewayError):
    """The HTTP client closed its connection before its first token: nobody is left to answer
    (499, nginx's "client closed request": recorded in the metrics, never sent)."""

    status = 499


# -- pure helpers -----------------------------------------------------------------------------


def schema_message(exc: SchemaError) -> str:
    """A client-facing message for a decoding error: the field and pydantic's reason."""
    if exc.field == "<payload>":
        # The body is judged by its Content-Type: msgpack's reason already says "not msgpack".
        if exc.reason.startswith("not msgpack"):
            return f"request body is {exc.reason}"
        return f"request body is not valid JSON: {exc.reason}"
    if exc.field == "<model>":
        return exc.reason.removeprefix("Value error, ")
    return f"field {exc.field!r}: {exc.reason}"


def check_limits(tokens: Sequence[int], max_tokens: int, settings: GatewaySettings) -> None:
    """Size and semantic limits of one prompt (raises TooLarge / Unprocessable)."""
    n = len(tokens)
    if n > settings.max_prompt_tokens:
        raise TooLarge(f"prompt has {n} tokens; this gateway accepts at most "
                       f"{settings.max_prompt_tokens} (max_prompt_tokens)")
    if n + max_tokens > settings.max_seq_len:
        raise Unprocessable(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = "
                            f"{n + max_tokens} exceeds the maximum sequence length "
                            f"{settings.max_seq_len}")
    limit = settings.vocab_size if settings.vocab_size is not None else INT32_MAX + 1
    if n and max(tokens) >= limit:  # one C-level pass; the index only on the error path
        i, t = next((i, t) for i, t in enumerate(tokens) if t >= limit)
        raise Unprocessable(f"prompt token {i} has id {t}, outside the vocabulary "
                            f"[0, {limit})")


def result_error(rid: str, error: str) -> GatewayError:
    """The client's error for a FirstToken that carries ``error`` instead of a token: the
    scheduler's refusal (``not servable``: no worker can ever serve the request) is 422, like
    the gateway's own sequence-length limit; its giving up (``not scheduled``: no worker took
    it in time) is 503, try again later; anything else is the worker's failure, 502."""
    if error.startswith(NOT_SERVABLE):
        return Unprocessable(error)
    if error.startswith(NOT_SCHEDULED):
        return Unavailable(error)
    return WorkerFailed(f"request {rid} failed: {error}")


FIRST_TOKEN_TRIP_SPAN: Final[str] = "first_token_trip"


def record_first_token_trip(result: FirstToken, received: float) -> None:
    """Record the first token's trip from its worker to this gateway as a span under the
    current one (the request's root): from the worker's ``finished_at_s`` (where its
    ``first_decode`` span ends) to ``received`` (where the TTFT measured here ends), so the
    root's children cover the whole TTFT. A worker clock ahead of this one would put the
    start after the end: the span is then empty at ``received``, and ``vtm.clock_skew_s``
    says by how much the worker's clock was ahead."""
    start = min(result.finished_at_s, received)
    attrs: dict[str, Any] = {"vtm.request_id": result.request_id}
    if result.worker_id:
        attrs["vtm.worker_id"] = result.worker_id
    if result.finished_at_s > received:
        attrs["vtm.clock_skew_s"] = result.finished_at_s - received
    span = tracer().start_span(FIRST_TOKEN_TRIP_SPAN, start_time=int(start * 1e9),
                               attributes=attrs)
    span.end(end_time=int(received * 1e9))


@dataclass(frozen=True, slots=True)
class Completion:
    """One answered completion: the worker's result and what the gateway measured."""

    request_id: str
    result: FirstToken
    input_len: int
    max_tokens: int
    ttft_s: float
    duplicate: bool
    trace_id: str | None
    text: str | None = None

    def stages(self) -> TtftStages:
        """The worker's stage breakdown with ``total_s`` = TTFT measured at the gateway."""
        return self.result.stages.model_copy(update={"total_s": self.ttft_s})


@dataclass(slots=True)
class _Claimants:
    """The requests at this gateway that hold one client request id's claim now, from their
    local claim to their end, and what they did with it (:meth:`GatewayService.
    _withdraw_claim`). NOTE: every request under the id at this gateway joins while any is
    still in (there is no await between the local claim and the joining), so what the
    flags below say of "them" holds of every request here since the first of them came."""

    count: int = 0
    maybe_stored: bool = False
    """One of them published under the id and that publish was not definitely refused: its
    message may be in the intake, which the claim must then cover."""
    made_local: bool = False
    """One of them made this gateway's local entry of the id (a NEW claim kept, or an entry
    kept anew where it was gone)."""
    revision: int | None = None
    """The revision of the bucket's record of the id as they wrote it last, where one of them
    made the record (NEW) and every write of it since was theirs (a replay's rewrite whose
    replaced revision was this one): the record is theirs to withdraw. None: nothing is."""


@dataclass(slots=True, eq=False)
class _Waiter:
    """One request waiting at this gateway for its first token, and which results answer it
    (:meth:`accepts`).

    Why not every result under its request id: the results stream keeps a result for its
    ``max_age`` from when the result is *stored*, which can be after the id's claim expired
    (the claim runs from before the publish). A later request under the id with other
    content -- a new claim, rightly -- would otherwise take the earlier attempt's answer: a
    kept one (a retry of it that is a duplicate publish, or the sweep after a reconnect), or
    a live one (the earlier attempt still running after its client got its 504). Every
    FirstToken echoes the ``arrival_s`` the gateway stamped into the IntakeRequest it
    answers, the attempt's mark (the scheduler matches kept answers the same way,
    ``_result_kept``). The rule, errors included (a worker's, the scheduler's):

    * a result without ``arrival_s`` (an older producer) answers every waiter, as before:
      which attempt it answers is not known;
    * a result of this request's own attempt (``arrival_s`` equal to its own stamp) answers
      it: a publish stored anew (no duplicate) waits for nothing else;
    * a replay whose claim holds (SAME: this content, seen here or in the bucket) whose
      publish was stored anew all the same (the intake lost with the server's store) takes
      the results :meth:`duplicate_of` takes as well -- the same edge argument holds for the
      claim's first attempt, whose message the store lost -- but no other attempt's
      scheduler failure (its own message is still to run);
    * after a *duplicate* publish (:meth:`duplicate_of`), the intake's stored message M is
      another attempt's, whose stamp this gateway does not know. ``since_s`` = the publish's
      start (wall clock, after the claim was restarted) minus the claim TTL (the intake's
      window W plus the publish's bound): a result of an attempt stamped after it answers.
      Why that edge: M de-duplicated this publish, so M was stored at or after start - W;
      M's publish began at most the bound before it was stored (every try ends by then, and
      nothing is queued while disconnected), and M's request arrived before that. An attempt
      with *other* content under the id had its claim expire before this request's claim
      was made (else this one was a 409), a claim TTL after that attempt's claim, which came
      after its arrival: it is stamped at or before start - TTL, never after the edge. So
      the results taken are M's and those of other attempts of this content (the same
      request: the same answer), never another content's.

    Limits: M's request may have arrived before its publish began by the time in between
    (the shared claim's round trip, a wait for the connection); M stored that close to the
    start of its window, its answer is passed over and the duplicate waits out
    ``result_timeout_s`` (504: the safe side, never a wrong answer). Stamps from another
    gateway are compared with this one's clock: a skew shifts the edge by as much. Where
    the claims do not hold (a bucket that failed open, a bucket TTL shorter than the window
    plus the bound) neither does the edge -- nor the intake's de-duplication, the same gap.

    NOTE: the waiter is registered before its publish, when it is not yet known whether the
    publish is a duplicate. Until then (``decided`` False) it takes only its own attempt's
    result and keeps the latest other one in ``passed``, judged once the ack says
    (a live result that went by then may not be readable from the stream yet)."""

    fut: asyncio.Future[tuple[FirstToken, float]]
    arrival_s: float
    since_s: float | None = None
    decided: bool = False
    passed: tuple[FirstToken, float] | None = None
    stored: bool = False
    """Its own message was stored anew (a replay after the intake was lost): another
    attempt's scheduler failure does not answer it -- its own message is still to run."""

    def accepts(self, result: FirstToken) -> bool:
        """Whether ``result`` answers this request's attempt (the class docstring's rule)."""
        if result.arrival_s is None:
            return True  # an older producer: not known which attempt; as before this check
        if result.arrival_s == self.arrival_s:
            return True
        if self.stored and _from_scheduler(result):
            return False
        return self.since_s is not None and result.arrival_s > self.since_s

    def duplicate_of(self, published_s: float, claim_ttl_s: float, *,
                     stored: bool = False) -> None:
        """The publish that started at ``published_s`` (wall clock) was a duplicate, or
        (``stored``) a replay under a claim that holds stored anew: take the results of
        attempts stamped after ``published_s - claim_ttl_s`` too."""
        self.since_s = published_s - claim_ttl_s
        self.decided = True
        self.stored = stored


def new_request_id() -> str:
    """A request id for a request that brings none: ``r`` and 32 hex digits (a form a client
    may not use, :func:`check_client_id`)."""
    return "r" + uuid.uuid4().hex


_GENERATED_ID: Final[re.Pattern[str]] = re.compile(r"r[0-9a-f]{32}")


def check_client_id(rid: str) -> None:
    """Refuse (400) a client id of the form the gateway gives requests without one: such an id
    is claimed by nobody (only a client's own id is, services.gateway.idempotency), so a
    request sent again under it with other content would get the first one's answer. A
    client never needs one to retry: it learns it only with the answer."""
    if _GENERATED_ID.fullmatch(rid):
        raise BadRequest(f"request_id {rid!r} has the form of the gateway's own ids ('r' and "
                         "32 hex digits), which clients may not use; choose another")


# -- the service --------------------------------------------------------------------------------


class GatewayService(MicroService):
    """The gateway process. Construct, then ``await run()`` (or ``start(stack)`` in tests)."""

    def __init__(self, settings: GatewaySettings) -> None:
        super().__init__(
            settings,
            name=micro_service_name("gateway"),
            version=VERSION,
            group=settings.subjects.service_group("gateway"),
            description="vertumnus gateway (HTTP + NATS completions → intake)",
            metadata={"block_size": str(settings.block_size)},
        )
        self.gsettings = settings
        self._js: JetStreamContext | None = None
        self._states: KeyValue | None = None
        self._http: Any = None
        self._tokenizer: Any = None
        # request id -> requests waiting for its FirstToken (several when a client retries an
        # id that is still in flight: the duplicate waits for the original's result), each
        # taking only the results that answer its attempt (_Waiter.accepts).
        self._waiting: dict[str, list[_Waiter]] = {}
        # NATS completions waiting for their first token (_on_completion): given the stop's
        # grace, then cancelled (_finish_requests).
        self._nats_completions: set[asyncio.Task[None]] = set()
        self._finishing = asyncio.Event()  # the stop's grace has begun (finishing)
        # request id -> its intake message (data, headers) while someone waits for it: sent
        # again if the server loses its store (_republish_waiting).
        self._intake_msgs: dict[str, tuple[bytes, dict[str, str]]] = {}
        self._intake_created: datetime.datetime | None = None  # the intake stream's birth
        self._republish_due = False
        # Content digests of client request ids, to refuse a reuse with other content (409).
        # A claim lasts the intake's window plus the longest the publish may go on after it
        # (claim_ttl_s): the intake's window runs from the stored message. The window is the
        # intake stream's own, read in ensure_jetstream (the default until then). NOTE: the
        # local timer restarts as each publish starts (_publish_and_wait), not at the local
        # claim: the shared claim between the two may take its timeout and, the bucket
        # missing, the re-making's too; from the publish's start the bound holds whatever
        # came before it.
        self._claim_ttl_s = claim_ttl_s(settings.publish_bound_s)
        self._fingerprints = Fingerprints(self._claim_ttl_s, settings.max_idempotency_keys)
        # The same, shared by every gateway replica (a KV bucket; made in ensure_jetstream).
        self._claims: SharedClaims | None = None
        # The bucket being made again after a claim found it missing (one making at a time,
        # which every request that found it missing meanwhile awaits: _remake_bucket), and
        # how many makings have ended: a failure of a claim begun before the last one ended
        # is older than the bucket made, and makes nothing.
        self._remaking: asyncio.Task[None] | None = None
        self._bucket_makings = 0
        # Claims the bucket did not decide (fail open), request id -> (digest, a number of
        # its own), oldest first, to be written there once it answers again, by one task
        # (_share_claims); the id it writes now, and whether that claim was withdrawn since.
        self._unshared: dict[str, tuple[RequestDigest, int]] = {}
        # Withdrawals the bucket did not decide, request id -> (digest, revision, whether
        # the local entry was the withdrawing requests' own), tried again by the same task.
        self._unwithdrawn: dict[str, tuple[RequestDigest, int, bool]] = {}
        self._unshared_made = 0
        self._sharing: asyncio.Task[None] | None = None
        self._sharing_now: str | None = None
        self._sharing_withdrawn = False
        # Client request id -> the requests at this gateway that hold its claim now, from
        # their local claim to their end: a claim is withdrawn only by a request alone in it
        # (_withdraw_claim).
        self._claimants: dict[str, _Claimants] = {}
        # results_malformed: messages on a result subject that are no FirstToken of that
        # subject's request (ignored: the request keeps waiting for its real result).
        # conflicts: request ids reused with other content (409); conflicts_shared: those
        # found in the shared bucket only; idempotency_store_failed / _release_failed: claims
        # / withdrawals the bucket did not do; idempotency_contended: claims refused (503) as
        # their key kept changing; idempotency_bucket_remade: makings that created it;
        # idempotency_shared_late / _split: fail-open claims written to the bucket later /
        # found claimed there with other content; idempotency_withdrawn_late: withdrawals
        # done once the bucket answered again (module docstring). clients_gone: HTTP clients
        # that closed their connection before their first token (their waiter dropped).
        self.counters: dict[str, int] = {"intake_remade": 0, "republished": 0,
                                         "results_malformed": 0, "conflicts": 0,
                                         "conflicts_shared": 0, "idempotency_store_failed": 0,
                                         "idempotency_release_failed": 0,
                                         "idempotency_contended": 0,
                                         "idempotency_bucket_remade": 0,
                                         "idempotency_shared_late": 0, "idempotency_split": 0,
                                         "idempotency_withdrawn_late": 0,
                                         "clients_gone": 0}
        self.metrics = RequestMetrics(settings.slo_table)
        if settings.tokenizer_path is not None:
            try:
                from tokenizers import Tokenizer  # engine extra; only when configured
            except ImportError as exc:  # pragma: no cover - depends on installed extras
                raise InvalidConfig("tokenizer_path is set but the `tokenizers` package is "
                                    "not installed (pip install 'vertumnus[engine]')") from exc
            try:
                self._tokenizer = Tokenizer.from_file(str(settings.tokenizer_path))
            except Exception as exc:  # tokenizers raises a bare Exception for any bad file
                raise InvalidConfig(f"VTM_TOKENIZER_PATH {str(settings.tokenizer_path)!r}: "
                                    f"not a readable tokenizer.json ({exc})") from None

    # -- lifecycle ----------------------------------------------------------------------------

    def connect_options(self) -> dict[str, Any]:
        """The gateway's connection queues no publish while it is down (nats-py's
        ``pending_size=0``; :meth:`MicroService.connect_options`).

        Why: nats-py keeps what is published while its connection is down (2 MiB by default)
        and sends it once the connection is back, however late. An intake publish given up
        after ``publish_bound_s`` -- its claim counting on it -- could then still be stored
        after the claim expired, and a reuse of its id with other content in between would
        get its answer. With nothing queued, a publish while disconnected raises
        ``OutboundBufferLimitError`` at once: sent never (:func:`publish_refused`), tried
        again by :meth:`_publish_intake` once the connection is back. Only publishes are
        refused: subscriptions (made again by nats-py's reconnect, written straight to the
        new socket), flushes and pings queue as before, and a JetStream or KV request is a
        publish plus a reply subscription, so while connected it works as ever; while not, it
        fails at once instead of waiting out its timeout (a claim fails open, a look-up of a
        kept result is skipped, an answer on the NATS endpoint waits for the connection:
        :meth:`_respond`). What nats-py had queued just before a loss still goes out on
        reconnect (module docstring of idempotency, "Window"). An ``nc`` handed in (tests,
        an embedding program) is used as it is."""
        return {"pending_size": 0}

    def endpoints(self) -> Sequence[Endpoint]:
        # "completions" in group "{prefix}.gateway" is subjects.gateway_completions().
        return [Endpoint(COMPLETIONS_ENDPOINT, self._on_completion)]

    def stats_data(self) -> dict[str, Any]:
        return {**self.counters, "waiting": len(self._waiting),
                "idempotency_keys": len(self._fingerprints),
                "idempotency_evicted": self._fingerprints.evicted}

    def waiting_for(self, request_id: str) -> int:
        """How many callers of this gateway wait for ``request_id``'s first token now (0: none;
        several: retries of an id still in flight). Read-only, for tests and inspection."""
        return len(self._waiting.get(request_id, ()))

    async def ensure_jetstream(self) -> None:
        # A context's requests time out after jetstream_timeout_s (nats-py's 5 s): the
        # bucket's claims, withdrawals and result look-ups, bounded by publish_timeout_s,
        # would end then when publish_timeout_s is longer (a claim then failed open early).
        self._js = self.jetstream(
            max(self.settings.jetstream_timeout_s, self.gsettings.publish_timeout_s))
        info = await ensure_intake_stream(self._js, self.subjects)
        # An intake stream born after the one this gateway knew was made anew: the server
        # lost its store (no persistent volume, a new node), and with it every message not
        # yet acked -- some never delivered. The waiting requests are sent again (by the
        # sweeper, _republish_waiting).
        if self._intake_created is not None and info.created is not None \
                and info.created != self._intake_created:
            self.counters["intake_remade"] += 1
            self._republish_due = True
            self.log.warning("the intake stream was made anew (the server lost its store); "
                             "sending the waiting requests again",
                             waiting=len(self._intake_msgs))
        if info.created is not None:
            self._intake_created = info.created
        # A claim outlasts the intake's own window (whoever made the stream, with whatever
        # window) by the publish's bound.
        window = info.config.duplicate_window or INTAKE_DUPLICATE_WINDOW_S
        self._claim_ttl_s = claim_ttl_s(self.gsettings.publish_bound_s, window_s=window)
        self._fingerprints.window_s = self._claim_ttl_s
        await ensure_results_stream(self._js, self.subjects)
        self._states = await worker_state_kv(self._js, self.subjects)
        self._claims = SharedClaims(await idempotency_kv(self._js, self.subjects,
                                                         ttl_s=self._claim_ttl_s,
                                                         log=self.log),
                                    self.gsettings.publish_timeout_s)

    async def setup(self, stack: AsyncExitStack) -> None:
        await self.ensure_jetstream()
        results = await self.nc.subscribe(self.subjects.result_all(), cb=self._on_result)

        async def unsubscribe() -> None:
            with contextlib.suppress(Exception):
                await results.unsubscribe()

        stack.push_async_callback(unsubscribe)
        sweeper = asyncio.create_task(self._sweep_after_reconnects(), name="gateway-sweep")

        async def stop_sweeper() -> None:
            await cancel_and_wait([sweeper])

        stack.push_async_callback(stop_sweeper)

        async def stop_bucket_making() -> None:
            tasks = [t for t in (self._sharing, self._remaking) if t is not None]
            await cancel_and_wait(tasks, self.log)

        # Run after the requests' stops (callbacks run last first): a request may start them.
        stack.push_async_callback(stop_bucket_making)

        # Both entries' requests in flight, in one grace: the HTTP server's close, and the
        # NATS completions' tasks. Run after the micro service's stop (pushed after setup,
        # so undone before it), which drains the NATS endpoint: no new NATS completion.
        stack.push_async_callback(self._finish_requests)
        if self.gsettings.http_port is not None:
            from services.gateway.app import make_http_server

            self._http = make_http_server(self)
            await self._http.start()
            self.set_metadata(http=self._http.url)
            self.log.info("http listening", url=self._http.url)

    async def _finish_requests(self) -> None:
        """The stop's grace for the requests in flight (``stop_grace_s``; the rule is
        :func:`~services.gateway.grace.finish_within`'s): the HTTP server stops accepting
        and gives its requests being handled the grace (:meth:`HttpServer.close`), and
        every NATS completion still waiting gets the same, side by side -- one period, not
        one after the other. A request answered within it gets its own answer; those
        unfinished when it ends are cancelled and answer 503 "stopping"
        (:meth:`_answer_completion`, the HTTP server). No new NATS completion comes by
        now: the micro service's stop drained the endpoint before this runs. The grace ends
        before the process's stop deadline (:func:`~services.gateway.grace.affordable_grace`),
        so that those 503s are sent."""
        grace_s = affordable_grace(self.gsettings.stop_grace_s, stop_time_left())
        self._finishing.set()
        waits = [finish_within(list(self._nats_completions), grace_s, self.log)]
        if self._http is not None:
            waits.append(self._http.close(grace_s))
        await asyncio.gather(*waits)

    @property
    def finishing(self) -> asyncio.Event:
        """Set once a stop takes no new request and gives those in flight their grace
        (:meth:`_finish_requests`). Read-only, for tests and inspection."""
        return self._finishing

    @property
    def http_port(self) -> int:
        if self._http is None:
            raise RuntimeError("HTTP server is not running")
        return int(self._http.port)

    @property
    def http_url(self) -> str:
        if self._http is None:
            raise RuntimeError("HTTP server is not running")
        return str(self._http.url)

    @property
    def nats_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    # -- NATS endpoint --------------------------------------------------------------------------

    async def _on_completion(self, request: Request) -> None:
        """Decode the body (a bad one is answered at once), then wait for the first token in
        a task of its own and answer from there.

        NOTE: nats-py runs one subscription's callbacks one after another; awaiting the first
        token here would hold every later NATS completion back until this one's answer (or
        its 504, ``result_timeout_s`` later)."""
        try:
            # Strict, as over HTTP (app.py): true is no token id, "3" no max_tokens.
            body = decode(CompletionRequest, request.data, request.headers, strict=True)
        except UnsupportedContentType as exc:
            raise GatewayError(f"Content-Type must be application/json or "
                               f"application/msgpack: {exc.reason}", 415
                               ).to_service_error() from exc
        except SchemaError as exc:
            raise BadRequest(schema_message(exc)).to_service_error() from exc
        task = asyncio.create_task(self._answer_completion(request, body),
                                   name="gateway-nats-completion")
        self._nats_completions.add(task)
        task.add_done_callback(self._nats_completions.discard)

    async def _answer_completion(self, request: Request, body: CompletionRequest) -> None:
        """Run one NATS completion and answer it: its FirstToken, or a micro error with the
        HTTP status as code (500 without details for an unexpected failure). An error is
        counted in the endpoint's ``$SRV.STATS`` before it is sent (so a caller that reads
        the stats after the answer sees it): the handler returned long ago, so nats.micro,
        which counts what a handler raises, never sees it. A stop lets it finish within its
        grace (``stop_grace_s``, :meth:`_finish_requests`), as an HTTP request gets; still
        running when that ends, it is cancelled and answers 503 :data:`STOPPING_DESCRIPTION`
        first, as a micro handler given up at a stop does (shared/service.py): the micro
        drain does not wait for this task, and its caller would otherwise wait out its whole
        timeout."""
        try:
            try:
                done = await self.complete(body)
            except asyncio.CancelledError:
                if self.nats_connected:  # else nothing could reach the caller now
                    with contextlib.suppress(Exception):
                        await request.respond_error(STOPPING_CODE, STOPPING_DESCRIPTION)
                raise
            except GatewayError as exc:
                err = exc.to_service_error()
                self.count_endpoint_error(COMPLETIONS_ENDPOINT, err)
                await self._respond(lambda: request.respond_error(err.code, err.description))
                return
            except Exception:
                self.log.exception("NATS completion failed")
                err = ServiceError(code="500", description="internal error")
                self.count_endpoint_error(COMPLETIONS_ENDPOINT, err)
                await self._respond(lambda: request.respond_error(err.code, err.description))
                return
            data, headers = encode(done.result.model_copy(update={"stages": done.stages()}))
            await self._respond(lambda: request.respond(data, headers=headers))
        except (nats.errors.Error, TimeoutError) as exc:  # the answer could not be sent
            self.log.warning("NATS completion not answered", error=f"{type(exc).__name__}: "
                                                                   f"{exc}")

    async def _respond(self, send: Callable[[], Awaitable[None]]) -> None:
        """Send an answer on the NATS endpoint; the connection down (nothing queued: see
        :meth:`connect_options`), once it is back within ``nats_wait_s`` (as nats-py's buffer would
        have sent it). Raises what the send raises."""
        try:
            await send()
        except nats.errors.OutboundBufferLimitError:
            if not await self._nats_back(self.gsettings.nats_wait_s):
                raise
            await send()

    async def _on_result(self, msg: Msg) -> None:
        """Hand a FirstToken to whoever waits for its request id (the id is the subject's
        last token; results of requests that entered at another gateway are ignored).

        A message there that is not a FirstToken *of that request* (bad bytes, another
        request's result) is counted (``results_malformed``), logged and ignored: the
        request keeps waiting for its own result, which a malformed message must not
        pre-empt (bad input anywhere on the bus loses nothing)."""
        # The first token is here now: stamped on arrival, not when the waiting coroutine
        # next runs (that is the HTTP answer's path, not TTFT).
        received = time.time()
        rid = msg.subject.rpartition(".")[2]
        if rid not in self._waiting:
            return  # not ours (decoding every result of every gateway would be wasted work)
        result = self._result_of(rid, msg)
        if result is not None:
            self._deliver(rid, result, received)

    def _result_of(self, rid: str, msg: Any) -> FirstToken | None:
        """The FirstToken of ``rid`` in a result message, or None (counted and logged:
        :meth:`_malformed`) when the message is none (``shared.service.first_token_of``)."""
        try:
            return first_token_of(rid, msg)
        except SchemaError as exc:
            self._malformed(rid, exc)
            return None

    def _malformed(self, rid: str, exc: SchemaError) -> None:
        self.counters["results_malformed"] += 1
        self.log.warning("malformed first-token result ignored", request_id=rid,
                         error=schema_message(exc))

    def _deliver(self, rid: str, result: FirstToken, received: float) -> int:
        """Hand a result to everyone waiting for ``rid`` whose attempt it answers
        (:meth:`_Waiter.accepts`; the others keep waiting, and one whose publish is not yet
        decided keeps it as ``passed``); returns how many were still waiting and took it."""
        waiters = self._waiting.get(rid)
        if waiters is None:
            return 0
        n = 0
        for w in list(waiters):
            if w.fut.done():
                waiters.remove(w)
            elif w.accepts(result):
                w.fut.set_result((result, received))
                waiters.remove(w)
                n += 1
            elif not w.decided:
                w.passed = (result, received)
        if not waiters:
            del self._waiting[rid]
            self._intake_msgs.pop(rid, None)
        return n

    def _answers_one_waiting(self, rid: str) -> Callable[[FirstToken], bool]:
        """Whether a result answers one of the requests waiting for ``rid`` now."""
        return lambda result: any(w.accepts(result) for w in self._waiting.get(rid, ()))

    async def _sweep_after_reconnects(self) -> None:
        """After our connection to NATS came back, look up every request still waiting in
        the results stream: a result that went by while we were cut off is there (workers
        store every result, ``publish_result``). A scheduler's "not scheduled" or "not servable"
        result is left alone: it may be an earlier attempt's, and this one's is still to
        come."""
        seen = self.nc.stats["reconnects"]
        while True:
            await asyncio.sleep(SWEEP_PERIOD_S)
            if self._republish_due and self.nats_connected:
                self._republish_due = False
                await self._republish_waiting()
            now = self.nc.stats["reconnects"]
            if now == seen or not self.nats_connected:
                continue
            seen = now
            found = 0
            for rid in list(self._waiting):
                # The latest result that answers one of them (_Waiter.accepts): a later one
                # may be an earlier attempt's (another content's) under the same id.
                kept = await self._kept_result(rid, accepts=self._answers_one_waiting(rid))
                if kept is None or _from_scheduler(kept[0]):
                    continue
                found += self._deliver(rid, kept[0], time.time())
            self.log.info("waiting requests looked up after a reconnect", answered=found)

    async def _republish_waiting(self) -> None:
        """Send every waiting request's intake message again, marked ``REPUBLISHED_HEADER``
        (a scheduler asks the workers first: most were dispatched before the loss and will
        be answered). Under the same ``Nats-Msg-Id``: a message that already reached the new
        stream is dropped as a duplicate, and so is a second re-send. A failed publish leaves
        the rest to the sweeper's next round."""
        assert self._js is not None
        sent = 0
        for rid, (data, headers) in list(self._intake_msgs.items()):
            if rid not in self._intake_msgs:
                continue  # answered meanwhile
            try:
                ack = await self._js.publish(
                    self.subjects.intake_requests(), data,
                    headers={**headers, REPUBLISHED_HEADER: "store-lost"},
                    timeout=self.gsettings.publish_timeout_s)
            except (nats.errors.Error, TimeoutError) as exc:
                self._republish_due = True
                self.log.warning("waiting requests not all sent again; trying again",
                                 error=f"{type(exc).__name__}: {exc}", sent=sent)
                return
            if not ack.duplicate:
                sent += 1
        self.counters["republished"] += sent
        self.log.info("waiting requests sent again after the store was lost", sent=sent,
                      waiting=len(self._intake_msgs))

    # -- one completion ---------------------------------------------------------------------

    def tokenize(self, body: CompletionRequest) -> list[int]:
        if body.prompt_tokens is not None:
            return list(body.prompt_tokens)
        if self._tokenizer is None:
            raise Unprocessable("a text prompt needs a tokenizer and none is configured "
                                "(VTM_TOKENIZER_PATH); send the prompt as a list of token ids")
        assert body.prompt is not None
        ids = list(self._tokenizer.encode(body.prompt).ids)
        if not ids:
            raise Unprocessable("the prompt tokenizes to zero tokens")
        return ids

    def detokenize(self, token: int | None) -> str | None:
        if token is None or self._tokenizer is None:
            return None
        return str(self._tokenizer.decode([token]))

    async def complete(self, body: CompletionRequest, *, arrival_s: float | None = None,
                       http: bool = False, carrier: Mapping[str, str] | None = None,
                       disconnected: asyncio.Future[None] | None = None,
                       ids: Callable[[str, str | None], None] | None = None) -> Completion:
        """Run one completion to its first token (see the module docstring).

        ``carrier``: the caller's W3C trace context (an HTTP client's ``traceparent`` /
        ``tracestate`` headers); the request's span joins that trace instead of starting one.
        None: the current context (the NATS endpoint's server span, or a new trace).
        ``disconnected``: done once the caller is gone (an HTTP client closed its connection);
        the wait for the first token then ends with :class:`ClientClosed` and leaves no
        waiter behind (the request, published already, still runs). ``ids``: called with the
        request id and the root span's trace id (None: no valid one) once the span is open,
        before anything can fail after it (an HTTP answer names them). Every
        outcome is recorded in :attr:`metrics`; a failure after the prompt was tokenized
        with the prompt's length, so the SLO attainment counts it as a miss
        (:meth:`RequestMetrics.refused`)."""
        entry = "http" if http else "nats"
        arrival = arrival_s if arrival_s is not None else time.time()
        input_len: int | None = None  # unknown until the prompt is tokenized
        try:
            if body.stream:
                raise BadRequest("stream=true is not supported yet (no server-sent events); "
                                 "send stream=false")
            tokens = self.tokenize(body)
            input_len = len(tokens)
            done = await self._complete(body, tokens, arrival=arrival, entry=entry,
                                        carrier=carrier, disconnected=disconnected, ids=ids)
        except GatewayError as exc:
            self.metrics.refused(exc.status, entry, input_len)
            raise
        except Exception:
            # Answered as an internal error by the caller.
            self.metrics.refused(500, entry, input_len)
            raise
        self.metrics.answered(done.result, done.input_len, done.ttft_s, entry)
        return done

    async def _complete(self, body: CompletionRequest, tokens: list[int], *, arrival: float,
                        entry: str, carrier: Mapping[str, str] | None = None,
                        disconnected: asyncio.Future[None] | None = None,
                        ids: Callable[[str, str | None], None] | None = None) -> Completion:
        check_limits(tokens, body.max_tokens, self.gsettings)
        if body.request_id:
            check_client_id(body.request_id)
        rid = body.request_id or new_request_id()
        # Only a client's own id can be reused (module docstring of idempotency).
        digest = request_digest(tokens, body.max_tokens) if body.request_id else None
        hashes = chain_hashes(tokens, self.gsettings.block_size)
        attrs = {"vtm.request_id": rid, "vtm.input_len": len(tokens),
                 "vtm.full_blocks": len(hashes), "vtm.max_tokens": body.max_tokens,
                 "vtm.entry": entry}
        with tracer().start_as_current_span(
            str(Stage.REQUEST), kind=trace.SpanKind.SERVER, attributes=attrs,
            start_time=int(arrival * 1e9),
            context=extract(carrier) if traceparent_of(carrier) is not None else None,
        ) as span, bind_request(rid):
            if ids is not None:
                ctx = span.get_span_context()
                ids(rid, format(ctx.trace_id, "032x") if ctx.is_valid else None)
            try:
                done = await self._publish_and_wait(rid, tokens, hashes, body, arrival,
                                                    digest=digest, disconnected=disconnected)
            except GatewayError as exc:
                span.set_attribute("vtm.error_code", exc.status)
                if exc.status >= 500:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
                raise
            span.set_attribute("vtm.ttft_s", done.ttft_s)
            if done.result.worker_id:
                span.set_attribute("vtm.worker_id", done.result.worker_id)
            return done

    async def _publish_and_wait(self, rid: str, tokens: list[int], hashes: list[int],
                                body: CompletionRequest, arrival: float, *,
                                digest: RequestDigest | None = None,
                                disconnected: asyncio.Future[None] | None = None
                                ) -> Completion:
        if self._js is None or not await self._nats_back(self.gsettings.nats_wait_s):
            raise Unavailable("not connected to NATS; try again later")
        carrier = inject({})
        if len(carrier.get("tracestate", "")) > MAX_TRACESTATE_CHARS:
            # A client's tracestate (up to ~16 KB of vendor entries) travels twice, in the
            # headers and in the message: dropped past the W3C's propagation minimum, which
            # the spec allows (the trace itself, traceparent, is kept).
            del carrier["tracestate"]
        intake = IntakeRequest(
            request_id=rid, input_len=len(tokens),
            tokens=tokens if self.gsettings.forward_tokens else None,
            block_hashes=hashes, block_size=self.gsettings.block_size,
            max_tokens=body.max_tokens, arrival_s=arrival, trace_context=carrier,
        )
        data, headers = encode(intake)
        headers[MSG_ID_HEADER] = rid
        headers.update(carrier)
        # Headers count (the server's check; nats-py counts the payload only, and a message
        # the server finds too large closes the connection for good), and so does the room
        # the scheduler needs to wrap the request into an assignment or send it again.
        size = message_size(data, headers) + INTAKE_HEADROOM_BYTES
        if size > self.nc.max_payload:
            raise TooLarge(f"intake message of {size} bytes (with its headers and "
                           f"{INTAKE_HEADROOM_BYTES} bytes of room to forward it) exceeds the "
                           f"NATS server's max_payload of {self.nc.max_payload} bytes; send a "
                           "shorter prompt (or run the gateway with forward_tokens=false)")
        # Claimed before the publish: first here, with no await in between check and keep
        # (of two requests racing here under one id with different content, the second is
        # refused at once), then in the bucket every replica shares, which decides.
        claim = self._fingerprints.claim(rid, digest) if digest is not None else Claim.SAME
        if claim is Claim.CONFLICT:
            raise self._conflict(rid)
        with self._holding(rid, digest) as group:
            return await self._claimed_publish_and_wait(
                rid, data, headers, tokens, body, arrival, digest=digest, claim=claim,
                group=group, disconnected=disconnected)

    @contextlib.contextmanager
    def _holding(self, rid: str, digest: RequestDigest | None) -> Iterator[_Claimants | None]:
        """Count a request among the holders of ``rid``'s claim for as long as it runs (None:
        no client id, no claim). NOTE: entered right after the local claim, with no await in
        between, so that a request still waiting for the bucket counts too: a request whose
        publish was refused meanwhile must not withdraw the claim it relies on."""
        if digest is None:
            yield None
            return
        group = self._claimants.setdefault(rid, _Claimants())
        group.count += 1
        try:
            yield group
        finally:
            group.count -= 1
            if not group.count and self._claimants.get(rid) is group:
                del self._claimants[rid]

    async def _claimed_publish_and_wait(
            self, rid: str, data: bytes, headers: dict[str, str], tokens: list[int],
            body: CompletionRequest, arrival: float, *, digest: RequestDigest | None,
            claim: Claim, group: _Claimants | None,
            disconnected: asyncio.Future[None] | None) -> Completion:
        """:meth:`_publish_and_wait` after the local claim (``claim``; SAME without a client
        id): the shared claim, the publish, the wait for the first token."""
        try:
            shared = await self._claim_shared(rid, digest) if digest is not None else None
        except BaseException:  # not decided (stopping): nothing was published
            if digest is not None and group is not None and claim is Claim.NEW:
                group.made_local = True
                self._release_local(rid, digest, group)
            raise
        if shared is not None and shared.claim is not Claim.NEW and claim is Claim.NEW:
            # Another claim was first (another replica's, or this one's before a restart):
            # the bucket keeps its window; this memory keeps only the ids claimed first here.
            assert digest is not None
            self._fingerprints.release(rid, digest)
            claim = Claim.SAME
        if shared is not None and shared.claim is Claim.CONFLICT:
            self.counters["conflicts_shared"] += 1
            raise self._conflict(rid)
        if digest is not None and group is not None:
            _note_shared(group, shared)
            # The local timer starts again as the publish starts (module docstring of
            # idempotency, "Window"): from here the message is stored, if at all, within
            # publish_bound_s. Kept anew where the claim is this gateway's to keep (made here,
            # or the bucket did not answer); where the bucket holds another replica's claim
            # (written again by this claim), only an entry kept already is restarted.
            had = self._fingerprints.expires_at(rid) is not None
            kept = self._fingerprints.restart(rid, digest,
                                              add=shared is None or shared.claim is Claim.NEW)
            if kept and (claim is Claim.NEW or not had):
                group.made_local = True
            if kept and shared is None:
                self._share_later(rid, digest)
        got: asyncio.Future[tuple[FirstToken, float]] = \
            asyncio.get_running_loop().create_future()
        # It takes only the results that answer its attempt (_Waiter: the arrival stamp in
        # the IntakeRequest, echoed by every FirstToken).
        waiter = _Waiter(got, arrival)
        self._waiting.setdefault(rid, []).append(waiter)
        self._intake_msgs.setdefault(rid, (data, headers))  # a duplicate keeps the original's
        try:
            try:
                published = time.time()  # after the claim's restart (the duplicate's edge)
                ack = await self._publish_intake(data, headers)
            except BaseException as exc:
                # Definitely not stored (IntakeRefused): a retry with other content is no
                # conflict with it, so the claim is withdrawn (_withdraw_claim: by the last
                # request here that holds it, when none of them may have stored). Anything
                # else (a timeout, a lost connection, a cancel as the gateway stops) may have
                # been stored all the same: the claim is kept, here and in the bucket, and
                # expires with the window (publish_refused says why).
                if group is not None and digest is not None:
                    if isinstance(exc, IntakeRefused):
                        await self._withdraw_claim(rid, digest, group)
                    else:
                        group.maybe_stored = True
                raise
            if group is not None:
                group.maybe_stored = True
            duplicate = bool(ack.duplicate)
            # A replay of a request whose claim holds (SAME) stored anew -- the intake lost
            # with the server's store, say -- is answered by an earlier attempt's result as
            # well as by its own: which of the two publishes of its message (its own, the
            # gateway's republish after the loss) landed first must not decide it.
            replay = duplicate or (digest is not None and claim is Claim.SAME)
            if not replay:
                waiter.decided = True  # stored anew: its own attempt's result only
                waiter.passed = None
            else:
                # A retry (say, after a gateway crash cut the client off): the intake dropped
                # it, so the original's result is the answer -- kept in the results stream if
                # it already went by, else still to come on the subscription. The original's
                # stamp is not known here: the results of attempts stamped after the edge
                # answer (_Waiter.duplicate_of says why), from now on live too.
                waiter.duplicate_of(published, self._claim_ttl_s, stored=not duplicate)
                kept = await self._kept_result(rid, accepts=waiter.accepts)
                if kept is None and waiter.passed is not None \
                        and waiter.accepts(waiter.passed[0]) and not got.done():
                    # Went by live before the ack said whose it is (perhaps not readable
                    # from the stream yet): the answer, as a live one after the ack is.
                    got.set_result(waiter.passed)
                waiter.passed = None
                if kept is not None and _from_scheduler(kept[0]) and not duplicate:
                    pass  # its own message is stored anew: its own result comes
                elif kept is not None and _from_scheduler(kept[0]):
                    # ...unless the scheduler gave up on it (503: "try again later") or
                    # refused it (422: against the workers of then): this is a later try, a
                    # new intake message. Its id is derived from the failure's, so concurrent
                    # retries of one failure are one message.
                    headers[MSG_ID_HEADER] = f"{rid}~{kept[1]}"
                    self._intake_msgs[rid] = (data, headers)
                    await self._publish_intake(data, headers)
                    self.log.info("retry of a request that was not scheduled; sent again")
                else:
                    if kept is not None and not got.done():
                        got.set_result((kept[0], time.time()))
                    self.log.info("replayed request id; the original's result answers it",
                                  kept=kept is not None, duplicate=duplicate)
            try:
                async with asyncio.timeout(self.gsettings.result_timeout_s):
                    if disconnected is not None:
                        await asyncio.wait((got, disconnected),
                                           return_when=asyncio.FIRST_COMPLETED)
                        if not got.done():
                            self.counters["clients_gone"] += 1
                            self.log.info("client closed its connection before its first "
                                          "token; no longer waiting (the request still runs)")
                            raise ClientClosed(f"the client closed its connection before "
                                               f"the first token of request {rid}")
                    result, received = await got
            except TimeoutError:
                raise FirstTokenTimeout(
                    f"no first token for request {rid} within "
                    f"{self.gsettings.result_timeout_s} s"
                    + (" (a duplicate of an earlier request id whose result is no longer "
                       "kept?)" if duplicate else "")) from None
        finally:
            self._forget(rid, waiter)
        if result.arrival_s == arrival:  # this request's own attempt, not a kept result
            record_first_token_trip(result, received)
        if result.error is not None:
            raise result_error(rid, result.error)
        return Completion(
            request_id=rid, result=result, input_len=len(tokens), max_tokens=body.max_tokens,
            ttft_s=max(0.0, received - arrival), duplicate=duplicate,
            trace_id=current_trace_id(),
            text=self.detokenize(result.token),
        )

    def _conflict(self, rid: str) -> Conflict:
        self.counters["conflicts"] += 1
        return Conflict(
            f"request_id {rid!r} was already used for a different request (another "
            f"prompt or max_tokens) within the last {self._claim_ttl_s:g} s; "
            "send the same request to get its answer, or a new request_id")

    async def _claim_shared(self, rid: str, digest: RequestDigest) -> SharedClaim | None:
        """Claim ``rid`` in the shared bucket; None when the bucket did not decide: the
        request goes on, checked by this gateway's memory alone (fail open: the module
        docstring of idempotency says why), counted and logged. Raises :class:`Unavailable`
        (503) when the claim was contended (:class:`ClaimContended`): nothing published."""
        if self._claims is None:  # pragma: no cover - made in ensure_jetstream at start
            return None
        makings = self._bucket_makings
        try:
            return await self._claims.claim(rid, digest)
        except ClaimContended as exc:
            # The bucket works and someone's claim was there every round: failing open could
            # run the request twice; the client's retry claims it again (ClaimContended).
            self.counters["idempotency_contended"] += 1
            self.log.warning("idempotency claim contended; request refused for now",
                             error=str(exc))
            raise Unavailable(f"request_id {rid!r} is being claimed by other requests at "
                              "this moment; try again") from exc
        except StoreFailed as exc:
            self.counters["idempotency_store_failed"] += 1
            self.log.warning("idempotency bucket did not decide; request id checked at this "
                             "gateway only", error=str(exc))
            await self._remake_bucket(exc, makings)
            return None

    async def _withdraw_claim(self, rid: str, digest: RequestDigest,
                              group: _Claimants) -> None:
        """Withdraw ``rid``'s claim after a request's publish was definitely refused, if that
        request is the last here that holds it and none of them may have stored a message
        under it (``group``): what they wrote of it goes -- the bucket's record where it is
        theirs alone (:attr:`_Claimants.revision`; a conditional delete, which a write by
        another replica since makes fail), then the local entry they made. A record someone
        else made or wrote is never withdrawn: that request's message may be stored."""
        if group.count > 1 or group.maybe_stored:
            return
        withdrawn = True
        revision = group.revision
        if revision is not None:
            withdrawn = await self._release_shared(rid, revision,
                                                   later=(digest, group.made_local))
            if withdrawn and group.revision == revision:
                group.revision = None
        # NOTE: the local entry goes only after the bucket's decision, and only if the record
        # was withdrawn there (else a later write, a replay's elsewhere, holds the claim) and
        # no request came meanwhile. A newcomer during the await finds the entry: with this
        # content it joins the holders (seen here: count > 1), with other content it is
        # refused (409) -- for the moment of the withdrawal, the safe side. Forgotten before
        # the await, a newcomer with this content would make an entry of its own, which this
        # release would then drop.
        if withdrawn:
            self._release_local(rid, digest, group)

    def _release_local(self, rid: str, digest: RequestDigest, group: _Claimants) -> None:
        """Forget the local entry of ``rid`` that the holders of its claim made, when the last
        of them published nothing that may be stored (``group``)."""
        if group.made_local and group.count == 1 and not group.maybe_stored:
            self._fingerprints.release(rid, digest)
            group.made_local = False
            waiting = self._unshared.get(rid)
            if waiting is not None and waiting[0] == digest:
                del self._unshared[rid]  # nothing to share: not stored
            if self._sharing_now == rid:
                self._sharing_withdrawn = True  # what its sharing writes goes again

    async def _release_shared(self, rid: str, revision: int, *,
                              later: tuple[RequestDigest, bool]) -> bool:
        """Withdraw this request's claim from the shared bucket (its publish was refused).
        False: not withdrawn -- a later record holds the key (a replay wrote it again, or it
        expired and was claimed again), or the bucket did not do it (counted, logged, and
        tried again once it answers: :meth:`_withdraw_later` with ``later``, the claim's
        digest and whether its local entry was the withdrawing requests' own)."""
        assert self._claims is not None
        makings = self._bucket_makings
        try:
            return await self._claims.release(rid, revision)
        except StoreFailed as exc:
            self.counters["idempotency_release_failed"] += 1
            self.log.warning("idempotency claim not withdrawn; tried again once the bucket "
                             "answers", error=str(exc))
            self._withdraw_later(rid, later[0], revision, later[1])
            await self._remake_bucket(exc, makings)
            return False

    async def _remake_bucket(self, exc: StoreFailed, makings: int) -> None:
        """Make the idempotency bucket again when it is missing (deleted, or lost with the
        server's store), so the next claims are shared again; returns once it is made (or
        that failed: the next claim that finds it missing tries again).

        One making at a time, in a task of its own: a request that finds the bucket missing
        while one runs awaits that one (a burst of requests makes it once, not once each),
        and a request whose bucket call began before a making ended (``makings``: the count
        of ended makings when the call began) makes none -- its failure is older than the
        bucket. Shielded: a request cancelled meanwhile leaves the making to the others (the
        gateway's stop cancels it)."""
        if not exc.bucket_missing or self._js is None:
            return
        task = self._remaking
        if task is None:
            if makings != self._bucket_makings:
                return
            self.log.warning("idempotency bucket missing; creating it again")
            task = self._remaking = asyncio.create_task(self._make_bucket(self._js),
                                                        name="gateway-idempotency-bucket")
        await asyncio.shield(task)

    def _share_later(self, rid: str, digest: RequestDigest) -> None:
        """Have the claim of ``rid`` for ``digest``, which the bucket did not decide (kept at
        this gateway only: fail open), written there once it answers again
        (:meth:`_share_claims`). At most ``max_idempotency_keys`` wait, the oldest dropped
        first (this gateway's memory keeps no more either)."""
        self._unshared.pop(rid, None)  # to the end: the latest claim of the id
        self._unshared_made += 1
        self._unshared[rid] = (digest, self._unshared_made)
        while len(self._unshared) > self.gsettings.max_idempotency_keys:
            del self._unshared[next(iter(self._unshared))]
        self._start_sharing()

    def _withdraw_later(self, rid: str, digest: RequestDigest, revision: int,
                        local: bool) -> None:
        """Have the withdrawal of ``rid``'s record at ``revision``, which the bucket did not
        decide, tried again once it answers (:meth:`_share_claims`); ``local``: the local
        entry for ``digest`` was the withdrawing requests' own, to go too once the record
        has. At most ``max_idempotency_keys`` wait, the oldest dropped first (their claims
        then expire with the window, as before)."""
        self._unwithdrawn.pop(rid, None)
        self._unwithdrawn[rid] = (digest, revision, local)
        while len(self._unwithdrawn) > self.gsettings.max_idempotency_keys:
            del self._unwithdrawn[next(iter(self._unwithdrawn))]
        self._start_sharing()

    def _start_sharing(self) -> None:
        if self._sharing is None:
            self._sharing = asyncio.create_task(self._share_claims(),
                                                name="gateway-idempotency-share")

    async def _share_claims(self) -> None:
        """Catch the bucket up with what it did not decide: the fail-open claims first
        (:meth:`_share_first`), then the withdrawals (:meth:`_withdraw_first`). A bucket
        that still fails is tried again after a pause, doubled up to
        :data:`SHARE_PAUSE_MAX_S` (a missing one is made again: :meth:`_remake_bucket`).
        Ends when none is left; no failure ends it -- the bucket's, or any other exception
        of a step (a defect: logged with its traceback, and the step tried again after the
        pause, as the bucket's are) -- and the next claim or withdrawal left over starts it
        again after anything else."""
        assert self._claims is not None
        pause = SHARE_PAUSE_S
        try:
            while self._unshared or self._unwithdrawn:
                try:
                    done = await (self._share_first() if self._unshared
                                  else self._withdraw_first())
                except Exception:
                    # Before, such an exception ended the task, leaving what waits unshared
                    # until another fail-open claim or withdrawal started it again.
                    self.log.exception("idempotency catch-up step failed; tried again after "
                                       "a pause")
                    done = False
                if done:
                    pause = SHARE_PAUSE_S
                else:
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, SHARE_PAUSE_MAX_S)
        finally:
            self._sharing = None

    async def _share_first(self) -> bool:
        """Write the oldest claim the bucket did not decide into it, if this gateway's memory
        still keeps it with its digest (expired, forgotten, withdrawn: dropped). Found
        claimed with other content (another replica took the id meanwhile: both requests
        ran) is counted (``idempotency_split``) and logged; nothing can undo it. False: the
        bucket failed again (the claim stays first)."""
        assert self._claims is not None
        rid, (digest, number) = next(iter(self._unshared.items()))
        if self._fingerprints.digest(rid) != digest:
            del self._unshared[rid]
            return True
        makings = self._bucket_makings
        self._sharing_now, self._sharing_withdrawn = rid, False
        try:
            shared = await self._claims.claim(rid, digest)
        except StoreFailed as exc:
            await self._remake_bucket(exc, makings)
            return False
        finally:
            self._sharing_now = None
        if self._sharing_withdrawn:
            # Withdrawn meanwhile (_release_local: no request under the id here may have
            # stored a message): what this wrote goes too.
            if shared.claim is Claim.NEW and shared.revision is not None:
                await self._release_shared(rid, shared.revision, later=(digest, False))
            return True
        waiting = self._unshared.get(rid)
        if waiting is not None and waiting[1] == number:
            del self._unshared[rid]
        # else: forgotten meanwhile (the bound), written all the same; or claimed again
        # since, which has its own turn (its write restarts the record's age).
        group = self._claimants.get(rid)
        if group is not None:  # its requests still run: what they may withdraw
            _note_shared(group, shared)
        if shared.claim is Claim.CONFLICT:
            self.counters["idempotency_split"] += 1
            self.log.warning("request id claimed with other content at another gateway "
                             "while the idempotency bucket did not answer; both requests "
                             "ran", request_id=rid)
        else:
            self.counters["idempotency_shared_late"] += 1
        return True

    async def _withdraw_first(self) -> bool:
        """Try the oldest withdrawal the bucket did not decide again (a delete at the
        revision the withdrawing requests wrote: a write since, a replay's or a new claim's,
        makes it fail and keeps the record). Withdrawn, the local entry goes too where it
        was theirs and nothing here claimed the id since: no request holds it now, none
        waits to share it, and the entry is still theirs (a request since with this content
        that published wrote the record again -- or waits to share it -- so the delete
        failed or the entry stays). False: the bucket failed again (it stays first)."""
        assert self._claims is not None
        rid, entry = next(iter(self._unwithdrawn.items()))
        digest, revision, local = entry
        makings = self._bucket_makings
        try:
            withdrawn = await self._claims.release(rid, revision)
        except StoreFailed as exc:
            await self._remake_bucket(exc, makings)
            return False
        if self._unwithdrawn.get(rid) == entry:
            del self._unwithdrawn[rid]
        if withdrawn:
            self.counters["idempotency_withdrawn_late"] += 1
            if local and rid not in self._claimants and rid not in self._unshared \
                    and self._fingerprints.digest(rid) == digest:
                self._fingerprints.release(rid, digest)
        return True

    async def _make_bucket(self, js: JetStreamContext) -> None:
        """One making of the idempotency bucket (:meth:`_remake_bucket`), counted in
        ``idempotency_bucket_remade`` only where it created the bucket (a claim may have
        taken a brief failure for a missing bucket); never raises but a cancel."""
        try:
            async with asyncio.timeout(self.gsettings.publish_timeout_s):
                _, created = await open_idempotency_kv(js, self.subjects,
                                                       ttl_s=self._claim_ttl_s)
            if created:
                self.counters["idempotency_bucket_remade"] += 1
            else:
                self.log.info("idempotency bucket found there; not made again")
        except (nats.errors.Error, TimeoutError) as exc:
            self.log.warning("idempotency bucket not made again; the next claim that finds "
                             "it missing tries again", error=f"{type(exc).__name__}: {exc}")
        finally:
            self._bucket_makings += 1
            self._remaking = None

    async def _nats_back(self, within_s: float) -> bool:
        """Connected now, or again within ``within_s`` (nats-py reconnects on its own)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while not self.nats_connected:
            if self._nc is None or self._nc.is_closed or loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _publish_intake(self, data: bytes, headers: dict[str, str]) -> Any:
        """Publish to the intake and return its ack. A connection lost, an intake that does
        not answer (a broker restarting, JetStream recovering its store) or one that answers
        it is briefly unable to (a 5xx: a leader election, a store being recovered;
        :func:`publish_transient`) is waited for and the message published again, up to
        ``nats_wait_s``: the ``Nats-Msg-Id`` makes a repeat that did land a duplicate. Then
        :class:`Unavailable` (503), or :class:`IntakeRefused` (503 too) when no try can have
        stored it (:func:`publish_refused`). An answer that retrying cannot change -- below
        500 (a check before storing), a failed store or a full stream -- fails it at once, the
        same way. Every try ends by ``publish_bound_s`` from the start (the claim's TTL counts
        on it, :func:`claim_ttl_s`)."""
        assert self._js is not None
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.gsettings.nats_wait_s
        end = start + self.gsettings.publish_bound_s
        # One indeterminate try (say, a timeout) makes the whole publish one: that try may
        # have stored the message though a later one was refused.
        maybe_stored = False
        retries = 0
        while True:
            failure: BaseException  # this try's, raised from if it is the last
            try:
                # A try after a late reconnect (_nats_back polls) still ends by `end`. The
                # outer bound covers what nats-py's timeout does not (it bounds the wait for
                # the ack only): publish() itself blocked behind a stalled socket's writes.
                try_s = min(self.gsettings.publish_timeout_s, max(0.001, end - loop.time()))
                async with asyncio.timeout(try_s):
                    return await self._js.publish(self.subjects.intake_requests(), data,
                                                  headers=headers, timeout=try_s)
            except (nats.errors.NoRespondersError, NoStreamResponseError,
                    nats.errors.TimeoutError, TimeoutError, nats.errors.ConnectionClosedError,
                    nats.errors.ConnectionReconnectingError,
                    nats.errors.ConnectionDrainingError,
                    # The connection down at this moment: nothing queued (start), nothing sent.
                    nats.errors.OutboundBufferLimitError) as exc:
                maybe_stored = maybe_stored or not publish_refused(exc)
                failure, answer = exc, type(exc).__name__
                said: dict[str, Any] = {}
            except APIError as exc:
                # The stream answered, refusing it: the broker's trouble, and for the client
                # one to retry later, not an internal error. A 5xx answer may follow a write
                # all the same (publish_refused), and a repeat of it that lands is a duplicate.
                maybe_stored = maybe_stored or not publish_refused(exc)
                answer = exc.description or type(exc).__name__
                if not publish_transient(exc):
                    # A check before storing, a failed store, a full stream: the same message
                    # gets the same answer for longer than this request waits.
                    failed = Unavailable if maybe_stored else IntakeRefused
                    raise failed(f"intake stream refused the request: {answer}") from exc
                failure = exc
                answer = f"{answer} (code {exc.code}, err_code {exc.err_code})"
                said = {"code": exc.code, "err_code": exc.err_code}
            left = deadline - loop.time()
            if left > 0:  # said before the wait for the connection, which may be long
                # The first retry of a request is news; the next ones, every request's
                # during an outage, would drown the log.
                say = self.log.info if not retries else self.log.debug
                say("intake publish failed; trying again", error=type(failure).__name__,
                    **said, connected=self.nats_connected, retries=retries)
            # After a 5xx the connection is up (it came as an answer): only the pause below
            # spaces the tries, growing and drawn at random, so that the requests waiting
            # do not ask a JetStream electing a leader in a tight loop, nor all at once.
            if left <= 0 or not await self._nats_back(left):
                failed = Unavailable if maybe_stored else IntakeRefused
                raise failed(f"intake stream unavailable: {answer}") from failure
            pause = min(PUBLISH_PAUSE_MAX_S, PUBLISH_PAUSE_S * (1 << min(retries, 16)))
            retries += 1
            await asyncio.sleep(min(random.uniform(pause / 2, pause),
                                    max(0.0, deadline - loop.time())))

    async def _kept_result(self, rid: str, *, accepts: Callable[[FirstToken], bool]
                           ) -> tuple[FirstToken, int] | None:
        """The latest result of ``rid`` in the results stream that ``accepts`` takes (one
        that answers the attempt waiting: :meth:`_Waiter.accepts`) and its stream sequence,
        or None: none kept, or the stream did not answer (then the live result may still
        come). What the stream keeps there that is no FirstToken of ``rid`` (bad input;
        logged, see :meth:`_result_of`), or no result ``accepts`` takes, is passed over for
        the latest one before it that is."""
        assert self._js is not None
        try:
            return await asyncio.wait_for(
                latest_result(self._js, self.subjects, rid,
                              on_bad=lambda exc: self._malformed(rid, exc), accept=accepts),
                self.gsettings.publish_timeout_s)
        except NotFoundError as exc:
            if exc.err_code == STREAM_NOT_FOUND:
                # Lost with the server's store: make it again, so the next retries find
                # their results (this one waits for its live result).
                self.log.warning("results stream missing; creating it again")
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await ensure_results_stream(self._js, self.subjects)
            return None
        except (nats.errors.Error, TimeoutError) as exc:
            self.log.warning("results stream not read", error=f"{type(exc).__name__}: {exc}")
            return None

    def _forget(self, rid: str, waiter: _Waiter) -> None:
        """Drop one waiter (answered, timed out or failed before publishing)."""
        waiters = self._waiting.get(rid)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)
        if not waiters:
            del self._waiting[rid]
            self._intake_msgs.pop(rid, None)

    # -- workers ------------------------------------------------------------------------------

    async def worker_states(self) -> list[WorkerState]:
        """Every worker's state from the worker-state KV bucket (sorted by id)."""
        if not self.nats_connected or self._states is None or self._js is None:
            raise Unavailable("not connected to NATS; try again later")
        try:
            keys = await bucket_keys(self._js, self.subjects.worker_state_bucket())
        except NotFoundError:
            return []
        except (nats.errors.Error, TimeoutError) as exc:  # a timeout, JetStream trouble
            raise Unavailable("worker-state bucket did not answer") from exc
        out: list[WorkerState] = []
        for key in keys:
            try:
                entry = await self._states.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                continue
            except (nats.errors.Error, TimeoutError) as exc:
                raise Unavailable("worker-state bucket did not answer") from exc
            if not entry.value:
                continue
            try:
                out.append(from_json(WorkerState, entry.value))
            except SchemaError as exc:
                self.log.warning("bad worker state skipped", key=key, error=str(exc))
        return out


def _note_shared(group: _Claimants, shared: SharedClaim | None) -> None:
    """Record in ``group`` what a claim wrote in the bucket (:attr:`_Claimants.revision`)."""
    if shared is None or shared.revision is None:
        return  # nothing written, or not known what: no change (a later delete then fails)
    if shared.claim is Claim.NEW or (shared.prior is not None and shared.prior == group.revision):
        group.revision = shared.revision  # made by them, or their record written again
    else:
        group.revision = None  # someone else's record: not theirs to withdraw


def _from_scheduler(result: FirstToken) -> bool:
    """A result the scheduler sent instead of a worker: it gave up on the request (no worker
    took it) or refused it (no worker it knew could serve it). Neither is the request's
    answer for good: a later attempt is judged against the workers of then."""
    return result.error is not None and result.error.startswith((NOT_SCHEDULED, NOT_SERVABLE))


class InvalidConfig(ValueError):
    """The gateway's settings cannot work (e.g. a tokenizer without its package)."""


__all__ = [
    "BadRequest",
    "ClientClosed",
    "Completion",
    "Conflict",
    "FirstTokenTimeout",
    "GatewayError",
    "GatewayService",
    "IntakeRefused",
    "InvalidConfig",
    "TooLarge",
    "Unavailable",
    "Unprocessable",
    "WorkerFailed",
    "check_limits",
    "new_request_id",
    "check_client_id",
    "publish_refused",
    "publish_transient",
    "result_error",
    "schema_message",
]
