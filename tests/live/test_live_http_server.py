"""The gateway's HTTP server on its own (services/gateway/httpserver.py): a stop answers the
requests being handled; framing headers cannot be smuggled; HEAD; a client that never reads.

Found by a review of the HTTP handling: a stop cancelled every connection at once (a request
being handled got no answer at all); a repeated ``Content-Length`` or ``Transfer-Encoding``
was overwritten by the last one, and ``Transfer-Encoding: identity`` with a chunked body left
the chunks to be parsed as a second request (request smuggling behind a proxy); ``HEAD`` got a
body, which a client reads as the next response; a client that never read its responses held
its connection for good (the write had no timeout).

A later review: a CRLF (or bare LF) before the request line, which RFC 9112 §2.2 asks a server
to ignore, was a 400; a head whose lines end in bare LFs was never answered (the server
waited for CRLF CRLF until its idle timeout); a client that closed its connection while its
request was handled went unnoticed until the handler's answer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from services.gateway.httpserver import HttpRequest, HttpResponse, HttpServer

WAIT_S = 30.0  # liveness bounds, never speed checks


async def read_response(reader: asyncio.StreamReader, *, head_only: bool = False
                        ) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k:
            headers[k.strip().lower()] = v.strip()
    n = 0 if head_only else int(headers["content-length"])
    body = await asyncio.wait_for(reader.readexactly(n), WAIT_S)
    return int(lines[0].split(" ")[1]), headers, body


async def echo(req: HttpRequest) -> HttpResponse:
    return HttpResponse.json(200, {"method": req.method, "path": req.path,
                                   "auth": req.headers.get("authorization", "")})


async def started(handler=echo, **kw) -> HttpServer:  # type: ignore[no-untyped-def]
    server = HttpServer(handler, **kw)
    await server.start()
    return server


@contextlib.asynccontextmanager
async def serving(handler=echo, **kw) -> AsyncIterator[HttpServer]:  # type: ignore[no-untyped-def]
    """A started server, closed on the way out (for the tests that do not stop it)."""
    server = await started(handler, **kw)
    try:
        yield server
    finally:
        await server.close()


async def send(server: HttpServer, raw: bytes) -> tuple[asyncio.StreamReader,
                                                         asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(raw)
    await writer.drain()
    return reader, writer


async def test_a_stop_answers_the_request_being_handled() -> None:
    release = asyncio.Event()
    entered = asyncio.Event()

    async def slow(req: HttpRequest) -> HttpResponse:
        entered.set()
        await release.wait()
        return HttpResponse.json(200, {"ok": True})

    server = await started(slow)
    reader, writer = await send(server, b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
    idle_r, idle_w = await send(server, b"")  # connected, no request: closed at once
    await asyncio.wait_for(entered.wait(), WAIT_S)
    closing = asyncio.create_task(server.close(grace_s=WAIT_S))
    assert await asyncio.wait_for(idle_r.read(), WAIT_S) == b""
    release.set()
    status, headers, body = await read_response(reader)
    assert (status, headers["connection"], body) == (200, "close", b'{"ok": true}')
    await asyncio.wait_for(closing, WAIT_S)
    writer.close()
    idle_w.close()


async def test_past_the_grace_a_request_being_handled_is_answered_503() -> None:
    entered = asyncio.Event()

    async def never(req: HttpRequest) -> HttpResponse:
        entered.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    server = await started(never)
    reader, writer = await send(server, b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
    await asyncio.wait_for(entered.wait(), WAIT_S)
    await asyncio.wait_for(server.close(grace_s=0.05), WAIT_S)
    status, headers, body = await read_response(reader)
    assert (status, headers["connection"]) == (503, "close") and b"stopping" in body
    writer.close()


@pytest.mark.parametrize(
    ("head", "status", "needle"),
    [
        (b"POST /x HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}", 400,
         b"Content-Length header given more than once"),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n"
         b"\r\n5\r\nhello\r\n0\r\n\r\n", 400, b"Transfer-Encoding header given more than once"),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", 400,
         b"both Transfer-Encoding and Content-Length"),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501, b"not supported"),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411,
         b"chunked request bodies"),
        (b"GET /x HTTP/1.1\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n", 400,
         b"Authorization header given more than once"),
    ],
)
async def test_framing_and_credentials_cannot_be_given_twice(head: bytes, status: int,
                                                            needle: bytes) -> None:
    async with serving() as server:
        reader, writer = await send(server, head)
        code, headers, body = await read_response(reader)
        assert (code, headers["connection"]) == (status, "close") and needle in body, body
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # nothing parsed after
        writer.close()


async def test_head_is_get_without_the_body_and_the_connection_stays_in_step() -> None:
    async with serving() as server:
        reader, writer = await send(server, b"HEAD /x HTTP/1.1\r\nHost: h\r\n\r\n"
                                            b"GET /y HTTP/1.1\r\nHost: h\r\n\r\n")
        code, headers, body = await read_response(reader, head_only=True)
        assert code == 200 and int(headers["content-length"]) > 0
        code, _, body = await read_response(reader)
        assert code == 200 and b'"path": "/y"' in body and b'"method": "GET"' in body
        writer.close()


async def test_a_header_named_like_an_internal_key_is_only_a_header() -> None:
    async with serving() as server:
        reader, writer = await send(server, b"GET /x HTTP/1.1\r\n_version: HTTP/1.0\r\n\r\n")
        code, headers, _ = await read_response(reader)
        assert (code, headers["connection"]) == (200, "keep-alive")
        writer.close()


async def test_a_client_that_never_reads_loses_its_connection() -> None:
    async def big(req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b"x" * (32 << 20))

    async with serving(big, idle_timeout_s=0.3) as server:
        reader, writer = await send(server, b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
        for _ in range(int(WAIT_S / 0.05)):  # a liveness bound
            if not server._conns:
                break
            await asyncio.sleep(0.05)
        assert not server._conns, "the connection of a client that never reads stays"
        writer.close()


@pytest.mark.parametrize("lead", [b"\r\n", b"\n", b"\r\n\n\r\n", b"\r\n" * 8])
async def test_empty_lines_before_the_request_line_are_skipped(lead: bytes) -> None:
    async with serving() as server:
        reader, writer = await send(server, lead + b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
        code, headers, body = await read_response(reader)
        assert (code, headers["connection"]) == (200, "keep-alive") and b'"/x"' in body, body
        # Old clients send a CRLF after a POST body: the next request on the connection.
        writer.write(b"POST /y HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}\r\n"
                     b"GET /z HTTP/1.1\r\nHost: h\r\n\r\n")
        code, _, body = await read_response(reader)
        assert code == 200 and b'"/y"' in body, body
        code, _, body = await read_response(reader)
        assert code == 200 and b'"/z"' in body, body
        writer.close()


@pytest.mark.parametrize(
    ("head", "needle"),
    [
        # Before: 400 "malformed request line" for these too, or no answer at all (bare LF).
        (b"\r\n" * 9 + b"GET /x HTTP/1.1\r\n\r\n", b"more than 8 empty lines"),
        (b"GET /x HTTP/1.1\nHost: h\n\n", b"must end with CRLF"),
        (b"GET /x HTTP/1.1\r\nHost: h\n\r\n", b"must end with CRLF"),
        (b"GET /x HTTP/1.1\r\nHost: h\rX: y\r\n\r\n", b"must end with CRLF"),
        (b"GET /x\r\nHost: h\r\n\r\n", b"malformed request line"),
        (b" /x HTTP/1.1\r\nHost: h\r\n\r\n", b"malformed request line"),
        (b"GET  /x HTTP/1.1\r\nHost: h\r\n\r\n", b"malformed request line"),
    ],
)
async def test_a_malformed_request_line_is_answered_400_at_once(head: bytes,
                                                                needle: bytes) -> None:
    # The idle timeout is far above WAIT_S: an answer can only come from the parse itself.
    async with serving(idle_timeout_s=3600.0) as server:
        reader, writer = await send(server, head)
        code, headers, body = await read_response(reader)
        assert (code, headers["connection"]) == (400, "close") and needle in body, body
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
        writer.close()
        # The server keeps serving.
        reader, writer = await send(server, b"GET /ok HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.close()


async def test_a_client_that_closes_its_connection_is_told_to_the_handler() -> None:
    """``HttpRequest.disconnected`` completes when the client goes away while its request is
    handled; nothing is written to it, and the server keeps serving."""
    seen: list[HttpRequest] = []
    release = asyncio.Event()

    async def waits(req: HttpRequest) -> HttpResponse:
        seen.append(req)
        assert req.disconnected is not None
        await asyncio.wait([req.disconnected, asyncio.ensure_future(release.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        return HttpResponse.json(200, {"gone": req.disconnected.done()})

    async with serving(waits) as server:
        reader, writer = await send(server, b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
        for _ in range(int(WAIT_S / 0.05)):  # a liveness bound
            if seen:
                break
            await asyncio.sleep(0.05)
        assert seen and not seen[0].disconnected.done()  # type: ignore[union-attr]
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(seen[0].disconnected, WAIT_S)  # type: ignore[arg-type]
        for _ in range(int(WAIT_S / 0.05)):
            if not server._conns:
                break
            await asyncio.sleep(0.05)
        assert not server._conns
        # A client that stays, with a request pipelined behind its first, is not "gone".
        reader, writer = await send(server, b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n"
                                            b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n")
        for _ in range(int(WAIT_S / 0.05)):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.05)
        release.set()
        assert (await read_response(reader))[2] == b'{"gone": false}'
        assert (await read_response(reader))[2] == b'{"gone": false}'
        writer.close()


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    """A client that sends ``Expect: 100-continue`` holds its body back until ``100
    Continue`` (curl does, for bodies over 1 MiB): it gets it, sends the body, gets its
    answer. An oversized body gets its 413 instead (nothing to send); another expectation,
    417. Before, the server waited for the withheld body until the client gave up."""
    async with serving(max_body_bytes=1024) as server:
        reader, writer = await send(server, b"POST /x HTTP/1.1\r\nHost: h\r\n"
                                            b"Content-Length: 2\r\nExpect: 100-Continue\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"{}")
        status, _, body = await read_response(reader)
        assert status == 200 and b'"method": "POST"' in body
        writer.close()
        reader, writer = await send(server, b"POST /x HTTP/1.1\r\nHost: h\r\n"
                                            b"Content-Length: 4096\r\nExpect: 100-continue"
                                            b"\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert (status, headers["connection"]) == (413, "close"), body
        writer.close()
        reader, writer = await send(server, b"POST /x HTTP/1.1\r\nHost: h\r\n"
                                            b"Content-Length: 2\r\nExpect: gold\r\n\r\n{}")
        status, _, body = await read_response(reader)
        assert status == 417 and b"100-continue" in body
        writer.close()


async def test_a_port_that_cannot_be_bound_is_an_error_naming_it() -> None:
    """A port in use (or an address of no interface here) raises InvalidInput naming the
    settings, which the service's main turns into one line and exit status 2 (it was a
    traceback and status 1)."""
    from shared.ids import InvalidInput

    async with serving() as busy:
        other = HttpServer(echo, port=busy.port)
        with pytest.raises(InvalidInput, match=f"127.0.0.1:{busy.port} .*http_port"):
            await other.start()
    # An address of no interface here (TEST-NET-1, RFC 5737): no name lookup involved.
    with pytest.raises(InvalidInput, match="192.0.2.1"):
        await HttpServer(echo, host="192.0.2.1", port=0).start()
