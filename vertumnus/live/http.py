"""A minimal asyncio HTTP/1.1 client for the gateway's JSON API (no extra dependency).

One connection per request (``Connection: close``): a replay opens at most a few hundred
concurrent requests on loopback, and a fresh connection keeps a slow response from delaying
the next request's send (no head-of-line blocking), which matters for TTFT.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    """The connection failed or the response was not HTTP."""


class ConnectionRefused(HttpError):
    """Nothing listens at the URL: the request never reached a server (safe to send again)."""


class GatewayCaError(ValueError):
    """``$VTM_GATEWAY_CA`` names no CA bundle this client can use: a setting to fix here,
    not a gateway that cannot be reached (the message names the variable, the path and
    what is wrong with it)."""


class ConnectionDropped(HttpError):
    """The server closed or lost the connection after the request was sent, before a whole
    response came (it crashed?): the request may have been taken."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


GATEWAY_CA_ENV: Final[str] = "VTM_GATEWAY_CA"
"""The CA bundle (PEM) an ``https://`` gateway's certificate must chain to (unset: the
system's CAs): the client side of the gateway's ``VTM_HTTP_TLS_CERT``."""


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, base path) of an ``http://`` or ``https://host:port[/base]`` URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s)://host:port URL, got {url!r}")
    default = 443 if parts.scheme == "https" else 80
    return parts.hostname, parts.port or default, parts.path.rstrip("/")


def client_tls(url: str) -> ssl.SSLContext | None:
    """The TLS context for ``url``: None for http://; for https://, one that verifies the
    server against ``$VTM_GATEWAY_CA`` (or the system's CAs). Raises
    :class:`GatewayCaError` when the variable names a file that cannot be read (missing, a
    directory, no permission: the OS's reason) or holds no PEM certificate."""
    if urlsplit(url).scheme != "https":
        return None
    ca = os.environ.get(GATEWAY_CA_ENV) or None
    if ca is None:
        return ssl.create_default_context()
    # Read first: OpenSSL's own error for a file it cannot open ("[Errno 21]", or an X509
    # code) does not say which of the two is wrong.
    try:
        with open(ca, "rb"):
            pass
    except OSError as exc:
        raise GatewayCaError(f"{GATEWAY_CA_ENV} {ca!r} cannot be read: "
                             f"{exc.strerror or exc}") from None
    try:
        return ssl.create_default_context(cafile=ca)
    except ssl.SSLError as exc:
        raise GatewayCaError(f"{GATEWAY_CA_ENV} {ca!r} is not a PEM certificate bundle "
                             f"({exc.reason or exc})") from None
    except OSError as exc:  # gone or changed since the read above
        raise GatewayCaError(f"{GATEWAY_CA_ENV} {ca!r} cannot be read: "
                             f"{exc.strerror or exc}") from None


async def request(url: str, method: str = "GET", body: bytes | None = None, *,
                  timeout_s: float = 300.0, api_key: str | None = None) -> Response:
    """One request (with ``Authorization: Bearer api_key`` when given); raises
    :class:`HttpError` on a connection or protocol failure."""
    host, port, path = split_url(url)
    path = path or "/"
    try:
        async with asyncio.timeout(timeout_s):
            try:
                reader, writer = await asyncio.open_connection(host, port, ssl=client_tls(url))
            except ConnectionRefusedError as exc:
                raise ConnectionRefused(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
            try:
                head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}",
                        "Connection: close", "Accept: application/json"]
                if api_key:
                    head.append(f"Authorization: Bearer {api_key}")
                if body is not None:
                    head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode("ascii"))
                if body:
                    writer.write(body)
                try:
                    await writer.drain()
                    status_line = await reader.readline()
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    raise ConnectionDropped(f"{method} {url}: connection lost: "
                                            f"{type(exc).__name__}: {exc}") from exc
                if not status_line:
                    raise ConnectionDropped(f"{method} {url}: connection closed before a "
                                            "response")
                fields = status_line.decode("latin-1").split(" ", 2)
                if len(fields) < 2 or not fields[0].startswith("HTTP/"):
                    raise HttpError(f"not an HTTP response: {status_line[:80]!r}")
                status = int(fields[1])
                headers: dict[str, str] = {}
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = line.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                if "content-length" in headers:
                    data = await reader.readexactly(int(headers["content-length"]))
                else:
                    data = await reader.read()
                return Response(status, headers, data)
            finally:
                writer.close()
                try:
                    await writer.wait_closed()
                except (ConnectionError, OSError):
                    pass
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        raise HttpError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc


async def get_json(url: str, *, timeout_s: float = 10.0,
                   api_key: str | None = None) -> tuple[int, Any]:
    r = await request(url, "GET", timeout_s=timeout_s, api_key=api_key)
    try:
        return r.status, r.json()
    except ValueError:
        return r.status, None


__all__ = [
    "ConnectionDropped",
    "ConnectionRefused",
    "GatewayCaError",
    "HttpError",
    "Response",
    "get_json",
    "request",
    "split_url",
]
