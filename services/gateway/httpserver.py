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
A handler exception becomes a 500 without details; the server keeps serving.

Stopping (:meth:`HttpServer.close`): no new connection is accepted, idle connections are
closed, and a request being handled gets up to ``grace_s`` to be answered (then a 503
"stopping", ``Connection: close``), so a stop never leaves a client without an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

import structlog

from shared.ids import InvalidInput
from shared.tasks import cancel_and_wait

log = structlog.get_logger("vertumnus.http")

IDLE_TIMEOUT_S: Final[float] = 60.0
SERVER_NAME: Final[str] = "vertumnus-gateway"
STOP_GRACE_S: Final[float] = 10.0
"""How long :meth:`HttpServer.close` lets requests being handled finish (below the
service's whole stop bound, ``stop_timeout_s``)."""
_ONCE: Final[frozenset[str]] = frozenset(
    {"content-length", "transfer-encoding", "authorization", "host"})
"""Headers a request may carry at most once (a repeat is how framing is smuggled)."""


@dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]  # lower-case names
    body: bytes
    peer: str = ""
    version: str = "HTTP/1.1"


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, status: int, obj: Any, headers: Mapping[str, str] | None = None) -> HttpResponse:
        return cls(status, json.dumps(obj).encode(),
                   {"Content-Type": "application/json", **(headers or {})})


def error_body(status: int, message: str, *, type_: str | None = None) -> dict[str, Any]:
    """OpenAI-style error object."""
    return {
        "error": {
            "message": message,
            "type": type_ or HTTPStatus(status).phrase.lower().replace(" ", "_"),
            "code": status,
        }
    }


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


def error_response(status: int, message: str) -> HttpResponse:
    return HttpResponse.json(status, error_body(status, message))


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
                 tls: ssl.SSLContext | None = None) -> None:
        self._handler = handler
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
        self._server = await asyncio.start_server(
            self._on_connection, self._host, self._port, limit=self.max_header_bytes + 2,
            ssl=self._tls,
        )

    async def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop: accept nothing new, close idle connections, give requests being handled up
        to ``grace_s`` to be answered (their connections then close), then cancel the rest,
        each answered 503 (module docstring)."""
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        await cancel_and_wait([t for t in self._conns if t not in self._busy], log)
        busy = list(self._busy)
        if busy and grace_s > 0:
            await asyncio.wait(busy, timeout=grace_s)
        # Bounded even if a connection's handler swallows a cancel (shared/tasks.py).
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
        try:
            keep_alive = True
            while keep_alive:
                try:
                    async with asyncio.timeout(self.idle_timeout_s):
                        request = await self._read_request(reader, str(peer))
                except _Reject as rej:
                    await self._write(writer, error_response(rej.status, rej.message), False)
                    return
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                if request is None:
                    return
                keep_alive = _wants_keep_alive(request)
                head_only = request.method == "HEAD"
                if head_only:  # answered as GET, without the body
                    request = dataclasses.replace(request, method="GET")
                self._busy.add(task)
                try:
                    try:
                        response = await self._handler(request)
                    except asyncio.CancelledError:
                        if self._closing:  # the stop's grace ran out: answer, then go
                            with contextlib.suppress(Exception):
                                async with asyncio.timeout(1.0):
                                    await self._write(writer, error_response(
                                        503, "the gateway is stopping; try again"), False)
                        raise
                    except Exception:
                        log.exception("HTTP handler failed", path=request.path)
                        response = error_response(500, "internal error")
                    keep_alive = keep_alive and not self._closing
                    await self._write(writer, response, keep_alive, head_only=head_only)
                finally:
                    self._busy.discard(task)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader, peer: str) -> HttpRequest | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _Reject(431, f"request head over {self.max_header_bytes} bytes") from None
        except asyncio.IncompleteReadError as exc:
            if not exc.partial.strip():
                return None  # clean close between requests
            raise _Reject(400, "incomplete request head") from None
        if len(head) > self.max_header_bytes:
            raise _Reject(431, f"request head over {self.max_header_bytes} bytes")
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise _Reject(400, "malformed request line") from None
        if not version.startswith("HTTP/1."):
            raise _Reject(505, f"unsupported protocol {version!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _Reject(400, f"malformed header line {line[:60]!r}")
            key = name.lower()
            if key in _ONCE and key in headers:
                raise _Reject(400, f"{name} header given more than once")
            headers[key] = value.strip()
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
        length = int(raw_length)
        if length > self.max_body_bytes:
            raise _Reject(413, f"request body of {length} bytes is over the limit of "
                               f"{self.max_body_bytes} bytes")
        try:
            split = urlsplit(target)
        except ValueError:  # e.g. "http://[::1/x": an unclosed IPv6 host
            raise _Reject(400, f"malformed request target {target[:60]!r}") from None
        body = await reader.readexactly(length) if length else b""
        return HttpRequest(method.upper(), split.path or "/", parse_qs(split.query), headers,
                           body, peer, version)

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


def _wants_keep_alive(request: HttpRequest) -> bool:
    conn = request.headers.get("connection", "").lower()
    if request.version == "HTTP/1.0":
        return conn == "keep-alive"
    return conn != "close"
