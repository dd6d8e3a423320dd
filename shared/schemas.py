"""Wire messages of the live system (pydantic v2) and their JSON / msgpack codecs.

Contract for every message:

* frozen, ``extra="forbid"``, a ``schema_version`` field (a message from a newer or older
  schema is rejected, not half-understood);
* JSON for control traffic (readable with a subject tap), msgpack for bulk payloads, the choice
  carried in the ``Content-Type`` header (:data:`CONTENT_TYPE`); a message without the header
  is JSON;
* decoding never raises anything but :class:`SchemaError` (an :class:`~shared.ids.InvalidInput`)
  naming the model and the first offending field, so adapters map it to a 400 micro error.

Units follow design.md: seconds (float) for durations and wall-clock instants (Unix seconds),
tokens (int) for lengths. Block hashes are ints that fit msgpack's 64-bit range.

Paper names: P = cached prefix tokens reused (``prefix_tokens``), R = tokens recomputed
(``recompute_tokens``, R ≥ 1), J = placement cost (§5.3).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal, TypeVar

import msgpack
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.ids import InvalidInput, tp_worker_name
from shared.worker import GpuGroup, Lifecycle, WorkerKind

SCHEMA_VERSION: Final[int] = 1

CONTENT_TYPE: Final[str] = "Content-Type"
JSON: Final[str] = "application/json"
MSGPACK: Final[str] = "application/msgpack"


class SchemaError(InvalidInput):
    """A payload does not decode into the expected message.

    ``model`` is the expected message's name, ``field`` the dotted location of the first error
    (``"<payload>"`` when the bytes are not JSON / msgpack at all, ``"<model>"`` for a rule
    across fields), ``errors`` pydantic's full error list (empty for undecodable bytes).
    """

    def __init__(self, model: str, field: str, reason: str, errors: list[Any] | None = None):
        super().__init__(f"{model}: field {field!r}: {reason}")
        self.model = model
        self.field = field
        self.reason = reason
        self.errors = errors or []


class UnsupportedContentType(SchemaError):
    """A payload whose ``Content-Type`` is neither JSON nor msgpack (an HTTP 415's case)."""


# -- field types ------------------------------------------------------------------------------

HashInt = Annotated[int, Field(ge=-(2**63), lt=2**64)]
"""A chained block hash; must fit msgpack's signed or unsigned 64-bit integers."""
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0)]
MAX_TOKENS: Final[int] = 1 << 24
"""Bound on a prompt's length and on every count derived from it (tokens, and blocks: a block
holds at least one token). The trace readers use it too (``sim.workloads.parsing``), so every
replayable request is a valid message; a larger value is refused at decoding instead of
inflating the statistics it feeds (the cache manager's missed benefit, Algorithm 1; the
controller's demand). Not to be confused with
``shared.subjects.MAX_TOKENS`` (tokens of a subject)."""
TokenCount = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
"""A number of tokens or blocks within one prompt (0 allowed)."""
MAX_TOKEN_ID: Final[int] = (1 << 32) - 1
"""Largest token id a message carries: an unsigned 32-bit id, far above any vocabulary (the
gateway refuses ids from 2**31 on, or from its ``vocab_size``; the engine's models have at
most a few hundred thousand) and within what msgpack carries. An unbounded id (2**64, say)
passed the schema, then failed what a worker digests of the prompt after the request had
run."""
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
"""One prompt token id."""
WallTime = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
"""Unix seconds (``time.time()``): instants compared across processes on one host."""
Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9_-]*$")]
"""A worker or request id: one legal subject token (see shared/subjects.py)."""
Incarnation = Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_-]*$")]
MAX_SCHEDULER_REPLICAS: Final[int] = 64
"""Most scheduler replicas a WorkerState itemises (``outstanding_by``)."""
"""Which start of a worker: a token its rank daemon draws when it creates the worker, so a
restarted (or re-created) worker with the same id is told apart from the one before it;
"" = not given (a reader then cannot tell)."""


class Message(BaseModel):
    """Base of every wire message."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    schema_version: Literal[1] = SCHEMA_VERSION


# -- client and intake --------------------------------------------------------------------------


class CompletionRequest(Message):
    """HTTP / NATS request body at the gateway: a prompt as text or token ids (exactly one)."""

    prompt: str | None = Field(default=None, min_length=1, description="prompt text")
    prompt_tokens: list[TokenId] | None = Field(
        default=None, min_length=1, description="prompt as token ids"
    )
    max_tokens: int = Field(default=1, ge=1, le=1 << 20, description="output tokens wanted")
    stream: bool = Field(default=False, description="stream tokens (server-sent events)")
    request_id: Id | None = Field(default=None, description="client-chosen id (idempotency)")

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise ValueError("give exactly one of prompt or prompt_tokens")
        return self


TRACE_CONTEXT_KEYS: Final[frozenset[str]] = frozenset({"traceparent", "tracestate"})
"""The keys of a W3C trace context carrier, as OpenTelemetry's propagator writes them."""
MAX_TRACE_HEADER: Final[int] = 32 * (256 + 1 + 256) + 31
"""The longest tracestate OpenTelemetry writes: 32 members of a 256-character key, ``=``, a
256-character value, comma-separated (a client's may reach the gateway's carrier)."""
_PRINTABLE: Final[frozenset[str]] = frozenset(chr(c) for c in range(0x20, 0x7F))


class IntakeRequest(Message):
    """A request on the durable intake stream (published by the gateway, pulled by schedulers).

    ``tokens`` travel only when a real engine needs them; the sim backend and trace replays use
    ``input_len`` and ``block_hashes`` (chained hashes of the prompt's blocks, full blocks first;
    a trailing partial block's hash may be present, as in Mooncake ``hash_ids``).
    """

    request_id: Id
    input_len: int = Field(ge=1, le=MAX_TOKENS, description="prompt length L in tokens")
    tokens: list[TokenId] | None = Field(default=None, description="prompt token ids")
    block_hashes: list[HashInt] = Field(default_factory=list)
    block_size: int = Field(default=512, ge=1)
    max_tokens: int = Field(default=1, ge=1)
    arrival_s: WallTime = Field(description="when the gateway received it (Unix s)")
    slo_s: NonNegFloat | None = Field(default=None, description="TTFT SLO τ, if known")
    trace_context: dict[str, str] = Field(
        default_factory=dict, description="W3C trace context carrier (traceparent, tracestate)"
    )

    @field_validator("trace_context")
    @classmethod
    def _w3c_carrier(cls, v: dict[str, str]) -> dict[str, str]:
        # The scheduler and rankd copy this carrier into NATS headers: any other key could
        # override theirs (Content-Type, Nats-Msg-Id), and a key or value nats-py refuses
        # would fail the dispatch after the placement was reserved.
        for key, value in v.items():
            if key not in TRACE_CONTEXT_KEYS:
                raise ValueError(
                    f"trace_context key {key!r} is not one of {sorted(TRACE_CONTEXT_KEYS)}")
            if len(value) > MAX_TRACE_HEADER or not _PRINTABLE.issuperset(value):
                raise ValueError(
                    f"trace_context[{key!r}] must be at most {MAX_TRACE_HEADER} printable "
                    "ASCII characters")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> IntakeRequest:
        if self.tokens is not None and len(self.tokens) != self.input_len:
            raise ValueError(f"len(tokens)={len(self.tokens)} != input_len={self.input_len}")
        max_blocks = -(-self.input_len // self.block_size)
        if len(self.block_hashes) > max_blocks:
            raise ValueError(
                f"{len(self.block_hashes)} block hashes for {self.input_len} tokens "
                f"(at most {max_blocks} blocks of {self.block_size})"
            )
        return self


# -- scheduling --------------------------------------------------------------------------------


class PlacementTerms(Message):
    """The J terms of the chosen worker (§5.3), for spans and audits."""

    policy: str = Field(min_length=1, description="policy name in the registry")
    q_s: NonNegFloat = Field(description="queueing term q_w")
    s_s: NonNegFloat = Field(description="service term s_{i,w}")
    gpu_cost_s: float = Field(allow_inf_nan=False, description="C_w·s − C_min·Ê_Cmin (may be <0)")
    beta: NonNegFloat = Field(description="β the score used (a load-following β's β_eff)")
    lam: NonNegFloat = Field(description="λ")
    j: float = Field(allow_inf_nan=False, description="J_{i,w}")
    candidates: NonNegInt = Field(description="eligible workers considered")


class Assignment(Message):
    """The scheduler's placement of one request on one worker under one epoch."""

    request: IntakeRequest
    worker_id: Id
    epoch: NonNegInt
    degree: int = Field(ge=1)
    prefix_tokens: NonNegInt = Field(description="P: cached prefix tokens reused at this worker")
    recompute_tokens: int = Field(ge=1, description="R: tokens prefilled (R ≥ 1)")
    predicted_s: NonNegFloat = Field(description="Ê_C(R, P) at this worker")
    dequeued_at_s: WallTime | None = Field(
        default=None, description="when the scheduler pulled it from intake (splits TTFT stages)"
    )
    assigned_at_s: WallTime
    terms: PlacementTerms | None = None
    scheduler_id: Id | None = Field(
        default=None, description="the scheduler replica that placed it (its reporter id): "
        "the worker reports its outstanding work per replica (WorkerState.outstanding_by)")
    pull_copy_s: NonNegFloat = Field(
        default=0.0, allow_inf_nan=False,
        description="P counts on the cache manager's route-time pull bringing part of the prefix "
        "(J's pull credit with its wait, services/scheduler/placement.py): the copy's estimated "
        "time in cost-model seconds. The worker holds the request at the head of its queue "
        "until its cache has the prefix, at most that long (with its slack, capped) from "
        "admitting it. "
        "0: nothing to wait for.")

    @model_validator(mode="after")
    def _lengths(self) -> Assignment:
        if self.prefix_tokens + self.recompute_tokens != self.request.input_len:
            raise ValueError(
                f"P + R = {self.prefix_tokens} + {self.recompute_tokens} != "
                f"input_len {self.request.input_len}"
            )
        return self


class AssignmentAck(Message):
    """A worker's reply to an Assignment: accepted into its FIFO at ``queue_position``."""

    request_id: Id
    worker_id: Id
    epoch: NonNegInt
    queue_position: NonNegInt = Field(description="requests ahead of this one, incl. running")
    incarnation: Incarnation = Field(
        default="", description="the admitting worker's incarnation (WorkerState.incarnation)")


class QueueQuery(Message):
    """Controller (or scheduler) → worker leader: list your queued and in-flight request ids."""

    worker_id: Id
    reconfiguration: NonNegInt = 0


class QueueReport(Message):
    """Worker leader → asker: its FIFO (queue order) and what is executing.

    ``arrivals``: one entry per listed request, in the order ``in_flight`` then ``queued``:
    the arrival stamps (``IntakeRequest.arrival_s``) of the attempts of it the worker holds
    -- its job's, and each later attempt under the id that joined that job (a client retry
    the intake took as new after a store loss). Empty: the worker does not tell, and each
    listed request holds every attempt. A list aligned with the ids rather than a map keyed
    by them: the report of a full queue of long ids stays within NATS's payload limit."""

    worker_id: Id
    queued: list[Id] = Field(default_factory=list)
    in_flight: list[Id] = Field(default_factory=list)
    arrivals: list[list[WallTime]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _aligned(self) -> QueueReport:
        listed = len(self.in_flight) + len(self.queued)
        if self.arrivals and len(self.arrivals) != listed:
            raise ValueError(f"arrivals has {len(self.arrivals)} entries for {listed} listed "
                             "requests (in_flight then queued), or must be empty")
        return self


# -- workers and epochs ------------------------------------------------------------------------


class WorkerState(Message):
    """One worker's state in the worker-state KV bucket (key = worker id).

    ``heartbeat_s`` is refreshed periodically; a reader treats a state older than its lease
    as UNAVAILABLE. ``seq`` increases with every publication by that worker (it starts again
    when the worker does). ``incarnation`` changes when the worker under this id is started
    again (a rank daemon restart, or the id re-created by a reconfiguration). ``max_seq_len``
    is the worker's own prompt limit when its backend knows one; a scheduler takes the smaller
    of it and its setting, so a prompt no worker can serve is refused before it is placed.
    """

    worker_id: Id
    kind: WorkerKind = WorkerKind.CP
    degree: int = Field(ge=1)
    gpus: list[NonNegInt] = Field(min_length=1)
    epoch: NonNegInt
    lifecycle: Lifecycle
    queue_len: NonNegInt = Field(description="requests waiting or running")
    outstanding_s: NonNegFloat = Field(description="Σ predicted remaining service time")
    outstanding_by: dict[Id, NonNegFloat] = Field(
        default_factory=dict, max_length=MAX_SCHEDULER_REPLICAS,
        description="the part of outstanding_s placed by each scheduler replica (by "
        "Assignment.scheduler_id): a replica counts the rest as other replicas' load")
    kv_free_blocks: NonNegInt = Field(description="free + LRU-evictable cache blocks")
    kv_total_blocks: NonNegInt
    kv_cached_blocks: NonNegInt | None = Field(
        default=None, description="blocks its prefix cache holds (the controller's estimate "
        "of what a split or merge of it must reconcile); None: not reported")
    hit_tokens: NonNegInt = Field(default=0, description="cumulative reused input tokens")
    input_tokens: NonNegInt = Field(default=0, description="cumulative input tokens")
    served: NonNegInt = Field(default=0, description="requests completed")
    seq: NonNegInt = 0
    incarnation: Incarnation = Field(
        default="", description="this start of the worker; a new value means the requests "
        "and cache of the one before are gone")
    max_seq_len: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS,
        description="longest prompt (tokens) the worker's engine serves, e.g. the model's "
        "max_position_embeddings; None: not known (the scheduler's own max_seq_len alone "
        "applies). A limit above MAX_TOKENS is published as MAX_TOKENS: no valid request is "
        "longer")
    heartbeat_s: WallTime

    @model_validator(mode="after")
    def _consistent(self) -> WorkerState:
        if len(self.gpus) != self.degree:
            raise ValueError(f"{len(self.gpus)} gpus for degree {self.degree}")
        if self.gpus != list(range(self.gpus[0], self.gpus[0] + self.degree)):
            raise ValueError(f"gpus {self.gpus} are not one contiguous group")
        if self.kv_free_blocks > self.kv_total_blocks:
            raise ValueError("kv_free_blocks > kv_total_blocks")
        if self.hit_tokens > self.input_tokens:
            raise ValueError("hit_tokens > input_tokens")
        return self


MAX_WORKER_DEGREE: Final[int] = 1 << 12
"""Most GPUs one worker of an epoch record may span: far beyond any lattice (§6 uses up to 8),
and small enough that a record's checks stay cheap."""


class EpochWorker(Message):
    """One worker of a composition: its lattice group and lifecycle under this epoch. The id is
    the group's (``w-cp{C}-g{first}``, ``w-tp{C}-g{first}`` for a TP worker): every reader --
    a rank host choosing the workers in its range, a rank daemon taking its GPUs from its id
    -- then agrees on the GPUs."""

    worker_id: Id
    kind: WorkerKind = WorkerKind.CP
    first_gpu: NonNegInt
    degree: int = Field(ge=1, le=MAX_WORKER_DEGREE)
    lifecycle: Lifecycle

    @model_validator(mode="after")
    def _lattice(self) -> EpochWorker:
        group = GpuGroup(first_gpu=self.first_gpu, degree=self.degree)  # raises InvalidInput
        want = group.worker_id if self.kind is WorkerKind.CP else \
            tp_worker_name(group.degree, group.first_gpu)
        if self.worker_id != want:
            raise ValueError(f"worker id {self.worker_id!r} is not {want!r}")
        return self

    @property
    def group(self) -> GpuGroup:
        return GpuGroup(first_gpu=self.first_gpu, degree=self.degree)


class EpochRecord(Message):
    """The versioned control record (§8): the composition under ``epoch``.

    Stored in the epoch KV bucket and changed only by compare-and-set, so exactly one
    controller wins each epoch change. Groups never overlap; ids are unique.
    """

    epoch: NonNegInt
    workers: list[EpochWorker]
    committed_at_s: WallTime
    reason: str = ""
    traceparent: str = Field(
        default="",
        description="W3C traceparent of the span that wrote the record (a reconfiguration's "
        "phase), so that a rank's adoption of it joins that trace (a KV value has no headers); "
        "empty: none. Not checked here: a malformed one must not make the record unreadable "
        "(the reader validates it, shared.telemetry.traceparent_of, and goes on without it).",
    )

    @model_validator(mode="after")
    def _disjoint(self) -> EpochRecord:
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate worker ids")
        # Aligned power-of-two groups: sorted by first GPU, each must end before the next.
        end, last = -1, ""
        for w in sorted(self.workers, key=lambda w: (w.first_gpu, -w.degree)):
            if w.first_gpu < end:
                raise ValueError(f"worker {w.worker_id} overlaps another group ({last})")
            end, last = w.first_gpu + w.degree, w.worker_id
        return self


class EpochAck(Message):
    """A rank's acknowledgement that it adopted ``epoch`` as a rank of ``worker_id``."""

    gpu: NonNegInt
    epoch: NonNegInt
    degree: int = Field(ge=1)
    worker_id: Id
    adopted_at_s: WallTime

    @model_validator(mode="after")
    def _member(self) -> EpochAck:
        group = GpuGroup.from_worker_id(self.worker_id)  # raises InvalidInput
        if group.degree != self.degree or self.gpu not in group.gpus:
            raise ValueError(f"gpu {self.gpu} / degree {self.degree} not in {self.worker_id}")
        return self


# -- prefix cache: events (design.md "Cache events") --------------------------------------------


MAX_BLOCKS_PER_EVENT: Final[int] = 1 << 20
"""Bound on the blocks of one event or command (rejects absurd payloads before any work)."""
BlockList = Annotated[list[HashInt], Field(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)]


def _distinct(hashes: list[int], what: str) -> None:
    if len(set(hashes)) != len(hashes):
        raise ValueError(f"{what} repeats a block hash")


class _CacheEventBase(Message):
    # Field names follow design.md ("worker", not "worker_id") and services/cachemgr/events.py.
    worker: Id
    event_id: int = Field(ge=1, description="per-worker monotonic, from 1")


class CacheStored(_CacheEventBase):
    """``block_hashes`` (a chain, parent first) stored under ``parent_hash`` (None = root)."""

    type: Literal["stored"] = "stored"
    parent_hash: HashInt | None = None
    block_hashes: BlockList

    @model_validator(mode="after")
    def _chain(self) -> CacheStored:
        _distinct(self.block_hashes, "block_hashes")
        if self.parent_hash is not None and self.parent_hash in self.block_hashes:
            raise ValueError("parent_hash also appears in block_hashes (a cycle)")
        return self


class CacheRemoved(_CacheEventBase):
    """The worker no longer holds ``block_hashes`` (any order)."""

    type: Literal["removed"] = "removed"
    block_hashes: BlockList

    @model_validator(mode="after")
    def _unique(self) -> CacheRemoved:
        _distinct(self.block_hashes, "block_hashes")
        return self


class CacheCleared(_CacheEventBase):
    """The worker dropped its whole cache."""

    type: Literal["cleared"] = "cleared"


class CacheSnapshot(Message):
    """A worker's whole index after event ``last_event_id`` (0: before any event).

    ``blocks`` = [(hash, parent or None)], closed under parents (whole prefixes only).
    """

    type: Literal["snapshot"] = "snapshot"
    worker: Id
    last_event_id: NonNegInt
    blocks: Annotated[list[tuple[HashInt, HashInt | None]], Field(max_length=MAX_BLOCKS_PER_EVENT)]

    @model_validator(mode="after")
    def _closed(self) -> CacheSnapshot:
        parents = dict(self.blocks)
        if len(parents) != len(self.blocks):
            raise ValueError("blocks repeats a hash")
        for h, p in self.blocks:
            if p is not None and p not in parents:
                raise ValueError(f"block {h}'s parent {p} is not in the snapshot")
        return self


CacheEvent = Annotated[
    CacheStored | CacheRemoved | CacheCleared | CacheSnapshot, Field(discriminator="type")
]
"""Any cache event; decode with ``decode(CacheEvent, ...)``."""


ReconciledRole = Literal["pending", "donor", "path"]
"""What a :class:`ReconciledNotice` entry is at its worker: a pending page (§6.2: resident or
at its source, valid once the reconcile copy lands), a donor page (resident outside the
worker's index, kept as a copy source) or only a link of the chain above one (no claim)."""


class ReconciledNotice(Message):
    """The cache manager's reconcile of one worker a split or merge made (§6.2), for the
    scheduler replicas' tries: which blocks are pending there, with each one's copy source
    (``None``: any valid copy in the pool), and which are donor pages. The replicas learn
    valid blocks from the worker's events and snapshots; only the manager reconciles, so
    this is how J's credit of a pending prefix (services/scheduler/placement.py "A pending
    prefix") sees them live.

    ``blocks`` = [(hash, parent or None, role, source or None)], parents before children (the
    chain above each page is listed as ``path`` entries, so a replica that never saw a block
    can link it). A large reconcile is cut into ``parts`` notices (``part`` from 0), sent in
    order; each is applied on its own: a part repeats, as ``path`` entries, the chain above
    its pages that earlier parts listed (services/cachemgr/reconcile.py ``reconciled_parts``).
    Every worker a split or merge makes gets a notice, an empty one (no ``blocks``) where
    nothing is pending or donated there, so a replica forgets an older reconcile of the
    same worker id. ``source`` is given for pending entries only.
    """

    worker: Id
    degree: int = Field(ge=1)
    epoch: NonNegInt = Field(description="the epoch record whose reconcile made the worker")
    part: NonNegInt = 0
    parts: int = Field(default=1, ge=1)
    blocks: Annotated[
        list[tuple[HashInt, HashInt | None, ReconciledRole, Id | None]],
        Field(max_length=MAX_BLOCKS_PER_EVENT),
    ]

    @model_validator(mode="after")
    def _ordered(self) -> ReconciledNotice:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of {self.parts}: parts count from 0")
        seen: set[int] = set()
        for h, p, role, src in self.blocks:
            if h in seen:
                raise ValueError(f"blocks repeats hash {h}")
            if p is not None and p == h:
                raise ValueError(f"block {h} is its own parent")
            if src is not None and role != "pending":
                raise ValueError(f"block {h}: only a pending entry names a source, not a {role}")
            seen.add(h)
        where = {h: i for i, (h, _, _, _) in enumerate(self.blocks)}
        for i, (h, p, _, _) in enumerate(self.blocks):
            if p is not None and where.get(p, -1) > i:
                raise ValueError(f"block {h} is listed before its parent {p}")
        return self



class PendingQuery(Message):
    """Body of the cache manager's ``pending`` endpoint (:meth:`Subjects.cache_pending_ask`):
    a scheduler replica that has just registered a worker, with no ReconciledNotice of it
    (the replica started after the split or merge, or the notice was lost), asks for the
    worker's reconcile as it stands now. ``incarnation``: the worker's incarnation in the
    state the replica registered (WorkerState.incarnation; "" where it does not say). Where
    the cache manager knows the worker under another incarnation, it has not handled that
    restart yet, or the asker's state is older than its own: it publishes nothing (a
    restarted worker starts empty, with nothing pending; a reconcile the manager has yet to
    make, it publishes itself when it makes it)."""

    worker_id: Id
    incarnation: Incarnation = Field(
        default="", description="the worker's incarnation in the asker's state, or empty")


class PendingReply(Message):
    """Answer of ``pending``: how many ReconciledNotice parts of the worker were published on
    ``{prefix}.cache.pending.{wid}`` just before (0: nothing pending, no donor page, or a
    worker the cache manager does not track)."""

    worker_id: Id
    parts: NonNegInt

# -- prefix cache: commands --------------------------------------------------------------------


class _CacheCommandBase(Message):
    command_id: Id
    worker_id: Id = Field(description="the worker that executes the command (destination)")
    epoch: NonNegInt
    blocks: BlockList = Field(description="block hashes; see each command")


class ReplicateCommand(_CacheCommandBase):
    """Make the destination hold the prefix ``blocks`` (the whole root-to-node path, root
    first), copying from ``source_worker`` only the blocks the destination lacks (§7)."""

    op: Literal["replicate"] = "replicate"
    source_worker: Id

    @model_validator(mode="after")
    def _distinct(self) -> ReplicateCommand:
        if self.source_worker == self.worker_id:
            raise ValueError("source_worker == destination worker")
        return self


class ReclaimCommand(_CacheCommandBase):
    """Delete exactly ``blocks`` where still present, unpinned and without a retained child
    (exact-key deletion, §8); blocks that do not qualify are skipped and reported."""

    op: Literal["reclaim"] = "reclaim"


class ReconcileCommand(_CacheCommandBase):
    """After a split/merge, install the pending prefix ``blocks`` (root-to-node path) from
    ``source_worker``; with no source the pending part is dropped (an ordinary miss)."""

    op: Literal["reconcile"] = "reconcile"
    source_worker: Id | None = None


class DemoteCommand(_CacheCommandBase):
    """Make ``blocks`` (root first: the blocks a route-time pull copied away from this
    worker) the first to be evicted here (services/cachemgr/pull.py, "A pull can be a move").
    Nothing is removed and no cache event follows: only the eviction order changes, so the
    trie's holders stay as they are; blocks no longer cached, and blocks with a cached child
    that is not demoted with them, are skipped (``blocks_done`` counts the ones demoted)."""

    op: Literal["demote"] = "demote"


CacheCommand = Annotated[
    ReplicateCommand | ReclaimCommand | ReconcileCommand | DemoteCommand,
    Field(discriminator="op"),
]


class CacheCommandResult(Message):
    """A worker's report on one command; visibility changes only through cache events."""

    command_id: Id
    worker_id: Id
    ok: bool
    blocks_done: NonNegInt = Field(default=0,
                                   description="blocks installed, removed or demoted")
    error: str | None = None


# -- controller ---------------------------------------------------------------------------------


# Notices on vtm.ctl.* (published by the controller; read by schedulers, the cache manager).


class RedirectedRequest(Message):
    worker_id: Id
    request_id: Id


class DrainNotice(Message):
    """The sources of a reconfiguration stop admitting (§6.2). The scheduler drops them from
    its candidate set at once and re-places ``redirected`` (their queued requests, in queue
    order) when they come back through intake; ``in_flight`` finish under the old geometry."""

    reconfiguration: NonNegInt
    kind: Literal["split", "merge"]
    epoch: NonNegInt = Field(description="record epoch of the drain record")
    sources: list[Id]
    targets: list[Id]
    redirected: list[RedirectedRequest] = Field(default_factory=list)
    in_flight: dict[str, NonNegInt] = Field(default_factory=dict)
    plan: list[NonNegInt] = Field(
        default_factory=list,
        description="every reconfiguration of the plan this one belongs to (all started "
        "under the same drain record ``epoch``)",
    )
    reason: str = ""
    issued_at_s: WallTime


class ReconfigurationEvent(Message):
    """One phase change of a split or merge; the exposed one carries drain and switch times."""

    reconfiguration: NonNegInt
    kind: Literal["split", "merge"]
    phase: Literal["draining", "drained", "committed", "ready", "exposed", "aborted"]
    sources: list[Id]
    targets: list[Id]
    epoch: NonNegInt | None = Field(description="record epoch of the commit (None before)")
    started_at_s: WallTime
    drained_at_s: WallTime | None = None
    switch_started_at_s: WallTime | None = None
    exposed_at_s: WallTime | None = None
    aborted_at_s: WallTime | None = None
    drain_s: NonNegFloat | None = None
    switch_s: NonNegFloat | None = None
    redirected: NonNegInt = 0
    composition: str = ""
    controller: str = ""


class CompositionNotice(Message):
    """The composition under the record ``epoch`` and which workers are schedulable."""

    epoch: NonNegInt
    composition: str
    workers: list[EpochWorker]
    schedulable: list[Id]
    at_s: WallTime


class RequestStats(Message):
    """Per-request statistics for the cache manager (Algorithm 1's inputs, §7.1).

    The cache manager matches ``block_hashes`` in its own trie and calls
    ``record_request(match, worker_id, degree, reused_blocks, preferred_degree, input_len)``.
    Lengths and counts are bounded by :data:`MAX_TOKENS`, as the IntakeRequest they come from
    (``input_len`` is Algorithm 1's L: at a huge L a node's missed benefit is the difference
    of two huge, nearly equal predictions, which rounding makes anything up to ~10^11 s).
    """

    request_id: Id
    reporter: Id
    worker_id: Id
    degree: int = Field(ge=1)
    input_len: int = Field(ge=1, le=MAX_TOKENS, description="prompt length L in tokens")
    block_hashes: list[HashInt] = Field(max_length=MAX_TOKENS)
    reused_blocks: TokenCount = Field(description="blocks the chosen worker reuses")
    prefix_tokens: TokenCount = Field(description="P: cached prefix tokens reused")
    preferred_degree: int = Field(ge=1)
    preferred_worker: Id
    predicted_s: NonNegFloat
    policy: str
    at_s: WallTime


WINDOW_REPORT_VERSION: Final[int] = 2
"""WindowReport's schema version: 2 added the demand-by-preferred-degree breakdown."""

# Relative slack for "the breakdown does not exceed D(k)": both are float sums of the same
# predictions, added in the same order, so only rounding separates them.
_SUM_SLACK: Final[float] = 1e-9


class WindowReport(Message):
    """One scheduler replica's demand in window k (§6.1): D(k) in predicted service seconds.

    Versions (both decode; a controller treats a version-1 report as one without a
    breakdown, which its merge gate reads as "nothing gated"):

    * 1 — D(k), request counts, the long-request count, D by placed degree.
    * 2 — adds ``demand_by_preferred``: D(k) split by each request's preferred degree (§6.1
      rule 1, ``services.controller.core.request_preferred_degree``) as the scheduler's
      fitted profile sees it, with the rule's inputs (``preferred_degrees``,
      ``preferred_speedup``) so a controller configured with another rule can refuse the
      breakdown instead of misreading it. Empty with ``preferred_speedup`` None when the
      scheduler computes no breakdown.
    """

    schema_version: Literal[1, 2] = WINDOW_REPORT_VERSION  # type: ignore[assignment]
    reporter: Id
    window_index: NonNegInt
    window_start_s: WallTime
    window_s: float = Field(gt=0.0, allow_inf_nan=False, description="H")
    epoch: NonNegInt
    demand_s: NonNegFloat = Field(description="D(k) = Σ Ê_C(R, P) of requests routed")
    requests: NonNegInt
    long_requests: NonNegInt = Field(description="requests at or above the long threshold")
    demand_by_degree: dict[Annotated[int, Field(ge=1)], NonNegFloat] = Field(
        default_factory=dict,
        description="D(k) by the degree each request was placed at; sums to at most demand_s",
    )
    demand_by_preferred: dict[Annotated[int, Field(ge=1)], NonNegFloat] = Field(
        default_factory=dict,
        description="(v2) D(k) by each request's preferred degree (§6.1 rule 1); sums to at "
        "most demand_s",
    )
    preferred_degrees: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="(v2) the degree set rule 1 climbed over (ascending, distinct)",
    )
    preferred_speedup: float | None = Field(
        default=None, ge=1.0, allow_inf_nan=False,
        description="(v2) rule 1's threshold: C → 2C while Ê_C ≥ this · Ê_2C; None: no "
        "breakdown computed",
    )

    @model_validator(mode="after")
    def _counts(self) -> WindowReport:
        if self.long_requests > self.requests:
            raise ValueError("long_requests > requests")
        has_rule = self.preferred_speedup is not None or bool(self.preferred_degrees)
        if self.schema_version == 1 and (self.demand_by_preferred or has_rule):
            raise ValueError("a version-1 report carries no preferred-degree breakdown")
        if self.demand_by_preferred and self.preferred_speedup is None:
            raise ValueError("demand_by_preferred needs the rule's preferred_speedup")
        if (self.preferred_speedup is None) != (not self.preferred_degrees):
            raise ValueError("give preferred_speedup and preferred_degrees together")
        degs = self.preferred_degrees
        if any(a >= b for a, b in zip(degs, degs[1:], strict=False)):
            raise ValueError("preferred_degrees must be ascending and distinct")
        if not set(self.demand_by_preferred) <= set(degs):
            raise ValueError("demand_by_preferred names a degree outside preferred_degrees")
        total = sum(self.demand_by_preferred.values())
        if total > self.demand_s * (1.0 + _SUM_SLACK) + _SUM_SLACK:
            raise ValueError(f"demand_by_preferred sums to {total} > demand_s {self.demand_s}")
        if len(self.demand_by_preferred) > self.requests:
            raise ValueError("demand_by_preferred names more degrees than there are requests")
        placed = sum(self.demand_by_degree.values())
        if placed > self.demand_s * (1.0 + _SUM_SLACK) + _SUM_SLACK:
            raise ValueError(f"demand_by_degree sums to {placed} > demand_s {self.demand_s}")
        if len(self.demand_by_degree) > self.requests:
            raise ValueError("demand_by_degree names more degrees than there are requests")
        return self


# -- results ----------------------------------------------------------------------------------


class TtftStages(Message):
    """TTFT broken into stages (seconds). ``total_s`` is measured end to end, not summed."""

    intake_wait_s: NonNegFloat = 0.0
    schedule_s: NonNegFloat = 0.0
    queue_wait_s: NonNegFloat = 0.0
    prefill_s: NonNegFloat = 0.0
    kv_transfer_s: NonNegFloat = 0.0
    first_decode_s: NonNegFloat = 0.0
    total_s: NonNegFloat = 0.0


NOT_SCHEDULED: Final[str] = "not scheduled"
"""How a scheduler's FirstToken ``error`` starts when no worker took the request in its
deliveries (transient: the gateway answers 503, and a client retry is a new attempt)."""
NOT_SERVABLE: Final[str] = "not servable"
"""How a scheduler's FirstToken ``error`` starts when no worker it knows can ever serve the
request (longer than every worker's ``max_seq_len``): the gateway answers 422."""


class FirstToken(Message):
    """The first output token of a request (or its failure), published on its result subject.

    Units: ``stages`` and ``finished_at_s`` are wall seconds as measured; ``predicted_prefill_s``
    is the scheduler's Ê_C in *modelled* seconds. A worker that models time (the ``sim``
    backend) runs at ``time_scale`` (modelled seconds × ``time_scale`` = wall seconds), so the
    prediction comparable with ``stages.prefill_s`` is ``predicted_prefill_s × time_scale``.
    """

    request_id: Id
    token: int | None = Field(description="first output token id (None if failed)")
    worker_id: Id | None = None
    epoch: NonNegInt | None = None
    predicted_prefill_s: NonNegFloat | None = Field(
        default=None, description="the scheduler's Ê_C(R, P), modelled seconds")
    time_scale: float = Field(
        default=1.0, gt=0.0, allow_inf_nan=False,
        description="the worker's wall seconds per modelled second (1: real time, as a real "
        "engine runs)")
    prefix_tokens: NonNegInt | None = Field(
        default=None, description="P actually reused at the worker (may differ from assigned)"
    )
    stages: TtftStages
    finished_at_s: WallTime
    error: str | None = None
    arrival_s: WallTime | None = Field(
        default=None,
        description="the answered request's arrival_s, echoed from its IntakeRequest: which "
        "attempt of a request id this answers, on the gateway's own clock (None: not known)",
    )

    @model_validator(mode="after")
    def _token_or_error(self) -> FirstToken:
        if (self.token is None) == (self.error is None):
            raise ValueError("give exactly one of token or error")
        return self


class KvChunk(Message):
    """One chunk of a request's KV handoff (msgpack only; ``data`` is raw bytes)."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    request_id: Id
    index: NonNegInt
    count: int = Field(ge=1)
    rank: NonNegInt = 0
    layer: NonNegInt | None = None
    dtype: str = Field(min_length=1)
    shape: list[NonNegInt]
    data: bytes

    @model_validator(mode="after")
    def _in_range(self) -> KvChunk:
        if self.index >= self.count:
            raise ValueError(f"chunk index {self.index} >= count {self.count}")
        return self


# -- codecs -----------------------------------------------------------------------------------

M = TypeVar("M")


@functools.cache
def _adapter(target: Any) -> TypeAdapter[Any]:
    return TypeAdapter(target)


def _name(target: Any) -> str:
    if isinstance(target, type):
        return target.__name__
    if target is CacheEvent:
        return "CacheEvent"
    if target is CacheCommand:
        return "CacheCommand"
    return repr(target)


def _schema_error(target: Any, exc: ValidationError) -> SchemaError:
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    loc = ".".join(str(p) for p in first.get("loc", ())) or "<model>"
    if first.get("type") == "json_invalid":
        loc = "<payload>"
    elif str(first.get("type", "")).startswith("union_tag"):
        # A bad or missing discriminator: name the tag field, not the whole union.
        tag = str(first.get("ctx", {}).get("discriminator", "")).strip("'\"")
        loc = ".".join(p for p in (loc if loc != "<model>" else "", tag) if p) or loc
    return SchemaError(_name(target), loc, str(first.get("msg", "invalid")), errors)


def to_json(msg: BaseModel) -> bytes:
    """Compact JSON bytes of a message."""
    return msg.model_dump_json().encode()


def from_json(target: type[M] | Any, data: bytes | str, *, strict: bool = False) -> M:
    """Decode JSON into ``target`` (a message class or :data:`CacheEvent`-style union).
    ``strict``: JSON's own types only (no ``"3"`` for 3, no ``true`` for 1)."""
    try:
        return _adapter(target).validate_json(data, strict=strict)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise _schema_error(target, exc) from None


def to_msgpack(msg: BaseModel) -> bytes:
    """msgpack bytes of a message (bytes fields stay binary)."""
    return msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)  # type: ignore[no-any-return]


def from_msgpack(target: type[M] | Any, data: bytes, *, strict: bool = False) -> M:
    """Decode msgpack into ``target``; any malformed input raises :class:`SchemaError`.
    ``strict`` as :func:`from_json`."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # A FormatError (a byte no msgpack value starts with) has no message: its name is one.
        raise SchemaError(_name(target), "<payload>",
                          f"not msgpack: {str(exc) or type(exc).__name__}") from None
    try:
        return _adapter(target).validate_python(obj, strict=strict)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise _schema_error(target, exc) from None


def encode(msg: BaseModel, content_type: str = JSON) -> tuple[bytes, dict[str, str]]:
    """``(payload, headers)`` for publishing ``msg``; headers carry ``Content-Type``."""
    if content_type == JSON:
        return to_json(msg), {CONTENT_TYPE: JSON}
    if content_type == MSGPACK:
        return to_msgpack(msg), {CONTENT_TYPE: MSGPACK}
    raise InvalidInput(f"unsupported content type {content_type!r}")


def content_type_of(headers: Mapping[str, str] | None) -> str:
    """The payload's content type from NATS headers (case-insensitive key); JSON if absent."""
    if headers:
        for key, value in headers.items():
            if key.lower() == "content-type":
                return value.split(";", 1)[0].strip().lower()
    return JSON


def decode(target: type[M] | Any, data: bytes, headers: Mapping[str, str] | None = None, *,
           strict: bool = False) -> M:
    """Decode a NATS payload into ``target`` by its ``Content-Type`` header (``strict`` as
    :func:`from_json`); an unknown content type raises :class:`UnsupportedContentType`."""
    ctype = content_type_of(headers)
    if ctype == JSON:
        return from_json(target, data, strict=strict)
    if ctype == MSGPACK:
        return from_msgpack(target, data, strict=strict)
    raise UnsupportedContentType(_name(target), "<payload>",
                                 f"unsupported content type {ctype!r}")


def json_schema(target: type[BaseModel] | Any) -> dict[str, Any]:
    """JSON Schema of a message (for docs and the subject tap)."""
    return _adapter(target).json_schema()


def dumps_pretty(msg: BaseModel) -> str:
    """Indented JSON for humans (taps, logs)."""
    return json.dumps(msg.model_dump(mode="json"), indent=2, sort_keys=True)


__all__ = [
    "RequestStats",
    "CONTENT_TYPE",
    "JSON",
    "MSGPACK",
    "MAX_TOKENS",
    "MAX_TOKEN_ID",
    "NOT_SCHEDULED",
    "NOT_SERVABLE",
    "SCHEMA_VERSION",
    "WINDOW_REPORT_VERSION",
    "Assignment",
    "AssignmentAck",
    "CacheCleared",
    "CacheCommand",
    "CacheCommandResult",
    "CacheEvent",
    "CacheRemoved",
    "CacheSnapshot",
    "CacheStored",
    "CompletionRequest",
    "CompositionNotice",
    "DemoteCommand",
    "DrainNotice",
    "EpochAck",
    "EpochRecord",
    "EpochWorker",
    "FirstToken",
    "IntakeRequest",
    "KvChunk",
    "Message",
    "PendingQuery",
    "PendingReply",
    "PlacementTerms",
    "QueueQuery",
    "QueueReport",
    "RedirectedRequest",
    "ReclaimCommand",
    "ReconfigurationEvent",
    "ReconcileCommand",
    "ReconciledNotice",
    "ReconciledRole",
    "ReplicateCommand",
    "SchemaError",
    "UnsupportedContentType",
    "TtftStages",
    "WindowReport",
    "WorkerState",
    "content_type_of",
    "decode",
    "encode",
    "from_json",
    "from_msgpack",
    "json_schema",
    "to_json",
    "to_msgpack",
]
