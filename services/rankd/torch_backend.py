"""The ``torch`` execution backend of rankd: real CP prefill on persistent rank processes.

:class:`TorchBackend` is the worker-leader side of one worker ``w-cp{C}-g{first}``. It shares a
:class:`~services.rankd.torch_world.TorchWorld` (one process per GPU, every lattice group
created once at start-up) with the other workers of the same GPU range, and per assignment:

1. **token ids**: the request's real ids when the IntakeRequest carries ``tokens``; otherwise
   (trace- or sim-driven workloads carry only ``input_len`` and ``block_hashes``) ids are
   synthesised deterministically by :func:`request_token_ids`: the tokens of full block i
   are drawn from a generator seeded with ``block_hashes[i]`` and the tail from one seeded
   with the request id. Equal hash chains therefore give equal token prefixes, so the
   engine's own prefix cache hits exactly where the trace says prefixes are shared (when the
   engine's block size equals the request's);
2. **geometry**: if the worker's ranks are in another geometry (the epoch record split or
   merged workers), they switch at this step boundary with ``RankEngine.switch(epoch, C)`` —
   same processes, no weight reload (:meth:`TorchBackend.adopt` does it eagerly; in host
   mode a worker made by a split or merge does it before it starts, with
   :meth:`TorchBackend.inherit_prefixes`, which also installs its retained prefixes in
   place from the predecessors' resident pages);
3. **prefill**: one zigzag CP step over the members (``RankEngine.prefill``: longest cached
   prefix reused, new full blocks stored); the first token is the greedy token of the last
   position, identical on every member. Inside rankd (:meth:`TorchBackend.bind_cache`) the
   engine's cache is kept in lockstep with the worker's BlockCache — same block names (the
   request's ``block_hashes``), the P rankd decided, rankd's evictions applied before the
   step and the engine's own evictions removed from the BlockCache after it — so the prefix
   reused, the FirstToken's ``prefix_tokens`` and the published cache events agree;
   standalone (no rankd) the engine's own cache decides over its own hashes;
4. **KV hand-off**: CP rank 0 returns the whole sequence's KV (prefix + new) as a safetensors
   blob; the leader cuts it into ≤ 512 KiB chunks in the wire format of
   ``engine/decode.py`` (``encode_chunks`` / ``ChunkReassembler``, what ChunkedBytesTransport
   carries) and publishes them on ``{prefix}.kv.{request_id}`` with a reply inbox; a
   :class:`KVDecodeRole` (queue group ``vtm-decode``) reassembles them, runs ``decode_step``
   (the first decode iteration) and replies with its token. Without NATS
   (``handoff=None``) the same chunks go through an in-process ChunkedBytesTransport and the
   decode step runs in this process (dev / tests only; stated in the outcome).

The service-level :class:`~services.rankd.backend.PrefillResult` carries the prefill's greedy
token (the request's first output token) and measured wall times: ``prefill_s`` (the step
round trip, switch excluded), ``kv_transfer_s`` (chunk publish → decode reply, minus the decode
compute), ``first_decode_s`` (the decode role's compute). Details per request (engine time per
rank, prefix actually reused, the decode token, chunk counts, switch reports, rank pids) are
kept in :attr:`TorchBackend.outcomes` (bounded).

Errors: bad input (token id outside the vocabulary, a sequence longer than the model's
positions, wrong worker) raises :class:`~shared.ids.InvalidInput` subclasses (the engine checks
before any collective, so every rank stays up); rankd turns them into a FirstToken with
``error``. A broken world (a rank process died — OOM kill, segfault, SIGKILL — or failed
outside the input checks, or stopped answering) raises
:class:`~services.rankd.torch_world.WorldBroken`, a :class:`~shared.ids.WorkerFault`: the
request is not at fault and gets no error answer; rankd hands it back to intake with the
worker's queue, the worker turns UNAVAILABLE and stops. The world is shared by every worker of
the host and stays broken, so in host mode (:func:`serve_torch_host`) every worker hands back
and stops, and the host raises the fault: the process exits non-zero for its supervisor to
restart it with a fresh world. :meth:`TorchBackend.health` (probed by rankd) notices a dead
rank under an idle worker as well. A single worker (:func:`single_worker_backend`) follows the
same rule through its RankdService.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import structlog

from services.rankd.backend import ExecutionBackend, PrefillResult
from services.rankd.blockcache import BlockCache
from services.rankd.engine.errors import SequenceTooLong, TokenOutOfVocab

# The backend's settings live in a module without torch, which shared/envcheck.py imports in
# every process to know the VTM_TORCH_* names exactly; re-exported here, where they are used.
from services.rankd.torch_settings import TINY_MODEL as TINY_MODEL
from services.rankd.torch_settings import TorchSettings as TorchSettings
from services.rankd.torch_settings import torch_settings_from_env as torch_settings_from_env
from services.rankd.torch_spec import initial_degrees as initial_degrees
from services.rankd.torch_spec import torch_dtype, world_spec
from services.rankd.torch_world import RankReply, SwitchReply, TorchWorld, WorldBroken
from shared.ids import InvalidInput, UnknownWorker
from shared.natsauth import security_options
from shared.schemas import Assignment, IntakeRequest
from shared.subjects import Subjects
from shared.worker import GpuGroup, WorkerKind

_log = structlog.get_logger("vertumnus.rankd.torch")

KV_CONTENT_TYPE: Final[str] = "application/vnd.vertumnus.kv-chunk"
DECODE_QUEUE: Final[str] = "vtm-decode"
_MASK64: Final[int] = (1 << 64) - 1

LIVE_TORCH_MODEL: Final[dict[str, Any]] = {
    **TINY_MODEL,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}
"""The small random model of ``vertumnus up --backend torch``: TINY_MODEL's layers with
Qwen3's vocabulary (tied embeddings, as the small Qwen3 checkpoints), so the token ids a
replay sends (drawn from Qwen3's range) are valid prompts."""


# --- token ids -------------------------------------------------------------------------------


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def request_token_ids(request: IntakeRequest, vocab: int) -> list[int]:
    """The prompt's token ids: real ones when present, else synthesised (module docstring).

    Real ids are returned unchanged (the engine rejects out-of-vocabulary ids itself).
    """
    if request.tokens is not None:
        return list(request.tokens)
    if vocab < 1:
        raise InvalidInput(f"vocab must be >= 1, got {vocab}")
    bs, n = request.block_size, request.input_len
    full = min(len(request.block_hashes), n // bs)
    parts = [
        np.random.default_rng(int(h) & _MASK64).integers(0, vocab, bs)
        for h in request.block_hashes[:full]
    ]
    rest = n - full * bs
    if rest:
        rng = np.random.default_rng(_seed_of(f"vtm-tail:{request.request_id}"))
        parts.append(rng.integers(0, vocab, rest))
    return [int(t) for t in np.concatenate(parts)]


def _leaf_chains(pairs: Sequence[tuple[int, int | None]]) -> list[list[int]]:
    """The root-to-leaf chains of a forest given as ``(hash, parent)`` pairs, parents before
    children (shallowest first), leaves in the pairs' order. Every block lies on one."""
    parent_of = dict(pairs)
    inner = {p for _, p in pairs if p is not None}
    chains = []
    for h, _ in pairs:
        if h in inner:
            continue
        chain = [h]
        while (p := parent_of.get(chain[-1])) is not None:
            chain.append(p)
        chains.append(chain[::-1])
    return chains


# --- KV hand-off -------------------------------------------------------------------------------


def _timed_decode(model: Any, kv: Any, token: int) -> tuple[Any, float]:
    """``decode_step(model, kv, token)`` and its seconds, with ``kv`` moved to the model's
    device first and outside the timing: that copy (host to GPU when the decode role runs on
    one) is part of the KV's transfer, the step alone is the first decode's compute."""
    from services.rankd.engine.decode import decode_step, kv_to_device

    kv = kv_to_device(kv, model.device)
    t0 = time.perf_counter()
    out = decode_step(model, kv, token)  # ends in .item(): the device's work is included
    return out, time.perf_counter() - t0


@dataclass(frozen=True)
class HandoffResult:
    """What the decode role answered for one request."""

    token: int  # the decode iteration's output (the token after the prefill's)
    decode_s: float  # decode compute, measured by the decode role
    transfer_s: float  # publish of the first chunk → reply, minus decode_s
    chunks: int
    largest_chunk: int
    via: str  # "nats" or "in-process"


class KVDecodeRole:
    """The decode role: reassembles KV chunks from ``{prefix}.kv.*``, runs the first decode
    iteration (``decode_step``) on its own copy of the model and replies with the token. The
    model's device is the role's (:attr:`TorchPool.decode_device`); the received KV (CPU
    tensors) is moved there before the step, and that copy counts as KV transfer, not as
    ``decode_s``.

    Reply (JSON to the completing chunk's reply subject): ``{"request_id", "token",
    "decode_s", "prefill_token"}`` or ``{"request_id", "error"}``.

    NOTE: the queue group hands each message to any one member, so only a transfer's first
    chunk goes through it: a role that receives the first chunk of an incomplete set answers
    ``{"claim": <its own subject>}`` and the sender publishes the other chunks there (with
    several roles -- one per torch rank-daemon process -- a transfer split between members
    would never complete).
    """

    def __init__(self, model: Any, subjects: Subjects, *, queue: str = DECODE_QUEUE) -> None:
        from services.rankd.engine.decode import ChunkReassembler

        self.model = model
        self.subjects = subjects
        self.queue = queue
        self._asm = ChunkReassembler()
        self._sub: Any = None
        self._direct_sub: Any = None
        self._direct = ""  # this role's own subject for the rest of a claimed transfer
        self._lock = asyncio.Lock()
        self.served = 0

    @property
    def subject(self) -> str:
        return self.subjects.kv_handoff("x").rsplit(".", 1)[0] + ".*"

    async def start(self, nc: Any) -> None:
        self._direct = nc.new_inbox()
        self._direct_sub = await nc.subscribe(self._direct, cb=self._on_chunk)
        self._sub = await nc.subscribe(self.subject, queue=self.queue, cb=self._on_chunk)
        await nc.flush()

    async def stop(self) -> None:
        for sub in (self._sub, self._direct_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._sub = self._direct_sub = None

    def _decode(self, kv: Any, token: int) -> tuple[Any, float]:
        """(decode_step's result, its seconds), the KV moved to the model's device first."""
        return _timed_decode(self.model, kv, token)

    async def _on_chunk(self, msg: Any) -> None:
        rid = "?"
        try:
            async with self._lock:
                # Tagged with the transfer's reply inbox (one per attempt): a stray chunk
                # naming this request cannot mix into its transfer.
                done = self._asm.add(msg.data, msg.reply or "")
            if done is None:
                if msg.reply and msg.subject != self._direct:  # a first chunk: claim the rest
                    await msg.respond(json.dumps({"claim": self._direct}).encode())
                return
            rid, kv, meta = done
            out, decode_s = await asyncio.to_thread(self._decode, kv, int(meta["token"]))
            reply: dict[str, Any] = {
                "request_id": rid,
                "token": out.next_token,
                "prefill_token": int(meta["token"]),
                "decode_s": decode_s,
            }
            self.served += 1
        except Exception as exc:  # malformed chunks or KV: answer, never kill the role
            reply = {"request_id": rid, "error": f"{type(exc).__name__}: {exc}"}
        if msg.reply:
            await msg.respond(json.dumps(reply).encode())


class NatsKVHandoff:
    """Leader side of the NATS hand-off (see module docstring)."""

    def __init__(
        self,
        nc: Any | None,
        subjects: Subjects,
        *,
        servers: Sequence[str] = (),
        timeout_s: float = 60.0,
        connect_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._nc = nc
        self._own = nc is None
        self._servers = list(servers)
        # Reconnecting, pings, credentials and TLS of its own connection
        # (service_connect_options).
        self._connect_options = dict(connect_options or {})
        self.subjects = subjects
        self.timeout_s = timeout_s

    async def _conn(self) -> Any:
        if self._nc is None:
            from shared.natsclient import connect
            from shared.service import nats_callbacks

            self._nc = await connect(servers=self._servers, name="vtm-rankd-kv",
                                     **self._connect_options, **nats_callbacks(_log))
        return self._nc

    async def transfer(self, request_id: str, blob: bytes) -> HandoffResult:
        from services.rankd.engine.decode import encode_chunks

        nc = await self._conn()
        chunks = encode_chunks(request_id, blob)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, max_msgs=2)
        headers = {"Content-Type": KV_CONTENT_TYPE}
        try:
            t0 = time.perf_counter()
            deadline = t0 + self.timeout_s
            # The first chunk through the queue group; the rest to the role that claimed it
            # (KVDecodeRole's NOTE).
            await nc.publish(self.subjects.kv_handoff(request_id), chunks[0], reply=inbox,
                             headers=headers)
            reply = await self._reply(sub, request_id, deadline)
            if len(chunks) > 1 and "error" not in reply:
                claim = reply.get("claim")
                if not isinstance(claim, str) or not claim:
                    raise RuntimeError(f"decode role did not claim {request_id}: {reply!r}")
                for c in chunks[1:]:
                    await nc.publish(claim, c, reply=inbox, headers=headers)
                reply = await self._reply(sub, request_id, deadline)
            elapsed = time.perf_counter() - t0
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if "error" in reply:
            raise RuntimeError(f"decode role failed for {request_id}: {reply['error']}")
        decode_s = float(reply["decode_s"])
        return HandoffResult(
            int(reply["token"]),
            decode_s,
            max(0.0, elapsed - decode_s),
            len(chunks),
            max(len(c) for c in chunks),
            "nats",
        )

    async def _reply(self, sub: Any, request_id: str, deadline: float) -> dict[str, Any]:
        try:
            msg = await sub.next_msg(timeout=max(0.001, deadline - time.perf_counter()))
        except Exception as exc:  # nats TimeoutError
            raise TimeoutError(
                f"no decode role answered for {request_id} within {self.timeout_s} s"
            ) from exc
        reply = json.loads(msg.data)
        if not isinstance(reply, dict):
            raise RuntimeError(f"decode role answered {request_id} with {reply!r}")
        return reply

    async def close(self) -> None:
        if self._own and self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()
            self._nc = None


class LocalKVHandoff:
    """No NATS: the same chunks through an in-process ChunkedBytesTransport, decode here."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def _run(self, request_id: str, blob: bytes) -> HandoffResult:
        from services.rankd.engine.decode import ChunkedBytesTransport, encode_chunks

        t0 = time.perf_counter()
        transport = ChunkedBytesTransport()
        chunks = encode_chunks(request_id, blob)
        for c in chunks:
            transport.deliver(c)
        kv, meta = transport.recv(request_id, timeout=0)
        out, decode_s = _timed_decode(self.model, kv, int(meta["token"]))
        return HandoffResult(
            out.next_token,
            decode_s,
            time.perf_counter() - t0 - decode_s,
            len(chunks),
            max(len(c) for c in chunks),
            "in-process",
        )

    async def transfer(self, request_id: str, blob: bytes) -> HandoffResult:
        return await asyncio.to_thread(self._run, request_id, blob)

    async def close(self) -> None:
        return None


KVHandoff = NatsKVHandoff | LocalKVHandoff


# --- the backend -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchOutcome:
    """Everything measured for one request (for spans, audits and tests)."""

    request_id: str
    worker_id: str
    epoch: int
    token: int
    decode_token: int | None
    prefix_len: int  # what the engine's own cache reused
    assigned_prefix_len: int  # what rankd's BlockCache decided (= prefix_len in lockstep)
    input_len: int
    synthesised_ids: bool
    engine_s: tuple[float, ...]  # per member rank, in rank order
    step_wall_s: float
    switch_wall_s: float
    switches: tuple[SwitchReply, ...]
    pids: tuple[int, ...]
    handoff: HandoffResult | None


class TorchBackend:
    """``ExecutionBackend`` of one worker over a shared :class:`TorchWorld`."""

    name: Final[str] = "torch"  # type: ignore[misc]

    def __init__(
        self,
        world: TorchWorld,
        worker_id: str,
        *,
        kind: WorkerKind = WorkerKind.CP,
        handoff: KVHandoff | None = None,
        owns_world: bool = False,
        clock: Callable[[], float] = time.time,
        keep_outcomes: int = 1024,
    ) -> None:
        if kind is not WorkerKind.CP:
            raise InvalidInput("the torch backend runs CP workers only (TP is a sim baseline)")
        self.group = GpuGroup.from_worker_id(worker_id)
        self.worker_id = worker_id
        self.world = world
        self.ranks = world.members(self.group.first_gpu, self.group.degree)
        self.handoff = handoff
        self._owns_world = owns_world
        self._clock = clock
        self.outcomes: collections.OrderedDict[str, TorchOutcome] = collections.OrderedDict()
        self._keep = keep_outcomes
        self.switches: list[tuple[int, float, tuple[SwitchReply, ...]]] = []
        self._closed = False
        self._bound = False
        self._cache: BlockCache | None = None
        # NOTE: the full blocks of the request between the start of its step and the end of
        # prefill() (its KV hand-off included): the engine stored its new blocks at the step,
        # rankd records them only at the finish (core.finish, with no await after prefill()
        # returns), and its prefix stays pinned until then. A cache command in that window
        # must neither evict nor drop them (prepare_cache_command, _stale_blocks).
        self._in_flight: tuple[int, ...] = ()

    @property
    def kv_capacity_blocks(self) -> int:
        """The engine's KV capacity for this worker in blocks: one page per block, page p of
        a prefix on rank p mod C, so C × ``pages_per_rank`` (at most: a rank that is full
        evicts even when another has room). rankd sizes the worker's BlockCache with it
        unless ``VTM_KV_TOTAL_BLOCKS`` is set, so the scheduler and the cache manager plan
        against what the engine can hold."""
        return self.group.degree * self.world.spec.pages_per_rank

    @property
    def max_seq_len(self) -> int | None:
        """The longest prompt this worker serves: its model's ``max_position_embeddings`` (the
        smallest any rank reported), one less with a KV hand-off (its decode step puts the
        first token at position P, which must exist too), None until the world started. rankd
        publishes it in the WorkerState so the scheduler refuses or routes a longer prompt
        instead of placing it here, where :meth:`prefill` refuses it (``SequenceTooLong``)
        before any step, not after the prefill when the hand-off's decode fails."""
        positions = self.world.max_positions
        if not positions:
            return None
        return positions - 1 if self.handoff is not None else positions

    def bind_cache(self, cache: BlockCache | None) -> None:
        """Keep the engine's cache in lockstep with rankd's BlockCache of this worker (called
        by RankdService; the BlockCache decides P and is what the cache events publish).

        From then on every step (a) first drops from the engine every block the BlockCache no
        longer holds (its LRU evictions, reclaims), (b) keys the engine's pages by the
        request's ``block_hashes`` (the gateway's chain: the blocks rankd caches when the
        request finishes), (c) reuses exactly the prefix rankd decided
        (``assignment.prefix_tokens``), and (d) removes from the BlockCache any block the
        engine had to evict to make room (its pages per rank are a hard limit; the removal
        goes out as a ``Removed`` cache event after the request). So at every step boundary
        both hold the same blocks, and the prefix the engine reuses is the FirstToken's
        ``prefix_tokens``. Cache-manager replicate / reconcile commands move the KV first
        (:meth:`prepare_cache_command`), so rankd never records a block the engine lacks; if
        the engine still reused less than rankd decided (a lockstep bug), it is recorded
        (:meth:`prefix_shortfall`) and the request is still correct (recomputed).
        ``None`` (a worker without a cache): the engine caches nothing.

        Requests must then come with the engine's block size (InvalidInput otherwise).
        """
        self._bound = True
        self._cache = cache

    def _stale_blocks(self) -> list[int]:
        """Blocks the engine holds for this worker and rankd's BlockCache no longer does
        (its evictions, reclaims since the last step). Runs on the event loop that owns the
        BlockCache; the engine side is the leader's mirror (no round trip)."""
        if not self._bound:
            return []
        held = self.world.cached_blocks(self.worker_id)
        cache = self._cache
        if cache is None:
            return list(held)
        # The in-flight request's new blocks are not in the BlockCache yet, but will be.
        keep = set(self._in_flight)
        return [h for h in held if h not in cache and h not in keep]

    async def sync_cache(self) -> int:
        """Apply rankd's pending removals to the engine now instead of at the next step (the
        step does it first anyway); returns the number of blocks dropped. Only when this
        worker's ranks are in its geometry (else the next step's switch comes first)."""
        drop = self._stale_blocks()
        if not drop or any(self.world.geometry(r)[1] != self.degree for r in self.ranks):
            return 0
        return len(await asyncio.to_thread(self.world.remove, self.ranks, drop))

    async def prepare_cache_command(self, cmd: Any) -> Any:
        """Move the KV a cache-manager command needs before rankd applies it to its
        BlockCache (called by RankdService; keeps the lockstep of :meth:`bind_cache`).

        A replicate / reconcile command names ``source_worker``: its blocks (the leading part
        the source holds, from its active or retired cache) are copied into this worker's
        engine cache when the source's ranks are in this world and this worker's ranks are in
        its geometry -- shared in place as far as every member's page pool already holds the
        pages it owns (:meth:`TorchWorld.adopt_resident`), the rest sent; the command is
        returned cut to the leading blocks the engine now holds, so rankd records exactly
        those (nothing, when nothing could be copied: an ordinary miss later, never a hit
        without KV). Reclaims pass unchanged (rankd's removals reach
        the engine before its next step), and so do demotes (no ``source_worker``): only
        rankd's BlockCache is demoted; the engine's own page pool keeps its own LRU order.
        The BlockCache's evictions reach the engine at the next step, so there the demoted
        blocks go first; an eviction the engine makes by itself (a rank's pages full, room
        for a copy) still follows the engine's order. Engine evictions caused by the copy are
        removed from the BlockCache, as after a prefill.

        The copy never evicts a block the BlockCache has pinned (the running request's
        prefix) nor a block of the request in flight (its prefix and the blocks its step
        stored, which rankd records when it finishes: a command may arrive while its KV
        hand-off runs). When that leaves too little room the engine installs the leading part
        that fits and the command is cut to it, as for any full cache. Evicting them would
        leave rankd recording blocks the engine lacks: the next request would be told a prefix
        the engine cannot reuse (recomputed, correct, but recorded as a prefix shortfall).
        """
        source = getattr(cmd, "source_worker", None)
        if not self._bound or source is None or cmd.worker_id != self.worker_id:
            return cmd  # nothing to move (or not ours: rankd refuses it)
        if all(self.world.geometry(r)[1] == self.degree for r in self.ranks) \
                and self._cache is not None:
            protect = self._cache.pinned() | set(self._in_flight)
            blocks = [int(h) for h in cmd.blocks]
            # In place first: pages this worker's ranks already hold where it needs them (the
            # retired predecessor's after a split or merge) are shared, not sent.
            _, evicted = await asyncio.to_thread(
                self.world.adopt_resident, self.ranks,
                list(zip(blocks, [None, *blocks[:-1]], strict=True)), protect=protect)
            if evicted:
                self._cache.remove(list(evicted))
            try:
                g = GpuGroup.from_worker_id(source)
                src = self.world.members(g.first_gpu, g.degree)
            except InvalidInput:
                src = None  # another host's worker: its KV is not reachable from here
            if src is not None and not set(blocks) <= self.world.cached_blocks(self.worker_id):
                _, evicted = await asyncio.to_thread(
                    self.world.copy_prefix, src, source, self.ranks, blocks, protect=protect,
                )
                if evicted:
                    self._cache.remove(list(evicted))
        held = self.world.cached_blocks(self.worker_id)
        n = 0
        while n < len(cmd.blocks) and cmd.blocks[n] in held:
            n += 1
        # model_copy: an empty block list is a valid outcome here, not a wire message.
        return cmd.model_copy(update={"blocks": list(cmd.blocks[:n])})

    async def inherit_prefixes(
        self, pairs: Sequence[tuple[int, int | None]], epoch: int
    ) -> list[tuple[int, int | None]]:
        """Make this worker, just made by a split or merge (``epoch``), hold the retained
        prefixes ``pairs`` (``(hash, parent)``, shallowest first: the reconciled index rankd
        seeds its BlockCache with, services/rankd/host.py) in its engine cache; returns the
        pairs it now holds, prefix-closed and in the same order: what rankd may seed.

        Called by the rank host before the worker's service starts (nothing runs here yet;
        its predecessors were drained). Steps: (1) its ranks switch to its geometry now
        (:meth:`adopt`) rather than at its first step; (2) a cache it revives (a merge back
        to a worker id these ranks retired) drops every block not in ``pairs``: those pages
        are stale, the predecessors changed since; (3) each chain of ``pairs`` (one per leaf)
        is installed in place (:meth:`TorchWorld.adopt_resident`): the predecessors' pages
        stay in their ranks' page pools after the switch (a *retired* engine cache), and the
        layout rule the reconciliation follows (page p of a prefix on rank p mod C) means a
        retained page is already on the rank that needs it, so no KV moves. A page reclaimed
        meanwhile (its rank needed the slot), or evicted for room, leaves its block out with
        its descendants; no other rank holds it either, so there is nothing to copy.

        Not bound to a BlockCache (standalone): only (1), returns []. Raises
        :class:`~shared.ids.InvalidInput` (e.g. a stale epoch) or :class:`WorldBroken`; what
        was installed before stays, and rankd then seeds nothing (stale blocks are dropped
        at the first step, as any block the BlockCache does not hold)."""
        await self.adopt(epoch)
        if not self._bound or self._cache is None or not pairs:
            return []
        return await asyncio.to_thread(self._inherit, list(pairs))

    def _inherit(self, pairs: list[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
        want = {h for h, _ in pairs}
        stale = [h for h in self.world.cached_blocks(self.worker_id) if h not in want]
        if stale:
            self.world.remove(self.ranks, stale)
        parent_of = dict(pairs)
        for chain in _leaf_chains(pairs):
            self.world.adopt_resident(self.ranks, [(h, parent_of[h]) for h in chain])
        held = self.world.cached_blocks(self.worker_id)
        kept: set[int] = set()
        out: list[tuple[int, int | None]] = []
        for h, parent in pairs:
            if h in held and (parent is None or parent in kept):
                kept.add(h)
                out.append((h, parent))
        return out

    def health(self) -> WorldBroken | None:
        """rankd's health probe (optional backend method, see services/rankd/backend.py): None
        while every rank process of the world runs, else the fault that breaks this worker —
        and every other worker of the world."""
        why = self.world.health()
        return None if why is None else WorldBroken(why)

    def prefix_shortfall(self) -> dict[str, int]:
        """Requests whose engine reused fewer tokens than rankd decided (request id → tokens
        short); empty when the two caches agreed on every remembered request."""
        return {
            o.request_id: o.assigned_prefix_len - o.prefix_len
            for o in self.outcomes.values()
            if o.assigned_prefix_len != o.prefix_len
        }

    @property
    def degree(self) -> int:
        return self.group.degree

    @property
    def time_scale(self) -> float:
        return 1.0

    def _check(self, a: Assignment) -> None:
        """Refuse an assignment before anything is sent to the ranks: RuntimeError when closed;
        UnknownWorker / InvalidInput (wrong worker, degree, block size), SequenceTooLong and
        TokenOutOfVocab (bad input: the request's error, every rank untouched)."""
        if self._closed:
            raise RuntimeError("backend closed")
        if a.worker_id != self.worker_id:
            raise UnknownWorker(f"assignment for {a.worker_id} reached {self.worker_id}")
        if a.degree != self.degree:
            raise InvalidInput(f"assignment degree {a.degree} != worker degree {self.degree}")
        limit = self.max_seq_len
        if limit is not None and a.request.input_len > limit:
            # Before the ids are made: synthesising (or shipping) an absurd input_len would
            # stall the event loop or exhaust memory before the ranks could refuse it.
            room = (" (one kept for the hand-off's first decoded token)"
                    if self.handoff is not None else "")
            raise SequenceTooLong(
                f"prompt of {a.request.input_len} tokens exceeds the model's "
                f"{self.world.max_positions} positions{room}"
            )
        vocab = self.world.vocab_size
        if a.request.tokens is not None and vocab > 0:
            # At rankd's boundary, before the ids are shipped: the ranks check them too, but an
            # id no int64 holds (the schema bounds them below only) must never reach a tensor
            # conversion, where it would fail as something other than bad input.
            bad = next((t for t in a.request.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise TokenOutOfVocab(f"token id {bad} outside the vocabulary [0, {vocab})")
        if self._bound and a.request.block_size != self.world.spec.block_size:
            raise InvalidInput(
                f"request block size {a.request.block_size} != engine block size "
                f"{self.world.spec.block_size}: rankd's cache and the engine's would name "
                "different blocks (set VTM_TORCH_BLOCK_SIZE to the gateway's VTM_BLOCK_SIZE)"
            )

    async def adopt(self, epoch: int) -> tuple[SwitchReply, ...]:
        """Bring this worker's ranks into its geometry now (eager split / merge); no-op when
        they already are. Returns the per-rank switch reports (empty when nothing changed)."""
        if all(self.world.geometry(r)[1] == self.degree for r in self.ranks):
            return ()
        t0 = time.perf_counter()
        reps = tuple(await asyncio.to_thread(self.world.switch, self.ranks, epoch, self.degree))
        self.switches.append((epoch, time.perf_counter() - t0, reps))
        return reps

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        self._check(assignment)
        req = assignment.request
        ids = request_token_ids(req, self.world.vocab_size)
        started = self._clock()
        t0 = time.perf_counter()
        drop = self._stale_blocks()  # before _in_flight is set: that one is this request's
        full = min(len(req.block_hashes), req.input_len // req.block_size)
        self._in_flight = tuple(int(h) for h in req.block_hashes[:full]) if self._bound else ()
        try:
            switched, replies, switch_s = await asyncio.to_thread(
                self._step, assignment, ids, drop
            )
            step_s = time.perf_counter() - t0
            prefilled = self._clock()
            lead: RankReply = replies[0]
            if self._cache is not None and lead.evicted:
                self._cache.remove(list(lead.evicted))  # (d) in bind_cache
            handoff = None
            if self.handoff is not None and lead.kv_blob is not None:
                handoff = await self.handoff.transfer(req.request_id, lead.kv_blob)
        finally:
            self._in_flight = ()
        finished = self._clock()
        if switched:
            self.switches.append((assignment.epoch, switch_s, tuple(switched)))
        self._remember(
            TorchOutcome(
                request_id=req.request_id,
                worker_id=self.worker_id,
                epoch=assignment.epoch,
                token=lead.token,
                decode_token=None if handoff is None else handoff.token,
                prefix_len=lead.prefix_len,
                assigned_prefix_len=assignment.prefix_tokens if self._bound else lead.prefix_len,
                input_len=req.input_len,
                synthesised_ids=req.tokens is None,
                engine_s=tuple(r.seconds for r in replies),
                step_wall_s=step_s - switch_s,
                switch_wall_s=switch_s,
                switches=tuple(switched),
                pids=tuple(r.pid for r in replies),
                handoff=handoff,
            )
        )
        decode_s = handoff.decode_s if handoff is not None else 0.0
        return PrefillResult(
            request_id=req.request_id,
            token=lead.token,
            # Consecutive stages (backend.py contract): the prefill starts after the switch.
            started_at_s=started + switch_s,
            prefill_s=max(0.0, step_s - switch_s),
            kv_transfer_s=max(0.0, (finished - prefilled) - decode_s),
            first_decode_s=decode_s,
            finished_at_s=finished,
            modelled_prefill_s=assignment.predicted_s,
            modelled_handoff_s=0.0,
            rank_compute_s=tuple(r.seconds for r in replies),
            # The switch (if any) ran before the prefill: rankd's epoch_switch span, inside
            # queue_wait, as the breakdown counts it (started_at_s is after it).
            switch_s=switch_s if switched else 0.0,
        )

    def _step(
        self, a: Assignment, ids: list[int], drop: list[int]
    ) -> tuple[list[SwitchReply], list[RankReply], float]:
        req = a.request
        if not self._bound:  # standalone: the engine's own cache decides, over its own hashes
            return self.world.step(
                self.ranks,
                a.epoch,
                ids,
                want_kv=self.handoff is not None,
                meta={"request_id": req.request_id},
            )
        cache = self._cache
        full = min(len(req.block_hashes), req.input_len // req.block_size)
        return self.world.step(
            self.ranks,
            a.epoch,
            ids,
            want_kv=self.handoff is not None,
            meta={"request_id": req.request_id},
            # The blocks rankd will cache for this request are exactly these (core.finish).
            chain=list(req.block_hashes[:full]) if cache is not None else [],
            max_prefix=a.prefix_tokens if cache is not None else 0,
            drop=drop,
        )

    def _remember(self, o: TorchOutcome) -> None:
        self.outcomes[o.request_id] = o
        while len(self.outcomes) > self._keep:
            self.outcomes.popitem(last=False)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_world:
            if self.handoff is not None:
                await self.handoff.close()
            await asyncio.to_thread(self.world.close)


# --- wiring into rankd -------------------------------------------------------------------------


def _decode_model(ts: TorchSettings, device: str = "cpu") -> Any:
    """The decode role's own copy of the model (the ranks' weights: same path, or same seeded
    random weights) on ``device`` (:attr:`TorchPool.decode_device`, checked by then)."""
    from services.rankd.engine.checkpoint import load_model
    from services.rankd.engine.config import Qwen3Config
    from services.rankd.engine.model import Qwen3ForCausalLM

    dtype = torch_dtype(ts.dtype)
    if ts.model_path:  # an empty path is none, as for the ranks (torch_spec.world_spec)
        return load_model(ts.model_path, dtype=dtype, device=device)
    # Built on the CPU and moved, as a rank builds its copy (torch_world._build_model).
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(ts.model_dict()), ts.seed, dtype)
    return model.to(device)


@dataclass
class TorchPool:
    """One rank-daemon process's torch pool: the world over its GPU range, the KV hand-off
    and (optionally) an embedded decode role. ``backend(wid)`` builds a worker's backend;
    workers come and go with the epoch record, the pool (processes, weights) stays."""

    world: TorchWorld
    subjects: Subjects
    settings: TorchSettings
    servers: list[str] = field(default_factory=list)
    handoff: KVHandoff | None = None
    decode_role: KVDecodeRole | None = None
    _decode_nc: Any = None
    connect_options: dict[str, Any] = field(default_factory=dict)
    """Credentials and TLS of the pool's own NATS connections (hand-off, decode role)."""
    decode_device: str = "cpu"
    """Where the embedded decode role (or the local hand-off's decode) puts its model and the
    KV it receives: ``cuda:{first GPU of the range}`` when ``settings.device`` is cuda, else
    cpu (:func:`~services.rankd.engine.device.decode_device`; :meth:`start` sets it)."""

    @classmethod
    def start(
        cls,
        gpus: range,
        *,
        initial_workers: Sequence[str] = (),
        subjects: Subjects | None = None,
        servers: Sequence[str] = (),
        settings: TorchSettings | None = None,
        connect_options: Mapping[str, Any] | None = None,
    ) -> TorchPool:
        """Spawn the world over ``gpus`` (blocking; ranks not covered by ``initial_workers``
        start at degree 1; ``settings`` None: read from the environment). Raises
        :class:`~shared.ids.InvalidInput` before spawning anything when an initial worker's
        GPUs are not all in ``gpus`` (:func:`initial_degrees`), or when any value of the
        settings would fail in the ranks or the decode role (:func:`~services.rankd.
        torch_spec.world_spec`: each problem naming its ``VTM_TORCH_*`` variable, e.g. a
        ``device`` that is not cpu / cuda, cuda without CUDA or without every GPU of
        ``gpus``), rather than failing later inside torch."""
        from services.rankd.engine.device import decode_device

        ts = settings or torch_settings_from_env()
        # Every value checked as the ranks will use it, before anything is built or spawned
        # (torch_spec.py; rankd's entry point runs the same checks at its start).
        spec = world_spec(ts, gpus, initial_workers)
        decode_on = str(decode_device(ts.device, gpus))
        subj = subjects or Subjects()
        handoff: KVHandoff | None
        if ts.handoff == "local":
            # Built before the world is spawned: a model that cannot be built (a bad path, a
            # device out of memory) then raises with no rank process left running.
            handoff = LocalKVHandoff(_decode_model(ts, decode_on))
        else:
            handoff = NatsKVHandoff(None, subj, servers=servers, timeout_s=ts.decode_timeout_s,
                                    connect_options=connect_options)
        world = TorchWorld(spec).start()
        return cls(world, subj, ts, list(servers), handoff,
                   connect_options=dict(connect_options or {}), decode_device=decode_on)

    async def start_decode_role(self, nc: Any | None = None) -> KVDecodeRole:
        """Start the embedded decode role (own connection unless ``nc`` is given). On failure
        nothing is left behind (its own connection drained, no role), so it can be called
        again."""
        own = nc is None
        if nc is None:
            from shared.natsclient import connect
            from shared.service import nats_callbacks

            nc = await connect(servers=self.servers, name="vtm-decode",
                               **self.connect_options, **nats_callbacks(_log))
        role = None
        try:
            model = await asyncio.to_thread(_decode_model, self.settings, self.decode_device)
            role = KVDecodeRole(model, self.subjects)
            await role.start(nc)
        except BaseException:
            if role is not None:
                await role.stop()
            if own:
                with contextlib.suppress(Exception):
                    await nc.drain()
            raise
        if own:
            self._decode_nc = nc
        self.decode_role = role
        return role

    def backend(self, worker_id: str, kind: WorkerKind = WorkerKind.CP) -> ExecutionBackend:
        return TorchBackend(self.world, worker_id, kind=kind, handoff=self.handoff)

    async def close(self) -> None:
        if self.decode_role is not None:
            await self.decode_role.stop()
        if self._decode_nc is not None:
            with contextlib.suppress(Exception):
                await self._decode_nc.drain()
        if self.handoff is not None:
            await self.handoff.close()
        await asyncio.to_thread(self.world.close)


class _PoolBackend(TorchBackend):
    """A single worker's backend that owns its pool (no host mode): the decode role starts
    with the first request, everything stops on close.

    The role counts as started only once it did: a start that fails (the NATS connect, the
    decode model) fails the request that met it (an error answer naming the cause, before its
    prefill) and the next request tries again. Before, a failed first start was never retried
    and every later request's hand-off waited ``decode_timeout_s`` for a role that did not
    exist, then failed."""

    def __init__(self, pool: TorchPool, worker_id: str, kind: WorkerKind) -> None:
        super().__init__(pool.world, worker_id, kind=kind, handoff=pool.handoff)
        self._pool = pool
        self._role_started = not (pool.settings.handoff == "nats" and pool.settings.embedded_decode)
        self._role_lock = asyncio.Lock()

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        if not self._role_started:
            async with self._role_lock:  # one start at a time; a waiter sees its outcome
                if not self._role_started:
                    try:
                        await self._pool.start_decode_role()
                    except Exception as exc:
                        raise RuntimeError(f"the embedded KV decode role did not start "
                                           f"(retried by the next request): "
                                           f"{type(exc).__name__}: {exc}") from exc
                    self._role_started = True
        return await super().prefill(assignment)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._pool.close()


def service_connect_options(settings: Any) -> dict[str, Any]:
    """``nats.connect`` options of the pool's own connections (the KV hand-off's, the
    embedded decode role's): a service's reconnecting for ever and pinging
    (:func:`shared.service.reconnect_options`), with its credentials and TLS. Without the
    first, nats-py's defaults give up after two minutes of a lost broker -- every hand-off
    failing and the decode role deaf until the process restarts -- and notice a silent one
    only after six."""
    from shared.service import reconnect_options

    return {**reconnect_options(settings), **security_options(settings)}


def single_worker_backend(
    settings: Any, torch_settings: TorchSettings | None = None
) -> TorchBackend:
    """rankd's ``backend=torch`` for one worker (``VTM_WORKER_ID``): a world over exactly the
    worker's GPUs, started in its degree; blocking (spawns the ranks)."""
    g = GpuGroup.from_worker_id(settings.worker_id)
    pool = TorchPool.start(
        g.gpus,
        initial_workers=[settings.worker_id],
        subjects=settings.subjects,
        servers=settings.nats_servers,
        settings=torch_settings,
        connect_options=service_connect_options(settings),
    )
    return _PoolBackend(pool, settings.worker_id, settings.kind)


async def start_torch_host(
    settings: Any, torch_settings: TorchSettings | None = None, *, nc: Any = None
) -> tuple[Any, TorchPool]:
    """The pool over ``settings.host_range`` (decode role started) and a RankdHost whose
    workers are TorchBackends on it; the caller runs ``host.run`` and closes the pool."""
    from services.rankd.host import RankdHost

    gpus = settings.host_range
    pool = await asyncio.to_thread(
        TorchPool.start,
        gpus,
        initial_workers=settings.initial_worker_ids,
        subjects=settings.subjects,
        servers=settings.nats_servers,
        settings=torch_settings,
        connect_options=service_connect_options(settings),
    )
    try:
        if pool.settings.handoff == "nats" and pool.settings.embedded_decode:
            await pool.start_decode_role(nc)
        host = RankdHost(settings, gpus, pool.backend, initial=settings.initial_worker_ids)
    except BaseException:
        await pool.close()
        raise
    return host, pool


async def serve_torch_host(
    settings: Any, torch_settings: TorchSettings | None = None, *, nc: Any = None
) -> None:
    """rankd's ``backend=torch`` in host mode (``VTM_HOST_GPUS``): one world over the host's
    GPU range for the process's lifetime; workers follow the epoch record (RankdHost), each
    one a :class:`TorchBackend` on the shared world, switching geometry at its first step.
    Raises :class:`~services.rankd.torch_world.WorldBroken` once the world broke and every
    worker has handed back and stopped (module docstring, "Errors")."""
    host, pool = await start_torch_host(settings, torch_settings, nc=nc)
    try:
        await host.run(nc, handle_signals=nc is None)
    finally:
        await pool.close()
