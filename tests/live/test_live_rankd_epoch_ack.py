"""An EpochAck that fails to publish neither ends the epoch watcher nor is lost.

Real nats-server, real RankdService / RankdHost (sim backend). The fault is injected by
wrapping the connection's ``publish`` so that the first ack publish for one GPU raises
nats-py's OutboundBufferLimitError (what a full outbound buffer raises while disconnected);
everything else goes through. Before the fix the exception ended the epoch watcher (the worker
never adopted a later epoch, the other GPU's ack was never sent) or, for a worker a rank host
started for a new record, failed the worker's start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import OutboundBufferLimitError
from rankd_host_support import record
from service_support import service_running

from services.rankd.backend import SimBackend
from services.rankd.host import RankdHost
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import EpochAck, decode
from shared.service import epoch_kv
from shared.subjects import Subjects
from shared.worker import Lifecycle

WAIT_S = 20.0  # bound for correctness waits only; nothing asserts on speed




def fail_first_ack(
    monkeypatch: pytest.MonkeyPatch, nc: Client, subject: str, epoch: int
) -> list[EpochAck]:
    """Make the first publish of an ack of ``epoch`` on ``subject`` raise; returns the acks
    that were refused (one, once it happened)."""
    real: Callable[..., Awaitable[None]] = nc.publish
    refused: list[EpochAck] = []

    async def publish(subj: str, payload: bytes = b"", *args: object, **kw: object) -> None:
        if subj == subject and not refused:
            ack = decode(EpochAck, payload, kw.get("headers"))  # type: ignore[arg-type]
            if ack.epoch == epoch:
                refused.append(ack)
                raise OutboundBufferLimitError
        await real(subj, payload, *args, **kw)

    monkeypatch.setattr(nc, "publish", publish)
    return refused


class Acks:
    """Every EpochAck published under the prefix, as (gpu, epoch, worker)."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int, str]] = set()
        self._new = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        ack = decode(EpochAck, msg.data, msg.headers)
        self.seen.add((ack.gpu, ack.epoch, ack.worker_id))
        self._new.set()

    async def wait_for(self, wanted: set[tuple[int, int, str]]) -> None:
        async with asyncio.timeout(WAIT_S):
            while not wanted <= self.seen:
                self._new.clear()
                await self._new.wait()


async def test_a_failed_ack_is_sent_again_and_the_watcher_adopts_later_epochs(
    nats_server: EmbeddedNats, nc: Client, uniq: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    wid = "w-cp2-g2"
    s = Subjects(uniq)
    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, worker_id=wid,
                             heartbeat_s=0.2)
    svc = RankdService(settings, SimBackend(time_scale=1.0))
    acks = Acks()
    sub = await nc.subscribe(s.epoch_ack_all(), cb=acks.on_msg)
    try:
        async with service_running(svc, timeout_s=WAIT_S) as task:
            refused = fail_first_ack(monkeypatch, svc.nc, s.epoch_ack(2), epoch=1)
            epochs = await epoch_kv(nc.jetstream(), s)

            await epochs.put(s.epoch_key(), record(1, wid))
            # GPU 2's first ack was refused; it is re-sent, and GPU 3's went out regardless.
            await acks.wait_for({(2, 1, wid), (3, 1, wid)})
            assert [(a.gpu, a.epoch) for a in refused] == [(2, 1)]

            await epochs.put(s.epoch_key(), record(2, wid))  # the watcher is still there
            await acks.wait_for({(2, 2, wid), (3, 2, wid)})
            assert svc.core.epoch == 2 and svc.core.lifecycle is Lifecycle.ACTIVE
            assert not task.done()
    finally:
        await sub.unsubscribe()


async def test_a_worker_whose_first_ack_fails_still_starts_and_acks(
    nats_server: EmbeddedNats, nc: Client, uniq: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank host starts the workers of a new record; each adopts the record while it sets
    up and acknowledges it there: a refused ack must not fail the worker's start."""
    s = Subjects(uniq)
    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2,
                             drain_timeout_s=5)
    host = RankdHost(settings, range(0, 4), lambda wid, kind: SimBackend(time_scale=1.0),
                     initial=["w-cp4-g0"])
    own = await nats.connect(nats_server.url, connect_timeout=5)
    refused = fail_first_ack(monkeypatch, own, s.epoch_ack(0), epoch=1)
    acks = Acks()
    sub = await nc.subscribe(s.epoch_ack_all(), cb=acks.on_msg)
    task = asyncio.create_task(host.run(own, handle_signals=False))
    try:
        async with asyncio.timeout(WAIT_S):
            while host.worker_ids != {"w-cp4-g0"}:
                host.changed.clear()
                await host.changed.wait()
        epochs = await epoch_kv(nc.jetstream(), s)
        await epochs.put(s.epoch_key(), record(1, "w-cp2-g0", "w-cp2-g2"))
        await acks.wait_for({(0, 1, "w-cp2-g0"), (1, 1, "w-cp2-g0"),
                             (2, 1, "w-cp2-g2"), (3, 1, "w-cp2-g2")})
        assert [(a.gpu, a.epoch) for a in refused] == [(0, 1)]
        assert host.worker_ids == {"w-cp2-g0", "w-cp2-g2"}
    finally:
        await sub.unsubscribe()
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
        await own.drain()
