"""One malformed message from any client must not make a connection of ours deaf.

nats-py parses each message in its read loop; a header block it cannot read (the 8 bytes
``XXXX\\r\\n\\r\\n``: IndexError) or a subject that is not UTF-8 (UnicodeDecodeError) ended
that loop with a log line only, and the connection still looked connected: a service then
answered nothing until its pings went stale, and a stream that stored such a message broke
each consumer it was delivered to. ``shared.natsclient.Client`` marks an unreadable header
block (:data:`~shared.natsclient.MALFORMED_HEADERS`) and drops a message it cannot name; a
service answers a request of the first kind 400.

The messages are written by a raw socket of the test's own (no client library writes them),
against a real nats-server. Bounds (``WAIT_S``) are liveness bounds, never speed checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import nats
import pytest
from malformed_support import WAIT_S, hpub, send_raw
from nats.js.api import AckPolicy, ConsumerConfig
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request
from service_support import service_running

from shared.natsclient import MALFORMED_HEADERS, Client, connect
from shared.natsserver import EmbeddedNats
from shared.service import Endpoint, MicroService, PullConsumer
from shared.settings import ServiceSettings

BAD_BLOCKS = [
    pytest.param(b"XXXX\r\n\r\n", id="8-bytes-no-NATS/1.0"),  # nats-py: IndexError
    pytest.param(b"\r\n\r\n", id="4-bytes"),  # nats-py: IndexError
    pytest.param(b"XXXXXXXX\r\nk: v\r\n\r\n", id="no-NATS/1.0-line"),  # read past unchecked
    pytest.param(b"NATS/1.0 \xff\xfe\xfd\r\n\r\n", id="status-not-utf8"),  # UnicodeDecodeError
]


class Echo(MicroService):
    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(settings, name="vtm-malformed", version="0.1.0",
                         group=f"{settings.subject_prefix}.svc")

    def endpoints(self) -> Sequence[Endpoint]:
        async def echo(request: Request) -> bytes:
            return b"echo:" + request.data

        return [Endpoint("echo", echo)]


@pytest.fixture
async def echo(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[Echo]:
    svc = Echo(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq))
    async with service_running(svc, timeout_s=WAIT_S):
        yield svc


@pytest.fixture
async def client(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    nc = await connect(nats_server.url, connect_timeout=5)
    try:
        yield nc
    finally:
        await nc.close()


@pytest.mark.parametrize("block", BAD_BLOCKS)
async def test_a_request_with_a_malformed_header_block_is_answered_400_and_serving_goes_on(
        nats_server: EmbeddedNats, echo: Echo, client: Client, uniq: str,
        block: bytes) -> None:
    subject = f"{uniq}.svc.echo".encode()
    inbox = client.new_inbox()
    replies = await client.subscribe(inbox)
    await client.flush()
    await send_raw(nats_server, hpub(subject, block, b"{}", reply=inbox.encode()))
    answer = await replies.next_msg(timeout=WAIT_S)  # the old read loop ended: none came
    assert answer.headers is not None
    assert answer.headers[ERROR_CODE_HEADER] == "400"
    assert answer.headers[ERROR_HEADER].startswith("malformed header block")
    # The service reads on: the next request is answered.
    assert (await client.request(subject.decode(), b"next", timeout=WAIT_S)).data == b"echo:next"
    assert echo.nc.is_connected


@pytest.mark.parametrize("block", BAD_BLOCKS)
async def test_a_subscriber_gets_a_malformed_header_block_marked_and_reads_on(
        nats_server: EmbeddedNats, client: Client, uniq: str, block: bytes) -> None:
    sub = await client.subscribe(f"{uniq}.>")
    await client.flush()
    await send_raw(nats_server, hpub(f"{uniq}.bad".encode(), block, b"body")
                   + b"PUB %s 4\r\ngood\r\n" % f"{uniq}.good".encode())
    bad = await sub.next_msg(timeout=WAIT_S)
    assert (bad.subject, bad.data) == (f"{uniq}.bad", b"body")
    assert bad.headers is not None and list(bad.headers) == [MALFORMED_HEADERS]
    good = await sub.next_msg(timeout=WAIT_S)
    assert (good.subject, good.data, good.headers) == (f"{uniq}.good", b"good", None)


async def test_a_message_whose_subject_or_reply_subject_is_not_utf8_is_dropped(
        nats_server: EmbeddedNats, echo: Echo, client: Client, uniq: str) -> None:
    sub = await client.subscribe(f"{uniq}.>")
    await client.flush()
    u = uniq.encode()
    await send_raw(nats_server,
                   b"PUB " + u + b".x \xff\xfe 2\r\n{}\r\n"  # reply subject
                   + b"PUB " + u + b".\xff 2\r\n{}\r\n"  # subject (a wildcard takes it)
                   + b"PUB " + u + b".svc.echo \xff\xfe 2\r\n{}\r\n"  # a request to a service
                   + b"PUB " + u + b".good 4\r\ngood\r\n")
    got = await sub.next_msg(timeout=WAIT_S)  # the first readable one
    assert (got.subject, got.data) == (f"{uniq}.good", b"good")
    answer = await client.request(f"{uniq}.svc.echo", b"next", timeout=WAIT_S)
    assert answer.data == b"echo:next"


async def test_a_stored_message_with_a_malformed_header_block_is_delivered_marked_and_acked(
        nats_server: EmbeddedNats, client: Client, uniq: str) -> None:
    """JetStream stores the header block as it came: each delivery of it broke the consumer's
    connection. Now it is delivered (marked), its ack reaches the server, and what follows it
    in the stream is delivered too."""
    js = client.jetstream()
    stream, durable = f"S{uniq}", "d"
    await js.add_stream(name=stream, subjects=[f"{uniq}.in.>"])
    try:
        await js.add_consumer(stream, ConsumerConfig(durable_name=durable,
                                                     ack_policy=AckPolicy.EXPLICIT))
        await send_raw(nats_server, hpub(f"{uniq}.in.bad".encode(), b"XXXX\r\n\r\n", b"poison"))
        await js.publish(f"{uniq}.in.good", b"good")
        got: asyncio.Queue[nats.aio.msg.Msg] = asyncio.Queue()

        async def handle(msg: nats.aio.msg.Msg) -> None:
            await msg.ack_sync(timeout=WAIT_S)  # a round trip: the connection reads
            got.put_nowait(msg)

        consumer = PullConsumer(client, stream=stream, consumer=durable, handler=handle)
        await consumer.start()
        try:
            bad = await asyncio.wait_for(got.get(), WAIT_S)
            good = await asyncio.wait_for(got.get(), WAIT_S)
        finally:
            await consumer.stop(timeout_s=WAIT_S)
        assert (bad.data, list(bad.headers or {})) == (b"poison", [MALFORMED_HEADERS])
        assert (good.data, good.headers) == (b"good", None)
        info = await js.consumer_info(stream, durable)
        assert (info.num_ack_pending, info.num_pending) == (0, 0)
    finally:
        await js.delete_stream(stream)
