"""The persistent rank processes of a torch prefill pool: one process per GPU, one gloo (CPU) or
NCCL (GPU) world, every lattice CP group created once at start-up.

A :class:`TorchWorld` is owned by the rank-daemon process (the workers' leader side). It spawns
``world_size`` rank processes; each one

1. joins the default process group (rendezvous through a file store in a private temp dir),
2. builds its model once (seeded random weights of a given config, or a local HF-format
   checkpoint) — never reloaded afterwards,
3. creates every lattice group of ``degrees`` with :class:`~services.rankd.engine.groups.RankGroups`
   (a collective of the whole world, exactly once) and starts in its own initial degree (ranks
   may start in different degrees: the initial composition can mix CP1 and CP2 workers),
4. serves commands from the leader over a private pipe, one at a time:
   ``prefill`` (one :meth:`RankEngine.prefill` step, SPMD over the members of a worker),
   ``switch`` (:meth:`RankEngine.switch`, split or merge at a step boundary), ``remove``
   (drop cached blocks of the active worker), ``blocks`` (its cached block hashes),
   ``export`` / ``import`` (KV replication between workers, :meth:`TorchWorld.copy_prefix`:
   each destination member is sent only the pages it keeps),
   ``info``, ``stop``. The leader mirrors each worker's cache index from the replies (stored and
   evicted blocks, removals, the index a switch leaves), so it knows what the engine holds
   without asking.

Commands to a worker go to every member rank; the leader holds the members' locks (acquired in
ascending rank order, so two workers sharing no rank run concurrently and a switch that spans
two former workers waits for both) for the whole round trip, so every member sees the same
command sequence (the SPMD contract of the engine).

Errors: bad input (token out of vocabulary, too long) is detected by the engine before any
collective on every member identically (engine/errors.py); each member answers with the typed
error, the leader re-raises it as that :class:`~shared.ids.InvalidInput` subclass and every
rank stays up. A rank that dies or stops answering makes the world *broken* for good
(:class:`WorldBroken`, a :class:`~shared.ids.WorkerFault`: every later command raises it too);
it is not restarted here — the rank daemon hands its requests back and its process exits to
be restarted (services/rankd/service.py). The error names the rank that died (GPU, pid, signal
or exit status) even when a surviving member reported the failure first (its collective broke),
and a leader waiting on one member notices a dead peer of the same command at once rather than
after the reply timeout. :meth:`TorchWorld.health` finds a dead rank without a command (a rank
host probes it, so a rank dying under an idle worker is noticed too).

Stopping: only the leader stops a rank (``stop``, or the end of its pipe when the leader is
gone; :meth:`TorchWorld.close` kills what does not stop). A rank that stopped in order ends at once
(``os._exit`` once its process group is destroyed), without the interpreter's teardown of
torch, which the leader's close would otherwise wait for. A rank ignores SIGINT and SIGTERM
(:data:`LEADER_SIGNALS`): the rank processes share the leader's process group, so a stop sent
to the group (``vertumnus up`` stopping its children, systemd's control-group kill, a Ctrl-C at
a terminal) reaches them too, and a rank killed by it while the leader still runs is a dead
rank to the leader's health probe -- an orderly stop ended as a world fault (exit status 75).
SIGKILL still ends a rank, as any death does, and is reported as one. A rank is spawned with
those signals blocked (:func:`start_shielded`; the mask survives fork and exec) and unblocks
them only once it ignores them, so a group stop in the instant of its start-up (the
interpreter starting, the spawn bootstrap) stays pending and is then ignored too.

Blocking by design (pipes); the async backend calls it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Final

from shared.ids import InvalidInput, WorkerFault, worker_name

DEFAULT_REPLY_TIMEOUT_S: Final[float] = 600.0  # hang guard, not a latency bound
LEADER_SIGNALS: Final[tuple[signal.Signals, ...]] = (signal.SIGINT, signal.SIGTERM)
"""Signals a rank process ignores: they stop its leader, which then stops the ranks (module
docstring, "Stopping")."""
REAP_GRACE_S: Final[float] = 1.0
"""How long a failure waits for a dying rank's exit status (its pipe and sockets close as it
exits, slightly before it can be reaped), so the error names the rank that died."""


class WorldBroken(WorkerFault):
    """A rank process died, failed outside the engine's input checks, or stopped answering.

    A worker fault (not the request's): every worker on this world is broken for good."""


@dataclass(frozen=True)
class WorldSpec:
    """What every rank process builds at start-up.

    ``model_path``: a local HF-format directory (checkpoint.load_model); otherwise
    ``model_config`` (Qwen3Config.to_dict()) with seeded random weights (``seed``), identical
    in every process. ``initial_degrees``: per rank (len == world_size) or one for all.
    ``gpu_offset``: global rank r is GPU r + gpu_offset (worker ids, CUDA device index).
    ``collective_timeout_s``: how long any collective (the default group's and every lattice
    CP group's) waits for its members before it fails, breaking the world (WorldBroken).
    """

    world_size: int
    degrees: tuple[int, ...] = (1, 2)
    initial_degrees: tuple[int, ...] = (1,)
    model_config: dict[str, Any] | None = None
    model_path: str | None = None
    seed: int = 0
    dtype: str = "float32"
    block_size: int = 16
    pages_per_rank: int = 256
    gpu_offset: int = 0
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, device = cuda:{gpu})
    threads: int = 1
    init_timeout_s: float = 120.0
    collective_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise InvalidInput(f"world_size must be >= 1, got {self.world_size}")
        if self.model_config is None and self.model_path is None:
            raise InvalidInput("give model_config (random weights) or model_path")
        if len(self.initial_degrees) not in (1, self.world_size):
            raise InvalidInput("initial_degrees: one value or one per rank")
        for d in self.degrees:
            if d < 1 or d & (d - 1) or self.world_size % d:
                raise InvalidInput(
                    f"degree {d} must be a power of two dividing world_size {self.world_size}"
                )
        for r in range(self.world_size):
            d = self.initial_degree(r)
            if d not in self.degrees:
                raise InvalidInput(f"initial degree {d} of rank {r} not in {self.degrees}")
        # Members of one group must agree on their initial degree (aligned groups).
        for r in range(self.world_size):
            d = self.initial_degree(r)
            start = r - r % d
            if any(self.initial_degree(m) != d for m in range(start, start + d)):
                raise InvalidInput(
                    f"initial degrees {self.initial_degrees} are not lattice-aligned"
                )
        if self.device not in ("cpu", "cuda"):
            raise InvalidInput(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    def initial_degree(self, rank: int) -> int:
        d = self.initial_degrees
        return d[0] if len(d) == 1 else d[rank]


@dataclass(frozen=True)
class RankReply:
    """One member's answer to a prefill: the greedy token (identical on every member), the
    prefix the engine reused, blocks newly stored, the step's wall seconds on that rank, the
    whole sequence's KV as safetensors bytes (CP rank 0 only, when asked), its pid."""

    rank: int
    pid: int
    token: int
    prefix_len: int
    stored: int
    seconds: float
    worker: str
    kv_blob: bytes | None = None
    evicted: tuple[int, ...] = ()  # blocks the step's store evicted to make room
    stored_blocks: tuple[int, ...] = ()  # the hashes of the ``stored`` blocks


@dataclass(frozen=True)
class SwitchReply:
    """One member's switch: ``blocks`` is what the new worker's active cache holds after it
    (a revived or kept cache's index, or nothing when a fresh cache started), identical on
    every member of the new worker; the leader's mirror is reset to it."""

    rank: int
    pid: int
    epoch: int
    old_worker: str
    new_worker: str
    seconds: float  # on this rank: from the switch call until every new-group member parked
    # repr=False: the whole index (hundreds of hashes) would drown a logged reply.
    blocks: frozenset[int] = field(default=frozenset(), repr=False)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pid: int
    epoch: int
    degree: int
    worker: str
    retired: tuple[str, ...] = field(default_factory=tuple)
    # Pages (and their KV bytes) this rank has received in ``import`` commands since it
    # started: what actually arrived over its pipe, whatever the leader meant to send.
    received_pages: int = 0
    received_kv_bytes: int = 0


# --- the rank process ----------------------------------------------------------------------


def _build_model(spec: WorldSpec, rank: int) -> Any:
    from services.rankd.engine.checkpoint import load_model
    from services.rankd.engine.config import Qwen3Config
    from services.rankd.engine.model import Qwen3ForCausalLM
    from services.rankd.torch_spec import torch_dtype

    # The parent checked the dtype by the same mapping (torch_spec.world_spec).
    dtype = torch_dtype(spec.dtype)
    device = f"cuda:{rank + spec.gpu_offset}" if spec.device == "cuda" else "cpu"
    if spec.model_path is not None:
        return load_model(spec.model_path, dtype=dtype, device=device)
    assert spec.model_config is not None
    cfg = Qwen3Config.from_dict(dict(spec.model_config))
    return Qwen3ForCausalLM.random(cfg, seed=spec.seed, dtype=dtype).to(device)


def start_shielded(process: BaseProcess) -> None:
    """Start ``process`` with :data:`LEADER_SIGNALS` blocked in this thread for the time of
    the spawn: the child inherits the mask, so those signals stay pending until it unblocks
    them itself (``_rank_main``, after ignoring them). This thread's mask is restored."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, LEADER_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _rank_main(spec: WorldSpec, rank: int, store: str, conn: Connection) -> None:
    """Body of one rank process (module level: picklable for the spawn start method)."""
    # First of all (the imports below take seconds): a stop of the process group is the
    # leader's to carry out (module docstring, "Stopping").
    for sig in LEADER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, LEADER_SIGNALS)  # blocked by start_shielded
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from services.rankd.engine.decode import kv_to_bytes
    from services.rankd.engine.groups import RankGroups
    from services.rankd.engine.rank import RankEngine

    torch.set_num_threads(spec.threads)
    try:
        if spec.device == "cuda":
            torch.cuda.set_device(rank + spec.gpu_offset)
        dist.init_process_group(
            "nccl" if spec.device == "cuda" else "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )
        model = _build_model(spec, rank)
        groups = RankGroups(
            spec.degrees,
            spec.initial_degree(rank),
            spec.gpu_offset,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )
        engine = RankEngine(model, groups, spec.block_size, spec.pages_per_rank)
        conn.send(("ready", os.getpid(), model.config.vocab_size,
                   model.config.max_position_embeddings))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("fatal", traceback.format_exc()))
        return

    received = [0, 0]  # pages, KV bytes received in "import" commands (RankInfo)

    def info() -> RankInfo:
        return RankInfo(
            rank,
            os.getpid(),
            groups.epoch,
            groups.active.degree,
            str(engine.worker_id),
            tuple(sorted(engine.retired)),
            received[0],
            received[1],
        )

    from shared.ids import InvalidInput as _Bad

    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break  # the leader is gone
            op = msg[0]
            try:
                if op == "stop":
                    conn.send(("ok", None))
                    break
                if op == "info":
                    conn.send(("ok", info()))
                elif op == "prefill":
                    _, ids, want_kv, meta, chain, max_prefix = msg
                    out = engine.prefill(ids, chain=chain, max_prefix=max_prefix)
                    engine.take_events()  # the leader mirrors the index from the replies
                    blob = None
                    if want_kv and engine.group.rank == 0:
                        kv_meta = dict(meta, token=out.next_token, length=len(ids))
                        blob = kv_to_bytes(out.result.full_kv(), kv_meta)
                    conn.send(
                        (
                            "ok",
                            RankReply(
                                rank,
                                os.getpid(),
                                out.next_token,
                                out.prefix_len,
                                len(out.stored),
                                out.seconds,
                                str(engine.worker_id),
                                blob,
                                tuple(int(h) for h in out.evicted),
                                tuple(int(h) for h in out.stored),
                            ),
                        )
                    )
                elif op == "remove":
                    gone = engine.remove(msg[1])
                    engine.take_events()
                    conn.send(("ok", tuple(int(h) for h in gone)))
                elif op == "blocks":
                    conn.send(("ok", (str(engine.worker_id), engine.cached_blocks())))
                elif op == "export":
                    conn.send(("ok", engine.export_prefix(msg[1], msg[2])))
                elif op == "resident":
                    conn.send(("ok", engine.resident_prefix(msg[1])))
                elif op == "import":
                    _, chain, pages, protect, page_shape = msg
                    received[0] += len(pages)
                    received[1] += sum(pg.kv.nbytes for pg in pages)
                    stored, evicted = engine.import_prefix(
                        chain, pages, protect, payload_shape=page_shape
                    )
                    engine.take_events()
                    conn.send(("ok", ([int(h) for h in stored], [int(h) for h in evicted])))
                elif op == "switch":
                    _, epoch, degree = msg
                    rep = engine.switch(epoch, degree)
                    conn.send(
                        (
                            "ok",
                            SwitchReply(
                                rank,
                                os.getpid(),
                                rep.epoch,
                                str(rep.old_worker),
                                str(rep.new_worker),
                                rep.seconds,
                                frozenset(int(h) for h in engine.cached_blocks()),
                            ),
                        )
                    )
                else:
                    conn.send(("invalid", "InvalidInput", f"unknown command {op!r}"))
            except _Bad as exc:  # checked before any collective: this rank stays usable
                conn.send(("invalid", type(exc).__name__, str(exc)))
            except Exception:
                conn.send(("fatal", traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    _end_rank_process()


def _end_rank_process() -> None:
    """End a rank process that stopped in order (``stop``, or its leader gone) at once: its
    output flushed, its process group destroyed, nothing else of it is needed. Without this
    the interpreter's teardown of torch ran first -- seconds on a loaded machine -- while the
    leader's :meth:`TorchWorld.close` waited for it, and the rank daemon's graceful stop
    overran its deadline (``vertumnus up`` gives it a share of ``--stop-timeout``: 2.3 s of
    the default 10 s) and exited with status 70 instead of 0."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


# --- the leader side -----------------------------------------------------------------------


def _typed_error(name: str, message: str) -> InvalidInput:
    """Rebuild the engine's typed input error by name (all derive from InvalidInput)."""
    from services.rankd.engine import errors

    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, InvalidInput):
        return cls(message)
    return InvalidInput(f"{name}: {message}")


class TorchWorld:
    """Spawns and drives the rank processes of ``spec`` (see module docstring)."""

    def __init__(self, spec: WorldSpec, *, reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S):
        self.spec = spec
        self.reply_timeout_s = reply_timeout_s
        self._locks = [threading.RLock() for _ in range(spec.world_size)]
        # The leader's exact view of each rank's (epoch, degree): every command passes here.
        self._geometry = [(0, spec.initial_degree(r)) for r in range(spec.world_size)]
        # The leader's mirror of each worker's engine cache index (block hashes), kept from
        # the replies of every command that changes it (prefill: stored / evicted; remove;
        # switch: reset to the new worker's index).
        self._blocks: dict[str, set[int]] = {}
        self._mirror_lock = threading.Lock()  # read on the event loop, written by step threads
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.pids: tuple[int, ...] = ()
        self.vocab_size = 0
        self.max_positions = 0  # the model's max_position_embeddings (0: not started)
        self.broken: str | None = None
        self._closed = False
        # Pages installed between workers: moved through this leader (copy_prefix) or shared
        # in place where every member already held them (adopt_resident).
        self.copied_pages = 0
        self.adopted_pages = 0
        # What copy_prefix sent each rank (index: global rank), cumulative: pages and their KV
        # bytes (tensor sizes, whatever the pipe's pickler makes of them). Each destination
        # member is sent only the pages it keeps, so these show what a re-shard costs.
        self.pages_sent = [0] * spec.world_size
        self.kv_bytes_sent = [0] * spec.world_size

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> TorchWorld:
        """Spawn every rank and wait until all built their model and groups."""
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="vtm-world-")
        store = os.path.join(self._tmp.name, "store")
        for r in range(self.spec.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                args=(self.spec, r, store, child),
                name=f"vtm-rank-{r}",
                daemon=True,
            )
            start_shielded(p)
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        pids, vocab, positions = [], set(), set()
        try:
            for r in range(self.spec.world_size):
                msg = self._recv(r, self.spec.init_timeout_s + 60.0)
                if msg[0] != "ready":
                    raise WorldBroken(f"rank {r} failed to start:\n{msg[-1]}")
                pids.append(msg[1])
                vocab.add(msg[2])
                positions.add(msg[3])
        except BaseException:
            self.close()
            raise
        self.pids = tuple(pids)
        self.vocab_size = vocab.pop()
        self.max_positions = min(positions)
        # A leader that exits without closing the world (an error path) stops its ranks on
        # the way out: multiprocessing's own exit handler, which runs after this one, would
        # SIGTERM them -- ignored -- and then wait for them for ever.
        atexit.register(self.close)
        return self

    def close(self) -> None:
        """Stop every rank (graceful, then killed); idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for c in self._conns:
            with contextlib.suppress(Exception):
                c.send(("stop",))
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self._conns:
            with contextlib.suppress(Exception):
                c.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> TorchWorld:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self._procs]

    # -- commands -----------------------------------------------------------------------------

    def members(self, first_gpu: int, degree: int) -> tuple[int, ...]:
        """Global ranks of the lattice worker starting at GPU ``first_gpu``."""
        start = first_gpu - self.spec.gpu_offset
        if start < 0 or start + degree > self.spec.world_size or start % degree:
            raise InvalidInput(
                f"worker of degree {degree} at GPU {first_gpu} is outside this world "
                f"(GPUs {self.spec.gpu_offset}..{self.spec.gpu_offset + self.spec.world_size - 1})"
            )
        return tuple(range(start, start + degree))

    def health(self) -> str | None:
        """None while every rank process runs (or the world was closed on purpose); else why
        the world is broken, which it then is for good. Non-blocking: safe on an event loop."""
        if self._closed:
            return None
        if self.broken is not None:
            return self.broken
        for r in range(len(self._procs)):
            if (why := self._death(r)) is not None:
                self.broken = why
                return why
        return None

    def _death(self, rank: int) -> str | None:
        """Why rank ``rank``'s process is gone (``rank 1 (GPU 1, pid 4242) was killed by
        SIGKILL``), None while it runs."""
        proc = self._procs[rank]
        if proc.is_alive():
            return None
        code = proc.exitcode
        how = f"exited with status {code}"
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        return f"rank {rank} (GPU {rank + self.spec.gpu_offset}, pid {proc.pid}) {how}"

    def _first_death(self, ranks: Sequence[int], grace_s: float = 0.0) -> str | None:
        """The first rank of ``ranks`` whose process is gone, described; else None, after
        waiting up to ``grace_s`` for one to be reaped (failure paths only)."""
        deadline = time.monotonic() + grace_s
        while True:
            for r in ranks:
                if (why := self._death(r)) is not None:
                    return why
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _recv(self, rank: int, timeout: float, peers: Sequence[int] = ()) -> tuple[Any, ...]:
        """Rank ``rank``'s next answer. Raises WorldBroken when it, or one of ``peers`` (the
        other members of the same command: ``rank`` may wait on them in a collective that a
        dead peer never completes), is gone, or after ``timeout`` seconds."""
        conn = self._conns[rank]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if (why := self._first_death((rank, *peers))) is not None:
                raise WorldBroken(why)
            if time.monotonic() > deadline:
                raise WorldBroken(f"rank {rank} did not answer within {timeout:.0f} s")
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:  # OSError: a reset socket pair (a killed rank)
            why = self._first_death((rank, *peers), REAP_GRACE_S)
            raise WorldBroken(why or f"rank {rank} closed its pipe ({exc!r})") from exc

    def _round(self, ranks: Sequence[int], msg: tuple[Any, ...]) -> list[Any]:
        """Send ``msg`` to every rank of ``ranks`` and collect their answers (rank order)."""
        return self._round_each({r: msg for r in ranks})

    def _round_each(self, msgs: Mapping[int, tuple[Any, ...]]) -> list[Any]:
        """Send each rank of ``msgs`` its own message and collect their answers (rank order).

        One command of one worker, as :meth:`_round`, whose members are given different
        arguments (each its share of a payload, :meth:`copy_prefix`): the same locking (all
        members' locks for the whole round trip) and the same failure handling (a broken
        pipe, a dead or silent member, a fatal answer break the world; typed "invalid"
        answers are re-raised only when every member gave one, else the members disagreed
        and the world is broken). The messages must keep the engine's SPMD contract: every
        member makes the same collectives and ends in the same index."""
        if self._closed:
            raise WorldBroken("world closed")
        if self.broken is not None:
            raise WorldBroken(f"world is broken: {self.broken}")
        ranks = sorted(msgs)
        with self._locked(ranks):
            for r in ranks:
                try:
                    self._conns[r].send(msgs[r])
                except OSError as exc:  # BrokenPipeError: the rank is gone (or going)
                    why = self._first_death(ranks, REAP_GRACE_S)
                    self.broken = why or f"rank {r}'s pipe broke: {exc}"
                    raise WorldBroken(self.broken) from exc
            answers = []
            for r in ranks:
                try:
                    answers.append(self._recv(r, self.reply_timeout_s, ranks))
                except WorldBroken as exc:
                    self.broken = str(exc)
                    raise
        fatal = [(r, a) for r, a in zip(ranks, answers, strict=True) if a[0] == "fatal"]
        if fatal:
            # A member whose collective broke because a peer died reports the failure first:
            # name the dead rank (the cause) before the survivors' tracebacks.
            dead = self._first_death(ranks, REAP_GRACE_S)
            # An answer is ("fatal", traceback): name the traceback's last line (the error).
            last = fatal[0][1][1].strip().splitlines()[-1:] or ["?"]
            self.broken = (f"{dead}; rank {fatal[0][0]} then failed: {last[0]}" if dead
                           else f"rank {fatal[0][0]} failed: {last[0]}")
            raise WorldBroken("\n".join([self.broken, *(f"rank {r}:\n{a[1]}" for r, a in fatal)]))
        invalid = [a for a in answers if a[0] == "invalid"]
        if invalid:
            if len(invalid) != len(answers):  # some members ran, some refused: not SPMD any more
                self.broken = "members disagreed on a command"
                raise WorldBroken(f"members disagreed: {answers!r}")
            raise _typed_error(invalid[0][1], invalid[0][2])
        return [a[1] for a in answers]

    @contextlib.contextmanager
    def _locked(self, ranks: Sequence[int]) -> Any:
        locks = [self._locks[r] for r in sorted(set(ranks))]  # ascending: no lock-order cycle
        for lk in locks:
            lk.acquire()
        try:
            yield
        finally:
            for lk in reversed(locks):
                lk.release()

    def geometry(self, rank: int) -> tuple[int, int]:
        """(epoch, degree) rank ``rank`` has adopted, as the leader drove it."""
        return self._geometry[rank]

    def info(self, ranks: Sequence[int] | None = None) -> list[RankInfo]:
        return self._round(range(self.spec.world_size) if ranks is None else ranks, ("info",))

    def prefill(
        self,
        ranks: Sequence[int],
        token_ids: Sequence[int],
        *,
        want_kv: bool = False,
        meta: dict[str, Any] | None = None,
        chain: Sequence[int] | None = None,
        max_prefix: int | None = None,
    ) -> list[RankReply]:
        """One CP prefill step over ``ranks`` (one worker's members, its active group).

        ``chain`` / ``max_prefix``: cache keys of the request's full blocks and a cap on the
        reused prefix (``RankKVCache.lookup``); None: the engine hashes the ids itself."""
        msg = (
            "prefill",
            list(token_ids),
            want_kv,
            dict(meta or {}),
            None if chain is None else [int(h) for h in chain],
            max_prefix,
        )
        replies: list[RankReply] = self._round(ranks, msg)
        lead = replies[0]
        self._mirror(lead.worker, lead.stored_blocks, lead.evicted)
        return replies

    def _mirror(self, worker: str, added: Sequence[int], gone: Sequence[int]) -> None:
        with self._mirror_lock:
            mirror = self._blocks.setdefault(worker, set())
            mirror.difference_update(gone)
            mirror.update(added)

    def cached_blocks(self, worker_id: str) -> frozenset[int]:
        """The leader's view of ``worker_id``'s engine cache index (no round trip)."""
        with self._mirror_lock:
            return frozenset(self._blocks.get(worker_id, ()))

    def engine_blocks(self, ranks: Sequence[int]) -> list[tuple[str, frozenset[int]]]:
        """Ask each rank of ``ranks`` for its active worker and cached block hashes (audits
        and tests: the engine's actual index, not the leader's mirror)."""
        return self._round(ranks, ("blocks",))

    def copy_prefix(
        self,
        src_ranks: Sequence[int],
        src_worker: str,
        dst_ranks: Sequence[int],
        hashes: Sequence[int],
        *,
        protect: Collection[int] = (),
    ) -> tuple[list[int], list[int]]:
        """Replicate KV between workers of this world (a replicate / reconcile command): the
        longest leading part of the chain ``hashes`` that ``src_worker``'s cache holds on
        ``src_ranks`` (its active or retired cache: after a split / merge the old worker's
        pages stay resident until the new worker needs their slots) is installed into the
        active cache of the worker made of ``dst_ranks`` (its members, in its geometry), each
        destination rank keeping the pages it owns at the destination's degree (a re-shard
        when the degrees differ).

        The destination makes room by evicting its LRU leaves except the blocks of
        ``protect`` (what its leader still needs resident: pinned blocks, the blocks of a
        request whose KV hand-off is in progress); when that leaves too little room, only
        the leading part of the chain that fits is installed.

        Each destination member is sent only the pages it keeps: page i of the chain (block
        i, root first) goes to the member of CP rank i mod C' (C' = ``len(dst_ranks)``, the
        members in ascending order being CP ranks 0..C'-1), with the whole chain's metadata,
        so every member updates the same index (the same (stored, evicted) answer) and a
        member's pool receives exactly the pages it would have kept from the whole chain.
        :attr:`pages_sent` / :attr:`kv_bytes_sent` count what each rank was sent.

        Checked on the leader before anything is installed: only a prefix whose every page
        arrived is sent, and its pages must share one shape (else :class:`KVFormatError`,
        nothing sent), declared to every member, which refuses a payload of another shape
        than its cache's -- so members given different pages still refuse or install
        together. Returns the destination's (stored, evicted) block hashes; ([], []) when
        nothing could be copied.
        """
        from services.rankd.engine.errors import KVFormatError

        src, dst = sorted(set(src_ranks)), sorted(set(dst_ranks))
        with self._locked(src + dst):
            answers = self._round(src, ("export", src_worker, [int(h) for h in hashes]))
            chain = min((c for c, _ in answers), key=len)  # members agree; be safe
            pages = {pg.hash: pg for _, pgs in answers for pg in pgs}
            whole = 0
            while whole < len(chain) and chain[whole][0] in pages:
                whole += 1
            chain = chain[:whole]
            if not chain:
                return [], []
            keep = [pages[h] for h, _ in chain]
            shapes = {tuple(pg.kv.shape) for pg in keep}
            if len(shapes) != 1:
                # A member checks only the pages it is given: one odd page would make its
                # owner refuse while the others install, splitting the worker's index.
                raise KVFormatError(f"exported pages of {src_worker} differ in shape: {shapes}")
            (shape,) = shapes
            guard = sorted(int(h) for h in protect)
            degree = len(dst)
            share = {r: keep[k::degree] for k, r in enumerate(dst)}  # page i -> CP rank i % C'
            replies = self._round_each(
                {r: ("import", chain, share[r], guard, shape) for r in dst}
            )
        stored, evicted = replies[0]
        with self._mirror_lock:  # workers' commands run on several threads
            self.copied_pages += len(stored)
            for r in dst:
                self.pages_sent[r] += len(share[r])
                self.kv_bytes_sent[r] += sum(pg.kv.nbytes for pg in share[r])
        self._mirror(str(worker_name(len(dst), dst[0] + self.spec.gpu_offset)), stored, evicted)
        return list(stored), list(evicted)

    def adopt_resident(
        self,
        dst_ranks: Sequence[int],
        chain: Sequence[tuple[int, int | None]],
        *,
        protect: Collection[int] = (),
    ) -> tuple[list[int], list[int]]:
        """Install into the active cache of the worker made of ``dst_ranks`` the longest
        leading part of ``chain`` (``(hash, parent)``, root first) whose pages every member
        already holds where that worker needs them: each in its rank's page pool, from
        another cache of the rank (after a split or merge, the retired predecessor's; page p
        of a prefix sits on rank p mod C, so the pages a new worker retains are already on
        its ranks). No KV moves; the members share the slots. Two rounds: each member says
        how far it could go, then all install the shortest of those (so they do the same).
        Room as in :meth:`copy_prefix`. Returns (stored, evicted)."""
        dst = sorted(set(dst_ranks))
        pairs = [(int(h), None if p is None else int(p)) for h, p in chain]
        with self._locked(dst):
            n = min(self._round(dst, ("resident", [h for h, _ in pairs])))
            if n == 0:
                return [], []
            replies = self._round(
                dst, ("import", pairs[:n], [], sorted(int(h) for h in protect), None)
            )
        stored, evicted = replies[0]
        self._mirror(str(worker_name(len(dst), dst[0] + self.spec.gpu_offset)), stored, evicted)
        with self._mirror_lock:  # workers' commands run on several threads
            self.adopted_pages += len(stored)
        return list(stored), list(evicted)

    def remove(self, ranks: Sequence[int], hashes: Sequence[int]) -> frozenset[int]:
        """Drop blocks (and their cached descendants) from the active cache of the worker
        made of ``ranks`` (its members, in its geometry); returns what was removed."""
        answers: list[tuple[int, ...]] = self._round(ranks, ("remove", [int(h) for h in hashes]))
        gone = frozenset(answers[0])
        if any(frozenset(a) != gone for a in answers):
            self.broken = "members' cache indices diverged"
            raise WorldBroken(f"members removed different blocks: {answers!r}")
        self._mirror(str(worker_name(len(ranks), min(ranks) + self.spec.gpu_offset)), (), gone)
        return gone

    def switch(self, ranks: Sequence[int], epoch: int, degree: int) -> list[SwitchReply]:
        """Adopt ``epoch`` at ``degree`` on ``ranks``, which must be whole groups of ``degree``
        (a merge: the new group; a split: the old group, now several new ones).

        Checked here before anything is sent, so a refused switch changes nothing and no member
        is left parked on a barrier: every rank must be between steps (guaranteed: the leader
        holds its lock), ``epoch`` newer than every member's, ``degree`` a lattice degree.
        """
        from services.rankd.engine.errors import GroupError

        ranks = sorted(set(ranks))
        if degree not in self.spec.degrees:
            raise GroupError(f"no lattice group of degree {degree} (have {self.spec.degrees})")
        for start in {r - r % degree for r in ranks}:
            if not set(range(start, start + degree)) <= set(ranks):
                raise GroupError(f"ranks {ranks} do not cover whole groups of degree {degree}")
        with self._locked(ranks):
            stale = [r for r in ranks if self._geometry[r][0] >= epoch]
            if stale:
                raise GroupError(
                    f"epoch {epoch} is not newer than the epoch of rank(s) {stale} "
                    f"({[self._geometry[r][0] for r in stale]})"
                )
            replies: list[SwitchReply] = self._round(ranks, ("switch", epoch, degree))
            for r in ranks:
                self._geometry[r] = (epoch, degree)
            # The engine may have started a fresh cache (a member no longer had the revived
            # one) or kept one: the mirror follows what each new worker now really holds, not
            # what it held before it was retired (else prepare_cache_command / _inherit would
            # count blocks the engine lacks as held and skip copies).
            with self._mirror_lock:
                for rep in replies:
                    self._blocks[rep.new_worker] = set(rep.blocks)
            return replies

    def step(
        self,
        ranks: Sequence[int],
        epoch: int,
        token_ids: Sequence[int],
        *,
        want_kv: bool = False,
        meta: dict[str, Any] | None = None,
        chain: Sequence[int] | None = None,
        max_prefix: int | None = None,
        drop: Sequence[int] = (),
    ) -> tuple[list[SwitchReply], list[RankReply], float]:
        """One engine step of the worker made of ``ranks``: switch them to that worker's
        geometry first if they are in another one (split / merge at this step boundary, under
        ``epoch``); then remove the blocks ``drop`` from its cache (so that it follows an
        authoritative index, e.g. rankd's BlockCache); then prefill. Atomic
        with respect to other workers' commands. Returns the switch reports (empty if none),
        the members' replies and the switch's wall seconds."""
        ranks = sorted(set(ranks))
        degree = len(ranks)
        with self._locked(ranks):
            switched: list[SwitchReply] = []
            t0 = time.perf_counter()
            if any(self._geometry[r][1] != degree for r in ranks):
                switched = self.switch(ranks, epoch, degree)
            switch_s = time.perf_counter() - t0 if switched else 0.0
            if drop:
                self.remove(ranks, drop)
            replies = self.prefill(
                ranks, token_ids, want_kv=want_kv, meta=meta, chain=chain, max_prefix=max_prefix
            )
            return switched, replies, switch_s
