"""``flush()`` of a ``shared.natsclient`` connection ends only after the server has read what
was sent before it: its PING is queued behind the commands queued before it.

nats-py (2.16) writes a flush's PING straight to the socket while a SUB just made may still
wait in its queue for the flusher task, so ``subscribe(); flush()`` could return before the
server had the subscription, and another connection's request then found no responders. The
plain client is run through the same check, so that the test is known to catch the bug
(should that check fail, nats-py fixed it and the override may go).
"""

from __future__ import annotations

from typing import Any

import nats
import nats.aio.client
from nats.aio.msg import Msg

from shared.natsclient import connect
from shared.natsserver import EmbeddedNats

WAIT_S = 30.0  # liveness bound only


def record_writes(nc: nats.aio.client.Client) -> list[bytes]:
    """Every write to ``nc``'s socket from now on, in order (one entry per command line)."""
    out: list[bytes] = []
    transport = nc._transport
    write, writelines = transport.write, transport.writelines

    def w(data: bytes) -> Any:
        out.append(bytes(data))
        return write(data)

    def wl(lines: list[bytes]) -> Any:
        out.extend(bytes(x) for x in lines)
        return writelines(lines)

    transport.write, transport.writelines = w, wl  # type: ignore[method-assign]
    return out


def sub_then_ping(writes: list[bytes]) -> list[str]:
    """The SUB and PING commands among ``writes``, in the order they were written."""
    return [c.split(b" ", 1)[0].strip().decode() for c in writes
            if c.startswith((b"SUB ", b"PING"))]


async def order_on_the_wire(nc: nats.aio.client.Client) -> list[str]:
    """The SUB of a subscription and the PING of the flush after it, in the order ``nc``
    wrote them to its socket; ``nc`` is closed after."""
    try:
        writes = record_writes(nc)
        await nc.subscribe("order.check")
        await nc.flush(timeout=WAIT_S)
        return sub_then_ping(writes)
    finally:
        await nc.close()


async def test_a_flush_writes_its_ping_after_the_subscription_made_before_it(
        nats_server: EmbeddedNats) -> None:
    assert await order_on_the_wire(await connect(nats_server.url)) == ["SUB", "PING"]


async def test_the_plain_client_writes_a_flushs_ping_ahead_of_the_queued_subscription(
        nats_server: EmbeddedNats) -> None:
    assert await order_on_the_wire(await nats.connect(nats_server.url)) == ["PING", "SUB"]


async def test_after_subscribe_and_flush_every_request_of_another_connection_is_answered(
        nats_server: EmbeddedNats) -> None:
    """The behaviour the order gives: 300 subscriptions, each flushed, each asked at once by
    another connection; before, about one in 80 found no responders."""
    a = await connect(nats_server.url)
    b = await nats.connect(nats_server.url)
    try:
        async def answer(msg: Msg) -> None:
            await msg.respond(b"ok")

        for i in range(300):
            sub = await a.subscribe(f"order.ask.{i}", cb=answer)
            await a.flush(timeout=WAIT_S)
            assert (await b.request(f"order.ask.{i}", b"?", timeout=WAIT_S)).data == b"ok"
            await sub.unsubscribe()
    finally:
        await a.close()
        await b.close()
