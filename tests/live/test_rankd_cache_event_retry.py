"""A cache command's events whose publish fails are kept and sent later, in order, under
their own event ids, on a real nats-server with a real RankdService (sim backend).

A worker publishes its cache events on core NATS; the cache manager applies them by event id
and asks for a snapshot only when an id is missing, i.e. on the worker's *next* event. Before,
the events of a command whose publish raised (the connection down with nats-py's reconnect
buffer full: OutboundBufferLimitError) were taken from the cache and lost: a quiet worker
sent nothing more, and the global index stayed wrong for as long as it stayed quiet.

The worker alone loses its connection: it connects through a TCP relay the test cuts and
restores (the test's own connection, subscribed to the events, stays up). Its reconnect buffer
is off (``pending_size=0``, an option the gateway uses), so a publish while it is down raises
as a full buffer does. The command arrives while it is connected; the backend's engine step
(``prepare_cache_command``) holds it until the relay is cut, so it is applied, and its events
published, while the connection is down."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from rankd_support import stopped, until

from services.rankd.backend import SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    CacheCommandResult,
    CacheEvent,
    ReplicateCommand,
    decode,
    encode,
)
from shared.service import call
from shared.subjects import Subjects

WID = "w-cp2-g2"
WAIT_S = 20.0  # bound for correctness waits only; nothing asserts on speed


class Relay:
    """A TCP relay from a local port to ``target`` (host, port): :meth:`cut` drops every
    connection through it and refuses new ones until :meth:`restore`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.cut_off = False
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"nats://127.0.0.1:{port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._links |= {writer, up_writer}
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await src.read(65_536):
                dst.write(data)
                await dst.drain()
        dst.transport.abort()
        self._links.discard(dst)

    def cut(self) -> None:
        self.cut_off = True
        for w in list(self._links):
            w.transport.abort()
        self._links.clear()

    def restore(self) -> None:
        self.cut_off = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)


class HeldEngine(SimBackend):
    """A sim backend whose engine step of a cache command waits for :attr:`go` (a real engine
    moves the KV there; here the test cuts the connection meanwhile)."""

    def __init__(self) -> None:
        super().__init__(prefill_time=lambda r, p, c, kind="cp": 0.01)
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    async def prepare_cache_command(self, cmd: Any) -> Any:
        self.entered.set()
        await self.go.wait()
        return cmd


class Unbuffered(RankdService):
    """rankd without a reconnect buffer: a publish while its connection is down raises
    OutboundBufferLimitError, as with nats-py's buffer full."""

    def connect_options(self) -> dict[str, Any]:
        return {"pending_size": 0}


@contextlib.asynccontextmanager
async def worker_behind(relay_url: str, prefix: str,
                        backend: SimBackend) -> AsyncIterator[RankdService]:
    settings = RankdSettings(nats_url=relay_url, subject_prefix=prefix, worker_id=WID,
                             heartbeat_s=0.2, kv_total_blocks=2, reconnect_wait_s=0.1)
    svc = Unbuffered(settings, backend)
    task = asyncio.create_task(svc.run(handle_signals=False))
    try:
        await asyncio.wait_for(svc.started.wait(), timeout=WAIT_S)
        yield svc
    finally:
        await stopped(svc, task, timeout_s=WAIT_S)


@dataclass
class Rig:
    """A worker behind a relay the test can cut, and the cache events it published."""

    svc: RankdService
    relay: Relay
    backend: HeldEngine
    events: list[CacheEvent]
    subjects: Subjects

    async def send_then_cut(self, nc: Client, command: ReplicateCommand) -> None:
        """Send ``command`` without awaiting its answer (the worker is cut off before it could
        send one) and cut the worker's connection while its engine step waits."""
        data, headers = encode(command)
        await nc.publish(self.subjects.cache_cmd(WID), data, headers=headers,
                         reply=nc.new_inbox())
        await asyncio.wait_for(self.backend.entered.wait(), timeout=WAIT_S)
        self.relay.cut()
        await until(lambda: not self.svc.nc.is_connected, "the worker disconnected")

    async def reconnect(self) -> None:
        self.relay.restore()
        await until(lambda: self.svc.nc.is_connected, "the worker reconnected")


@contextlib.asynccontextmanager
async def rig(nats_server: EmbeddedNats, nc: Client, uniq: str) -> AsyncIterator[Rig]:
    """A :class:`HeldEngine` worker behind a :class:`Relay` to the test server, the events it
    publishes collected from its cache-event subject; all of it gone on the way out."""
    s = Subjects(uniq)
    host, port = nats_server.url.removeprefix("nats://").rsplit(":", 1)
    relay = Relay((host, int(port)))
    relay_url = await relay.start()
    events: list[CacheEvent] = []

    async def got(msg: Msg) -> None:
        events.append(decode(CacheEvent, msg.data, msg.headers))

    sub = await nc.subscribe(s.cache_events(WID), cb=got)
    backend = HeldEngine()
    try:
        async with worker_behind(relay_url, uniq, backend) as svc:
            yield Rig(svc, relay, backend, events, s)
    finally:
        await sub.unsubscribe()
        await relay.close()


async def publish_failed(svc: RankdService, kept: list[int]) -> None:
    """Until the worker has tried to publish its new events while cut off, and kept those
    with ids ``kept`` unsent. A sleep in its place let a slow handler publish only after the
    reconnect: the test then passed without a publish having failed."""
    await until(lambda: svc._events_unsent.is_set(), "the events' publish failed")
    assert [e.event_id for e in svc._unsent_events] == kept


async def test_a_quiet_workers_unsent_cache_events_go_out_once_it_reconnects(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A replicate command is applied while the worker's connection is down: it evicts the
    cached chain (Removed, event 2) and stores the new one (Stored, event 3), and their
    publish fails. The worker then gets nothing else to do. Once its connection is back,
    both events reach the cache manager's subject, in order, with their ids. Before, they
    were lost: the subscriber saw event 1 and nothing after it."""
    s = Subjects(uniq)
    async with rig(nats_server, nc, uniq) as r:
        svc, backend, events = r.svc, r.backend, r.events
        backend.go.set()
        first = ReplicateCommand(command_id="c-1", worker_id=WID, epoch=0, blocks=[1, 2],
                                 source_worker="w-cp2-g0")
        done = await call(nc, s.cache_cmd(WID), first, CacheCommandResult, timeout_s=WAIT_S)
        assert done.ok and done.blocks_done == 2
        await until(lambda: len(events) == 1, "event 1 published")
        backend.go.clear()
        backend.entered.clear()
        await r.send_then_cut(nc, ReplicateCommand(command_id="c-2", worker_id=WID, epoch=0,
                                                   blocks=[3, 4], source_worker="w-cp2-g0"))
        backend.go.set()  # applied now: Removed [1, 2] (2), Stored [3, 4] (3)
        await until(lambda: svc.core.cache_snapshot().last_event_id == 3, "the command applied")
        await publish_failed(svc, [2, 3])
        assert [e.event_id for e in events] == [1]
        await r.reconnect()
        await until(lambda: len(events) >= 3, "the unsent events published")
        await nc.flush()
        assert [(e.type, e.event_id) for e in events] \
            == [("stored", 1), ("removed", 2), ("stored", 3)]
        assert sorted(events[1].block_hashes) == [1, 2] and events[2].block_hashes == [3, 4]

async def test_unsent_cache_events_go_out_before_the_next_commands(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """As above, but the cache manager sends the worker a command as soon as it is back,
    likely before the re-sender's next round: the kept events still go out first, then the
    new command's, every id once and in order."""
    s = Subjects(uniq)
    async with rig(nats_server, nc, uniq) as r:
        svc, backend, events = r.svc, r.backend, r.events
        await r.send_then_cut(nc, ReplicateCommand(command_id="c-1", worker_id=WID, epoch=0,
                                                   blocks=[1, 2], source_worker="w-cp2-g0"))
        backend.go.set()  # Stored [1, 2] (1), unsent
        await until(lambda: svc.core.cache_snapshot().last_event_id == 1, "the command applied")
        await publish_failed(svc, [1])
        await r.reconnect()
        for i, blocks in enumerate(([3], [4]), 2):
            later = ReplicateCommand(command_id=f"c-{i}", worker_id=WID, epoch=0,
                                     blocks=blocks, source_worker="w-cp2-g0")
            done = await call(nc, s.cache_cmd(WID), later, CacheCommandResult,
                              timeout_s=WAIT_S)
            assert done.ok and done.blocks_done == 1
        # [3]: evicts 2 (2), stores 3 (3); [4]: evicts 1 (4), stores 4 (5).
        await until(lambda: len(events) >= 5, "every event published")
        await nc.flush()
        assert [(e.type, e.event_id) for e in events] == [
            ("stored", 1), ("removed", 2), ("stored", 3), ("removed", 4), ("stored", 5)]
