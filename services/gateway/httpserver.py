"""A small HTTP/1.1 server on ``asyncio.start_server`` (no framework dependency).

Scope: what the gateway's JSON API needs, done carefully. Requests with a ``Content-Length``
body (chunked request bodies are refused with 411, any other ``Transfer-Encoding`` with 501),
keep-alive (HTTP/1.1 default, ``Connection: close`` honoured), bounded request head (431) and
body (413, checked against ``Content-Length`` *before* reading, so an oversized upload costs
nothing), malformed request lines or headers (400), a read timeout on idle connections and a
write timeout on clients that do not read. The framing headers (``Content-Length``,
``Transfer-Encoding``) and ``Authorization``/``Host`` may appear once, and never
``Transfer-Encoding`` with ``Content-Length`` (RFC 9112 §6.3: a proxy in front could frame the
bytes otherwise than this server, smuggling a request past it): 400 and the connection closed.
``HEAD`` is answered as ``GET`` without the body. Responses always carry ``Content-Length``.
``Expect: 100-continue`` (RFC 9110 §10.1.1; curl sends it for bodies over 1 MiB) is answered
``100 Continue`` once the head has passed its checks and before the body is read (an oversized
body gets its 413 instead, and the client need not send it); any other expectation, 417.
A handler exception becomes a 500 without details; the server keeps serving.

The head is read line by line, each line ending in CRLF: a line ending in a bare LF is a 400
at once (read as a whole head up to CRLF CRLF, such a request waited for the idle timeout).
Up to :data:`MAX_EMPTY_LINES` empty lines (CRLF or a bare LF) before the request line are
skipped (RFC 9112 §2.2: a server SHOULD ignore at least one; old clients send a CRLF after a
POST body), more are a 400; a request line that is not ``method SP target SP version``, 400.

While a handler runs, the connection is watched: a client that closes it (or shuts down its
sending side, as nginx too reads it) completes the request's :attr:`HttpRequest.disconnected`
future, so the handler can stop waiting on its behalf; no response is written then and the
connection is closed. Bytes a client sends meanwhile (a pipelined request) end the watch.

Stopping (:meth:`HttpServer.close`): no new connection is accepted, idle connections are
closed, and a request being handled gets up to ``grace_s`` to be answered (then a 503
"stopping", ``Connection: close``), so a stop never leaves a client without an answer.

Correlation: each request gets an :class:`Exchange` as its first line comes -- a request id
minted here and a trace id (the client's ``traceparent``'s, else one minted here), which the
handler may replace with better ones (the completion's id, its root span's trace): every
answer, those of the server's own refusals (400, 413, 431, 500, 503 ...) included, carries
them as ``X-Request-Id`` and ``X-Trace-Id`` headers, and an error's JSON body as
``error.request_id`` and ``error.trace_id`` (:func:`error_body` given the exchange). Each
request answered (or whose client left first: 499) is logged as one access line,
:data:`ACCESS_EVENT` (:meth:`HttpServer._access` says which level and why some are left out),
and recorded as one span: the handler's, where it opened one for the request
(:meth:`Exchange.note_traced`), else a server span of the answer in that trace
(:mod:`services.gateway.httpspan`), so every ``X-Trace-Id`` names a recorded trace (as far as
the installed sampler keeps it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

import structlog

from services.gateway.grace import STOP_GRACE_S, finish_within
from services.gateway.httpspan import FAILURE_LINES_PER_S, new_trace_id, record_http_span
from shared.ids import InvalidInput
from shared.tasks import cancel_and_wait
from shared.telemetry import trace_id_of

log = structlog.get_logger("vertumnus.http")

IDLE_TIMEOUT_S: Final[float] = 60.0
SERVER_NAME: Final[str] = "vertumnus-gateway"
_ONCE: Final[frozenset[str]] = frozenset(
    {"content-length", "transfer-encoding", "authorization", "host"})
"""Headers a request may carry at most once (a repeat is how framing is smuggled)."""
MAX_EMPTY_LINES: Final[int] = 8
"""Empty lines skipped before a request line (RFC 9112 §2.2 asks for at least one); more are
no robustness but a client sending garbage, answered 400."""
ACCESS_EVENT: Final[str] = "http request"
"""The event of the access-log line written for each request answered."""
REQUEST_ID_HEADER: Final[str] = "X-Request-Id"
TRACE_ID_HEADER: Final[str] = "X-Trace-Id"
ERROR_LINES_PER_S: Final[float] = 20.0
ERROR_LINES_BURST: Final[int] = 100
"""Budget of access lines for 4xx answers, and separately for 5xx ones (:class:`LineBudget`,
:meth:`HttpServer._access`)."""
_MAX_LOGGED_PATH: Final[int] = 256
"""A path longer than this is cut in the access line (a client chooses it: up to the head's
limit, 16 KiB by default, per line otherwise)."""


def new_http_request_id() -> str:
    """A request id for a request that has none of its own yet: ``r`` and 32 hex digits, the
    form of the gateway's own completion ids, which clients may not use."""
    return "r" + uuid.uuid4().hex


@dataclass(slots=True)
class Exchange:
    """One request, from its first line to its answer: the ids its answer and its access line
    name, and what that line reports. Made by :class:`HttpServer`; a handler reaches it as
    :attr:`HttpRequest.exchange` and replaces the ids with better ones once it knows them
    (:meth:`note`), and records a TTFT.

    ``trace_id``: the client's (its ``traceparent``), or the trace of the request's root span
    where a handler opened one (:meth:`note_traced`); else minted here
    (:func:`~services.gateway.httpspan.new_trace_id`). Where no handler recorded the request,
    the server records its answer's span in that trace (:mod:`services.gateway.httpspan`):
    a child of the client's span (``trace_carrier``), else a root with the minted id.
    ``route``: the route of the app the path matched (its span's ``http.route``), None for
    none."""

    request_id: str
    trace_id: str
    method: str = "-"
    path: str = "-"
    peer: str = ""
    started: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None
    trace_carrier: Mapping[str, str] | None = None
    """The request's headers once read (their ``traceparent`` is the parent of its answer's
    span); None before."""
    route: str | None = None
    traced: bool = False
    """Whether a handler recorded the request in a span of its own: the server records none
    then (:meth:`note_traced`)."""

    def note(self, request_id: str | None = None, trace_id: str | None = None) -> None:
        """Replace the ids (None: keep that one)."""
        if request_id:
            self.request_id = request_id
        if trace_id:
            self.trace_id = trace_id

    def note_traced(self, request_id: str | None = None, trace_id: str | None = None) -> None:
        """Replace the ids as :meth:`note` does, and mark the request recorded by the
        handler's span (whose trace ``trace_id`` is): the answer then gets no span of the
        server's. For a handler that opens its request's root span (the completions'), called
        once that span is open."""
        self.note(request_id, trace_id)
        self.traced = True


class LineBudget:
    """A token bucket for log lines: ``rate_per_s`` a second on average, bursts of ``burst``.
    :meth:`take` answers None for a line to leave out (counted), else how many were left
    out since the last line let through, for that line to say."""

    def __init__(self, rate_per_s: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate_per_s
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self._dropped = 0

    def take(self) -> int | None:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1.0:
            self._dropped += 1
            return None
        self._tokens -= 1.0
        dropped, self._dropped = self._dropped, 0
        return dropped


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One request. ``disconnected`` (set by :class:`HttpServer` while the request is
    handled; None elsewhere): done once the client closed its connection, so nobody will read
    the response (module docstring)."""

    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]  # lower-case names
    body: bytes
    peer: str = ""
    version: str = "HTTP/1.1"
    disconnected: asyncio.Future[None] | None = field(default=None, compare=False, repr=False)
    exchange: Exchange | None = field(default=None, compare=False, repr=False)
    """Its ids and access-log record (module docstring, "Correlation"); None outside a
    server."""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """An answer. ``error``: its error object (:func:`error_body`'s ``error``) where it is
    one, for the answer's span (:mod:`services.gateway.httpspan`); :meth:`json` fills it."""

    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    error: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def json(cls, status: int, obj: Any, headers: Mapping[str, str] | None = None) -> HttpResponse:
        """``obj`` as a JSON answer; an error status's ``{"error": {...}}`` body (an
        :func:`error_body`) is kept as :attr:`error` too."""
        err = obj.get("error") if status >= 400 and isinstance(obj, dict) else None
        return cls(status, json.dumps(obj).encode(),
                   {"Content-Type": "application/json", **(headers or {})},
                   err if isinstance(err, dict) else None)


def error_body(status: int, message: str, *, type_: str | None = None,
               ids: Exchange | None = None) -> dict[str, Any]:
    """OpenAI-style error object (``type``: the status's phrase in snake case; "error" for a
    status without one, e.g. nginx's 499), naming the request and trace ids of ``ids``
    (``request_id``, ``trace_id``: the ``X-Request-Id`` and ``X-Trace-Id`` of the answer)."""
    if type_ is None:
        try:
            type_ = HTTPStatus(status).phrase.lower().replace(" ", "_")
        except ValueError:
            type_ = "error"
    err: dict[str, Any] = {"message": message, "type": type_, "code": status}
    if ids is not None:
        err["request_id"] = ids.request_id
        err["trace_id"] = ids.trace_id
    return {"error": err}


def server_tls(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """The HTTPS context of ``VTM_HTTP_TLS_CERT`` / ``VTM_HTTP_TLS_KEY`` (None: plain HTTP);
    files that are no certificate chain and its key raise InvalidInput naming the settings."""
    if cert is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(str(cert), str(key) if key is not None else None)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidInput(f"VTM_HTTP_TLS_CERT {str(cert)!r} / VTM_HTTP_TLS_KEY {str(key)!r} "
                           f"are not a certificate chain and its private key: {exc}") from None
    return ctx


def error_response(status: int, message: str, ids: Exchange | None = None) -> HttpResponse:
    return HttpResponse.json(status, error_body(status, message, ids=ids))


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class HttpServer:
    """Serve ``handler`` on ``host:port`` (port 0: kernel-chosen; read :attr:`port`)."""

    def __init__(self, handler: Handler, *, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = 4 << 20, max_header_bytes: int = 16 << 10,
                 idle_timeout_s: float = IDLE_TIMEOUT_S,
                 tls: ssl.SSLContext | None = None,
                 request_ids: Callable[[], str] = new_http_request_id,
                 error_lines_per_s: float = ERROR_LINES_PER_S,
                 error_lines_burst: int = ERROR_LINES_BURST) -> None:
        self._handler = handler
        self._request_ids = request_ids
        # One budget per class, so a flood of 4xx cannot crowd out the 5xx lines (_access).
        self._budget_4xx = LineBudget(error_lines_per_s, error_lines_burst)
        self._budget_5xx = LineBudget(error_lines_per_s, error_lines_burst)
        self._budget_tracing = LineBudget(FAILURE_LINES_PER_S, 1)  # spans that failed
        self._tls = tls
        self._host = host
        self._port = port
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.idle_timeout_s = idle_timeout_s
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._busy: set[asyncio.Task[None]] = set()  # handling a request (not idle)
        self._closing = False

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("HTTP server is not running")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"{'https' if self._tls is not None else 'http'}://{self._host}:{self.port}"

    async def start(self) -> None:
        """Listen. A host or port that cannot be bound (in use, no such address) raises
        :class:`InvalidInput` naming them: the service cannot start, and says why in one
        line (shared/servicemain.py ``run_service``)."""
        try:
            self._server = await asyncio.start_server(
                self._on_connection, self._host, self._port, limit=self.max_header_bytes + 2,
                ssl=self._tls,
            )
        except OSError as exc:  # socket.gaierror included
            reason = exc.strerror or str(exc)
            raise InvalidInput(f"cannot listen for HTTP on {self._host}:{self._port} "
                               f"(http_host, http_port): {reason}") from None

    async def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop: accept nothing new, close idle connections, give requests being handled up
        to ``grace_s`` to be answered (their connections then close), then cancel the rest,
        each answered 503 (module docstring; the gateway's NATS completions get the same
        grace, side by side: :mod:`services.gateway.grace`)."""
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        await cancel_and_wait([t for t in self._conns if t not in self._busy], log)
        await finish_within(list(self._busy), grace_s, log)
        # Any connection left (bounded even if a handler swallows a cancel: shared/tasks.py).
        await cancel_and_wait(list(self._conns), log)
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        self._server = None

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        peer = writer.get_extra_info("peername")
        peer_s = (f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2
                  else str(peer))
        try:
            keep_alive = True
            while keep_alive:
                ex = Exchange(self._request_ids(), new_trace_id(), peer=peer_s)
                try:
                    async with asyncio.timeout(self.idle_timeout_s):
                        request = await self._read_request(reader, writer, str(peer), ex)
                except _Reject as rej:
                    await self._answer(writer, ex, error_response(rej.status, rej.message, ex),
                                       False)
                    return
                except (asyncio.IncompleteReadError, OSError):
                    # OSError: a timeout, a reset, and a TLS session that broke (ssl.SSLError
                    # is no ConnectionError): the connection is gone either way.
                    return
                if request is None:
                    return
                keep_alive = _wants_keep_alive(request)
                head_only = request.method == "HEAD"
                gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                # HEAD is answered as GET, without the body.
                request = dataclasses.replace(request, method="GET" if head_only
                                              else request.method, disconnected=gone,
                                              exchange=ex)
                watch = asyncio.create_task(_watch_close(reader, gone), name="http-watch")
                self._busy.add(task)
                try:
                    try:
                        response = await self._handler(request)
                    except asyncio.CancelledError:
                        if self._closing:  # the stop's grace ran out: answer, then go
                            with contextlib.suppress(Exception):
                                async with asyncio.timeout(1.0):
                                    await self._answer(writer, ex, error_response(
                                        503, "the gateway is stopping; try again", ex), False)
                        raise
                    except Exception:
                        log.exception("HTTP handler failed", path=ex.path,
                                      request_id=ex.request_id, trace_id=ex.trace_id)
                        response = error_response(500, "internal error", ex)
                    finally:
                        # Ended before the next read: it must not wait on the reader then.
                        await cancel_and_wait([watch], log)
                    if gone.done():  # nobody reads it
                        self._access(ex, 499)
                        self._trace(ex, 499, response, sent=False)
                        return
                    keep_alive = keep_alive and not self._closing
                    await self._answer(writer, ex, response, keep_alive, head_only=head_only)
                finally:
                    self._busy.discard(task)
        except (OSError, asyncio.CancelledError):  # OSError: as above (a write's, too)
            pass
        finally:
            self._conns.discard(task)
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _read_line(self, reader: asyncio.StreamReader, budget: int) -> bytes:
        """One line of the head, up to and including its LF (``budget``: head bytes left).
        EOF before the LF raises IncompleteReadError (partial: what came)."""
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            raise _Reject(431, f"request head over {self.max_header_bytes} bytes") from None
        if len(line) > budget:
            raise _Reject(431, f"request head over {self.max_header_bytes} bytes")
        return line

    async def _read_head(self, reader: asyncio.StreamReader,
                         ex: Exchange) -> list[str] | None:
        """The request line and header lines (without their CRLF), or None for a clean close
        before a request (only empty lines, if anything, came). Rejects a bare-LF line, too
        many empty lines first, an incomplete or oversized head (module docstring)."""
        budget = self.max_header_bytes
        for _ in range(MAX_EMPTY_LINES + 1):
            try:
                line = await self._read_line(reader, budget)
            except asyncio.IncompleteReadError as exc:
                if not exc.partial.strip():
                    return None  # clean close between requests
                raise _Reject(400, "incomplete request head") from None
            budget -= len(line)
            if line not in (b"\r\n", b"\n"):
                ex.started = time.monotonic()  # its first line: the request begins
                break
        else:
            raise _Reject(400, f"more than {MAX_EMPTY_LINES} empty lines before the request "
                               "line")
        lines: list[str] = []
        while True:
            # NOTE: a bare LF ends no line here (RFC 9112 §2.2 only *allows* taking it): a
            # proxy in front that takes it could frame the head otherwise than we do.
            if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
                kind = "request line" if not lines else "header line"
                raise _Reject(400, f"malformed {kind} {line[:60]!r}: a line must end with "
                                   "CRLF and hold no other CR or LF")
            if line == b"\r\n":
                return lines
            lines.append(line[:-2].decode("latin-1"))
            try:
                line = await self._read_line(reader, budget)
            except asyncio.IncompleteReadError:
                raise _Reject(400, "incomplete request head") from None
            budget -= len(line)

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            peer: str, ex: Exchange) -> HttpRequest | None:
        """The next request, recording in ``ex`` what its access line names as soon as it is
        read (a refusal's line too)."""
        lines = await self._read_head(reader, ex)
        if lines is None:
            return None
        parts = lines[0].split(" ")
        if len(parts) != 3 or not all(parts):
            raise _Reject(400, f"malformed request line {lines[0][:60]!r} (want: METHOD "
                               "TARGET HTTP/1.1)")
        method, target, version = parts
        ex.method = method.upper()[:16]
        ex.path = target.partition("?")[0][:_MAX_LOGGED_PATH]
        if not version.startswith("HTTP/1."):
            raise _Reject(505, f"unsupported protocol {version!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _Reject(400, f"malformed header line {line[:60]!r}")
            key = name.lower()
            if key in _ONCE and key in headers:
                raise _Reject(400, f"{name} header given more than once")
            headers[key] = value.strip()
        # The client's trace, for the answer, its line and its span even if the request is
        # refused.
        ex.note(trace_id=trace_id_of(headers))
        ex.trace_carrier = headers
        if "transfer-encoding" in headers:
            if "content-length" in headers:
                raise _Reject(400, "both Transfer-Encoding and Content-Length given")
            if "chunked" in headers["transfer-encoding"].lower():
                raise _Reject(411, "chunked request bodies are not supported; send "
                                   "Content-Length")
            raise _Reject(501, f"Transfer-Encoding {headers['transfer-encoding'][:40]!r} is "
                               "not supported; send Content-Length")
        raw_length = headers.get("content-length", "0")
        # 1*DIGIT (RFC 9110): int() alone would also take "+5", " 5", "1_0".
        if not (raw_length.isascii() and raw_length.isdigit()):
            raise _Reject(400, "invalid Content-Length")
        # Leading zeros are allowed; past them, more digits than the limit has is over it --
        # judged before int(), which refuses more than 4300 digits (a ValueError that would
        # drop the connection unanswered).
        digits = raw_length.lstrip("0") or "0"
        if len(digits) > len(str(self.max_body_bytes)):
            raise _Reject(413, f"request body of a {len(digits)}-digit number of bytes is over "
                               f"the limit of {self.max_body_bytes} bytes")
        length = int(digits)
        if length > self.max_body_bytes:
            raise _Reject(413, f"request body of {length} bytes is over the limit of "
                               f"{self.max_body_bytes} bytes")
        try:
            split = urlsplit(target)
        except ValueError:  # e.g. "http://[::1/x": an unclosed IPv6 host
            raise _Reject(400, f"malformed request target {target[:60]!r}") from None
        expect = headers.get("expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                raise _Reject(417, f"unsupported expectation {expect[:40]!r} (only "
                                   "100-continue)")
            if length and version == "HTTP/1.1":
                # The client holds the body back until this (or a final status) comes.
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
        body = await reader.readexactly(length) if length else b""
        ex.path = (split.path or "/")[:_MAX_LOGGED_PATH]
        return HttpRequest(method.upper(), split.path or "/", parse_qs(split.query), headers,
                           body, peer, version)

    async def _answer(self, writer: asyncio.StreamWriter, ex: Exchange, response: HttpResponse,
                      keep_alive: bool, *, head_only: bool = False) -> None:
        """Send ``response`` with ``ex``'s ids as headers, log its access line and record its
        span (also when the send fails: both say so)."""
        response = dataclasses.replace(response, headers={
            **response.headers, REQUEST_ID_HEADER: ex.request_id, TRACE_ID_HEADER: ex.trace_id})
        sent = False
        try:
            await self._write(writer, response, keep_alive, head_only=head_only)
            sent = True
        finally:
            self._access(ex, response.status, sent=sent)
            self._trace(ex, response.status, response, sent=sent)

    def _trace(self, ex: Exchange, status: int, response: HttpResponse, *,
               sent: bool) -> None:
        """Record the span of ``ex``'s answer where no handler recorded the request
        (:func:`~services.gateway.httpspan.record_http_span`: never raises). Unlike access
        lines, spans have no budget here: one per answer, and the installed sampler bounds
        what is built and exported."""
        record_http_span(ex, status, scheme="https" if self._tls is not None else "http",
                         error=response.error, sent=sent, failures=self._budget_tracing)

    def _access(self, ex: Exchange, status: int, *, sent: bool = True) -> None:
        """Log ``ex``'s access line: a warning for a 5xx (504 included: the gateway or what is
        behind it failed the client), info otherwise (499: the client left first).

        NOTE: 4xx and 5xx lines each have a :class:`LineBudget` (``error_lines_per_s``,
        ``error_lines_burst``); past it, lines are left out and the next line let through
        says how many (``suppressed``). Why: a client decides how many 4xx it causes (a
        fuzzer, a misconfigured client in a loop sends thousands a second, each refused in
        microseconds), and a stack without NATS answers every request 503 as fast, so one
        line each would make the log the bottleneck and bury everything else. Lines of 2xx
        are not limited: they come no faster than the pool answers, and each is a request
        someone may ask about. Every answer still carries its ids; the counts of every
        status are in the gateway's metrics. 4xx are logged at info, not debug, so that a
        client's error can be found at the default level."""
        extra: dict[str, Any] = {}
        if 400 <= status < 600 and status != 499:
            budget = self._budget_5xx if status >= 500 else self._budget_4xx
            suppressed = budget.take()
            if suppressed is None:
                return
            if suppressed:
                extra["suppressed"] = suppressed
        if ex.ttft_s is not None:
            extra["ttft_s"] = ex.ttft_s
        if not sent:
            extra["sent"] = False
        emit = log.warning if status >= 500 else log.info
        emit(ACCESS_EVENT, method=ex.method, path=ex.path, status=status,
             duration_s=round(time.monotonic() - ex.started, 6), request_id=ex.request_id,
             trace_id=ex.trace_id, peer=ex.peer, **extra)

    async def _write(self, writer: asyncio.StreamWriter, response: HttpResponse,
                     keep_alive: bool, *, head_only: bool = False) -> None:
        """Send ``response`` (``head_only``: its head, for HEAD). A client that does not read
        it within the idle timeout loses the connection (ConnectionError): a full send buffer
        would otherwise hold the connection, and its task, for good."""
        try:
            phrase = HTTPStatus(response.status).phrase
        except ValueError:
            phrase = "Status"
        head = [f"HTTP/1.1 {response.status} {phrase}", f"Server: {SERVER_NAME}",
                f"Content-Length: {len(response.body)}",
                f"Connection: {'keep-alive' if keep_alive else 'close'}"]
        head += [f"{k}: {v}" for k, v in response.headers.items()
                 if k.lower() not in ("content-length", "connection")]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
                     + (b"" if head_only else response.body))
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                await writer.drain()
        except TimeoutError:
            raise ConnectionError("the client did not read its response in time") from None


async def _watch_close(reader: asyncio.StreamReader, gone: asyncio.Future[None]) -> None:
    """Complete ``gone`` once the client closes the connection (EOF, or an error such as a
    reset) while nothing else is to be read; return, leaving it pending, once the client
    sends bytes (a pipelined request: it is still there, and its close is seen when those
    bytes are read). Cancelled when the handler ends.

    NOTE: StreamReader has no public way to wait for bytes or EOF without taking the bytes
    (they belong to the next request), so this waits on its private ``_wait_for_data``, as its
    own readers do, and reads its private ``_buffer`` to see pending bytes. Polling ``at_eof()``
    instead would wake every in-flight request's task several times a second. The watch
    ends at the first byte rather than waiting again: that would resume a transport the
    reader paused for a full buffer, and a client could then pile up requests unbounded."""
    while True:
        if reader.exception() is not None:
            break
        if reader._buffer:  # type: ignore[attr-defined]
            return
        if reader.at_eof():
            break
        try:
            await reader._wait_for_data("_watch_close")  # type: ignore[attr-defined]
        except OSError:  # the connection was lost with an error (reset, TLS failure)
            break
    if not gone.done():
        gone.set_result(None)


def _wants_keep_alive(request: HttpRequest) -> bool:
    conn = request.headers.get("connection", "").lower()
    if request.version == "HTTP/1.0":
        return conn == "keep-alive"
    return conn != "close"
