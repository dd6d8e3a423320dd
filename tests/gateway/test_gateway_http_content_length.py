"""A ``Content-Length`` of more digits than Python converts (4,300) is answered, not dropped:
413 where its value is over the body limit, and taken as it is where leading zeros make it
long (``1*DIGIT``, RFC 9110). The server keeps serving.

Found by a review of the HTTP server's input checks: ``int()`` of such a header raised
ValueError outside the server's refusals, so the connection was closed without an answer (no
status, no ``X-Request-Id``, no access line) and asyncio logged an "Unhandled exception"
traceback at ERROR -- one a request, for any client to cause."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from services.gateway.httpserver import HttpRequest, HttpResponse, HttpServer

WAIT_S = 30.0  # hang guard for reads, never a speed check
LIMIT = 4096
LONG = 5000  # digits: over CPython's int conversion limit (4300)


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    async def echo(req: HttpRequest) -> HttpResponse:
        return HttpResponse.json(200, {"body": req.body.decode()})

    srv = HttpServer(echo, max_body_bytes=LIMIT)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


async def exchange(port: int, content_length: bytes, body: bytes = b"") -> tuple[int, bytes,
                                                                                  bytes]:
    """One request on a fresh connection: its status line's code, head and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: "
                     + content_length + b"\r\n\r\n" + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
    assert data, "the connection was closed without an answer"
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, rest


async def test_a_length_of_too_many_digits_is_answered_413(server: HttpServer) -> None:
    with capture_logs() as logs:
        status, head, body = await exchange(server.port, b"9" * LONG)
    assert status == 413, head
    assert b"X-Request-Id: " in head
    err = json.loads(body)["error"]
    assert f"over the limit of {LIMIT} bytes" in err["message"]
    assert len(err["message"]) < 300  # the digits are not echoed whole
    assert not [e for e in logs if e["log_level"] == "error"], logs
    # The server goes on serving.
    assert (await exchange(server.port, b"2", b"ok"))[0] == 200


async def test_a_length_long_by_leading_zeros_is_taken_as_it_is(server: HttpServer) -> None:
    status, head, body = await exchange(server.port, b"0" * LONG + b"2", b"ok")
    assert status == 200, head
    assert json.loads(body) == {"body": "ok"}
