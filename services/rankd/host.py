"""All rank daemons of a GPU range in one process, following the epoch record (sim / dev).

With the ``sim`` backend a rank daemon is mostly waiting, so one process per worker is
wasteful at 40 "GPUs". A host owns a contiguous GPU range (e.g. one node, [0, 8)) and runs one
:class:`~services.rankd.service.RankdService` per worker of the current composition whose group
lies in that range, all on one NATS connection:

* on start, the workers come from the epoch record if one exists, else from ``initial``;
* on every newer record, services for new workers in range are started (they read and adopt
  the record themselves, then acknowledge it per GPU), and services of workers that left the
  composition are stopped: each has already adopted the record as UNAVAILABLE and handed its
  queue back to intake; its stop waits until intake has acknowledged every redirect (bounded
  by ``redirect_timeout_s``) and its running request has finished (``drain_timeout_s``);
  a worker id that a record re-creates while its previous instance still stops is started
  once that instance has ended, after the record's other new workers (which do not wait);
* a worker of the record that this host cannot build (InvalidInput: e.g. a TP worker whose id
  is no lattice id, or one the backend does not run) is logged and skipped; the record's
  other workers start all the same.

This is how a split or merge happens in the live sim without restarting a process: the
worker set changes; the process (and, with a real engine, the weights) stays.

Retained prefix pages (§6.2; design.md "Prefix pages under CP"): a worker made by a split or a
merge (a record whose diff with the workers running here, by
:func:`~services.cachemgr.reconcile.diff_compositions`, shows it) starts with the cache index the
cache manager's trie gives it: :func:`~services.cachemgr.reconcile.reconciled_index` over its
predecessors' BlockCaches as they are when this host applies the record (the controller drained
them: nothing runs there), seeded with ``BlockCache.adopt`` before its service starts (before
it admits anything or emits a cache event). A backend whose KV is modelled (``sim``) needs
nothing more; one that keeps a real engine cache in lockstep with the BlockCache (``torch``)
first installs those chains in place from its predecessors' resident pages
(``inherit_prefixes``), and only what it then holds is seeded (see :meth:`RankdHost._seed`).

Worker faults: the process is the unit of restart. When one worker meets a
:class:`~shared.ids.WorkerFault` (a request's execution raised it, or its backend's health
probe reported it; with the torch backend the world its workers share is broken, so every one
of them is), every worker of the host fails the same way
(:meth:`RankdService.fail <services.rankd.service.RankdService.fail>`: hands back its queue,
UNAVAILABLE, stops), no new worker is started, and once every worker has stopped (hand-backs
settled) :meth:`RankdHost.run` raises the fault: the process exits non-zero and its supervisor
starts it again, drawing new worker incarnations.

Start-up (:meth:`RankdHost.run` from its connection to the epoch watch: the epoch bucket,
the current record, the first workers' starts): a stop (SIGINT/SIGTERM,
:meth:`RankdHost.request_stop`, a worker fault) ends it at once -- it is cancelled, the
workers started so far stop as after the start-up, and ``run`` returns. Before, the stop
waited for the whole start-up: for a server gone meanwhile, for its return (a worker's start
waits for the connection to come back), and then a JetStream step timed out and ``run``
raised ``nats: timeout`` (exit status 1 and a traceback). Two steps are never cut short, as
what they leave half made would keep running: a seed's engine work (``inherit_prefixes`` on a
thread: its ranks switch and install pages) and the making of the epoch watch (nats-py's
ordered consumer: a subscription and two tasks before its last request); the cancel waits
for them (one seed, or the watch's few JetStream requests, each bounded by its timeout) and
then undoes them. A start-up that fails because its NATS server was lost (a JetStream step
timed out or the connection closed) logs one error naming that, stops what had started and
raises :class:`StartUpLost`: the process exits with the status that asks its supervisor for
a restart (services/rankd/main.py), not with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Final

import nats.errors
import structlog
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from services.cachemgr.reconcile import (
    NewWorker,
    ResidentPage,
    diff_compositions,
    index_pages,
    reconciled_index,
)
from services.rankd.backend import ExecutionBackend
from services.rankd.blockcache import BlockCache
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings, initial_workers_problem
from shared.ids import BlockHash, InvalidInput, WorkerFault, WorkerId
from shared.natsauth import security_options
from shared.natsclient import connect
from shared.schemas import EpochRecord, EpochWorker, SchemaError, decode
from shared.service import (
    KvWatch,
    StartUpLost,
    drain_or_close,
    epoch_kv,
    nats_callbacks,
    reconnect_options,
)
from shared.stopping import handle_stop_signals
from shared.tasks import cancel_and_wait, cancel_requested, finish_first, unless_stopped
from shared.worker import GpuGroup, WorkerKind

BackendFactory = Callable[[str, WorkerKind], ExecutionBackend]
"""Builds the backend of one worker from its id and kind."""

log = structlog.get_logger("vertumnus.rankd.host")

START_ATTEMPTS = 5
"""How many times a worker's start is tried when the bus goes away during it (``_start_worker``)."""
START_RETRY_S = 0.2
"""Pause after the connection is back before the next attempt (JetStream settles)."""
START_CANCEL_AGAIN_S: Final[float] = 0.5
"""How often a stopped start-up is cancelled again while it has not ended: a cancel that lands
as a nats-py request's reply arrives is swallowed (shared/tasks.py); one that lands in a step
never cut short (:func:`~shared.tasks.finish_first`) is held until that step ends."""
BUS_ERRORS: Final = (nats.errors.Error, TimeoutError, ConnectionError)
"""What a step on the bus raises when its server went away (a request that timed out, the
connection closed under it)."""



@dataclass(frozen=True, slots=True)
class Seed:
    """What a worker made by a split or merge inherits: the pages of the worker(s) it replaces
    (``(parent,)`` or ``(left, right)``, each its BlockCache index as reconciliation sees it)
    and its place among them; the arguments of ``reconciled_index`` but its capacity."""

    predecessors: tuple[Mapping[BlockHash, ResidentPage], ...]
    child_degree: int
    new: NewWorker


def _pages(svc: RankdService | None) -> dict[BlockHash, ResidentPage]:
    """The pages a running worker's own cache index holds (none without a cache)."""
    cache: BlockCache | None = svc.core.cache if svc is not None else None
    if cache is None:
        return {}
    return index_pages({h: cache.parent_of(h) for h in cache.blocks()})


def seed_pages(
    services: Mapping[str, RankdService], wanted: Mapping[str, GpuGroup]
) -> dict[str, Seed]:
    """New worker id -> its :class:`Seed`, for the workers of ``wanted`` (the record's workers
    in this host's range) that a split or merge of the running (not stopping) ``services``
    makes. Reads the predecessors' caches now: call it before they are asked to stop."""
    running = {WorkerId(w): GpuGroup.from_worker_id(w)
               for w, svc in services.items() if not svc.stopping}
    splits, merges, _, _ = diff_compositions(
        running, {WorkerId(w): g for w, g in wanted.items()})
    seeds: dict[str, Seed] = {}
    for parent, (lo, hi) in splits:
        pages = (_pages(services.get(parent)),)
        half = GpuGroup.from_worker_id(lo).degree
        seeds[lo] = Seed(pages, half, "left")
        seeds[hi] = Seed(pages, half, "right")
    for (lo, hi), merged in merges:
        seeds[merged] = Seed((_pages(services.get(lo)), _pages(services.get(hi))),
                             GpuGroup.from_worker_id(lo).degree, "merged")
    return seeds


class RankdHost:
    """Runs the workers of GPUs ``gpus`` (see module docstring)."""

    def __init__(
        self,
        settings: RankdSettings,
        gpus: range,
        backend_factory: BackendFactory,
        *,
        initial: Iterable[str] = (),
    ) -> None:
        if not gpus or gpus.step != 1 or gpus.start < 0:
            raise InvalidInput(f"gpus must be a non-empty ascending range, got {gpus}")
        self.settings = settings
        self.gpus = gpus
        self.backend_factory = backend_factory
        self.initial = tuple(initial)
        problem = initial_workers_problem(self.initial, gpus)
        if problem is not None:
            raise InvalidInput(problem)
        self.services: dict[str, RankdService] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._epoch = -1
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()  # the worker set changed (tests wait on it)
        self._nc: Client | None = None
        self.fault: WorkerFault | None = None
        """The worker fault that ended this host (:meth:`fail`); :meth:`run` raises it."""

    def _in_range(self, g: GpuGroup) -> bool:
        return g.first_gpu >= self.gpus.start and g.first_gpu + g.degree <= self.gpus.stop

    @property
    def worker_ids(self) -> set[str]:
        """Workers whose service is running (not stopping)."""
        return {w for w, s in self.services.items() if not s.stopping}

    @property
    def changed(self) -> asyncio.Event:
        return self._changed

    def request_stop(self) -> None:
        self._stop.set()

    def fail(self, exc: WorkerFault, *, cause_logged: bool = False) -> None:
        """Every worker of this host can no longer compute (module docstring): each one hands
        back and stops, the host stops and :meth:`run` raises ``exc``. ``cause_logged``: a
        worker already logged the cause (it met the fault). Idempotent (the first fault wins)."""
        if self.fault is not None:
            return
        self.fault = exc
        if not cause_logged:
            log.error("rank host fault: every worker hands its requests back to intake, "
                      "exiting for a restart", gpus=f"{self.gpus.start}-{self.gpus.stop - 1}",
                      cause=str(exc))
        for svc in list(self.services.values()):
            svc.fail(exc, cause_logged=True)
        self._stop.set()

    def _worker_fault(self, exc: WorkerFault) -> None:
        self.fail(exc, cause_logged=True)

    # -- worker set ---------------------------------------------------------------------------

    async def _start_worker(
        self, wid: str, kind: WorkerKind, epoch: int, seed: Seed | None = None
    ) -> None:
        """Start worker ``wid`` and wait until its endpoints are subscribed. A start that
        fails because the bus went away meanwhile (nats-server restarting: the worker's
        JetStream set-up times out, its connection drops) is tried again with a fresh
        service once the host's connection is back, up to :data:`START_ATTEMPTS` times:
        before, the worker was lost for the whole epoch (its record counts as applied). Such a
        failed start leaves nothing registered (its exit stack undoes what it made). Any
        other failure, or the last attempt's, is raised."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                await self._start_worker_once(wid, kind, epoch, seed)
                return
            except BUS_ERRORS as exc:
                if attempt == START_ATTEMPTS or self._stop.is_set() or self.fault is not None:
                    raise
                log.warning("worker did not start while the bus was away; starting it again",
                            worker_id=wid, epoch=epoch, attempt=attempt, error=repr(exc))
                await self._until_connected()

    async def _until_connected(self) -> None:
        """Until the host's connection is up again (or the host stops), then a short pause."""
        assert self._nc is not None
        while not self._nc.is_connected and not self._stop.is_set():
            if self._nc.is_closed:
                return  # the next attempt fails fast and raises
            await asyncio.sleep(0.05)
        await asyncio.sleep(START_RETRY_S)

    async def _start_worker_once(
        self, wid: str, kind: WorkerKind, epoch: int, seed: Seed | None = None
    ) -> None:
        assert self._nc is not None
        settings = self.settings.model_copy(update={"worker_id": wid, "kind": kind, "epoch": epoch})
        backend = self.backend_factory(wid, kind)
        try:
            svc = RankdService(settings, backend, on_fault=self._worker_fault)
        except BaseException:  # not built: nobody else would close its backend
            await finish_first(backend.close())
            raise
        if seed is not None:
            # Before run(): nothing admitted, no cache event emitted yet. A cancel (a stop)
            # lets the seed's engine work end first (_seed), then closes the backend.
            try:
                await self._seed(svc, seed, epoch)
            except BaseException:
                await finish_first(svc.backend.close())
                raise
            if self.fault is not None or self._stop.is_set():
                # The host failed or stops meanwhile: it starts nothing more.
                await finish_first(svc.backend.close())
                return
        task = asyncio.create_task(svc.run(self._nc, handle_signals=False), name=f"rankd-{wid}")
        self.services[wid] = svc
        self._tasks[wid] = task
        task.add_done_callback(lambda t, w=wid: self._reap(w, t))
        # From here the worker is the host's: a cancel (a stop) leaves it to _stop_all, whose
        # stop ends its start too (MicroService.run) and closes its backend.
        started = asyncio.ensure_future(svc.started.wait())
        try:
            done, _ = await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()  # a waiter left pending for a worker that never starts
        if task in done and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        if svc.started.is_set():
            log.info("worker started", worker_id=wid, epoch=epoch)

    @staticmethod
    async def _seed(svc: RankdService, seed: Seed, epoch: int) -> None:
        """Seed ``svc``'s BlockCache with the index the cache manager's reconciliation makes
        valid for it (module docstring).

        A backend that keeps real KV in lockstep with the BlockCache (``bind_cache``) must
        hold those pages first: with ``inherit_prefixes`` (the torch backend) it brings the
        worker's ranks into its geometry, installs the chains in place from its predecessors'
        pages (they stay resident after the switch, in a *retired* engine cache) and returns
        the part it now holds; only that is seeded, so rankd never records a hit the engine cannot
        serve (``prefix_shortfall``). Such a backend without ``inherit_prefixes`` starts
        empty. A seed that cannot be computed, copied or adopted is logged and the worker
        starts empty (its snapshot, which the cache manager asks for, keeps the trie true).

        ``inherit_prefixes`` is never cut short: a cancel (a stop) meanwhile waits for it to
        end, then is raised (nothing adopted). Its ranks' switch and page installs run on a
        thread, which a cancel would leave running while the caller closes the backend (and
        the torch host its world). Without it nothing here awaits: no cancel lands inside."""
        cache = svc.core.cache
        if cache is None:
            return
        inherit = getattr(svc.backend, "inherit_prefixes", None)
        if callable(getattr(svc.backend, "bind_cache", None)) and not callable(inherit):
            log.info("new worker's cache not seeded: its backend holds real KV",
                     worker_id=svc.core.worker_id, backend=svc.backend.name)
            return
        try:
            pairs = reconciled_index(seed.predecessors, child_degree=seed.child_degree,
                                     new=seed.new, capacity_blocks=cache.capacity_blocks)
            wanted = len(pairs)
            if callable(inherit):
                pairs = await finish_first(inherit(pairs, epoch))
            cache.adopt(pairs)
        except (InvalidInput, WorkerFault) as exc:
            # A fault here is met again by the worker's first step or health probe, which
            # then fails the host the usual way; this worker just starts empty.
            log.warning("new worker's cache could not be seeded; it starts empty",
                        worker_id=svc.core.worker_id, error=repr(exc))
            return
        log.info("new worker's cache seeded with its retained prefixes",
                 worker_id=svc.core.worker_id, made_by=seed.new, blocks=len(pairs),
                 reconciled=wanted)

    def _reap(self, wid: str, task: asyncio.Task[None]) -> None:
        svc = self.services.get(wid) if self._tasks.get(wid) is task else None
        if svc is not None:
            del self._tasks[wid]
            del self.services[wid]
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, WorkerFault):
            self.fail(exc, cause_logged=True)  # no-op: the worker reported it when it met it
        elif exc is not None and svc is not None and not svc.started.is_set():
            # Failed while starting: _start_worker has it (it starts the worker again, or
            # raises it to whoever applies the record, who logs it).
            log.info("worker start failed", worker_id=wid, error=repr(exc))
        elif exc is not None:
            log.error("worker service failed", worker_id=wid, error=repr(exc))
        self._changed.set()

    async def _apply(self, record: EpochRecord) -> None:
        if record.epoch <= self._epoch or self.fault is not None:  # a faulted host only stops
            return
        self._epoch = record.epoch
        wanted = {w.worker_id: w for w in record.workers if self._in_range(w.group)}
        # Before any stop and any await: the predecessors' caches as of this record.
        try:
            seeds = seed_pages(self.services, {wid: w.group for wid, w in wanted.items()})
        except InvalidInput:  # a broken index (a bug): the record applies all the same
            log.exception("retained prefixes not computed; new workers start empty",
                          epoch=record.epoch)
            seeds = {}
        for wid, svc in list(self.services.items()):
            if wid not in wanted:
                log.info("worker leaves the composition", worker_id=wid, epoch=record.epoch)
                svc.request_stop()
        # A worker re-created (e.g. merged back) while its previous instance still stops
        # starts once that one has ended (one service per worker id); the record's other new
        # workers start first, without waiting for it. Before, every worker after it in the
        # record waited for that stop (up to its running request's drain_timeout_s, its
        # hand-backs' redirect_timeout_s, ...), and their EpochAcks with them.
        fresh: list[str] = []
        predecessors: dict[asyncio.Task[None], str] = {}  # old instance -> re-created id
        for wid in wanted:
            old = self.services.get(wid)
            if old is None:
                fresh.append(wid)
            elif old.stopping:
                predecessors[self._tasks[wid]] = wid
        for wid in fresh:
            if self.fault is not None:  # failed while starting the workers before: no more
                break
            await self._start_of_record(wid, wanted[wid], record.epoch, seeds.get(wid))
        order = {wid: i for i, wid in enumerate(wanted)}
        pending = set(predecessors)
        while pending and self.fault is None:
            # Not cancelled by a cancel of this wait (asyncio.wait leaves them running).
            ended, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for old_task in sorted(ended, key=lambda t: order[predecessors[t]]):
                wid = predecessors[old_task]
                if self.fault is None and wid not in self.services:
                    await self._start_of_record(wid, wanted[wid], record.epoch, seeds.get(wid))
        self._changed.set()

    async def _start_of_record(
        self, wid: str, w: EpochWorker, epoch: int, seed: Seed | None
    ) -> None:
        """Start worker ``w`` of the record of ``epoch``; a worker that cannot start costs only
        itself (logged): the record's other workers start all the same."""
        try:
            await self._start_worker(wid, w.kind, epoch, seed)
        except InvalidInput as exc:  # a worker this host cannot build: only it is lost
            log.error("worker of the epoch record cannot start here", worker_id=wid,
                      epoch=epoch, error=str(exc))
        except Exception:
            # Its last start failed too (the bus away through every attempt): only this
            # worker is lost; the record's other workers start all the same.
            log.exception("worker of the epoch record did not start", worker_id=wid,
                          epoch=epoch)

    # -- main ---------------------------------------------------------------------------------

    async def run(self, nc: Client | None = None, *, handle_signals: bool = True) -> None:
        """Serve until :meth:`request_stop`, SIGINT/SIGTERM or a worker fault; then stop every
        worker. After a fault, raises it once every worker has stopped (module docstring). A
        stop during the start-up ends it at once; a start-up that lost its NATS server raises
        :class:`StartUpLost` once what it had started has stopped (module docstring)."""
        async with AsyncExitStack() as stack:
            if handle_signals:
                handle_stop_signals(stack, self._stop)
            if nc is None:
                # A stop while the server is unreachable (or refuses us) ends the run at once.
                connected, nc = await unless_stopped(connect(
                    servers=self.settings.nats_servers,
                    name=f"vtm-rankd-host:{self.gpus.start}-{self.gpus.stop - 1}",
                    connect_timeout=self.settings.connect_timeout_s,
                    **reconnect_options(self.settings),
                    **security_options(self.settings),
                    **nats_callbacks(log, self._stop.is_set),
                ), self._stop, log)
                if not connected or nc is None:
                    log.info("rank host stopped before it had connected")
                    return
                # Not nc.drain alone: it raises on a connection still reconnecting.
                stack.push_async_callback(drain_or_close, nc, self.settings.drain_timeout_s)
            self._nc = nc
            stack.push_async_callback(self._stop_all)
            try:
                started = await self._start_up_unless_stopped(nc, stack)
            except BUS_ERRORS as exc:
                if self.fault is not None:
                    raise self.fault from None  # after the stack: every worker stopped
                log.error("rank host did not start: its NATS server was lost during the "
                          "start-up; stopping what started and exiting for a restart",
                          gpus=f"{self.gpus.start}-{self.gpus.stop - 1}", error=repr(exc))
                raise StartUpLost(f"NATS server lost during the rank host's start-up: "
                                  f"{exc!r}") from exc
            if started:
                await self._stop.wait()
            else:
                log.info("rank host stopped during its start-up")
        if self.fault is not None:
            raise self.fault

    async def _start_up_unless_stopped(self, nc: Client, stack: AsyncExitStack) -> bool:
        """:meth:`_start_up` unless a stop comes first: True once it finished (its error
        raised), False when the stop ended it (cancelled, and cancelled again until it has
        ended: :data:`START_CANCEL_AGAIN_S`). It has always ended on return: nothing of it is
        left running (what it made is undone by ``stack``)."""
        work = asyncio.create_task(self._start_up(nc, stack), name="rankd-host-start")
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            while not work.done():  # a stop (or this run cancelled): end the start-up
                work.cancel()
                await asyncio.wait({work}, timeout=START_CANCEL_AGAIN_S)
        if work.cancelled():
            return False
        if self._stop.is_set() and isinstance(work.exception(), BUS_ERRORS):
            # It failed as the stop came (the server and the host told to stop at once, as
            # when ``vertumnus up`` is killed): a stop, not a lost start-up.
            log.info("rank host start-up ended by its server's loss while stopping",
                     error=repr(work.exception()))
            return False
        work.result()  # raises what the start-up raised
        return True

    async def _start_up(self, nc: Client, stack: AsyncExitStack) -> None:
        """The epoch bucket, the workers of its record (else ``initial``), then the epoch
        watch and its follower, each undone by ``stack`` (module docstring, start-up)."""
        epochs = await epoch_kv(nc.jetstream(timeout=self.settings.jetstream_timeout_s),
                                self.settings.subjects)
        key = self.settings.subjects.epoch_key()
        try:
            entry = await epochs.get(key)
        except NotFoundError:
            entry = None
        record = self._decode(entry.value) if entry is not None and entry.value else None
        if record is not None:
            await self._apply(record)
        else:
            for wid in self.initial:
                await self._start_worker(wid, self.settings.kind, self.settings.epoch)
            self._changed.set()
        watcher = KvWatch(nc, epochs, key)  # survives a server restart
        stack.push_async_callback(watcher.stop)  # whatever part of it was made
        # Not cut short: a cancel inside nats-py's watch, after its subscription and its
        # tasks are made, would leave them running on the connection (module docstring).
        await finish_first(watcher.start())
        follow = asyncio.create_task(self._follow(watcher), name="rankd-host-epochs")
        # Awaited, not just cancelled: a follower still applying a record while the workers
        # stop could start a new one after _stop_all (cancel_and_wait: shared/tasks.py).
        stack.push_async_callback(cancel_and_wait, [follow], log)

    async def _follow(self, watcher: object) -> None:
        async for entry in watcher:  # type: ignore[attr-defined]
            if cancel_requested():  # a cancel swallowed inside a KV call (shared/tasks.py)
                return
            if entry is None or not entry.value:
                continue
            record = self._decode(entry.value)
            if record is not None:
                try:
                    await self._apply(record)
                except Exception:  # never ends the follower: the next record is applied
                    log.exception("applying epoch failed", epoch=record.epoch)

    @staticmethod
    def _decode(payload: bytes) -> EpochRecord | None:
        """The record, or None (logged) for one that does not decode, whatever the reason:
        a follower that died of a record would apply none after it."""
        try:
            return decode(EpochRecord, payload)
        except SchemaError as exc:
            log.error("bad epoch record ignored", error=str(exc))
        except Exception:
            log.exception("epoch record that could not be decoded ignored")
        return None

    async def _stop_all(self) -> None:
        for svc in self.services.values():
            svc.request_stop()
        tasks = list(self._tasks.values())
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
