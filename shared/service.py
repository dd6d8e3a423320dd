"""A thin base for running one NATS micro service (``nats.micro``) per process.

What a subclass gets:

* a connection (or a given one), a micro service with name, semver version and metadata
  (``$SRV.PING|INFO|STATS`` discovery and health for free), endpoints in one subject group
  with a queue group;
* endpoint handlers that take a :class:`nats.micro.Request` and return a message (encoded as
  JSON with ``Content-Type``), raw bytes, or None (the handler responded itself);
* typed errors mapped to micro errors (``Nats-Service-Error`` / ``-Code`` headers), counted in
  STATS (an error answered later, from a task the handler started, is counted with
  :meth:`MicroService.count_endpoint_error`), and the service keeps serving:

  ===========================================  =====
  :class:`~shared.ids.InvalidInput` (and
  :class:`~shared.schemas.SchemaError`)         400
  :class:`~shared.ids.UnknownWorker`            404
  other :class:`~shared.ids.VertumnusError`,
  a KV compare-and-set loss                     409 (illegal in the current state)
  anything else                                 500 (logged with traceback; no details sent)
  ===========================================  =====

  and, from the base itself: a request whose header block is malformed
  (:data:`shared.natsclient.MALFORMED_HEADERS`) 400 before its handler runs; a reply that
  may not be sent (:class:`ReplyTooLarge`) 500 ``reply too large`` in its place; a request
  still being handled, or queued behind one, when a graceful stop gives up waiting for it
  503 ``service stopping`` (:func:`stop_micro_service`). A request without a reply subject
  is handled, and a failure logged as above, but nothing is answered;

* a server span per request, child of the caller's W3C trace context, with request-scoped
  log context;
* :meth:`MicroService.run`: one ``AsyncExitStack``, SIGINT/SIGTERM → graceful stop (endpoints
  take no new requests and finish those received, within ``drain_timeout_s``; then the
  subclass's cleanup; then the connection drains), bounded in a service process by
  ``stop_timeout_s`` (:mod:`shared.stopping`). A stop during the start-up ends it at once; a
  start-up that loses its NATS server stops what had started and raises
  :class:`StartUpLost` (the process exits for a restart: shared/servicemain.py).

Subclasses override :meth:`MicroService.endpoints` and optionally :meth:`MicroService.setup`
(subscriptions, KV buckets, background tasks; register their cleanup on the stack) and
:meth:`MicroService.serving` (what may only be announced once the endpoints answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig, StreamInfo
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request, ServiceError
from nats.micro.service import SEMVER_REGEX, Service, ServiceConfig
from opentelemetry import trace
from pydantic import BaseModel

from shared.ids import InvalidInput, UnknownWorker, VertumnusError
from shared.logging import current_trace_id
from shared.microstart import BoundedStartService, flush_within
from shared.natsauth import security_options
from shared.natsclient import MALFORMED_HEADERS, connect
from shared.schemas import JSON, FirstToken, SchemaError, decode, encode
from shared.settings import ServiceSettings
from shared.stopping import handle_stop_signals
from shared.subjects import BUS_PROTOCOL, Subjects, validate_subject
from shared.tasks import cancel_and_wait, cancel_requested, finish_first
from shared.telemetry import extract, inject, is_sampled, traceparent_of, tracer

DEFAULT_QUEUE_GROUP: Final[str] = "q"
WORKER_LEASE_S: Final[float] = 10.0
"""Worker-state bucket TTL: a worker that stops heartbeating disappears after this long.
Readers should also treat a state whose ``heartbeat_s`` is older than their own lease as gone
(KV watchers are not told about TTL expiry)."""
EPOCH_HISTORY: Final[int] = 16
INTAKE_DUPLICATE_WINDOW_S: Final[float] = 120.0
RESULTS_STREAM_MAX_BYTES: Final[int] = 64 * 1024 * 1024
"""Server memory the results stream may hold (≈ 100k results of ~600 bytes)."""
RESULTS_KEPT_PER_REQUEST: Final[int] = 4
"""Results the results stream keeps per request id: the latest and a few before it, so that a
stray message on a request's result subject (bad input) does not displace its answer
(:func:`latest_result`: the latest that is a FirstToken of that request)."""
JETSTREAM_CHECK_S: Final[float] = 1.0
"""How often a service looks for a reconnect after which to ensure its JetStream assets."""
PROTOCOL_CHECK_WINDOW_S: Final[float] = 1.0
"""How long a service collects ``$SRV.PING`` answers once after its start to find services of
its prefix that speak another bus protocol (in the background: the start does not wait)."""
REPUBLISHED_HEADER: Final[str] = "Vtm-Republished"
"""Header of an intake message a gateway sent again because the server lost its store (the
intake stream was made anew): the request may have been dispatched before the loss, so a
scheduler asks the workers before placing it (value: why it was sent again)."""
START_CANCEL_AGAIN_S: Final[float] = 0.5
"""How often :meth:`MicroService.run` cancels again a start-up that a stop cancelled and that has
not ended yet: a cancel that lands as a nats-py request's reply arrives is swallowed
(shared/tasks.py), and one that lands in a step never cut short (a KV watch's making:
:meth:`KvWatch.start`) is held until that step ends."""
LOST_SERVER_ERRORS: Final = (
    nats.errors.TimeoutError,  # a request, a flush, a JetStream call unanswered
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,  # and UnexpectedEOF
    nats.errors.OutboundBufferLimitError,  # a publish while reconnecting, with no buffer
    nats.errors.NoServersError,
)
"""What nats-py raises for a step whose server went away (:func:`lost_server`)."""
_NAME_RE: Final[re.Pattern[str]] = re.compile(r"^[A-Za-z0-9_-]+$")

Reply = BaseModel | bytes | None
Handler = Callable[[Request], Awaitable[Reply]]
M = TypeVar("M")
T = TypeVar("T")

log = structlog.get_logger("vertumnus.service")


# -- error mapping ----------------------------------------------------------------------------


def error_code(exc: BaseException) -> str:
    """The micro error code for an exception (see the module table)."""
    if isinstance(exc, ServiceError):
        return exc.code
    if isinstance(exc, InvalidInput):
        return "400"
    if isinstance(exc, UnknownWorker):
        return "404"
    if isinstance(exc, (VertumnusError, KeyWrongLastSequenceError)):
        return "409"
    return "500"


class ReplyTooLarge(Exception):
    """A reply that may not be sent: over the server's ``max_payload`` with its headers
    (:func:`message_size`; the server would close the connection), or too large for
    :func:`respond_in_parts`. Answered in its place as micro error 500 ``reply too large``
    (the sizes go to the log only: the caller can do nothing with them)."""


def to_service_error(exc: BaseException) -> ServiceError:
    """A :class:`ServiceError` for ``exc``; 500s carry no internal details."""
    code = error_code(exc)
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, ReplyTooLarge):
        return ServiceError(code="500", description="reply too large")
    description = "internal error" if code == "500" else str(exc) or type(exc).__name__
    # Header values cannot hold line breaks; keep the description one line and bounded.
    description = " ".join(description.split())[:512]
    return ServiceError(code=code, description=description)


class RemoteError(VertumnusError):
    """A service answered with a micro error (``code`` as int, ``description``)."""

    def __init__(self, code: int, description: str, subject: str):
        super().__init__(f"{subject}: {code} {description}")
        self.code = code
        self.description = description
        self.subject = subject


class StartUpLost(VertumnusError):
    """A service's start-up failed because its NATS server was lost meanwhile: a request went
    unanswered, or the connection dropped (:meth:`MicroService.run`). Raised once what had
    started has stopped; a service process then exits with the status that asks its
    supervisor to start it again (:data:`shared.servicemain.RESTART_EXIT`), not a traceback."""


def lost_server(exc: BaseException, nc: Client | None) -> bool:
    """Whether ``exc``, raised by a step of a start-up on its own connection ``nc`` (made by
    that start-up; None: not made yet), says the server was lost: nats-py's timeout of a
    request, flush or JetStream call, a connection closed, reconnecting or stale
    (:data:`LOST_SERVER_ERRORS`); or any NATS or OS error once ``nc`` has lost its server (not
    connected now, or reconnected since it was made). Not so an error that a server which
    answers gives on a connection that never dropped (a JetStream API error, a bad subject, a
    file the setup cannot read): a restart would meet it again."""
    if nc is None:
        return False
    if isinstance(exc, LOST_SERVER_ERRORS):
        return True
    return isinstance(exc, (nats.errors.Error, OSError)) and (
        not nc.is_connected or nc.stats["reconnects"] > 0)


def raise_for_error(headers: Mapping[str, str] | None, subject: str) -> None:
    """Raise :class:`RemoteError` if a reply carries micro error headers."""
    if headers and ERROR_CODE_HEADER in headers:
        try:
            code = int(headers[ERROR_CODE_HEADER])
        except ValueError:
            code = 500
        raise RemoteError(code, headers.get(ERROR_HEADER, ""), subject)


async def call(
    nc: Client,
    subject: str,
    message: BaseModel | bytes,
    reply_type: type[M] | Any,
    *,
    timeout_s: float = 5.0,
    headers: Mapping[str, str] | None = None,
) -> M:
    """Request-reply to a micro endpoint with trace context; decode the reply or raise.

    Raises :class:`RemoteError` for a micro error reply, :class:`SchemaError` for a malformed
    reply, and nats' ``NoRespondersError`` / ``TimeoutError`` as they are.
    """
    if isinstance(message, BaseModel):
        payload, hdrs = encode(message)
    else:
        payload, hdrs = message, {}
    hdrs.update(headers or {})
    inject(hdrs)
    msg = await nc.request(subject, payload, timeout=timeout_s, headers=hdrs)
    raise_for_error(msg.headers, subject)
    return decode(reply_type, msg.data, msg.headers)  # type: ignore[no-any-return]


PART_HEADER: Final[str] = "Vtm-Part"
"""Header of each message of a reply sent in parts (:func:`respond_in_parts`): ``i/n``, the
part's number from 1 and how many there are."""
MAX_REPLY_PARTS: Final[int] = 1024
"""Most parts :func:`respond_in_parts` sends and :func:`request_in_parts` takes: a reply
announcing more is refused before anything is collected. With :data:`MAX_REPLY_BYTES` it
bounds a reply in parts: at the default ``max_payload`` (1 MiB) the bytes come first (33
parts), at a small one (1 KiB) the parts (about 1 MiB)."""
MAX_REPLY_BYTES: Final[int] = 32 * 1024 * 1024
"""Most payload bytes of a reply in parts (:func:`respond_in_parts` refuses to send more,
:func:`request_in_parts` to take more). Why 32 MiB: the parts go out as fast as the
responder writes them, without flow control, so the whole reply may wait in the server for
a requester that reads slower (a busy event loop reads nothing meanwhile); nats-server
closes a client whose pending bytes pass its ``max_pending`` -- 64 MiB by default -- as a
slow consumer, which loses every subscription of that connection, not only this reply (seen
with a 100 MiB reply). Half of it leaves the other half for what else the requester is sent
meanwhile. (A server configured with a smaller ``max_pending`` lowers what is safe; clients
cannot see it.)"""


async def respond_in_parts(nc: Client, request: Request, data: bytes,
                           headers: Mapping[str, str] | None = None) -> int:
    """Answer ``request`` with ``data``, in as many messages as the server's ``max_payload``
    needs; returns how many were sent. One message when it fits (exactly a plain
    ``respond``); else each part carries :data:`PART_HEADER` ``i/n`` and the first also
    ``headers``. The parts go out in order on one connection, so NATS delivers them in order
    (:func:`request_in_parts` reassembles them). A whole index of a worker's cache (tens of
    thousands of blocks) is more than one message may hold.

    Raises :class:`ReplyTooLarge`, having sent nothing, for a reply in parts of more than
    :data:`MAX_REPLY_BYTES` or :data:`MAX_REPLY_PARTS` parts, or whose ``headers`` leave no
    room for a part (a handler's raise is answered 500 ``reply too large``): the requester
    is never sent more than it can be sure to receive."""
    hdrs = dict(headers or {})
    if message_size(data, hdrs) <= nc.max_payload:
        await request.respond(data, headers=hdrs or None)
        return 1
    if len(data) > MAX_REPLY_BYTES:
        raise ReplyTooLarge(f"reply of {len(data)} bytes is over {MAX_REPLY_BYTES} bytes, "
                            f"the most sent in parts")
    # Room for the worst part header; the first part also carries ``headers``.
    widest = f"{MAX_REPLY_PARTS}/{MAX_REPLY_PARTS}"
    room = nc.max_payload - message_size(b"", {**hdrs, PART_HEADER: widest})
    if room <= 0:
        raise ReplyTooLarge(f"reply headers leave no room under max_payload {nc.max_payload}")
    n = -(-len(data) // room)
    if n > MAX_REPLY_PARTS:
        raise ReplyTooLarge(f"reply of {len(data)} bytes needs {n} parts, more than "
                            f"{MAX_REPLY_PARTS}")
    for i in range(n):
        part = data[i * room:(i + 1) * room]
        first = hdrs if i == 0 else {}
        await request.respond(part, headers={**first, PART_HEADER: f"{i + 1}/{n}"})
    return n


def _part_of(headers: Mapping[str, str] | None, subject: str) -> tuple[int, int]:
    """``(i, n)`` of a reply part's :data:`PART_HEADER`; ``(1, 1)`` without one."""
    value = (headers or {}).get(PART_HEADER)
    if value is None:
        return 1, 1
    i_s, _, n_s = value.partition("/")
    try:
        i, n = int(i_s), int(n_s)
    except ValueError:
        raise SchemaError("reply", PART_HEADER, f"{value!r} from {subject} is not i/n") from None
    if not 1 <= i <= n <= MAX_REPLY_PARTS:
        raise SchemaError("reply", PART_HEADER,
                          f"{value!r} from {subject} is not a part i/n with 1 <= i <= n <= "
                          f"{MAX_REPLY_PARTS}")
    return i, n


async def request_in_parts(
    nc: Client,
    subject: str,
    payload: bytes,
    *,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """Request-reply where the reply may come in parts (:func:`respond_in_parts`): the
    whole reply's bytes and the first message's headers. A micro error is raised as
    :class:`RemoteError`, also one in place of a later part (a responder that failed, or was
    stopped, half-way). ``timeout_s`` bounds the whole exchange. Raises nats'
    ``NoRespondersError`` / ``TimeoutError`` as ``nc.request`` does, and :class:`SchemaError`
    for parts out of order, a bad :data:`PART_HEADER`, or parts of more than
    :data:`MAX_REPLY_BYTES` in all. A reply without the header is one part, so this also
    talks to responders that answer plainly."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, payload, reply=inbox, headers=dict(headers or {}) or None)
        chunks: list[bytes] = []
        first: dict[str, str] = {}
        n = 1
        size = 0
        while True:
            msg = await sub.next_msg(timeout=max(0.001, deadline - loop.time()))
            if (not chunks and msg.headers and msg.headers.get("Status") == "503"
                    and not msg.data):
                raise nats.errors.NoRespondersError
            raise_for_error(msg.headers, subject)  # first or later: the error is the answer
            if not chunks:
                first = {k: v for k, v in (msg.headers or {}).items() if k != PART_HEADER}
            i, n_here = _part_of(msg.headers, subject)
            if (chunks and n_here != n) or i != len(chunks) + 1:
                raise SchemaError("reply", PART_HEADER,
                                  f"part {i}/{n_here} from {subject} after {len(chunks)} of {n}")
            n = n_here
            size += len(msg.data)
            if n > 1 and size > MAX_REPLY_BYTES:
                raise SchemaError("reply", PART_HEADER,
                                  f"parts from {subject} of more than {MAX_REPLY_BYTES} bytes")
            chunks.append(msg.data)
            if len(chunks) == n:
                return b"".join(chunks), first
    finally:
        with contextlib.suppress(nats.errors.ConnectionClosedError,
                                 nats.errors.BadSubscriptionError):
            await sub.unsubscribe()


async def until_served(nc: Client, subject: str, *, timeout_s: float = 30.0) -> None:
    """Return once a request on ``subject`` reaches a responder; raise ``TimeoutError`` if none
    does within ``timeout_s``.

    A micro service flushes its subscriptions before it reports itself started, yet nats-server
    (2.15) occasionally answers another connection's first request to a just-subscribed subject
    with "no responders"; an immediate retry succeeds (cf. nats-server#2876). Supervisors and
    tests that talk to a service they have just started wait here first. The probe is an empty
    request, which every endpoint rejects as a bad request (400) without side effects.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            await nc.request(subject, b"", timeout=max(0.1, deadline - loop.time()))
            return
        except nats.errors.NoRespondersError:
            if loop.time() >= deadline:
                raise TimeoutError(f"no responder on {subject} within {timeout_s} s") from None
            await asyncio.sleep(0.05)


async def every_answer(nc: Client, subject: str, *, prefix: str | None = None,
                       window_s: float = 0.5, flush: bool = True) -> list[dict[str, Any]]:
    """The JSON objects that answer a request on ``subject`` within ``window_s`` -- all of
    them, where nats-py's ``request`` returns the first (``$SRV.PING/INFO/STATS``: one per
    service instance) -- of this deployment only when ``prefix`` is given (their micro
    metadata ``prefix``). Answers that are not JSON objects are ignored. ``flush=False``
    leaves the request to nats-py's flusher instead of a round trip of its own (a check in
    the background should not hold a PING outstanding that a stop would then wait behind)."""
    inbox = nc.new_inbox()
    answers: list[dict[str, Any]] = []

    async def on_msg(msg: Msg) -> None:
        with contextlib.suppress(ValueError):
            info = json.loads(msg.data)
            if isinstance(info, dict):
                answers.append(info)

    sub = await nc.subscribe(inbox, cb=on_msg)
    try:
        await nc.publish(subject, b"", reply=inbox)
        if flush:
            await nc.flush()
        await asyncio.sleep(window_s)
    finally:
        await sub.unsubscribe()
    if prefix is not None:
        answers = [a for a in answers
                   if isinstance(m := a.get("metadata"), dict) and m.get("prefix") == prefix]
    return answers


# -- JetStream resources (one definition, so every service creates them identically) ----------


async def ensure_key_value(
    js: JetStreamContext,
    bucket: str,
    *,
    history: int = 1,
    ttl_s: float | None = None,
    description: str | None = None,
) -> KeyValue:
    """Bind to ``bucket``, creating it if missing (an existing bucket's config is kept)."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    # Two processes may race here; creating with an identical config is idempotent.
    return await js.create_key_value(
        bucket=bucket, history=history, ttl=ttl_s, description=description
    )


async def bucket_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """The keys holding a value or a delete marker in KV ``bucket`` (sorted), from its stream's
    per-subject state -- not ``KeyValue.keys()``, whose watcher can end its initial replay
    early and answer with a partial or empty list (nats-py issue 842). Raises what
    ``stream_info`` raises (NotFoundError: no bucket)."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    return sorted(s[len(prefix):] for s in (info.state.subjects or {}))


async def worker_state_kv(
    js: JetStreamContext, subjects: Subjects, *, lease_s: float = WORKER_LEASE_S
) -> KeyValue:
    """The worker-state bucket (WorkerState per worker id, TTL = liveness lease)."""
    return await ensure_key_value(
        js, subjects.worker_state_bucket(), ttl_s=lease_s, description="vertumnus worker state"
    )


async def epoch_kv(js: JetStreamContext, subjects: Subjects) -> KeyValue:
    """The epoch bucket (EpochRecord under ``subjects.epoch_key()``, compare-and-set)."""
    return await ensure_key_value(
        js, subjects.epoch_bucket(), history=EPOCH_HISTORY, description="vertumnus epochs"
    )


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> StreamInfo:
    """The stream ``config.name`` as it exists, else created with ``config`` (an existing one
    is kept as it is: every replica of every service may call this at start)."""
    assert config.name is not None
    try:
        return await js.stream_info(config.name)
    except NotFoundError:
        return await js.add_stream(config)


async def ensure_intake_stream(
    js: JetStreamContext,
    subjects: Subjects,
    *,
    duplicate_window_s: float = INTAKE_DUPLICATE_WINDOW_S,
) -> StreamInfo:
    """The durable intake work-queue stream (``Nats-Msg-Id`` de-duplication window)."""
    return await _ensure_stream(js, StreamConfig(
        name=subjects.intake_stream(),
        subjects=[subjects.intake_requests()],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        duplicate_window=duplicate_window_s,
    ))


async def ensure_results_stream(
    js: JetStreamContext,
    subjects: Subjects,
    *,
    max_age_s: float = INTAKE_DUPLICATE_WINDOW_S,
) -> StreamInfo:
    """The stream that keeps each request's latest FirstTokens (``{prefix}.result.<id>``, up
    to :data:`RESULTS_KEPT_PER_REQUEST`) for ``max_age_s``: as long as the intake
    de-duplicates a re-sent request id, so a retry that
    the intake drops as a duplicate can still be answered after the original's result went
    by, and a gateway that was cut off from NATS when a result went by finds it there
    (:func:`publish_result` stores every result before it counts as sent). On file, like the
    intake: it outlives a server restart."""
    return await _ensure_stream(js, StreamConfig(
        name=subjects.results_stream(),
        subjects=[subjects.result_all()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=max_age_s,
        max_msgs_per_subject=RESULTS_KEPT_PER_REQUEST,
        max_bytes=RESULTS_STREAM_MAX_BYTES,  # the oldest go first past it (a bound, not a goal)
    ))


async def kept_results(js: JetStreamContext, subjects: Subjects, request_id: str) -> list[Any]:
    """Every message the results stream keeps for ``request_id``, oldest first (at most
    :data:`RESULTS_KEPT_PER_REQUEST`; none: empty). For a reader whose latest one
    (``get_last_msg``) is no result of that request. Raises what JetStream raises, except
    NotFoundError (the end)."""
    out: list[Any] = []
    seq = 1
    for _ in range(RESULTS_KEPT_PER_REQUEST):
        try:
            msg = await js.get_msg(subjects.results_stream(), seq=seq,
                                   subject=subjects.result(request_id), next=True)
        except NotFoundError:
            break
        out.append(msg)
        seq = int(msg.seq) + 1
    return out


def message_size(data: bytes, headers: Mapping[str, str] | None = None) -> int:
    """The bytes of a message the NATS server checks against its ``max_payload``: the payload
    and the headers block as nats-py writes it (``NATS/1.0``, one ``key: value`` line each, the
    blank line; keys and values stripped). nats-py's own check counts the payload alone, and a
    message the server then finds too large costs the connection: the server answers
    ``-ERR 'Maximum Payload Violation'`` and closes it, and nats-py does not reconnect after
    that error."""
    if not headers:
        return len(data)
    size = len(b"NATS/1.0\r\n\r\n")
    for k, v in headers.items():
        size += len(k.strip().encode()) + len(b": ") + len(v.strip().encode()) + len(b"\r\n")
    return len(data) + size


def first_token_of(request_id: str, msg: Any) -> FirstToken:
    """The FirstToken of ``request_id`` in a message of its result subject (``.data``,
    ``.headers``). Anything else published there -- bytes that do not decode, or another
    request's result -- raises :class:`SchemaError` (field ``request_id`` for the latter):
    bad input, which must neither answer nor finish that request."""
    result = decode(FirstToken, msg.data, msg.headers)
    if result.request_id != request_id:
        raise SchemaError("FirstToken", "request_id",
                          f"it is the result of request {result.request_id!r}")
    return result


async def latest_result(
    js: JetStreamContext,
    subjects: Subjects,
    request_id: str,
    *,
    on_bad: Callable[[SchemaError], None] | None = None,
    accept: Callable[[FirstToken], bool] | None = None,
) -> tuple[FirstToken, int] | None:
    """The latest FirstToken of ``request_id`` the results stream keeps, and its stream
    sequence; None when it keeps none. Messages kept there that are no FirstToken of that
    request (:func:`first_token_of`) are passed over for the latest one before them that is;
    ``on_bad`` hears of the latest message only when it is such (once per read, not for
    every earlier one). ``accept``: only a FirstToken it accepts counts (the others -- say,
    an earlier attempt's under the same id -- are passed over too, silently). Raises what
    JetStream raises: NotFoundError when the stream keeps nothing for the request, or when
    the stream itself is missing (``err_code``)."""
    kept = await js.get_last_msg(subjects.results_stream(), subjects.result(request_id))
    try:
        result = first_token_of(request_id, kept)
    except SchemaError as exc:
        if on_bad is not None:
            on_bad(exc)
    else:
        if accept is None or accept(result):
            return result, int(kept.seq)
    for earlier in reversed(await kept_results(js, subjects, request_id)):
        try:
            result = first_token_of(request_id, earlier)
        except SchemaError:
            continue
        if accept is None or accept(result):
            return result, int(earlier.seq)
    return None


async def publish_result(nc: Client, subject: str, data: bytes, headers: dict[str, str], *,
                         timeout_s: float = 2.0, within_s: float = 30.0,
                         log: Any = None) -> bool:
    """Publish a FirstToken so that it is not lost to a broker blip: as a JetStream publish,
    which the waiting gateway receives like any message and the results stream stores,
    sent again (after the connection is back) until the stream acknowledges it, for up to
    ``within_s``. A repeat may reach the gateway twice; a result is idempotent there.
    Returns False (after a warning through ``log``) when it was never acknowledged."""
    js = nc.jetstream()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        try:
            await js.publish(subject, data, headers=headers, timeout=timeout_s)
            return True
        except (nats.errors.Error, TimeoutError) as exc:
            if loop.time() >= deadline or nc.is_closed:
                if log is not None:
                    log.warning("result not stored by the results stream", subject=subject,
                                error=f"{type(exc).__name__}: {exc}")
                return False
        while not nc.is_connected and not nc.is_closed and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)


# -- continuous pull from a durable consumer --------------------------------------------------


class PullConsumer:
    """Messages of a durable JetStream pull consumer, each handed to ``handler`` on arrival.

    Why not nats-py's ``PullSubscription.fetch(batch, timeout)``: once a lingering pull has
    delivered one message, ``fetch`` keeps waiting for the rest of the batch (or a status
    that ends the pull, or its timeout) before returning *any*; and a pull it gave up on
    stays on the server and takes the next messages, which the next ``fetch`` then holds
    until its own timeout. A request arriving in such a moment waited hundreds of
    milliseconds in the client while the consumer loop was idle.

    Here up to ``batch`` deliveries are requested at any time (pull requests of
    ``expires_s``; a new one for the difference whenever fewer than half are outstanding) and
    every message goes to ``handler`` as it arrives, in delivery order, one at a time:
    ``handler`` is awaited before the next message, so a handler that waits (e.g. for a free
    slot) is the back-pressure. A pull ends with a 404/408/409 status that says how many of
    its deliveries were left (``Nats-Pending-Messages``); should that status never come (a
    reconnect), the credit is given up ``grace_s`` after the latest pull expired and a new
    pull is sent. Messages keep their JetStream reply subject: ``ack``/``nak``/``term`` and
    ``metadata`` work as on fetched ones.

    ``start`` subscribes and sends the first pull; ``stop`` sends no more pulls, removes the
    interest (the server drops pulls nobody listens to) and hands back, with a NAK (at once
    redeliverable, e.g. to another replica), every delivery already received but not yet
    handed over; the one being handled is finished first. The consumer must exist.
    """

    def __init__(
        self,
        nc: Client,
        *,
        stream: str,
        consumer: str,
        handler: Callable[[Any], Awaitable[None]],
        batch: int = 16,
        expires_s: float = 2.0,
        grace_s: float = 0.5,
        api_prefix: str = "$JS.API",
    ) -> None:
        if batch < 1:
            raise InvalidInput(f"pull batch must be >= 1, got {batch}")
        if expires_s <= 0 or grace_s <= 0:
            raise InvalidInput(f"expires_s and grace_s must be > 0, got {expires_s}, {grace_s}")
        self._nc = nc
        for name in (stream, consumer):
            if not _NAME_RE.match(name):
                raise InvalidInput(f"stream/consumer name {name!r} must match {_NAME_RE.pattern}")
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._handler = handler
        self._batch = batch
        self._expires_s = expires_s
        self._grace_s = grace_s
        # Each pull asks for the same expiry (ns; a little less than the client's view so the
        # server's status comes before our fallback).
        self._expires_ns = int(expires_s * 1e9)
        self._outstanding = 0
        self._expiry = 0.0  # loop time the latest pull expires
        self._busy = False
        self._stopping = False
        self._inbox = ""
        self._sub: Any = None
        self._timer: asyncio.Task[None] | None = None
        self.pulls = 0  # pull requests sent (for tests and status)

    async def start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_msg)
        await self._pull()
        self._timer = asyncio.create_task(self._fallback(), name="pull-fallback")

    async def stop(self, timeout_s: float = 30.0) -> None:
        """See the class docstring. Bounded: the hand-back (and the delivery being handled)
        gets ``timeout_s``, and is given up as soon as the connection is lost -- no NAK can
        reach the server then (the deliveries come again after ``ack_wait``), and nats-py's
        drain would wait for a PONG that never comes (:func:`while_connected`)."""
        self._stopping = True
        if self._sub is not None:
            # Unsubscribe before anything can yield, then let the callback NAK what is queued
            # (see _on_msg). The order matters: a NAK the server sees while this inbox still
            # has interest is redelivered to this consumer's own open pull request, and the
            # delivery is then stuck until ack_wait instead of going to the next consumer.
            # drain() queues the UNSUB synchronously, ahead of any NAK the callback sends.
            try:
                drained, _ = await while_connected(self._nc, self._sub.drain(),
                                                   timeout_s=timeout_s)
            except Exception:  # closed or draining connection: nothing left to hand back
                drained = False
            if not drained:
                await forget_subscription(self._nc, self._sub)
        if self._timer is not None:
            await cancel_and_wait([self._timer], log)

    async def _pull(self) -> None:
        n = self._batch - self._outstanding
        if n <= 0:
            return
        self._outstanding += n
        self._expiry = asyncio.get_running_loop().time() + self._expires_s
        self.pulls += 1
        body = b'{"batch":%d,"expires":%d}' % (n, self._expires_ns)
        try:
            await self._nc.publish(self._next_subject, body, reply=self._inbox)
        except Exception as exc:  # closed/reconnecting: the fallback pulls again
            self._outstanding -= n
            log.warning("pull request not sent", error=repr(exc))

    async def _on_msg(self, msg: Any) -> None:
        hdrs = msg.headers
        status = hdrs.get("Status") if hdrs and not msg.data else None
        if status is None and self._stopping:
            with contextlib.suppress(Exception):
                await msg.nak()
            return
        if status is None:
            self._outstanding = max(0, self._outstanding - 1)
            self._busy = True
            try:
                await self._handler(msg)
            finally:
                self._busy = False
        elif status != "100":  # 100: idle heartbeat / flow control (not asked for)
            left = hdrs.get("Nats-Pending-Messages")
            if left is not None and left.isdigit():
                self._outstanding = max(0, self._outstanding - int(left))
            else:  # a pull refused as a whole (409 …); the fallback re-pulls after grace
                if status not in ("404", "408"):
                    log.warning("pull request ended", status=status,
                                description=hdrs.get("Description", ""))
                return
        if self._outstanding <= self._batch // 2 and not self._stopping:
            await self._pull()

    async def _fallback(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.05, self._expiry + self._grace_s - loop.time()))
            if (not self._busy and not self._stopping
                    and loop.time() >= self._expiry + self._grace_s):
                # Every pull sent has expired and its status never came: start afresh.
                self._outstanding = 0
                await self._pull()


# -- endpoints and the service base ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One endpoint: ``name`` (micro name), subject = ``group.subject`` (default name), or
    ``subject`` as given when ``absolute`` (for subjects outside the service's group, e.g. a
    worker's ``vtm.cache.cmd.{wid}``)."""

    name: str
    handler: Handler
    subject: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    absolute: bool = False

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise InvalidInput(f"endpoint name {self.name!r} must match {_NAME_RE.pattern}")
        if self.subject is not None:
            validate_subject(self.subject)
        elif self.absolute:
            raise InvalidInput(f"endpoint {self.name!r}: an absolute endpoint needs a subject")


STOPPING_CODE: Final[str] = "503"
STOPPING_DESCRIPTION: Final[str] = "service stopping"
"""The micro error of a request its service gave up when stopping (:func:`stop_micro_service`):
not handled, or not to the end; another replica may take it."""


def _reply_subject(request: Request) -> str:
    """Where ``request`` is to be answered; empty for a plain publish. (nats.micro keeps the
    message private: ``Request`` has no public view of its reply subject.)"""
    return str(getattr(getattr(request, "_msg", None), "reply", "") or "")


async def _answer_stopping(nc: Client, reply: str) -> None:
    """Answer the request of reply subject ``reply`` with micro error 503
    :data:`STOPPING_DESCRIPTION`, so that its caller need not wait out its timeout; nothing
    on a connection not connected (nothing could reach the caller now). Never raises but
    CancelledError."""
    if reply and nc.is_connected:
        with contextlib.suppress(Exception):
            await nc.publish(reply, b"", headers={ERROR_HEADER: STOPPING_DESCRIPTION,
                                                  ERROR_CODE_HEADER: STOPPING_CODE})


async def _respond(request: Request, reply: Reply) -> None:
    """Send a handler's ``reply`` (nothing for None), encoded; raises :class:`ReplyTooLarge`
    -- sending nothing -- when it does not fit the server's ``max_payload`` with its headers:
    nats-py checks the payload alone, and the server closes the connection of a client that
    sends more (``Maximum Payload Violation``), for good."""
    if isinstance(reply, BaseModel):
        data, headers = encode(reply)
    elif isinstance(reply, (bytes, bytearray)):
        data, headers = bytes(reply), {}
    else:
        return
    limit = request._msg._client.max_payload  # the connection the request came on
    if (size := message_size(data, headers)) > limit:
        raise ReplyTooLarge(f"reply of {size} bytes with its headers is over the server's "
                            f"max_payload {limit}")
    await request.respond(data, headers=headers or None)


def wrap_handler(service_name: str, endpoint: Endpoint) -> Callable[[Request], Awaitable[None]]:
    """Adapt a typed handler to nats.micro: span, log context, encoding, error mapping.

    Everything of a request -- its headers checked, the handler, the reply encoded, sized
    and sent -- goes through the module's error mapping: whatever fails is answered as a
    micro error with a code and no internals, and the connection is never put at risk (a
    reply too large is not sent). A request without a reply subject (a plain publish) is
    handled and its failure logged, but nothing is answered (there is nobody to answer;
    nats.micro's own error answer would fail). A handler cancelled -- its service's stop
    gave up waiting for it (:func:`stop_micro_service`) or its connection closes -- answers
    503 :data:`STOPPING_DESCRIPTION` first (after a reply the handler sent itself, say part
    of one, the caller may see that error too)."""
    span_name = f"{service_name}.{endpoint.name}"

    async def handle(request: Request) -> None:
        headers = request.headers
        reply_to = _reply_subject(request)
        span_cm: contextlib.AbstractContextManager[trace.Span]
        if traceparent_of(headers) is not None and not is_sampled(headers):
            # An unsampled caller (the usual case at a low ratio; every descendant is dropped
            # by the ParentBased sampler): no span object, its context is current instead, so
            # what the handler injects downstream carries the same decision.
            span_cm = trace.use_span(trace.get_current_span(extract(headers)),
                                     end_on_exit=False, record_exception=False,
                                     set_status_on_exception=False)
        else:
            span_cm = tracer().start_as_current_span(
                span_name,
                context=extract(headers),
                kind=trace.SpanKind.SERVER,
                attributes={"messaging.destination.name": request.subject},
            )
        with span_cm as span:
            # The trace id on every log line of the handler (conventions.md: bound per message);
            # a handler that knows its request id binds that too (shared.logging.bind_request).
            tid = current_trace_id()
            with structlog.contextvars.bound_contextvars(
                    endpoint=endpoint.name, **({"trace_id": tid} if tid is not None else {})):
                try:
                    if headers and MALFORMED_HEADERS in headers:
                        # Its trace context, content type, ... are lost: nothing to go on.
                        raise InvalidInput(
                            f"malformed header block ({headers[MALFORMED_HEADERS]})")
                    reply = await endpoint.handler(request)
                    if reply_to:
                        await _respond(request, reply)
                except asyncio.CancelledError:
                    await _answer_stopping(request._msg._client, reply_to)
                    raise
                except Exception as exc:
                    err = to_service_error(exc)
                    span.set_attribute("vtm.error_code", err.code)
                    if err.code == "500":
                        span.record_exception(exc)
                        span.set_status(trace.Status(trace.StatusCode.ERROR))
                        if isinstance(exc, ReplyTooLarge):  # no traceback: says it all
                            log.error("reply too large", subject=request.subject,
                                      reason=str(exc))
                        else:
                            log.exception("handler failed", subject=request.subject)
                    else:
                        log.info("request rejected", code=err.code, reason=err.description)
                    if not reply_to:
                        return
                    # nats.micro answers a raised ServiceError and counts it in STATS.
                    raise err from exc

    return handle


def request_model(request: Request, model: type[M] | Any) -> M:
    """Decode a micro request body into ``model`` (SchemaError → 400 via the wrapper)."""
    return decode(model, request.data, request.headers)  # type: ignore[no-any-return]


def optional_request_model(request: Request, model: type[M] | Any) -> M:
    """As :func:`request_model`, but a body that is empty or only white space stands for
    ``model()`` (every field at its default): for an endpoint whose query may be left out,
    e.g. ``inspect`` asked with no body by ``nats req ... ''``."""
    if not request.data.strip():
        return model()  # type: ignore[no-any-return]
    return request_model(request, model)


class MicroService:
    """Base of every vertumnus service process. See the module docstring.

    Construction validates name, version, group and queue group and touches no network.
    """

    def __init__(
        self,
        settings: ServiceSettings,
        *,
        name: str,
        version: str,
        group: str,
        description: str = "",
        queue_group: str = DEFAULT_QUEUE_GROUP,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if not _NAME_RE.match(name):
            raise InvalidInput(f"service name {name!r} must match {_NAME_RE.pattern}")
        if not SEMVER_REGEX.match(version):
            raise InvalidInput(f"service version {version!r} is not semver")
        validate_subject(group)
        if not queue_group or " " in queue_group:
            raise InvalidInput(f"bad queue group {queue_group!r}")
        self.settings = settings
        self.subjects: Subjects = settings.subjects
        self.name = name
        self.version = version
        self.group = group
        self.description = description
        self.queue_group = queue_group
        # NOTE: nats.micro keeps a reference to this very dict (we pass it non-empty), so
        # set_metadata() changes what $SRV.PING/INFO report without restarting the service.
        # ``protocol`` is the bus contract this process speaks (shared.subjects.BUS_PROTOCOL),
        # for `vertumnus status` to find a deployment mixing releases that cannot talk.
        self._metadata: dict[str, str] = {"prefix": self.subjects.prefix,
                                          "protocol": BUS_PROTOCOL, **(metadata or {})}
        self._nc: Client | None = None
        self._service: Service | None = None
        self._stop = asyncio.Event()
        self._started = asyncio.Event()
        # The start-up lost its server (run): what started stops without round trips.
        self._start_lost = False
        # Checks the JetStream keeper has completed (read-only; for tests, which wait on it
        # instead of sleeping a number of check periods). Stays 0 without a keeper.
        self.jetstream_checks = 0
        # The services of this prefix found speaking another bus protocol once started
        # ("name id" -> their protocol, "none" before protocols), set when the check is done.
        self.peer_protocols: dict[str, str] = {}
        self.protocols_checked = asyncio.Event()
        self.log = structlog.get_logger(f"vertumnus.{name}")

    # -- overridables -------------------------------------------------------------------------

    def endpoints(self) -> Sequence[Endpoint]:
        """The endpoints to add under :attr:`group` (override)."""
        return ()

    def stats_data(self) -> dict[str, Any] | None:
        """The service's own counters, JSON-able, reported as every endpoint's ``data`` in
        ``$SRV.STATS`` (``nats micro stats NAME``: one answer per replica, where an endpoint
        request reaches only one); None (the default) reports none (override)."""
        return None

    def connect_options(self) -> dict[str, Any]:
        """Further ``nats.connect`` options of the connection :meth:`start` makes (override;
        none by default): e.g. the gateway's ``pending_size=0``. Not used for a connection
        handed to :meth:`start`."""
        return {}

    async def setup(self, stack: AsyncExitStack) -> None:
        """Called after connecting and before endpoints are added (override).

        Register cleanup with ``stack``; it runs before the connection drains.
        """

    async def serving(self) -> None:
        """Called once the endpoints are reachable, before the service counts as started
        (override). What sends others to this service's endpoints -- a rank daemon's
        EpochAck and first WorkerState -- goes out here, not in :meth:`setup`: from there it
        would reach them before the endpoints exist, and their requests would meet "no
        responders"."""

    async def ensure_jetstream(self) -> None:
        """Make what this service needs of JetStream -- streams, KV buckets, consumers, and
        records that only it writes -- where missing; idempotent (override; none by default).

        A service calls it from :meth:`setup`; :meth:`start` calls it again after every
        reconnect (every ``JETSTREAM_CHECK_S`` until it succeeds), so a server that comes
        back *without* its store (no persistent volume, a new node) gets them back and the
        system serves again; otherwise every publish to a stream lost with the store would
        fail for as long as the processes live. A server that kept its store has them all.
        """

    # -- accessors ----------------------------------------------------------------------------

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise RuntimeError("service not started")
        return self._nc

    def jetstream(self, timeout_s: float | None = None) -> JetStreamContext:
        """A JetStream context on :attr:`nc` whose requests time out after ``timeout_s``
        (None: the ``jetstream_timeout_s`` setting)."""
        return self.nc.jetstream(
            timeout=self.settings.jetstream_timeout_s if timeout_s is None else timeout_s)

    @property
    def service(self) -> Service:
        if self._service is None:
            raise RuntimeError("service not started")
        return self._service

    @property
    def started(self) -> asyncio.Event:
        """Set once every endpoint is subscribed (tests and supervisors wait on it)."""
        return self._started

    @property
    def metadata(self) -> Mapping[str, str]:
        return dict(self._metadata)

    def set_metadata(self, **values: str) -> None:
        """Update micro metadata (e.g. ``epoch="7"``) as seen by ``$SRV.PING/INFO``."""
        self._metadata.update({k: str(v) for k, v in values.items()})

    def count_endpoint_error(self, endpoint: str, err: ServiceError) -> None:
        """Count ``err`` in endpoint ``endpoint``'s ``$SRV.STATS`` (``num_errors`` + 1,
        ``last_error``) as nats.micro counts an error its handler raised, for an error answered
        *outside* the handler: by a task the handler started (``Request.respond_error`` counts
        nothing). Call it before responding, so a caller that reads the stats after its answer
        sees the count. Unknown endpoint, or the service not started: nothing is counted.

        NOTE: nats.micro (nats-py 2.x) keeps the counters only privately on its Endpoint and
        offers no way to add to them; this writes them as its own ``_handle_request`` does
        (``last_error`` = ``repr(err)``, e.g. ``"504:no first token ..."``)."""
        for ep in getattr(self._service, "_endpoints", None) or ():
            if getattr(ep, "_name", None) == endpoint:
                ep._num_errors += 1
                ep._last_error = repr(err)
                return

    @property
    def stopping(self) -> bool:
        """True once a stop was requested (the service may still be draining)."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Ask :meth:`run` to shut down gracefully (what SIGINT/SIGTERM do)."""
        self._stop.set()

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, stack: AsyncExitStack, nc: Client | None = None) -> None:
        """Connect (unless ``nc`` is given; then the caller owns it), run :meth:`setup`, add the
        micro service and its endpoints, then run :meth:`serving`. Everything started is undone
        by ``stack``."""
        if nc is None:
            nc = await connect(
                servers=self.settings.nats_servers,
                name=f"{self.name}:{self.settings.instance_id or ''}",
                connect_timeout=self.settings.connect_timeout_s,
                # One dict, so that a service's own option overrides the common ones (as
                # separate keyword sets a repeated key would be a TypeError at start).
                **{**reconnect_options(self.settings), **security_options(self.settings),
                   # Our own drain, or the close after a start-up that lost its server.
                   **nats_callbacks(self.log, lambda: self._stop.is_set() or self._start_lost),
                   **self.connect_options()},
            )
            stack.push_async_callback(self._drain, nc)
        self._nc = nc
        await self.setup(stack)
        service = BoundedStartService(
            nc,
            ServiceConfig(
                name=self.name,
                version=self.version,
                description=self.description or None,
                metadata=self._metadata,
                queue_group=self.queue_group,
                stats_handler=lambda _endpoint: self.stats_data(),
            ),
            # nats.micro's own flush, bounded as the start-up's other round trips are.
            flush_timeout_s=self.settings.connect_timeout_s,
        )
        try:
            await service.start()
        except BaseException:
            # Given up (its flush unanswered, or a stop's cancel): the PING/INFO/STATS
            # subscriptions it made are taken back, without a round trip (the server may not
            # answer) -- else a service that never started would answer discovery for as long
            # as the connection lives (one handed in lives on).
            await forget_micro_service(nc, service)
            raise
        self._service = service
        # Bounded, and without round trips once the server is gone (stop_micro_service).
        stack.push_async_callback(self._stop_micro, nc, self._service)
        if type(self).ensure_jetstream is not MicroService.ensure_jetstream:
            keeper = asyncio.create_task(self._keep_jetstream(nc), name=f"{self.name}-jetstream")
            stack.push_async_callback(cancel_and_wait, [keeper], self.log)
        group = self._service.add_group(name=self.group, queue_group=self.queue_group)
        for ep in self.endpoints():
            target = self._service if ep.absolute else group
            await target.add_endpoint(
                name=ep.name,
                subject=ep.subject or ep.name,
                handler=wrap_handler(self.name, ep),
                metadata=dict(ep.metadata) or None,
                queue_group=self.queue_group,
            )
        # Bounded as the start-up's other plain round trips are (the connection's first PING,
        # the micro service's flush, the $SRV.PING below), not by nats-py's own 10 s, which no
        # setting changes.
        await flush_within(nc, self.settings.connect_timeout_s, step="adding the endpoints")
        # nats-server sometimes answers another connection's first request to a just-subscribed
        # subject with "no responders" although the SUB was flushed (~1 in 300 starts under
        # load); one request round trip to our own PING endpoint closes that window (0 in
        # 10,000 starts in a repro), so "started" means reachable.
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await nc.request(
                f"$SRV.PING.{self.name}.{self._service.id}",
                b"",
                timeout=self.settings.connect_timeout_s,
            )
        await self.serving()
        self._started.set()
        self.log.info("service started", id=self._service.id, group=self.group)
        checker = asyncio.create_task(self._check_peer_protocols(nc),
                                      name=f"{self.name}-protocols")
        stack.push_async_callback(cancel_and_wait, [checker], self.log)

    async def run(self, nc: Client | None = None, *, handle_signals: bool = True) -> None:
        """Start, serve until :meth:`request_stop` or SIGINT/SIGTERM, then stop gracefully.

        A stop during the start-up (which may be waiting for its server) ends it at once:
        it is cancelled -- a step never cut short, a KV watch's making, ends first -- what it
        started stops, and ``run`` returns. A start-up on the service's own connection (no
        ``nc``) that fails because its NATS server was lost (:func:`lost_server`: a request
        unanswered, the connection dropped) logs one error naming that, stops what had started
        -- without round trips, which nothing would answer -- and raises
        :class:`StartUpLost`; one that fails so as the stop comes (the server and the
        service told to stop at once, as when ``vertumnus up`` is killed) is a stop. With
        ``nc`` given its owner decides what a loss means (a rank host starts its worker
        again): the error is raised as it is."""
        async with AsyncExitStack() as stack:
            if handle_signals:
                handle_stop_signals(stack, self._stop)
            try:
                started = await self._start_unless_stopped(stack, nc)
            except Exception as exc:
                if nc is not None or not lost_server(exc, self._nc):
                    raise
                self._start_lost = True  # read by the stack's undoing (_drain, _stop_micro)
                if self._stop.is_set():
                    self.log.info("start-up ended by its NATS server's loss while stopping",
                                  error=f"{type(exc).__name__}: {exc}")
                    return
                self.log.error(f"{self.name} did not start: its NATS server was lost during "
                               "the start-up; stopping what started and exiting for a restart",
                               error=f"{type(exc).__name__}: {exc}")
                raise StartUpLost(f"{self.name}: NATS server lost during the start-up: "
                                  f"{exc!r}") from exc
            if not started:
                self.log.info("service stopped before it had started")
                return
            await self._stop.wait()
            self.log.info("service stopping")
        self._started.clear()

    async def _start_unless_stopped(self, stack: AsyncExitStack, nc: Client | None) -> bool:
        """:meth:`start` unless a stop comes first: True once it finished (its error raised),
        False when the stop ended it -- cancelled, and cancelled again until it has ended
        (:data:`START_CANCEL_AGAIN_S`). Why not :func:`~shared.tasks.unless_stopped`: a start
        holding its cancel for a step never cut short (a KV watch's making, up to a JetStream
        timeout) would be warned of every second, then given up while still running. It has
        always ended on return, also when ``run`` itself is cancelled meanwhile (that cancel
        is raised once it has): nothing of it is left running, what it made is the stack's."""
        work = asyncio.create_task(self.start(stack, nc), name=f"{self.name}-start")
        stopped = asyncio.ensure_future(self._stop.wait())
        cancelled = False
        try:
            await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            cancelled = True
        stopped.cancel()
        while not work.done():  # a stop (or run cancelled): end the start-up
            work.cancel()
            try:
                await asyncio.wait({work}, timeout=START_CANCEL_AGAIN_S)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            if not work.cancelled():
                work.exception()  # retrieved: superseded by the cancel
            raise asyncio.CancelledError
        if work.cancelled():
            return False
        work.result()  # raises what the start raised
        return True

    async def stop_listening(self, tasks: Iterable[asyncio.Task[Any]],
                             watches: Iterable[KvWatch],
                             subs: Iterable[Subscription | None]) -> None:
        """The end of a :meth:`setup`'s teardown: cancel ``tasks`` and wait for them
        (:func:`~shared.tasks.cancel_and_wait`, which logs any that will not end), then stop
        each of ``watches`` and unsubscribe each of ``subs`` (None: a subscription the setup
        did not make). Never raises but CancelledError.

        The tasks go first, as they read the watches and the state the subscriptions' callbacks
        keep. A watch or subscription that fails to stop is passed over without a word: at a
        stop the connection may be gone already, and the others must still be stopped."""
        await cancel_and_wait(tasks, self.log)  # re-cancels (shared/tasks.py)
        for watch in watches:
            with contextlib.suppress(Exception):
                await watch.stop()
        for sub in subs:
            if sub is None:
                continue
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _keep_jetstream(self, nc: Client) -> None:
        """:meth:`ensure_jetstream` after each reconnect, until it succeeds."""
        done = told = nc.stats["reconnects"]
        while True:
            await asyncio.sleep(JETSTREAM_CHECK_S)
            try:
                reconnects = nc.stats["reconnects"]
                if reconnects == done or not nc.is_connected:
                    continue
                try:
                    await self.ensure_jetstream()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # JetStream not ready yet (recovering): next check
                    if told != reconnects:  # once per reconnect (it may take a while)
                        told = reconnects
                        self.log.info("jetstream assets not ensured yet", error=repr(exc))
                    continue
                done = told = reconnects
                self.log.info("jetstream assets ensured after a reconnect")
            finally:
                self.jetstream_checks += 1

    async def _check_peer_protocols(self, nc: Client) -> None:
        """Once, after the start: warn when services of this prefix speak another bus protocol
        (their ``$SRV.PING`` metadata ``protocol``, :data:`shared.subjects.BUS_PROTOCOL`;
        none: a release older than protocols). That is a deployment upgraded one service at a
        time across a change of the bus contract, whose services do not understand each other
        (README, "Upgrading"): said at the start of the newcomer, where an operator looks.
        Only a check -- a failure to ask is logged at debug level and the service goes on."""
        try:
            if self._stop.is_set():
                return  # stopping already: nobody to tell
            answers = await every_answer(nc, "$SRV.PING", prefix=self.subjects.prefix,
                                         window_s=PROTOCOL_CHECK_WINDOW_S, flush=False)
            mine = self._service.id if self._service is not None else None
            for a in answers:
                if a.get("id") == mine:
                    continue
                meta = a.get("metadata")
                theirs = str(meta.get("protocol", "none")) if isinstance(meta, dict) else "none"
                if theirs != BUS_PROTOCOL:
                    self.peer_protocols[f"{a.get('name', '?')} {a.get('id', '?')}"] = theirs
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a check, not the service's work (a server gone, say)
            self.log.debug("bus protocols of the other services not checked", error=repr(exc))
            return
        finally:
            self.protocols_checked.set()
        if self.peer_protocols:
            self.log.warning(
                "services of this prefix speak another bus protocol: messages between them are "
                "lost or misread; run one release of every service (upgrade them together)",
                protocol=BUS_PROTOCOL, others=dict(sorted(self.peer_protocols.items())))

    async def _drain(self, nc: Client) -> None:
        if self._start_lost:
            # Its server lost during the start-up (run): a drain's round trips would wait for
            # answers that never come, for all of drain_timeout_s with a server frozen.
            await close_for_good(nc)
        else:
            await drain_or_close(nc, self.settings.drain_timeout_s)

    async def _stop_micro(self, nc: Client, service: Service) -> None:
        # Its server lost during the start-up (run): its subscriptions are forgotten at once.
        await stop_micro_service(nc, service, self.settings.drain_timeout_s, self.log,
                                 server_lost=self._start_lost)


CONNECTION_POLL_S: Final[float] = 0.02
"""How often :func:`while_connected` looks whether its connection was lost."""


async def while_connected(nc: Client, coro: Coroutine[Any, Any, T], *, timeout_s: float,
                          lost: Callable[[], bool] | None = None) -> tuple[bool, T | None]:
    """Run ``coro`` -- NATS round trips of a stop -- for at most ``timeout_s`` while ``nc``
    keeps its server: ``(True, its result)`` when it finished (its exception is raised),
    ``(False, None)`` when the connection was lost (``lost()``; default: ``nc`` is not
    connected) or ``timeout_s`` passed first; ``coro`` is then cancelled and awaited (cancelled
    again should it swallow the cancel: shared/tasks.py). On a connection lost already,
    ``coro`` is not run at all.

    Why: nats-py forgets a round trip whose connection drops instead of failing it. A flush
    (every ``Subscription.drain``, so the micro ``Service.stop`` and ``Client.drain``) waits
    for its PONG for the whole flush timeout (10 s) and then raises; a JetStream publish or KV
    put waits for its ack for its own timeout. A service stopped while its server went away
    (``vertumnus up`` killed: the server and the services get SIGTERM at once) spent those
    timeouts one after the other, then ended in a traceback; here such a step ends within
    ``CONNECTION_POLL_S`` of the loss."""
    is_lost = lost if lost is not None else (lambda: not nc.is_connected)
    if is_lost():
        coro.close()
        return False, None
    work: asyncio.Task[T] = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while not work.done():
            if is_lost() or loop.time() >= deadline:
                break
            await asyncio.wait({work}, timeout=min(CONNECTION_POLL_S,
                                                   max(0.0, deadline - loop.time())))
    finally:
        if not work.done():
            shield_pongs(nc)  # before the cancel can reach a flush's PONG waiter
            await cancel_and_wait([work], log)
            shield_pongs(nc)  # a waiter made and cancelled while the cancel was repeated
    if not work.done() or work.cancelled():
        return False, None
    return True, work.result()  # raises what coro raised


def shield_pongs(nc: Client) -> None:
    """Put a proxy in place of each PONG waiter of ``nc`` (in place, in order), so that
    cancelling a flush cannot break the connection.

    nats-py answers a PONG by ``set_result`` on the oldest waiter without looking whether it
    is done; a flush cancelled while its PING was outstanding (a bounded drain given up: see
    :func:`while_connected`) leaves a cancelled waiter there, the PONG's InvalidStateError
    ends the client's read loop silently, and the connection then looks connected but hands
    nothing on -- no message, no ack, no reply (seen: a rank daemon whose bounded stop was
    cut short lost every redirect's ack). Each proxy takes its PONG and passes it to the
    waiter it replaced, unless that one was cancelled meanwhile; a waiter cancelled already
    is replaced by a fresh future. The waiters stay aligned with the PINGs outstanding.
    ``_pongs`` is private (no public view); nats-py empties it on a reconnect.

    Every connection the project opens itself is a :class:`shared.natsclient.Client`, which
    consumes a PONG whose waiter is done already (so nats-py's own flush timeout cannot break
    it either); this is for a plain nats-py client an embedding program hands in
    (``start(stack, nc)``), and does no harm to the subclass."""
    pongs = getattr(nc, "_pongs", None)
    if not pongs:
        return
    loop = asyncio.get_running_loop()

    def relay(proxy: asyncio.Future[Any], waiter: asyncio.Future[Any]) -> None:
        if waiter.done():
            return
        if proxy.cancelled():
            waiter.cancel()
        elif proxy.exception() is not None:
            waiter.set_exception(proxy.exception())  # type: ignore[arg-type]
        else:
            waiter.set_result(proxy.result())

    def proxy_of(waiter: asyncio.Future[Any]) -> asyncio.Future[Any]:
        proxy: asyncio.Future[Any] = loop.create_future()
        if not waiter.done():
            proxy.add_done_callback(lambda p, w=waiter: relay(p, w))
        return proxy

    pongs[:] = [proxy_of(w) for w in pongs]


FORGET_UNSUB_S: Final[float] = 1.0
"""Bound on queueing one UNSUB in :func:`forget_subscription` (no round trip is awaited)."""


async def forget_subscription(nc: Client, sub: Subscription) -> None:
    """Stop ``sub`` at once, without a round trip: no more messages are handed to it (a
    callback still running is cancelled) and a reconnect does not subscribe it again. For a
    stop whose connection is lost, or whose drain of ``sub`` was given up half-way (nats-py
    then marks it closed but keeps it registered, and would subscribe it again on the next
    reconnect). The server forgets a lost connection's interest by itself; on a live one the
    UNSUB is sent (not flushed). Never raises but CancelledError."""
    if not sub._closed and not nc.is_closed:  # nats-py keeps these private
        # Unregisters it; queues the UNSUB unless reconnecting (nothing is awaited then).
        with contextlib.suppress(Exception):
            async with asyncio.timeout(FORGET_UNSUB_S):
                await sub.unsubscribe()
    # A drain given up half-way (or the unsubscribe above cut short) left it registered.
    sub._stop_processing()
    nc._remove_sub(sub._id)


async def forget_micro_service(nc: Client, service: Service) -> None:
    """Take back at once, without a round trip, every subscription of ``service`` (nats.micro)
    whose start did not finish: its PING/INFO/STATS ones made so far (it has no endpoints yet,
    nor requests to finish); it is stopped then. For a start given up -- its server not
    answering, or a stop -- on a connection that may live on. Never raises but
    CancelledError."""
    for sub in list(getattr(service, "_subscriptions", {}).values()):  # private in nats-py
        await forget_subscription(nc, sub)
    service._subscriptions = {}
    service._stopped.set()


async def _drain_all(subs: Sequence[Subscription]) -> None:
    """Drain every subscription of ``subs`` at once (each: UNSUB, a round trip, then the
    messages received before it handled); raises the first failure once all have ended."""
    results = await asyncio.gather(*(sub.drain() for sub in subs), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def _refuse_queued(nc: Client, sub: Subscription) -> int:
    """Answer each request queued on ``sub`` -- given up, no longer handled -- with 503
    :data:`STOPPING_DESCRIPTION`; returns how many there were. (nats-py keeps the queue
    private.)"""
    queue = getattr(sub, "_pending_queue", None)
    refused = 0
    while queue is not None and not queue.empty():
        msg = queue.get_nowait()
        queue.task_done()
        refused += 1
        await _answer_stopping(nc, msg.reply)
    return refused


async def stop_micro_service(nc: Client, service: Service, timeout_s: float,
                             logger: Any = None, *, server_lost: bool = False) -> bool:
    """Stop ``service`` (nats.micro) gracefully, within ``timeout_s``: first its endpoints
    take no new request and finish those received -- each endpoint's subscription drained:
    UNSUB, a round trip, and then every request that came before it handled to its end --
    then the service's own ``stop`` (PING/INFO/STATS drained). Returns whether all of it
    completed; never raises but CancelledError.

    Given up: the requests still being handled when ``timeout_s`` passes, and those queued
    behind them, are answered 503 :data:`STOPPING_DESCRIPTION` (:func:`wrap_handler`) and
    their handlers cancelled; with the connection lost before or during the stop, every
    subscription of the service is forgotten (:func:`forget_subscription`): no round trip
    can complete then, and nats-py's drain would wait 10 s per subscription for a PONG
    (:func:`while_connected`). ``server_lost``: the caller knows the server is lost although
    the connection may look connected (a frozen server: :meth:`MicroService.run`'s start-up
    that lost it), so no round trip is tried.

    Why not nats.micro's ``stop`` alone: it unsubscribes its endpoints, which cancels a
    handler running and drops the requests queued; their callers wait out their whole
    timeout for an answer that never comes."""
    logger = logger if logger is not None else log
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    # nats-py keeps these only privately (nats.micro has no stop without round trips, and no
    # drain of its endpoints).
    endpoints = [sub for ep in getattr(service, "_endpoints", ())
                 if (sub := getattr(ep, "_subscription", None)) is not None and not sub._closed]
    try:
        done, _ = await while_connected(nc, _drain_all(endpoints), timeout_s=timeout_s,
                                        lost=(lambda: True) if server_lost else None)
    except (nats.errors.Error, TimeoutError, OSError) as exc:  # e.g. the server too slow
        logger.warning("micro endpoints not drained", error=repr(exc))
        done = False
    if done:
        service._endpoints = []  # drained: nats.micro's stop would unsubscribe them again
        try:
            done, _ = await while_connected(nc, service.stop(),
                                            timeout_s=max(0.0, deadline - loop.time()))
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            logger.warning("micro service stop failed", error=repr(exc))
            done = False
        if done:
            return True
    connected = nc.is_connected and not server_lost
    refused = 0
    for sub in endpoints:
        await forget_subscription(nc, sub)  # cancels a handler running: it answers 503
        refused += await _refuse_queued(nc, sub)
    for sub in getattr(service, "_subscriptions", {}).values():
        await forget_subscription(nc, sub)
    service._endpoints = []
    service._subscriptions = {}
    service._stopped.set()
    if connected:  # work cut short: worth a warning
        logger.warning("micro service stopped without a drain (its bound passed): requests "
                       "still being handled or queued were answered 503", timeout_s=timeout_s,
                       queued=refused)
    else:
        logger.info("micro service stopped without a drain (no connection to the server)")
    return False


async def drain_or_close(nc: Client, timeout_s: float) -> None:
    """A process's last step with its connection: drain ``nc`` (bounded by ``timeout_s``, and
    given up as soon as the connection is lost meanwhile), else close it. nats-py refuses to
    drain a connection closed already or one reconnecting (its server down when the process
    is stopped: a killed nats-server not back yet); raised there, the stop would end in a
    traceback and a non-zero exit, the connection never closed. A server lost *during* the
    drain would leave it waiting for PONGs that never come (:func:`while_connected`) for all
    of ``timeout_s``, and nats-py's drain swallows the cancel of that bound to flush once
    more (10 s). The close of a reconnecting one marks it closed and stops its reconnection
    (made sure of here: nats-py's may outlive the close), then may fail writing what was
    queued meanwhile to the lost socket (ConnectionResetError): nothing is left to hand to
    that server."""
    try:
        # Lost: reconnecting (a drain ends CLOSED by itself, so closed is no loss here).
        drained, _ = await while_connected(
            nc, nc.drain(), timeout_s=timeout_s,
            lost=lambda: nc.is_reconnecting or nc.is_connecting)
    except (TimeoutError, nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError, OSError):
        # OSError: the socket died during the drain (ConnectionResetError). nats-py's drain
        # catches the cancel of a bound given up (the loss seen: reconnecting) and flushes
        # once more; with its read and write loops cancelled by the reconnect, that flush
        # writes what was queued meanwhile to the lost socket itself and raises.
        drained = False
    if not drained or not nc.is_closed:
        await close_for_good(nc)


async def close_for_good(nc: Client) -> None:
    """Close ``nc`` without a drain, and make sure its reconnection has ended: for a
    connection whose server is lost, or whose drain was given up (:func:`drain_or_close`).
    Never raises but CancelledError (a write of what was queued to a lost socket may fail:
    nothing is left to hand to that server)."""
    with contextlib.suppress(OSError, nats.errors.Error):
        await nc.close()
    # nats-py's close cancels its reconnect loop once and goes on after reconnect_time_wait
    # whether it ended or not; a loop that missed the cancel (its server refusing a connect
    # in the same loop step: shared/tasks.py) retries a gone server for ever, closed client
    # or not, and asyncio.run's final cancel-and-gather then waits on it for ever: a process
    # that never exits (seen in 1 of 7 stops with the server SIGKILLed at the SIGTERM).
    reconnecting = getattr(nc, "_reconnection_task", None)  # private: no public handle
    if reconnecting is not None and not reconnecting.done():
        await cancel_and_wait([reconnecting], log, grace_s=0.2)


async def _discard_watcher(nc: Client, watcher: Any) -> None:
    """Stop a nats-py KV watcher (``KeyValue.watch``'s) for good; never raises but
    CancelledError. Its ordered consumer is a subscription and two tasks of the connection
    (heartbeat and flow-control checks): nats-py's ``stop`` unsubscribes and cancels them, but
    raises first on a closed connection, leaving both tasks running (the heartbeat check up to
    two heartbeats, 10 s). Whatever its stop left is ended here, and its tasks are awaited.
    (nats-py keeps the subscription's state private: ``_sub``, ``_jsi``.)"""
    with contextlib.suppress(Exception):
        await watcher.stop()
    sub = getattr(getattr(watcher, "_sub", None), "_sub", None)  # the plain Subscription
    if sub is None:
        return
    jsi = getattr(sub, "_jsi", None)
    tasks = [t for t in (getattr(jsi, "_hbtask", None), getattr(jsi, "_fctask", None))
             if isinstance(t, asyncio.Task)]
    await cancel_and_wait(tasks, log)
    if nc._subs.get(sub._id) is sub:  # still registered (its unsubscribe failed)
        await forget_subscription(nc, sub)


async def _watch_made_whole(nc: Client, kv: KeyValue, keys: str) -> Any:
    """``kv.watch(keys)``, its making never cut short. nats-py makes a watch in steps -- the
    ordered consumer's subscription and its two tasks, then a consumer-info request -- and a
    cancel that lands after the first (during that request) leaves them running on the
    connection, with nobody holding the watcher to stop them; nats-py undoes them only for
    an error. So a cancel that lands meanwhile (each one: a stop cancels again) is held until
    the making ends -- each of its JetStream requests bounded by the context's timeout --
    then whatever it made is stopped (:func:`_discard_watcher`) and the cancel raised."""
    return await finish_first(kv.watch(keys), lambda watcher: _discard_watcher(nc, watcher))


KV_WATCH_VERIFY_CHECKS: Final[int] = 5
"""How many ``check_s`` apart a :class:`KvWatch` asks the server by default whether its bucket
is still the one it watches (one JetStream API request per watch and period)."""


class KvWatch:
    """A watch of a KV bucket's keys that survives a server restart, and its bucket being
    deleted and created again: an async iterator of entries (None marks the end of a watch's
    initial values), as ``KeyValue.watch`` gives.

    nats-py's watch is an ordered consumer that is not reset when its server restarts
    (nats.py#510): the client reconnects and the watch stays silent for ever -- a rank host
    would adopt no epoch record again, a scheduler would see no worker state again. So
    whenever the connection has reconnected since the watch was made, it is made again (if
    the server cannot take it yet, at the next check, every ``check_s``).

    The consumer also goes with the bucket's stream when the bucket is deleted, the connection
    staying up; nats-py resumes it, if at all, at the old stream's next sequence, which a new
    stream reaches late or never. So every ``verify_s`` (default
    :data:`KV_WATCH_VERIFY_CHECKS` ``* check_s``; one stream-info request, the only cost when
    nothing is wrong) the watch asks whether its bucket is still the one it was made on (the
    stream's creation time; where a server does not tell it, a last sequence below a revision
    the watch yielded): a bucket created again is watched again at once; a bucket gone is
    logged (a warning, once), its dead watch stopped, and a new one tried every ``check_s``,
    quietly, until the bucket is back -- ``__anext__`` neither raises nor spins meanwhile.
    A check the server does not answer (busy, restarting) changes nothing.

    A new watch first delivers each key's current value (a delete marker for a deleted key)
    and None, as any new watch does: a consumer sees a restart or a re-created bucket as a
    replay of the current values, which the stack's consumers (worker states, epoch records)
    take idempotently, and nothing written meanwhile is missed. ``remade`` counts the
    re-watches; each is logged (``info``). A re-watch that fails is logged once per outage.

    ``logger``: structlog-like (``info``, ``warning``); default this module's log. The
    bucket's stream is reached through nats-py's private ``KeyValue._js`` / ``._stream``
    (nats-py 2.16; no public accessor).
    """

    def __init__(self, nc: Client, kv: KeyValue, keys: str = ">", *,
                 check_s: float = 1.0, verify_s: float | None = None,
                 logger: Any = None) -> None:
        if not check_s > 0:
            raise InvalidInput(f"check_s must be > 0, got {check_s!r}")
        if verify_s is None:
            verify_s = KV_WATCH_VERIFY_CHECKS * check_s
        elif not verify_s > 0:
            raise InvalidInput(f"verify_s must be > 0, got {verify_s!r}")
        self._nc, self._kv, self._keys = nc, kv, keys
        self._check_s, self._verify_s = check_s, verify_s
        # Where the re-watches are told (class docstring: ``logger``).
        self._log = log if logger is None else logger
        # None while the bucket is gone (the dead watch stopped, a new one not made yet).
        self._watcher: Any = None
        self._reconnects = 0
        self._stopped = False
        self._woken = asyncio.Event()  # set by stop: ends a wait without a watcher at once
        # The watched stream as the current watch was made on it: its creation time (None
        # where the server does not tell it) and the highest revision this watch yielded.
        self._created: Any = None
        self._revision = 0
        self._verify_at = 0.0  # loop time of the next check of the bucket
        self._lost = False  # the bucket was found gone: its watch is made again when back
        self._told = False  # a failed re-watch (or the bucket gone) was logged this outage
        self.remade = 0

    async def start(self) -> KvWatch:
        """Make the watch; raises what ``KeyValue.watch`` (or the stream-info request) raises,
        e.g. NotFoundError for a bucket that does not exist.

        Cancelled, it leaves nothing behind: a cancel that lands while nats-py makes the watch
        waits for the making to end (its JetStream requests, each bounded by the context's
        timeout), then stops what it made and is raised (:func:`_watch_made_whole`)."""
        self._reconnects = self._nc.stats["reconnects"]
        # Before the watch: a bucket created again in between is seen at the first check.
        self._created = (await self._stream_info()).created
        self._watcher = await _watch_made_whole(self._nc, self._kv, self._keys)
        self._verify_at = asyncio.get_running_loop().time() + self._verify_s
        return self

    async def stop(self) -> None:
        """Stop the watch (and end an iteration waiting for it); never raises but
        CancelledError: on a closed connection, where nats-py's stop fails before it ends the
        watch's tasks, those are ended here (:func:`_discard_watcher`)."""
        self._stopped = True
        self._woken.set()
        if self._watcher is not None:
            await _discard_watcher(self._nc, self._watcher)

    def __aiter__(self) -> KvWatch:
        return self

    async def __anext__(self) -> Any:
        loop = asyncio.get_running_loop()
        while True:
            if self._stopped:
                raise StopAsyncIteration
            if cancel_requested():  # a stop's cancel swallowed by a wait_for (shared/tasks.py)
                raise asyncio.CancelledError
            if self._nc.is_connected:
                if self._nc.stats["reconnects"] != self._reconnects:
                    await self._remake("after a reconnect")
                elif self._lost:
                    await self._remake("after its bucket was created again")
                elif loop.time() >= self._verify_at:
                    await self._verify()
            if self._watcher is None:  # the bucket gone: tried again after check_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), self._check_s)
                continue
            try:
                entry = await self._watcher.updates(timeout=self._check_s)
            except nats.errors.TimeoutError:
                continue
            if entry is KeyValue.KeyWatcher.STOP_ITER:  # a stopped (replaced) watcher
                continue
            if entry is not None and entry.revision:
                self._revision = max(self._revision, entry.revision)
            return entry

    async def _stream_info(self) -> StreamInfo:
        return await self._kv._js.stream_info(self._kv._stream)

    async def _verify(self) -> None:
        """Is the bucket still the one the watch was made on? Gone: stop the dead watch (its
        nats-py heartbeat check would otherwise try to resume it, and report each failure
        through the connection's error callback) and make it again once the bucket is back.
        Created again: make it again now."""
        self._verify_at = asyncio.get_running_loop().time() + self._verify_s
        try:
            info = await self._stream_info()
        except NotFoundError:
            old, self._watcher, self._lost = self._watcher, None, True
            if not self._told:
                self._told = True
                self._log.warning("kv bucket gone; its watch is made again once it is back",
                                  stream=self._kv._stream, keys=self._keys)
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.stop()
            return
        except (nats.errors.Error, TimeoutError):
            return  # no answer now (a busy or restarting server): asked again next time
        if self._recreated(info):
            await self._remake("after its bucket was created again")

    def _recreated(self, info: StreamInfo) -> bool:
        if info.created is not None and self._created is not None:
            return bool(info.created != self._created)
        # No creation time from this server: a new stream numbers from 1 again, while no
        # purge, expiry or delete ever lowers a stream's last sequence.
        return info.state.last_seq < self._revision

    async def _remake(self, why: str) -> None:
        reconnects = self._nc.stats["reconnects"]
        try:
            # The stream info first, as in start: a re-creation after it is seen next time.
            info = await self._stream_info()
            watcher = await _watch_made_whole(self._nc, self._kv, self._keys)
        except (nats.errors.Error, TimeoutError) as exc:  # not ready yet, or the bucket gone
            if not self._told:
                self._told = True
                self._log.info("kv watch not made again yet", keys=self._keys, why=why,
                               error=repr(exc))
            return
        if self._stopped:  # stopped while this was made: nothing will stop it later
            with contextlib.suppress(Exception):
                await watcher.stop()
            return
        old, self._watcher = self._watcher, watcher
        self._reconnects, self._created, self._revision = reconnects, info.created, 0
        self._lost = self._told = False
        self._verify_at = asyncio.get_running_loop().time() + self._verify_s
        self.remade += 1
        if old is not None:
            with contextlib.suppress(Exception):
                await old.stop()
        self._log.info(f"kv watch made again {why}", keys=self._keys)


def reconnect_options(settings: ServiceSettings) -> dict[str, Any]:
    """``nats.connect`` options of a service: reconnect every ``reconnect_wait_s``, for ever
    (nats-py's defaults give up after 60 attempts 2 s apart: a broker down for two minutes
    would leave a live process that never serves again), and ping every ``ping_interval_s``,
    counting the connection lost after ``max_outstanding_pings`` unanswered ones (a silent
    connection -- no FIN, no RST -- is noticed only by its pings)."""
    return {"reconnect_time_wait": settings.reconnect_wait_s, "max_reconnect_attempts": -1,
            "ping_interval": settings.ping_interval_s,
            "max_outstanding_pings": settings.max_outstanding_pings}


def security_hint(exc: BaseException) -> str | None:
    """What to check when ``exc`` (from nats-py) says the server refused our credentials or
    the TLS handshake failed; None for any other error."""
    if isinstance(exc, ssl.SSLError):
        return ("the TLS handshake failed: check VTM_NATS_TLS_CA (the server's CA), "
                "VTM_NATS_TLS_CERT / VTM_NATS_TLS_KEY and VTM_NATS_TLS_HOSTNAME")
    text = str(exc).lower()
    if "authorization violation" in text or "authentication" in text:
        return ("the server refused this process's credentials: check VTM_NATS_CREDS, "
                "VTM_NATS_NKEY_SEED, VTM_NATS_TOKEN or VTM_NATS_USER / VTM_NATS_PASSWORD")
    if "secure connection" in text or "tls" in text:
        return ("the server and this process disagree on TLS: set VTM_NATS_TLS_CA (or a "
                "tls:// URL) for a server that requires it, a client certificate for one that "
                "verifies clients")
    return None


def nats_callbacks(log: Any, stopping: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """``error_cb`` / ``disconnected_cb`` / ``reconnected_cb`` for ``nats.connect`` that log
    through ``log`` (structlog) as :class:`MicroService` does: a transient error or disconnect
    is a warning (nats-py reconnects by itself), not nats-py's default ERROR with a traceback;
    a disconnect while ``stopping()`` (our own drain) is info. A server refusing this
    process's credentials, or a failed TLS handshake, is an error naming the settings to check
    (the process keeps retrying: the server's accounts may be fixed while it runs)."""

    async def error_cb(exc: Exception) -> None:
        hint = security_hint(exc)
        if hint is None:
            log.warning("nats error", error=str(exc))
        else:
            log.error("nats refused the connection", error=str(exc), hint=hint)

    async def disconnected_cb() -> None:
        if stopping():
            log.info("nats disconnected")
        else:
            log.warning("nats disconnected")

    async def reconnected_cb() -> None:
        log.info("nats reconnected")

    return {"error_cb": error_cb, "disconnected_cb": disconnected_cb,
            "reconnected_cb": reconnected_cb}


__all__ = [
    "JSON",
    "Endpoint",
    "MicroService",
    "PullConsumer",
    "RemoteError",
    "ReplyTooLarge",
    "SchemaError",
    "call",
    "close_for_good",
    "drain_or_close",
    "lost_server",
    "StartUpLost",
    "forget_subscription",
    "forget_micro_service",
    "stop_micro_service",
    "while_connected",
    "KvWatch",
    "KV_WATCH_VERIFY_CHECKS",
    "reconnect_options",
    "nats_callbacks",
    "security_hint",
    "ensure_intake_stream",
    "ensure_key_value",
    "ensure_results_stream",
    "first_token_of",
    "kept_results",
    "latest_result",
    "publish_result",
    "epoch_kv",
    "every_answer",
    "message_size",
    "worker_state_kv",
    "error_code",
    "raise_for_error",
    "optional_request_model",
    "request_model",
    "to_service_error",
    "wrap_handler",
]
