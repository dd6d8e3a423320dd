"""A TLS connection that breaks while the HTTP server reads it (a corrupt record: an
``ssl.SSLError``, which is an OSError but no ConnectionError) ends that connection quietly,
as a reset does; the server goes on serving.

Found by a review of the HTTP server's read path: only ConnectionError (and a timeout, an
incomplete read) ended a connection there, so the SSLError escaped the connection's handler
and asyncio logged "Unhandled exception in client_connected_cb" with a traceback at ERROR --
one for each such connection, for any client to cause (the server's close watch already took
any OSError as the connection lost)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from natssecurity_support import make_pki

from services.gateway.httpserver import HttpRequest, HttpResponse, HttpServer, server_tls

WAIT_S = 30.0  # hang guard for reads, never a speed check


@pytest.fixture
async def tls_server(tmp_path: Path) -> AsyncIterator[tuple[HttpServer, ssl.SSLContext]]:
    pki = make_pki(tmp_path)

    async def ok(req: HttpRequest) -> HttpResponse:
        return HttpResponse.json(200, {"ok": True})

    srv = HttpServer(ok, tls=server_tls(pki["server_cert"], pki["server_key"]))
    await srv.start()
    client = ssl.create_default_context(cafile=str(pki["ca"]))
    try:
        yield srv, client
    finally:
        await srv.close()


def corrupt_record(port: int, ctx: ssl.SSLContext) -> None:
    """A TLS session that sends part of a request head, then a record that fails its MAC
    (written below the TLS layer); reads until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
        tls = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        tls.sendall(b"GET /health HTTP/1.1\r\n")
        plain = socket.socket(fileno=tls.detach())
        try:
            plain.sendall(b"\x17\x03\x03\x00\x10" + b"\x00" * 16)
            while plain.recv(4096):
                pass
        except OSError:
            pass  # reset: the server closed it
        finally:
            plain.close()


def good_request(port: int, ctx: ssl.SSLContext) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            out = b""
            while chunk := tls.recv(4096):
                out += chunk
            return out


async def test_a_corrupt_tls_record_ends_its_connection_without_an_unhandled_error(
        tls_server: tuple[HttpServer, ssl.SSLContext]) -> None:
    srv, ctx = tls_server
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        await asyncio.to_thread(corrupt_record, srv.port, ctx)
        # The server still serves.
        assert (await asyncio.to_thread(good_request, srv.port, ctx)).startswith(
            b"HTTP/1.1 200 ")
        # Every connection's handler ended, and with it what asyncio reports of its end (a
        # done callback of its task, added before the wait's own).
        handlers = [t for t in asyncio.all_tasks()
                    if getattr(t.get_coro(), "__qualname__", "").endswith("_on_connection")]
        if handlers:
            await asyncio.wait(handlers, timeout=WAIT_S)
    finally:
        loop.set_exception_handler(before)
    assert not [c for c in reported if "client_connected_cb" in str(c.get("message"))], \
        reported
