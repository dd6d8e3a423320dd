"""What a reply in parts may carry, and a micro error in place of a later part.

``respond_in_parts`` sends its parts as fast as it writes them, without flow control; a
reply of ~100 MiB (within the 1024 parts once documented as about 1 GiB) made nats-server
drop the requester as a slow consumer (its pending bytes past the default 64 MiB
``max_pending``), losing every subscription of that connection. The bound is now
:data:`~shared.service.MAX_REPLY_BYTES` (32 MiB): all of it reaches even a requester that
reads nothing until the last part was sent, and a reply over it is refused by the responder
with a micro error, before any part goes out. Against a real nats-server (default limits:
1 MiB max_payload, 64 MiB max_pending); bounds (``WAIT_S``) are liveness bounds, never speed
checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request
from service_support import service_running

import shared.natsclient as natsclient
from shared.natsserver import EmbeddedNats
from shared.schemas import SchemaError
from shared.service import (
    MAX_REPLY_BYTES,
    PART_HEADER,
    Endpoint,
    MicroService,
    RemoteError,
    message_size,
    request_in_parts,
    respond_in_parts,
)
from shared.settings import ServiceSettings

WAIT_S = 30.0


class Dump(MicroService):
    """``dump``: a reply in parts of as many bytes as the request says; :attr:`sent` is set
    once all of it has reached the server (a flush after the last part)."""

    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(settings, name="vtm-dump", version="0.1.0",
                         group=f"{settings.subject_prefix}.svc")
        self.sent = asyncio.Event()

    def endpoints(self) -> Sequence[Endpoint]:
        async def dump(request: Request) -> None:
            data = bytes(i % 251 for i in range(256)) * (int(request.data) // 256) \
                + b"z" * (int(request.data) % 256)
            await respond_in_parts(self.nc, request, data, {"Content-Type": "x/test"})
            await self.nc.flush()
            self.sent.set()

        return [Endpoint("dump", dump)]


@pytest.fixture
async def dump(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[Dump]:
    svc = Dump(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq))
    async with service_running(svc, timeout_s=WAIT_S):
        yield svc


@pytest.fixture
async def client(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await natsclient.connect(nats_server.url, connect_timeout=5, allow_reconnect=False,
                            error_cb=on_error)
    try:
        yield nc
        assert not errors and nc.is_connected  # never cut off (slow consumer, ...)
    finally:
        await nc.close()


async def read_parts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n_expected: int | None = None) -> tuple[int, int]:
    """Read ``HMSG`` frames of a raw connection until the last part (``i/n`` with i == n):
    how many parts and payload bytes came. Fails on anything else the server says (an
    ``-ERR``: it closed us as a slow consumer)."""
    parts = size = 0
    while True:
        line = await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)
        if line == b"PING\r\n":
            writer.write(b"PONG\r\n")
            continue
        assert line.startswith(b"HMSG "), line
        hdr_len, total = (int(x) for x in line.split()[-2:])
        frame = await asyncio.wait_for(reader.readexactly(total + 2), WAIT_S)
        block = frame[:hdr_len].decode()
        parts += 1
        size += total - hdr_len
        part = next(v for k, _, v in (h.partition(": ") for h in block.split("\r\n"))
                    if k == PART_HEADER)
        i, n = part.split("/")
        if i == n:
            return parts, size


async def test_a_reply_of_the_most_bytes_reaches_a_requester_that_reads_nothing_meanwhile(
        nats_server: EmbeddedNats, dump: Dump, uniq: str) -> None:
    """The worst case of the bound: the whole reply waits in the server (and the sockets)
    for a requester that does not read until the responder has sent the last part."""
    host, port = nats_server.url.split("//", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)  # INFO
        writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n'
                     b"SUB _raw.inbox 1\r\nPING\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S) == b"PONG\r\n"
        subject = f"{uniq}.svc.dump".encode()
        body = str(MAX_REPLY_BYTES).encode()
        writer.write(b"PUB %s _raw.inbox %d\r\n%s\r\n" % (subject, len(body), body))
        await writer.drain()
        await asyncio.wait_for(dump.sent.wait(), WAIT_S)  # all of it is at the server
        parts, size = await read_parts(reader, writer)
        assert size == MAX_REPLY_BYTES and parts > 1
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_reply_over_the_most_bytes_is_refused_by_the_responder_with_a_micro_error(
        dump: Dump, client: Client, uniq: str) -> None:
    with pytest.raises(RemoteError) as err:
        await request_in_parts(client, f"{uniq}.svc.dump", str(MAX_REPLY_BYTES + 1).encode(),
                               timeout_s=WAIT_S)
    assert (err.value.code, err.value.description) == (500, "reply too large")
    assert not dump.sent.is_set()  # refused before any part went out
    # The same endpoint answers a reply within the bound.
    got, headers = await request_in_parts(client, f"{uniq}.svc.dump", b"3000000",
                                          timeout_s=WAIT_S)
    assert len(got) == 3000000 and headers == {"Content-Type": "x/test"}


async def test_the_requester_refuses_parts_of_more_than_the_most_bytes(
        client: Client, uniq: str) -> None:
    room = client.max_payload - message_size(b"", {PART_HEADER: "99/99"})
    n = MAX_REPLY_BYTES // room + 1  # one part more than the bound holds
    chunk = b"p" * room
    subject = f"{uniq}.parts"

    async def answer(msg: Msg) -> None:
        for i in range(1, n + 1):
            await client.publish(msg.reply, chunk, headers={PART_HEADER: f"{i}/{n}"})

    await client.subscribe(subject, cb=answer)
    await client.flush()
    with pytest.raises(SchemaError):
        await request_in_parts(client, subject, b"", timeout_s=WAIT_S)


async def test_a_micro_error_in_place_of_a_later_part_is_raised_as_remote_error(
        client: Client, uniq: str) -> None:
    subject = f"{uniq}.parts"

    async def answer(msg: Msg) -> None:
        await client.publish(msg.reply, b"a", headers={PART_HEADER: "1/2"})
        await client.publish(msg.reply, b"", headers={ERROR_HEADER: "service stopping",
                                                      ERROR_CODE_HEADER: "503"})

    await client.subscribe(subject, cb=answer)
    await client.flush()
    with pytest.raises(RemoteError) as err:  # was SchemaError "part 1/1 after 1 of 2"
        await request_in_parts(client, subject, b"", timeout_s=WAIT_S)
    assert (err.value.code, err.value.description) == (503, "service stopping")
