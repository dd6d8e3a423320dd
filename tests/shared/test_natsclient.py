"""A connection made by ``shared.natsclient`` keeps working after a flush timed out.

nats-py's ``flush(timeout=...)`` cancels its PONG waiter on timeout and leaves it queued; the
PONG that comes later is ``set_result`` on that cancelled future, the ``InvalidStateError``
ends the client's read loop (a log line only), and the connection looks connected but never
reads again. Reproduced with a real nats-server, frozen (SIGSTOP) so that a flush's PONG
cannot come within its timeout, then resumed (SIGCONT) so that it comes late. The plain
nats-py client is run through the same steps once, so that the test is known to catch the
bug (should that check fail, nats-py fixed it and ``shared.natsclient.Client`` may go).

Bounds (``WAIT_S``) are liveness bounds, never speed checks.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Iterator

import nats
import nats.aio.client
import pytest
from frozen import freeze, resume
from nats.aio.msg import Msg
from service_support import service_running

from shared.natsclient import Client, connect
from shared.natsserver import EmbeddedNats
from shared.service import MicroService
from shared.settings import ServiceSettings
from vertumnus.live.tap import connect_cli

WAIT_S = 30.0
FLUSH_TIMEOUT_S = 0.2  # the flush that times out: the server is frozen, no PONG can come


@pytest.fixture(scope="module")
def frozen_server() -> Iterator[EmbeddedNats]:
    """A nats-server of this module's own: the tests freeze it, which would stall the
    session's server for every other test's connection."""
    srv = EmbeddedNats(jetstream=False).start()
    try:
        yield srv
    finally:
        srv.stop()


async def time_a_flush_out(server: EmbeddedNats, nc: nats.aio.client.Client) -> None:
    """Freeze ``server``, let a flush of ``nc`` time out (nats-py's FlushTimeoutError path),
    and resume it: the flush's PONG then comes after its waiter was cancelled."""
    freeze(server)
    try:
        with pytest.raises(nats.errors.FlushTimeoutError):
            await nc.flush(timeout=FLUSH_TIMEOUT_S)  # type: ignore[arg-type]  # int in stubs
    finally:
        resume(server)


async def echo(nc: nats.aio.client.Client, subject: str) -> None:
    """Answer each request on ``subject`` with its own payload."""

    async def reply(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(subject, cb=reply)
    await nc.flush(timeout=int(WAIT_S))


async def test_a_connection_survives_a_flush_that_timed_out(
        frozen_server: EmbeddedNats, uniq: str) -> None:
    nc = await connect(frozen_server.url, connect_timeout=5)
    try:
        assert isinstance(nc, Client)
        await echo(nc, f"{uniq}.echo")
        await time_a_flush_out(frozen_server, nc)
        # Request/reply on the same connection (the plain client never reads the reply).
        reply = await nc.request(f"{uniq}.echo", b"after", timeout=WAIT_S)
        assert reply.data == b"after"
        # Publish/subscribe, and a flush that waits for its own PONG.
        sub = await nc.subscribe(f"{uniq}.news")
        await nc.flush(timeout=int(WAIT_S))
        await nc.publish(f"{uniq}.news", b"news")
        assert (await sub.next_msg(timeout=WAIT_S)).data == b"news"
        # Twice in a row: the late PONG of the first did not shift the waiters.
        await time_a_flush_out(frozen_server, nc)
        reply = await nc.request(f"{uniq}.echo", b"again", timeout=WAIT_S)
        assert reply.data == b"again"
        assert nc.is_connected
    finally:
        await nc.close()


async def skip_unless_the_plain_client_has_the_bug() -> None:
    """Skip (naming why) once the installed nats-py handles a PONG for a cancelled waiter
    itself: the plain-client tests then have nothing to show, and the subclass may go. A
    newer nats-py within the pinned range must not turn the suite red on its own."""
    nc = nats.aio.client.Client()
    given_up = asyncio.get_running_loop().create_future()
    given_up.cancel()
    nc._pongs = [given_up]
    try:
        await nc._process_pong()
    except asyncio.InvalidStateError:
        return
    version = importlib.metadata.version("nats-py")
    pytest.skip(f"nats-py {version} no longer raises on a PONG for a cancelled waiter: "
                "shared.natsclient.Client may go")


async def test_the_plain_nats_py_client_is_broken_by_a_flush_that_timed_out(
        frozen_server: EmbeddedNats, uniq: str) -> None:
    """What the test above guards against (on nats-py up to 2.16 at least)."""
    await skip_unless_the_plain_client_has_the_bug()
    nc = await nats.connect(frozen_server.url, connect_timeout=5)
    try:
        await echo(nc, f"{uniq}.echo")
        await time_a_flush_out(frozen_server, nc)
        reading = nc._reading_task  # nats-py's read loop (private)
        assert reading is not None
        # The late PONG ends it (InvalidStateError); wait for that, not for a timeout.
        await asyncio.wait_for(asyncio.shield(reading), WAIT_S)
        assert nc.is_connected, "looks connected"
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(f"{uniq}.echo", b"lost", timeout=0.5)  # can never be read
    finally:
        await nc.close()


# -- the PONG handling alone (no server) --------------------------------------------------


async def test_a_pong_whose_waiter_was_cancelled_is_consumed_and_the_next_reaches_its_own(
        ) -> None:
    nc = Client()
    loop = asyncio.get_running_loop()
    given_up, waiting = loop.create_future(), loop.create_future()
    given_up.cancel()
    nc._pongs = [given_up, waiting]
    nc._pings_outstanding = 1
    await nc._process_pong()  # answers the PING of the cancelled waiter
    assert nc._pongs == [waiting]
    assert not waiting.done()  # its own PING is still outstanding
    assert (nc._pongs_received, nc._pings_outstanding) == (1, 0)
    await nc._process_pong()
    assert waiting.result() is True
    assert nc._pongs == []
    assert nc._pongs_received == 2
    await nc._process_pong()  # no PING outstanding: ignored, as nats-py does
    assert nc._pongs_received == 2


async def test_the_plain_client_raises_on_a_pong_whose_waiter_was_cancelled() -> None:
    """The bug itself, as nats-py has it (what ends its read loop)."""
    await skip_unless_the_plain_client_has_the_bug()
    nc = nats.aio.client.Client()
    given_up = asyncio.get_running_loop().create_future()
    given_up.cancel()
    nc._pongs = [given_up]
    with pytest.raises(asyncio.InvalidStateError):
        await nc._process_pong()


# -- the project's own connections are made with it ---------------------------------------


async def test_a_service_and_a_command_line_tool_connect_with_it(
        nats_server: EmbeddedNats, uniq: str) -> None:
    svc = MicroService(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq),
                       name="vtm-natsclienttest", version="0.1.0", group=f"{uniq}.svc")
    async with service_running(svc, timeout_s=WAIT_S):
        assert isinstance(svc.nc, Client)
    nc = await connect_cli(nats_server.url, "vtm-natsclienttest")
    try:
        assert isinstance(nc, Client)
    finally:
        await nc.close()
