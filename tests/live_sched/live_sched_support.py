"""Helpers of the live gateway + scheduler tests (imported by conftest and the tests; the
unique module name avoids clashes under ``--import-mode=importlib``): in-process services on
the test server, a fake rank worker, a tiny HTTP client, a bounded wait."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import Request
from service_support import ServiceTasks

from services.gateway.adapter import GatewayService
from services.gateway.settings import GatewaySettings
from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.schemas import (
    Assignment,
    AssignmentAck,
    FirstToken,
    IntakeRequest,
    QueueReport,
    TtftStages,
    WorkerState,
    decode,
    encode,
    to_json,
)
from shared.service import respond_in_parts, worker_state_kv
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait
from shared.worker import Lifecycle

WAIT_S = 20.0  # bound on correctness waits only; nothing asserts on speed


async def wait_until(pred: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``pred`` until true (a bound for correctness, not a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# -- services -------------------------------------------------------------------------------


@dataclass
class Services(ServiceTasks):
    """In-process services started on the test server; stopped by the fixture (``close``),
    then ``stack`` is closed."""

    wait_s: ClassVar[float] = WAIT_S

    stack: AsyncExitStack

    _run = ServiceTasks.run  # the name the tests use

    async def scheduler(self, **kw: Any) -> SchedulerService:
        kw.setdefault("instance_id", "sched-" + uuid.uuid4().hex[:6])
        settings = SchedulerSettings(nats_url=self.url, subject_prefix=self.prefix, **kw)
        return await self._run(SchedulerService(settings))  # type: ignore[no-any-return]

    async def gateway(self, **kw: Any) -> GatewayService:
        kw.setdefault("http_port", 0)
        settings = GatewaySettings(nats_url=self.url, subject_prefix=self.prefix, **kw)
        return await self._run(GatewayService(settings))  # type: ignore[no-any-return]

    async def close(self) -> None:
        await super().close()
        await self.stack.aclose()


# -- requests in, answers out ---------------------------------------------------------------


async def publish_intake(nc: Client, uniq: str, rid: str) -> None:
    """A 40-token request ``rid`` (blocks of 16, no hashes) on the intake stream of prefix
    ``uniq``, deduplicated by its id."""
    req = IntakeRequest(request_id=rid, input_len=40, block_size=16, arrival_s=time.time())
    data, headers = encode(req)
    headers["Nats-Msg-Id"] = rid
    await nc.jetstream().publish(Subjects(uniq).intake_requests(), data, headers=headers)


async def results_for(nc: Client, uniq: str, rid: str) -> list[FirstToken]:
    """Every FirstToken published for ``rid`` from now on, in the list returned (filled as
    they come; subscribed and flushed before this returns)."""
    got: list[FirstToken] = []

    async def on(msg: Msg) -> None:
        got.append(decode(FirstToken, msg.data, msg.headers))

    await nc.subscribe(Subjects(uniq).result(rid), cb=on)
    await nc.flush()
    return got


# -- a fake rank worker ----------------------------------------------------------------------


def fake_token(request_id: str) -> int:
    return sum(request_id.encode()) % 32000


@dataclass
class FakeWorker:
    """A plain NATS subscriber on one worker's assign subject (no rankd): acks each
    Assignment (as rankd's endpoint does) and publishes a FirstToken on the request's result
    subject. Publishes its WorkerState to the KV bucket, cache events on demand, and answers
    snapshot requests with the blocks it says it holds."""

    nc: Client
    subjects: Subjects
    worker_id: str
    degree: int
    first_gpu: int
    kv_total_blocks: int = 4096
    assignments: list[Assignment] = field(default_factory=list)
    blocks: dict[int, int | None] = field(default_factory=dict)
    event_id: int = 0
    snapshot_requests: int = 0
    queue_queries: int = 0  # QueueQuery requests answered (it lists what it was assigned)
    reply_results: bool = True
    incarnation: str = ""  # WorkerState.incarnation (a test changes it to play a restart)
    epoch: int = 0  # WorkerState.epoch as published
    outstanding_s: float = 0.0  # WorkerState.outstanding_s / outstanding_by as published
    outstanding_by: dict[str, float] = field(default_factory=dict)
    max_seq_len: int | None = None  # WorkerState.max_seq_len as published (None: not known)
    _subs: list[Any] = field(default_factory=list)

    async def start(self) -> FakeWorker:
        self._subs.append(await self.nc.subscribe(
            self.subjects.worker_assign(self.worker_id), cb=self._on_assign))
        self._subs.append(await self.nc.subscribe(
            self.subjects.worker_queue(self.worker_id), cb=self._on_queue))
        # Last: tests pop it to play a snapshot endpoint that is not up yet.
        self._subs.append(await self.nc.subscribe(
            self.subjects.cache_snapshot(self.worker_id), cb=self._on_snapshot))
        await self.nc.flush()
        await self.publish_state()
        return self

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.unsubscribe()

    async def publish_state(self, lifecycle: Lifecycle = Lifecycle.ACTIVE) -> None:
        kv = await worker_state_kv(self.nc.jetstream(), self.subjects)
        state = WorkerState(
            worker_id=self.worker_id, degree=self.degree,
            gpus=list(range(self.first_gpu, self.first_gpu + self.degree)), epoch=self.epoch,
            lifecycle=lifecycle, queue_len=0, outstanding_s=self.outstanding_s,
            outstanding_by=self.outstanding_by,
            kv_free_blocks=self.kv_total_blocks, kv_total_blocks=self.kv_total_blocks,
            hit_tokens=512, input_tokens=2048, served=1, incarnation=self.incarnation,
            max_seq_len=self.max_seq_len, heartbeat_s=time.time(),
        )
        await kv.put(self.worker_id, to_json(state))

    async def _on_assign(self, msg: Msg) -> None:
        a = decode(Assignment, msg.data, msg.headers)
        self.assignments.append(a)
        ack = AssignmentAck(request_id=a.request.request_id, worker_id=self.worker_id,
                            epoch=a.epoch, queue_position=0)
        data, headers = encode(ack)
        await msg.respond(data)
        if self.reply_results:
            await self.answer(a)

    async def answer(self, a: Assignment) -> None:
        """Publish the FirstToken of an assignment (what it does on its own unless
        ``reply_results`` is off)."""
        now = time.time()
        arrival = a.request.arrival_s
        dequeued = a.dequeued_at_s or arrival
        result = FirstToken(
            request_id=a.request.request_id, token=fake_token(a.request.request_id),
            worker_id=self.worker_id, epoch=a.epoch, predicted_prefill_s=a.predicted_s,
            stages=TtftStages(intake_wait_s=max(0.0, dequeued - arrival),
                              schedule_s=max(0.0, a.assigned_at_s - dequeued),
                              queue_wait_s=0.0, prefill_s=0.001, kv_transfer_s=0.0,
                              first_decode_s=0.0, total_s=max(0.0, now - arrival)),
            finished_at_s=now,
        )
        data, headers = encode(result)
        await self.nc.publish(self.subjects.result(a.request.request_id), data, headers=headers)

    async def _on_queue(self, msg: Msg) -> None:
        self.queue_queries += 1
        # Every assignment it got is queued here, each attempt (arrival stamp) of an id too.
        arrivals: dict[str, list[float]] = {}
        for a in self.assignments:
            arrivals.setdefault(a.request.request_id, []).append(a.request.arrival_s)
        report = QueueReport(worker_id=self.worker_id, queued=list(arrivals),
                             arrivals=list(arrivals.values()))
        data, _ = encode(report)  # JSON: the default content type needs no header
        await msg.respond(data)

    async def _on_snapshot(self, msg: Msg) -> None:
        self.snapshot_requests += 1
        body = {"type": "snapshot", "worker": self.worker_id, "last_event_id": self.event_id,
                "blocks": [[h, p] for h, p in self.blocks.items()]}
        # As a rank daemon answers: in parts when over the server's max_payload.
        await respond_in_parts(self.nc, Request(msg), json.dumps(body).encode())

    async def store(self, parent: int | None, hashes: list[int], *, publish: bool = True,
                    skip_ids: int = 0) -> None:
        """Cache ``hashes`` under ``parent``; publish the stored event (``skip_ids`` > 0
        leaves a gap in the event ids, as if events were lost)."""
        prev = parent
        for h in hashes:
            self.blocks[h] = prev
            prev = h
        self.event_id += 1 + skip_ids
        if publish:
            ev = {"type": "stored", "worker": self.worker_id, "event_id": self.event_id,
                  "parent_hash": parent, "block_hashes": hashes}
            await self.nc.publish(self.subjects.cache_events(self.worker_id),
                                  json.dumps(ev).encode())


# -- a tiny HTTP client -------------------------------------------------------------------------


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def http(port: int, method: str, path: str, body: Any = None, *,
               raw: bytes | None = None, headers: dict[str, str] | None = None) -> HttpReply:
    """One request on a fresh connection (``Connection: close``); returns status, headers,
    body. ``raw`` sends bytes as the body as they are; ``body`` is sent as JSON."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    hdrs = {"Host": "localhost", "Connection": "close", "Content-Length": str(len(payload))}
    if body is not None:
        hdrs["Content-Type"] = "application/json"
    hdrs.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    writer.write(head.encode() + b"\r\n" + payload)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), timeout=WAIT_S)
    writer.close()
    head_b, _, rest = data.partition(b"\r\n\r\n")
    lines = head_b.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    rheaders = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        rheaders[k.strip().lower()] = v.strip()
    return HttpReply(status, rheaders, rest)


@asynccontextmanager
async def heartbeats(workers: list[FakeWorker]) -> AsyncIterator[None]:
    """Every running fake worker of ``workers`` (a list the test may extend) publishes its
    state every 0.2 s; a stopped one does not, so its lease runs out."""
    async def beat() -> None:
        while True:
            for w in list(workers):
                if w._subs:
                    await w.publish_state()
            await asyncio.sleep(0.2)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        await cancel_and_wait([task])
