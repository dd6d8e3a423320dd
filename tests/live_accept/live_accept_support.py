"""Helpers of the live acceptance tests (unique module name for ``--import-mode=importlib``).

Everything here drives *real* processes: :class:`vertumnus.live.stack.LiveStack` starts an
embedded ``nats-server`` and every service as a child process (rank daemons on the ``sim``
backend timed by the ground truth × a small time scale). The helpers only watch and send:

* :class:`ResultTap` — every FirstToken published on ``{prefix}.result.*`` (duplicates kept,
  so "exactly once" is checked on the wire, not through the gateway's single answer);
* :class:`EpochLog` — every epoch record written (by the controller or by a test acting as
  it), by epoch;
* :func:`fire_steady` — requests through the gateway's HTTP API at a steady rate, each with a
  client-chosen id, every HTTP answer kept per id;
* :func:`geometry_violations` — FirstTokens whose worker is not in the composition of their
  epoch, and pairs of requests that ran at the same time on overlapping GPU groups of two
  different workers (a request "across two geometries").

Waits are bounded (correctness only); nothing asserts on speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from service_support import ServiceTasks

import shared.natsclient as natsclient
from services.scheduler.service import SchedulerService
from shared.schemas import EpochRecord, FirstToken, SchemaError, decode
from shared.service import epoch_kv, until_served
from shared.subjects import Subjects
from shared.worker import GpuGroup
from vertumnus.live.http import HttpError, request
from vertumnus.live.stack import LiveStack, UpConfig

WAIT_S = 90.0  # bound on correctness waits only (a loaded 2-core machine); never a speed check
BLOCKER_LEN = 4000
"""Input length of a request that holds a :meth:`InProcess.blocked_rankd` worker (its prefill
takes 120 s) while what is assigned after it waits queued."""

CRASH_MAX_DELIVER = 100
"""``max_deliver`` for the schedulers of a test with a :class:`DiesBeforeDispatchedRecord`:
each delivery the dead replica fetches and drops counts, so well above how many ack_waits a
loaded machine may take before the test stops it."""


class DiesBeforeDispatchedRecord(SchedulerService):
    """A scheduler replica that dies in the window a SIGKILL can hit by chance: the worker has
    acknowledged the assignment, and neither the ``dispatched`` record nor the intake ack is
    written (the record stays ``dispatching``; the message is redelivered after ack_wait).

    Dead from then on: it takes no further delivery (a dead process neither acks nor naks).
    Before, it went on serving until the test stopped it, and on a loaded machine (a stop more
    than ack_wait after the crash) the redelivery came back to it -- handled correctly, but
    not by the second replica the test hands it to (seen in CI). Give it and that replica
    ``max_deliver=CRASH_MAX_DELIVER``."""

    died = False

    async def _put_record(self, a, seq, msg_id, state, *args, **kw):  # type: ignore[no-untyped-def]
        if state == "dispatched":
            self.died = True
            raise ConnectionError("killed before the dispatched record")
        return await super()._put_record(a, seq, msg_id, state, *args, **kw)

    async def _on_intake(self, msg: Msg) -> None:
        if not self.died:
            await super()._on_intake(msg)
VOCAB = 151_936


async def wait_until(pred: Callable[[], bool], what: str, timeout_s: float = WAIT_S,
                     poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(poll_s)


async def quiescent(nc: Client, subjects: Subjects, workers: Sequence[str],
                    besides: Sequence[str] = (), held: Callable[[], int] = lambda: 0) -> bool:
    """Nothing more can execute: the intake consumer has no message waiting (``num_pending``)
    nor any delivered and unacknowledged (``num_ack_pending``: no redelivery can come), and
    each of ``workers`` reports an empty FIFO and nothing in flight (one with no responders
    runs nothing). Intake is read again after the workers, so a request a worker handed back
    meanwhile shows there. ``besides``: request ids a worker may still hold (e.g. a blocker
    occupying it on purpose, sent straight to it and not through intake). ``held``: how many
    intake messages a live in-process scheduler holds (``hold_intake``: renewed, so none of
    them is redelivered while it runs); that many may stay unacknowledged."""
    import nats.errors

    from shared.schemas import QueueQuery, QueueReport
    from shared.service import call

    async def intake_idle() -> bool:
        info = await nc.jetstream().consumer_info(subjects.intake_stream(),
                                                  subjects.intake_consumer())
        return info.num_pending == 0 and info.num_ack_pending <= held()

    if not await intake_idle():
        return False
    for wid in workers:
        try:
            rep = await call(nc, subjects.worker_queue(wid), QueueQuery(worker_id=wid),
                             QueueReport, timeout_s=5.0)
        except nats.errors.NoRespondersError:
            continue
        if set(rep.queued) - set(besides) or set(rep.in_flight) - set(besides):
            return False
    return await intake_idle()


async def wait_quiescent(nc: Client, subjects: Subjects, workers: Sequence[str],
                         besides: Sequence[str] = (), held: Callable[[], int] = lambda: 0,
                         timeout_s: float = WAIT_S) -> None:
    """Wait (bounded) until :func:`quiescent`, then flush: what was published is delivered."""
    deadline = time.monotonic() + timeout_s
    while not await quiescent(nc, subjects, workers, besides, held):
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for intake and the workers to be idle")
        await asyncio.sleep(0.05)
    await nc.flush()


# -- the stack ------------------------------------------------------------------------------


class StackWithoutController(LiveStack):
    """The live stack minus the controller: a test writes the epoch records itself, exactly as
    the controller would (compare-and-set on the record key), so a split and a merge happen
    at known moments."""

    def specs(self, nats_url: str):  # type: ignore[no-untyped-def]
        return [(info, spec) for info, spec in super().specs(nats_url)
                if info.name != "controller"]


def small_config(**kw: Any) -> UpConfig:
    """8 GPUs, degrees {2, 4}, a tiny time scale (modelled seconds run 50× faster)."""
    base: dict[str, Any] = dict(gpus=8, degrees=(2, 4), time_scale=0.02,
                                health_timeout_wall_s=120.0, stop_timeout_wall_s=10.0,
                                log_level="info")  # logs stay in tmp_path for diagnosis
    base.update(kw)
    return UpConfig(**base)


@contextlib.asynccontextmanager
async def running_stack(config: UpConfig, log_dir: Path | None = None, *,
                        cls: type[LiveStack] = LiveStack) -> AsyncIterator[LiveStack]:
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="vtm-accept-"))
    stack = cls(config, log_dir=log_dir)
    try:
        await stack.start()
        yield stack
    finally:
        await stack.stop()


# -- watching ---------------------------------------------------------------------------------


@dataclass
class ResultTap:
    """Every FirstToken on ``{prefix}.result.*`` in arrival order (duplicates kept)."""

    nc: Client
    subjects: Subjects
    results: list[FirstToken] = field(default_factory=list)
    malformed: int = 0
    _sub: Any = None

    async def start(self) -> ResultTap:
        self._sub = await self.nc.subscribe(self.subjects.result_all(), cb=self._on)
        await self.nc.flush()
        return self

    async def _on(self, msg: Msg) -> None:
        try:
            self.results.append(decode(FirstToken, msg.data, msg.headers))
        except SchemaError:
            self.malformed += 1

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    def by_id(self) -> dict[str, list[FirstToken]]:
        out: dict[str, list[FirstToken]] = defaultdict(list)
        for r in self.results:
            out[r.request_id].append(r)
        return out

    def ok_ids(self) -> set[str]:
        return {r.request_id for r in self.results if r.error is None}


@dataclass
class EpochLog:
    """Every epoch record seen on the record key (watch from the start), by epoch."""

    nc: Client
    subjects: Subjects
    records: dict[int, EpochRecord] = field(default_factory=dict)
    _watcher: Any = None
    _task: asyncio.Task[None] | None = None

    async def start(self) -> EpochLog:
        kv = await epoch_kv(self.nc.jetstream(), self.subjects)
        self._watcher = await kv.watch(self.subjects.epoch_key())
        self._task = asyncio.create_task(self._follow())
        return self

    async def _follow(self) -> None:
        async for entry in self._watcher:
            if entry is None or not entry.value:
                continue
            with contextlib.suppress(SchemaError):
                rec = decode(EpochRecord, entry.value)
                self.records[rec.epoch] = rec

    async def stop(self) -> None:
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def compositions(self) -> list[tuple[int, tuple[str, ...]]]:
        """(epoch, sorted worker ids) at each change of the worker set."""
        out: list[tuple[int, tuple[str, ...]]] = []
        for e in sorted(self.records):
            ws = tuple(sorted(w.worker_id for w in self.records[e].workers))
            if not out or out[-1][1] != ws:
                out.append((e, ws))
        return out


def splits_and_merges(log: EpochLog) -> tuple[int, int]:
    """(splits, merges) between consecutive worker sets of the log."""
    splits = merges = 0
    comps = log.compositions()
    for (_, a), (_, b) in zip(comps, comps[1:], strict=False):
        da = sorted(GpuGroup.from_worker_id(w).degree for w in set(a) - set(b))
        db = sorted(GpuGroup.from_worker_id(w).degree for w in set(b) - set(a))
        if da and db:
            if max(db) < max(da):
                splits += 1
            elif max(db) > max(da):
                merges += 1
    return splits, merges


# -- sending ------------------------------------------------------------------------------------


def prompt_tokens(rid: str, rng: random.Random, *, prefixes: int = 4, prefix_len: int = 1024,
                  min_tail: int = 200, max_tail: int = 2500) -> list[int]:
    """A prompt sharing one of ``prefixes`` common prefixes (two full 512-token blocks), with
    a unique tail: enough structure for the caches, small enough for quick sim prefills."""
    k = rng.randrange(prefixes)
    prefix = random.Random(1000 + k)
    head = [prefix.randrange(VOCAB) for _ in range(prefix_len)]
    tail_rng = random.Random(rid)
    tail = [tail_rng.randrange(VOCAB) for _ in range(rng.randint(min_tail, max_tail))]
    return head + tail


@dataclass
class HttpAnswer:
    status: int
    body: Any
    error: str | None = None


async def fire_steady(url: str, ids: Sequence[str], rate: float, *, seed: int = 0,
                      timeout_s: float = 120.0,
                      bodies: dict[str, bytes] | None = None) -> dict[str, list[HttpAnswer]]:
    """POST one completion per id at ``rate`` per second (steady: id i leaves at i/rate) and
    wait for every answer; returns each id's answers (exactly one expected)."""
    rng = random.Random(seed)
    if bodies is None:
        bodies = {rid: json.dumps({"prompt": prompt_tokens(rid, rng), "request_id": rid},
                                  separators=(",", ":")).encode() for rid in ids}
    answers: dict[str, list[HttpAnswer]] = defaultdict(list)
    endpoint = url.rstrip("/") + "/v1/completions"
    start = time.monotonic()

    async def one(i: int, rid: str) -> None:
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            r = await request(endpoint, "POST", bodies[rid], timeout_s=timeout_s)
            try:
                body = r.json()
            except ValueError:
                body = None
            answers[rid].append(HttpAnswer(r.status, body))
        except (HttpError, TimeoutError) as exc:
            answers[rid].append(HttpAnswer(0, None, repr(exc)))

    await asyncio.gather(*(one(i, rid) for i, rid in enumerate(ids)))
    return answers


def answered_once_ok(ids: Sequence[str], answers: dict[str, list[HttpAnswer]],
                     sent: Sequence[str] | None = None) -> list[str]:
    """Problems with the HTTP side: an id of ``ids`` not answered exactly once, or not 200
    with its id; an answer for an id never ``sent`` (default: ``ids``)."""
    problems = []
    for rid in ids:
        got = answers.get(rid, [])
        if len(got) != 1:
            problems.append(f"{rid}: {len(got)} HTTP answers")
            continue
        a = got[0]
        if a.status != 200 or not isinstance(a.body, dict):
            problems.append(f"{rid}: HTTP {a.status} {a.error or a.body}")
            continue
        vtm = a.body.get("vtm") or {}
        if vtm.get("request_id") != rid or vtm.get("duplicate"):
            problems.append(f"{rid}: answered as {vtm.get('request_id')} "
                            f"duplicate={vtm.get('duplicate')}")
    stray = set(answers) - set(sent if sent is not None else ids)
    if stray:
        problems.append(f"answers for ids never sent: {sorted(stray)[:5]}")
    return problems


def exactly_once_problems(ids: Sequence[str], tap: ResultTap) -> list[str]:
    """Each id has exactly one FirstToken on the wire, a token and no error; no stray ids."""
    by_id = tap.by_id()
    problems = []
    for rid in ids:
        got = by_id.get(rid, [])
        if len(got) != 1:
            desc = [(r.worker_id, r.epoch, r.error) for r in got]
            problems.append(f"{rid}: {len(got)} FirstTokens {desc}")
        elif got[0].error is not None or got[0].token is None:
            problems.append(f"{rid}: failed: {got[0].error}")
    stray = sorted(set(by_id) - set(ids))
    if stray:
        problems.append(f"FirstTokens for ids never sent: {stray[:5]}")
    return problems


# -- geometry -------------------------------------------------------------------------------------


def execution_interval(r: FirstToken) -> tuple[float, float]:
    """[start, end] of the request's prefill on its worker's GPUs (Unix seconds, measured by
    the rank daemon's own clock). Only the prefill is counted: in the live sim stack the KV
    handoff and first decode run off the worker's slot (vertumnus/live/rankd_sim.py
    ``handoff_off_worker``, the simulator's model), so the next prefill may overlap them."""
    st = r.stages
    start = r.finished_at_s - (st.prefill_s + st.kv_transfer_s + st.first_decode_s)
    return start, start + st.prefill_s


def geometry_violations(results: Sequence[FirstToken], records: dict[int, EpochRecord]
                        ) -> list[str]:
    """(1) each successful FirstToken names an epoch that was recorded and a worker in that
    epoch's composition; (2) no two requests of two *different* workers whose GPU groups
    overlap ran at overlapping times (so no GPU ever served two geometries at once, and no
    request ran on a group that had been split or merged away)."""
    problems: list[str] = []
    ok = [r for r in results if r.error is None]
    for r in ok:
        rec = records.get(r.epoch) if r.epoch is not None else None
        if rec is None:
            problems.append(f"{r.request_id}: epoch {r.epoch} was never recorded")
        elif r.worker_id not in {w.worker_id for w in rec.workers}:
            problems.append(f"{r.request_id}: worker {r.worker_id} not in epoch {r.epoch}'s "
                            f"composition {[w.worker_id for w in rec.workers]}")
    per_worker: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for r in ok:
        if r.worker_id is not None:
            s, e = execution_interval(r)
            per_worker[r.worker_id].append((s, e, r.request_id))
    workers = sorted(per_worker)
    for i, wa in enumerate(workers):
        ga = set(GpuGroup.from_worker_id(wa).gpus)
        for wb in workers[i + 1:]:
            if not ga & set(GpuGroup.from_worker_id(wb).gpus):
                continue
            for sa, ea, ra in per_worker[wa]:
                for sb, eb, rb in per_worker[wb]:
                    if sa < eb and sb < ea:
                        problems.append(f"{ra} on {wa} [{sa:.4f}, {ea:.4f}] overlaps {rb} on "
                                        f"{wb} [{sb:.4f}, {eb:.4f}]")
    # And one worker runs one request at a time (FIFO).
    for w, spans in per_worker.items():
        spans.sort()
        for (_s1, e1, r1), (s2, _e2, r2) in zip(spans, spans[1:], strict=False):
            if s2 < e1 - 1e-6:
                problems.append(f"{w} ran {r1} and {r2} at once")
    return problems


async def connect(stack: LiveStack) -> Client:
    assert stack.nats is not None
    return await natsclient.connect(stack.nats.url, connect_timeout=5)


# -- a test acting as the controller ---------------------------------------------------------


class ActingController:
    """Writes epoch records the way ``services/controller/service.py`` does (§8): the initial
    record by ``create``, every later one by compare-and-set on the last revision; a split or
    merge as *drain* (sources DRAINING) → wait until each source's WorkerState, under the
    drain epoch, shows an empty queue → *commit* (sources gone, targets SWITCHING) → wait for
    every target rank's EpochAck of the commit epoch → *exposure* (targets ACTIVE). The rank
    host applies the records (starts / stops worker services), rank daemons adopt them
    (redirecting queued requests of a draining worker to intake) and acknowledge per GPU."""

    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.kv: Any = None
        self.states: Any = None
        self.revision = 0
        self.record: EpochRecord | None = None
        self.acks: set[tuple[int, int]] = set()  # (gpu, epoch)
        self._sub: Any = None

    async def start(self, workers: Sequence[str]) -> ActingController:
        from shared.schemas import EpochAck
        from shared.service import worker_state_kv
        from shared.worker import Lifecycle

        js = self.nc.jetstream()
        self.kv = await epoch_kv(js, self.subjects)
        self.states = await worker_state_kv(js, self.subjects)

        async def on_ack(msg: Msg) -> None:
            with contextlib.suppress(SchemaError):
                ack = decode(EpochAck, msg.data, msg.headers)
                self.acks.add((ack.gpu, ack.epoch))

        self._sub = await self.nc.subscribe(self.subjects.epoch_ack_all(), cb=on_ack)
        rec = self._make(0, {w: Lifecycle.ACTIVE for w in workers}, "initial composition")
        self.revision = await self.kv.create(self.subjects.epoch_key(), rec.model_dump_json()
                                             .encode())
        self.record = rec
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    @staticmethod
    def _make(epoch: int, lifecycles: dict[str, Any], reason: str) -> EpochRecord:
        from shared.schemas import EpochWorker

        workers = []
        for wid, lc in sorted(lifecycles.items(), key=lambda kv: GpuGroup.from_worker_id(kv[0])):
            g = GpuGroup.from_worker_id(wid)
            workers.append(EpochWorker(worker_id=wid, first_gpu=g.first_gpu, degree=g.degree,
                                       lifecycle=lc))
        return EpochRecord(epoch=epoch, workers=workers, committed_at_s=time.time(),
                           reason=reason)

    async def _write(self, lifecycles: dict[str, Any], reason: str) -> EpochRecord:
        assert self.record is not None
        rec = self._make(self.record.epoch + 1, lifecycles, reason)
        self.revision = await self.kv.update(self.subjects.epoch_key(),
                                             rec.model_dump_json().encode(), last=self.revision)
        self.record = rec
        return rec

    def lifecycles(self) -> dict[str, Any]:
        assert self.record is not None
        return {w.worker_id: w.lifecycle for w in self.record.workers}

    async def _drained(self, wid: str, epoch: int) -> bool:
        from nats.js.errors import KeyNotFoundError

        from shared.schemas import WorkerState, from_json

        try:
            entry = await self.states.get(wid)
        except KeyNotFoundError:
            return False
        st = from_json(WorkerState, entry.value)
        return st.epoch >= epoch and st.queue_len == 0

    async def reconfigure(self, sources: Sequence[str], targets: Sequence[str],
                          reason: str) -> None:
        from shared.worker import Lifecycle

        lc = self.lifecycles()
        assert set(sources) <= set(lc), (sources, lc)
        drain = await self._write({**lc, **{s: Lifecycle.DRAINING for s in sources}},
                                  f"drain for {reason}")
        deadline = time.monotonic() + WAIT_S
        while not all([await self._drained(s, drain.epoch) for s in sources]):
            assert time.monotonic() < deadline, f"sources {sources} never drained"
            await asyncio.sleep(0.05)
        rest = {w: s for w, s in lc.items() if w not in sources}
        commit = await self._write({**rest, **{t: Lifecycle.SWITCHING for t in targets}},
                                   f"commit {reason}")
        gpus = {g for t in targets for g in GpuGroup.from_worker_id(t).gpus}
        await wait_until(lambda: all((g, commit.epoch) in self.acks for g in gpus),
                         f"acks of {targets} for epoch {commit.epoch}")
        await self._write({**rest, **{t: Lifecycle.ACTIVE for t in targets}},
                          f"expose {reason}")


async def fire_until(url: str, prefix: str, rate: float, stop: asyncio.Event, *,
                     seed: int = 0, after_stop: int = 0,
                     timeout_s: float = 120.0) -> tuple[list[str], dict[str, list[HttpAnswer]]]:
    """Steady load: one completion every 1/rate s, ids ``{prefix}-{i}``, until ``stop`` is set
    (then ``after_stop`` more); waits for every answer. Returns (ids sent, answers)."""
    rng = random.Random(seed)
    answers: dict[str, list[HttpAnswer]] = defaultdict(list)
    endpoint = url.rstrip("/") + "/v1/completions"
    ids: list[str] = []
    tasks: list[asyncio.Task[None]] = []

    async def one(rid: str, body: bytes) -> None:
        try:
            r = await request(endpoint, "POST", body, timeout_s=timeout_s)
            try:
                b = r.json()
            except ValueError:
                b = None
            answers[rid].append(HttpAnswer(r.status, b))
        except (HttpError, TimeoutError) as exc:
            answers[rid].append(HttpAnswer(0, None, repr(exc)))

    start = time.monotonic()
    extra = 0
    i = 0
    while True:
        if stop.is_set():
            if extra >= after_stop:
                break
            extra += 1
        rid = f"{prefix}-{i:05d}"
        body = json.dumps({"prompt": prompt_tokens(rid, rng), "request_id": rid},
                          separators=(",", ":")).encode()
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        ids.append(rid)
        tasks.append(asyncio.create_task(one(rid, body)))
        i += 1
    await asyncio.gather(*tasks)
    return ids, answers


# -- services in-process (trace checks, deterministic crash windows) ----------------------------


@dataclass
class InProcess(ServiceTasks):
    """Gateway, scheduler and rank daemons as asyncio services in this process, on a real
    ``nats-server`` (so spans reach this process' in-memory exporter)."""

    wait_s: ClassVar[float] = WAIT_S

    async def rankd(self, worker_id: str, prefill_s: float = 0.02, handoff_s: float = 0.005,
                    *, cls: type | None = None,
                    prefill_time: Callable[..., float] | None = None,
                    **settings_kw: Any) -> Any:
        """A rank daemon (``cls``, default RankdService) on the sim backend, each prefill
        taking ``prefill_s`` (or ``prefill_time(r, p, c, kind)``), serving once it answers."""
        from services.rankd.backend import SimBackend
        from services.rankd.service import RankdService
        from services.rankd.settings import RankdSettings

        settings = RankdSettings(nats_url=self.url, subject_prefix=self.prefix,
                                 worker_id=worker_id, heartbeat_s=0.2, **settings_kw)
        backend = SimBackend(prefill_time=prefill_time
                             or (lambda r, p, c, kind="cp": prefill_s),
                             handoff_time=lambda n, c: handoff_s)
        svc = await self.run((cls or RankdService)(settings, backend))
        await self.until_served(self.subjects.worker_assign(worker_id))
        return svc

    async def blocked_rankd(self, worker_id: str, *, cls: type | None = None,
                            **settings_kw: Any) -> Any:
        """A rank daemon (drain timeout 0.5 s) whose prefill of a request of
        :data:`BLOCKER_LEN` tokens or more takes 120 s -- far longer than any scenario, a
        bound, not a speed check -- and of any other 0.02 s: :meth:`occupy` it, and what
        is assigned next waits in its queue."""
        return await self.rankd(
            worker_id, handoff_s=0.001, cls=cls, drain_timeout_s=0.5,
            prefill_time=lambda r, p, c, kind="cp": 120.0 if r >= BLOCKER_LEN else 0.02,
            **settings_kw)

    async def occupy(self, nc: Client, worker: Any, rid: str = "blocker") -> None:
        """Assign ``worker`` (a :meth:`blocked_rankd`) a :data:`BLOCKER_LEN`-token request
        ``rid`` directly, as a scheduler would, and wait until it runs."""
        from shared.schemas import Assignment, AssignmentAck, IntakeRequest
        from shared.service import call

        wid = worker.settings.worker_id
        blocker = IntakeRequest(request_id=rid, input_len=BLOCKER_LEN, block_size=16,
                                arrival_s=time.time())
        await call(nc, self.subjects.worker_assign(wid),
                   Assignment(request=blocker, worker_id=wid, epoch=0, degree=2,
                              prefix_tokens=0, recompute_tokens=BLOCKER_LEN, predicted_s=0.1,
                              assigned_at_s=time.time()), AssignmentAck, timeout_s=5.0)
        await wait_until(lambda: worker.core.running is not None, f"{rid} running on {wid}")

    async def until_served(self, subject: str) -> None:
        """Wait until ``subject`` has a responder (see :func:`shared.service.until_served`)."""
        nc = await natsclient.connect(self.url, connect_timeout=5)
        try:
            await until_served(nc, subject, timeout_s=WAIT_S)
        finally:
            await nc.close()

    async def scheduler(self, cls: type | None = None, **kw: Any) -> Any:
        from services.scheduler.service import SchedulerService, SchedulerSettings

        kw.setdefault("instance_id", "sched-" + uuid.uuid4().hex[:6])
        settings = SchedulerSettings(nats_url=self.url, subject_prefix=self.prefix, **kw)
        return await self.run((cls or SchedulerService)(settings))

    async def gateway(self, **kw: Any) -> Any:
        from services.gateway.adapter import GatewayService
        from services.gateway.settings import GatewaySettings

        kw.setdefault("http_port", 0)
        settings = GatewaySettings(nats_url=self.url, subject_prefix=self.prefix, **kw)
        return await self.run(GatewayService(settings))
