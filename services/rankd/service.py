"""rankd: the NATS adapter of one worker's leader rank.

Per process (one worker, its leader rank, for now):

* micro service ``vtm-rankd`` with endpoint ``{prefix}.worker.{wid}.assign``: an Assignment
  in, an AssignmentAck out (queue position) or a micro error (400 malformed, 404 wrong worker,
  409 not ACTIVE / epoch ahead / queue full). Admission is instant; execution is FIFO in a
  background task through an :class:`~services.rankd.backend.ExecutionBackend`.
* after each request, a FirstToken on ``{prefix}.result.{rid}`` with TTFT stage timings
  (wall seconds, see :mod:`services.rankd.backend`), and spans ``queue_wait`` and ``prefill``
  parented to the assigning scheduler's trace context (predicted and modelled time on them).
* WorkerState in the worker-state KV bucket (key = worker id) on every change, coalesced, and
  at least every ``heartbeat_s`` (the liveness lease).
* the worker's prefix cache (LRU, :mod:`services.rankd.blockcache`) decides the P actually
  reused; its events (stored / removed / cleared, per-worker monotonic ids) are published as
  JSON on ``{prefix}.cache.events.{wid}`` in order; ``{prefix}.cache.snapshot.{wid}``
  answers a CacheSnapshot (after publishing every earlier event) and
  ``{prefix}.cache.cmd.{wid}`` executes a CacheCommand (replicate / reclaim / reconcile).
* the epoch record is watched; a newer record is adopted (lifecycle from it) and one EpochAck
  per GPU of the worker is published on ``{prefix}.epoch.ack.{gpu}``; queued requests of a
  worker leaving ACTIVE are redirected to intake (``Nats-Msg-Id`` =
  ``{rid}-r{epoch}-{worker}``, so the redirect is not de-duplicated against the original
  publish nor against another source's redirect of the same request).
* shutdown (SIGINT/SIGTERM): stop admitting, redirect queued requests, let the running one
  finish (bounded by ``drain_timeout_s``), publish a final UNAVAILABLE state, drain.

No policy lives here: admission rules and bookkeeping are in :mod:`services.rankd.core`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Final

from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError, NotFoundError
from nats.js.kv import KeyValue
from nats.micro.request import Request

from services.rankd.backend import ExecutionBackend, PrefillResult
from services.rankd.core import Job, WorkerCore
from services.rankd.settings import RankdSettings
from shared.ids import InvalidInput
from shared.schemas import (
    Assignment,
    AssignmentAck,
    CacheCommand,
    CacheCommandResult,
    CacheEvent,
    CacheSnapshot,
    EpochAck,
    EpochRecord,
    FirstToken,
    SchemaError,
    TtftStages,
    decode,
    encode,
    to_json,
)
from shared.service import Endpoint, MicroService, epoch_kv, request_model, worker_state_kv
from shared.subjects import micro_service_name
from shared.telemetry import Stage, inject, record_span, stage_span
from shared.worker import Lifecycle

VERSION: Final[str] = "0.1.0"


def _wire_json(wire: dict[str, object]) -> bytes:
    """JSON bytes of a core event's wire dict (validated again by the wire schema)."""
    return json.dumps(wire).encode()


def _nonneg(x: float) -> float:
    # Stages span processes on one host; guard against tiny clock disagreements.
    return max(0.0, x)


def ttft_stages(job: Job, result: PrefillResult) -> TtftStages:
    """Stage breakdown of one finished request from the instants the pipeline recorded."""
    a = job.assignment
    arrival = a.request.arrival_s
    dequeued = a.dequeued_at_s if a.dequeued_at_s is not None else arrival
    return TtftStages(
        intake_wait_s=_nonneg(dequeued - arrival),
        schedule_s=_nonneg(a.assigned_at_s - dequeued),
        queue_wait_s=_nonneg(result.started_at_s - a.assigned_at_s),
        prefill_s=_nonneg(result.prefill_s),
        kv_transfer_s=_nonneg(result.kv_transfer_s),
        first_decode_s=_nonneg(result.first_decode_s),
        total_s=_nonneg(result.finished_at_s - arrival),
    )


class RankdService(MicroService):
    """One worker leader. Construct, then ``await run()`` (or ``start(stack)`` in tests)."""

    def __init__(
        self,
        settings: RankdSettings,
        backend: ExecutionBackend,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        subjects = settings.subjects
        super().__init__(
            settings,
            name=micro_service_name("rankd"),
            version=VERSION,
            group=subjects.worker_group(settings.worker_id),
            description="vertumnus rank daemon (worker leader)",
            metadata={"worker_id": settings.worker_id, "backend": backend.name},
        )
        self.rsettings = settings
        self.backend = backend
        self.clock = clock
        self.core = WorkerCore(
            settings.worker_id,
            kind=settings.kind,
            epoch=settings.epoch,
            kv_total_blocks=settings.kv_total_blocks,
            max_queue=settings.max_queue,
            time_scale=getattr(backend, "time_scale", 1.0),
        )
        self._js: JetStreamContext | None = None
        self._state_kv: KeyValue | None = None
        self._work = asyncio.Event()  # something to start
        self._dirty = asyncio.Event()  # state changed; publish soon
        self._idle = asyncio.Event()  # nothing running
        self._idle.set()

        self._events_lock = asyncio.Lock()  # cache events leave in event-id order
        self._update_metadata()

    # -- endpoints ----------------------------------------------------------------------------

    def endpoints(self) -> Sequence[Endpoint]:
        wid = self.core.worker_id
        return [
            Endpoint("assign", self._on_assign),
            Endpoint(
                "cache-snapshot",
                self._on_snapshot,
                subject=self.subjects.cache_snapshot(wid),
                absolute=True,
            ),
            Endpoint(
                "cache-cmd", self._on_cache_cmd, subject=self.subjects.cache_cmd(wid), absolute=True
            ),
        ]

    async def _on_snapshot(self, request: Request) -> CacheSnapshot:
        async with self._events_lock:
            await self._publish_cache_events_locked()
            snap = self.core.cache_snapshot()
        return CacheSnapshot(
            worker=snap.worker, last_event_id=snap.last_event_id, blocks=list(snap.blocks)
        )

    async def _on_cache_cmd(self, request: Request) -> CacheCommandResult:
        cmd = request_model(request, CacheCommand)
        result = self.core.apply_command(cmd)
        await self._publish_cache_events()
        self._dirty.set()
        return result

    async def _on_assign(self, request: Request) -> AssignmentAck:
        a = request_model(request, Assignment)
        position = self.core.admit(a, self.clock(), trace_carrier=inject({}))
        self._work.set()
        self._dirty.set()
        self.log.debug("admitted", request_id=a.request.request_id, position=position)
        return AssignmentAck(
            request_id=a.request.request_id,
            worker_id=self.core.worker_id,
            epoch=self.core.epoch,
            queue_position=position,
        )

    # -- setup and teardown -------------------------------------------------------------------

    async def setup(self, stack: AsyncExitStack) -> None:
        self._js = self.nc.jetstream()
        self._state_kv = await worker_state_kv(
            self._js, self.subjects, lease_s=self.rsettings.lease_s
        )
        epochs = await epoch_kv(self._js, self.subjects)
        # Adopt the current record before serving, so the first admission uses it.
        try:
            entry = await epochs.get(self.subjects.epoch_key())
        except NotFoundError:  # no record yet (dev runs): keep the configured epoch
            entry = None
        if entry is not None and entry.value:
            await self._adopt_payload(entry.value)
        watcher = await epochs.watch(self.subjects.epoch_key())

        tasks = [
            asyncio.create_task(self._executor(), name="rankd-executor"),
            asyncio.create_task(self._publisher(), name="rankd-state"),
            asyncio.create_task(self._watch_epochs(watcher), name="rankd-epochs"),
        ]
        await self._publish_state()

        async def teardown() -> None:
            await watcher.stop()
            await self._shutdown(tasks)

        stack.push_async_callback(teardown)

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        redirected = self.core.set_lifecycle(Lifecycle.UNAVAILABLE)
        await self._redirect(redirected)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.drain_timeout_s):
                await self._idle.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        running = self.core.running
        if running is not None:  # drain timed out mid-request
            self.core.finish(running.request_id, ok=False)
            await self._publish_failure(running, "worker stopped during prefill")
        await self._publish_state()
        await self.backend.close()

    # -- execution ----------------------------------------------------------------------------

    async def _executor(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while (job := self.core.start_next(self.clock())) is not None:
                self._idle.clear()
                self._dirty.set()
                try:
                    await self._run(job)
                except asyncio.CancelledError:
                    raise
                except Exception:  # e.g. a publish on a closing connection: keep serving
                    self.log.exception("request bookkeeping failed", request_id=job.request_id)
                    if self.core.running is job:  # never leave the slot occupied
                        self.core.finish(job.request_id, ok=False)
                finally:
                    self._idle.set()
                    self._dirty.set()

    async def _run(self, job: Job) -> None:
        a = job.executed or job.assignment  # P, R as this worker's cache found them
        assert job.started_at_s is not None
        record_span(
            Stage.QUEUE_WAIT,
            start_s=a.assigned_at_s,
            end_s=job.started_at_s,
            parent=job.trace_carrier,
            attributes={"vtm.worker_id": a.worker_id, "vtm.request_id": a.request.request_id},
        )
        with stage_span(
            Stage.PREFILL,
            parent=job.trace_carrier,
            attributes={
                "vtm.request_id": a.request.request_id,
                "vtm.worker_id": a.worker_id,
                "vtm.degree": a.degree,
                "vtm.epoch": a.epoch,
                "vtm.prefix_tokens": a.prefix_tokens,
                "vtm.recompute_tokens": a.recompute_tokens,
                "vtm.assigned_prefix_tokens": job.assignment.prefix_tokens,
                "vtm.predicted_s": a.predicted_s,
                "vtm.backend": self.backend.name,
            },
        ) as span:
            try:
                result = await self.backend.prefill(a)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                span.record_exception(exc)
                if not isinstance(exc, InvalidInput):
                    self.log.exception("prefill failed", request_id=job.request_id)
                self.core.finish(job.request_id, ok=False)
                await self._publish_failure(job, f"prefill failed: {exc}")
                return
            span.set_attribute("vtm.modelled_prefill_s", result.modelled_prefill_s)
            span.set_attribute("vtm.actual_prefill_s", result.prefill_s)
        self.core.finish(job.request_id, ok=True)
        await self._publish_result(job, result)
        await self._publish_cache_events()

    async def _publish_result(self, job: Job, result: PrefillResult) -> None:
        a = job.assignment
        msg = FirstToken(
            request_id=a.request.request_id,
            token=result.token,
            worker_id=a.worker_id,
            epoch=a.epoch,
            predicted_prefill_s=a.predicted_s,
            prefix_tokens=(job.executed or a).prefix_tokens,
            stages=ttft_stages(job, result),
            finished_at_s=result.finished_at_s,
        )
        data, headers = encode(msg)
        await self.nc.publish(
            self.subjects.result(a.request.request_id), data, headers=inject(headers)
        )

    async def _publish_failure(self, job: Job, reason: str) -> None:
        a = job.assignment
        now = self.clock()
        msg = FirstToken(
            request_id=a.request.request_id,
            token=None,
            error=reason,
            worker_id=a.worker_id,
            epoch=a.epoch,
            predicted_prefill_s=a.predicted_s,
            stages=TtftStages(total_s=_nonneg(now - a.request.arrival_s)),
            finished_at_s=now,
        )
        data, headers = encode(msg)
        await self.nc.publish(self.subjects.result(a.request.request_id), data, headers=headers)

    async def _redirect(self, jobs: Sequence[Job]) -> None:
        """Send queued requests back to intake for re-placement (§6.2), in queue order.

        ``Nats-Msg-Id`` = ``{rid}-r{epoch}-{worker}``: unique per hop (two sources of one merge
        drain under the same epoch, and a request may be redirected by both).
        KNOWN BUG (open): stopping the service while this loop runs loses the jobs not yet
        republished (tests/live_accept: test_stopping_while_redirecting_loses_nothing)."""
        epoch = self.core.epoch
        for job in jobs:
            await self._redirect_one(job, epoch)

    async def _redirect_one(self, job: Job, epoch: int) -> None:
        assert self._js is not None
        req = job.assignment.request
        data, headers = encode(req)
        headers["Nats-Msg-Id"] = f"{req.request_id}-r{epoch}-{self.core.worker_id}"
        headers.update(req.trace_context)
        try:
            ack = await self._js.publish(self.subjects.intake_requests(), data, headers=headers)
        except (NoStreamResponseError, NoRespondersError, TimeoutError) as exc:
            await self._publish_failure(job, f"redirect failed: {exc}")
            return
        if ack.duplicate:
            self.log.warning("redirect de-duplicated by the intake stream",
                             request_id=req.request_id, worker=self.core.worker_id, epoch=epoch)
        else:
            self.log.info("redirected", request_id=req.request_id,
                          worker=self.core.worker_id, epoch=epoch)

    # -- cache events ---------------------------------------------------------------------------

    async def _publish_cache_events(self) -> None:
        async with self._events_lock:
            await self._publish_cache_events_locked()

    async def _publish_cache_events_locked(self) -> None:
        subject = self.subjects.cache_events(self.core.worker_id)
        for ev in self.core.take_cache_events():
            wire = decode(CacheEvent, _wire_json(ev.to_wire()))
            data, headers = encode(wire)
            await self.nc.publish(subject, data, headers=headers)

    # -- state and epochs ---------------------------------------------------------------------

    async def _publish_state(self) -> None:
        assert self._state_kv is not None
        state = self.core.state(self.clock())
        await self._state_kv.put(self.core.worker_id, to_json(state))

    async def _publisher(self) -> None:
        while True:
            # NOTE: asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
            # races with the event being set, and shutdown would then wait forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.rsettings.heartbeat_s):
                    await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._publish_state()
            except Exception as exc:  # a KV hiccup must not stop the heartbeat
                self.log.warning("state publish failed", error=str(exc))

    async def _watch_epochs(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is None or not entry.value:  # end of initial values / delete marker
                continue
            await self._adopt_payload(entry.value)

    async def _adopt_payload(self, payload: bytes) -> None:
        try:
            record = decode(EpochRecord, payload)
        except SchemaError as exc:
            self.log.error("bad epoch record ignored", error=str(exc))
            return
        adoption = self.core.adopt(record)
        if not adoption.adopted:
            return
        self.log.info(
            "epoch adopted",
            epoch=adoption.epoch,
            lifecycle=adoption.lifecycle.value,
            member=adoption.member,
        )
        self._update_metadata()
        await self._redirect(adoption.redirected)
        if adoption.member:
            now = self.clock()
            for gpu in self.core.group.gpus:
                ack = EpochAck(
                    gpu=gpu,
                    epoch=adoption.epoch,
                    degree=self.core.degree,
                    worker_id=self.core.worker_id,
                    adopted_at_s=now,
                )
                data, headers = encode(ack)
                await self.nc.publish(self.subjects.epoch_ack(gpu), data, headers=headers)
        self._dirty.set()

    def _update_metadata(self) -> None:
        g = self.core.group
        self.set_metadata(
            epoch=str(self.core.epoch),
            lifecycle=self.core.lifecycle.value,
            degree=str(g.degree),
            gpus=f"{g.first_gpu}-{g.first_gpu + g.degree - 1}",
        )
