"""Helpers of the controller / cache-manager live tests: fake workers as plain NATS clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.schemas import EpochAck, EpochRecord, SchemaError, WindowReport, decode, encode
from shared.service import epoch_kv
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait


async def eventually(
    probe: Callable[[], Awaitable[Any]], *, what: str, timeout: float = 30.0
) -> Any:
    """Poll ``probe`` until it returns a truthy value (a liveness bound, not a timed check)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


class Collector:
    """Every message on a subject, decoded as JSON (plain subscriber)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.msgs: list[Msg] = []

    async def cb(self, msg: Msg) -> None:
        self.msgs.append(msg)
        with contextlib.suppress(ValueError):
            self.items.append(json.loads(msg.data))

    async def first(
        self, pred: Callable[[dict[str, Any]], bool] = lambda _: True, *, what: str
    ) -> dict[str, Any]:
        async def probe() -> dict[str, Any] | None:
            return next((i for i in self.items if pred(i)), None)

        return await eventually(probe, what=what)


class FakeRanks:
    """Rank daemons as rankd behaves: adopt every newer epoch record, ack each member GPU.

    ``coalesce_s`` > 0: ranks that are busy (switching their geometry) for that long after a
    record arrives, then adopt and ack only the newest record they have by then -- as a
    rankd whose switch ends after the controller wrote further records does.
    ``lose_epochs``: records whose acks are lost on the way (adopted, never heard of)."""

    def __init__(self, nc: Client, subjects: Subjects, *, coalesce_s: float = 0.0,
                 lose_epochs: frozenset[int] = frozenset()) -> None:
        self.nc = nc
        self.subjects = subjects
        self.coalesce_s = coalesce_s
        self.lose_epochs = lose_epochs
        self.records: list[EpochRecord] = []
        self.acked: list[int] = []  # record epochs acknowledged, in order
        self._task: asyncio.Task[None] | None = None
        self._late: asyncio.Task[None] | None = None
        self._watcher: Any = None

    async def start(self) -> None:
        kv = await epoch_kv(self.nc.jetstream(), self.subjects)
        self._watcher = await kv.watch(self.subjects.epoch_key())
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for entry in self._watcher:
            if entry is None or not entry.value:
                continue
            try:
                rec = decode(EpochRecord, entry.value)
            except SchemaError:
                continue  # as rankd: a value that is no record is ignored
            if self.records and rec.epoch <= self.records[-1].epoch:
                continue
            self.records.append(rec)
            if self.coalesce_s <= 0:
                await self._ack(rec)
            elif self._late is None or self._late.done():
                self._late = asyncio.create_task(self._ack_newest_later())

    async def _ack_newest_later(self) -> None:
        await asyncio.sleep(self.coalesce_s)
        await self._ack(self.records[-1])

    async def _ack(self, rec: EpochRecord) -> None:
        if rec.epoch in self.lose_epochs:
            return
        self.acked.append(rec.epoch)
        for w in rec.workers:
            for gpu in w.group.gpus:
                ack = EpochAck(
                    gpu=gpu,
                    epoch=rec.epoch,
                    degree=w.degree,
                    worker_id=w.worker_id,
                    adopted_at_s=time.time(),
                )
                data, headers = encode(ack)
                await self.nc.publish(self.subjects.epoch_ack(gpu), data, headers=headers)

    async def stop(self) -> None:
        # cancel_and_wait, not cancel-then-await: a cancel a nats-py call drops (shared/tasks.py)
        # would leave the await waiting for ever.
        await cancel_and_wait([t for t in (self._task, self._late) if t is not None])
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()


V2_FIELDS = ("demand_by_preferred", "preferred_degrees", "preferred_speedup")


class FakeScheduler:
    """Publishes one WindowReport per window of ``window_s`` (on the Unix-epoch grid) with
    the demand ``demand()`` returns, as a scheduler replica does.

    ``fields``: extra WindowReport fields of every report (e.g. the demand by preferred
    degree); ``v1``: publish the JSON an older (version-1) scheduler sends, without the
    version-2 fields."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        window_s: float,
        demand: Callable[[], float],
        reporter: str = "sched-a",
        *,
        fields: Callable[[float], dict[str, Any]] | None = None,
        v1: bool = False,
    ) -> None:
        self.nc, self.subjects, self.window_s = nc, subjects, window_s
        self.demand, self.reporter = demand, reporter
        self.fields, self.v1 = fields, v1
        self.sent = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        last = -1
        while True:
            k = math.floor(time.time() / self.window_s)
            if k != last:
                last = k
                demand = self.demand()
                rep = WindowReport(
                    reporter=self.reporter,
                    window_index=k,
                    window_start_s=k * self.window_s,
                    window_s=self.window_s,
                    epoch=0,
                    demand_s=demand,
                    requests=10,
                    long_requests=0,
                    **({"schema_version": 1} if self.v1 else {}),
                    **(self.fields(demand) if self.fields else {}),
                )
                data, headers = encode(rep)
                if self.v1:
                    data = rep.model_dump_json(exclude=set(V2_FIELDS)).encode()
                await self.nc.publish(
                    self.subjects.window_demand(self.reporter), data, headers=headers
                )
                self.sent += 1
            await asyncio.sleep(self.window_s / 8)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])  # as FakeRanks.stop


async def request(nc: Client, subject: str, body: bytes = b"", *, attempts: int = 5) -> Any:
    """``nc.request`` that retries a *no responders* answer a few times.

    NOTE: with nats-server 2.15.1 the first request to an endpoint that was subscribed (and
    flushed) a moment earlier on another connection occasionally gets a 503 although
    ``/subsz`` lists the subscription and an immediate retry succeeds (seen ~1 in 30 service
    starts under load). Services treat no-responders as retryable anyway; tests do the same.
    """
    from nats.errors import NoRespondersError

    for i in range(attempts):
        try:
            return await nc.request(subject, body, timeout=5)
        except NoRespondersError:
            if i == attempts - 1:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("unreachable")
