"""Cache-key events: what a worker reports about its own prefix cache (design.md, "Contracts").

Every worker numbers its events 1, 2, 3, ... (``event_id``, per worker, monotonic). The global
prefix trie applies them in order; a duplicate is a no-op and a gap makes the worker's view stale
until a :class:`Snapshot` replaces it (see :meth:`services.cachemgr.trie.PrefixTrie.apply`).

* :class:`Stored`  -- the worker installed ``block_hashes`` as one chain hanging under
  ``parent_hash`` (``None``: the chain starts at the root, i.e. block 0 of a prompt).
  ``block_hashes[i]``'s parent is ``block_hashes[i-1]``.
* :class:`Removed` -- the worker dropped these blocks (LRU eviction or a reclaim command).
* :class:`Cleared` -- the worker dropped everything.
* :class:`Snapshot` -- the worker's whole cache index as ``(hash, parent)`` pairs, as of
  ``last_event_id``; sent on request after a gap.

The wire form is a JSON-able dict with a ``"type"`` field (``to_wire`` / :func:`event_from_wire`).
Construction validates, so a malformed event never exists as an object: every problem raises
:class:`MalformedEvent` naming it. Pure module: no IO, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from shared.ids import BlockHash, InvalidInput, WorkerId

MAX_BLOCKS_PER_EVENT: Final[int] = 1 << 20
"""Upper bound on the blocks of one event: rejects absurd payloads before any work is done."""
HASH_MIN: Final[int] = -(1 << 63)
HASH_END: Final[int] = 1 << 64
"""Block hashes lie in [HASH_MIN, HASH_END): msgpack's signed or unsigned 64-bit integers."""


_set = object.__setattr__  # frozen dataclasses: the trusted constructors set slots directly


class MalformedEvent(InvalidInput):
    """A cache event (object or wire dict) that breaks the schema; the message names the field."""


def _check_worker(worker: object) -> None:
    if not isinstance(worker, str) or not worker:
        raise MalformedEvent(f"worker must be a non-empty string, got {worker!r}")


def _check_event_id(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass: reject it explicitly, True is not an event id.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MalformedEvent(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_hash(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedEvent(f"{name} must be an integer block hash, got {value!r}")
    # NOTE: the wire schema's range (shared.schemas HashInt): a hash outside it could never
    # travel in a cache command, so a replicate or reclaim naming it could not be sent.
    if not HASH_MIN <= value < HASH_END:
        raise MalformedEvent(f"{name} must fit 64 bits [{HASH_MIN}, {HASH_END}), got {value}")


def _check_hashes(name: str, hashes: object) -> None:
    if not isinstance(hashes, tuple):
        raise MalformedEvent(f"{name} must be a tuple of block hashes, got {type(hashes).__name__}")
    if not hashes:
        raise MalformedEvent(f"{name} must not be empty")
    if len(hashes) > MAX_BLOCKS_PER_EVENT:
        raise MalformedEvent(f"{name} has {len(hashes)} blocks, more than {MAX_BLOCKS_PER_EVENT}")
    for i, h in enumerate(hashes):
        _check_hash(f"{name}[{i}]", h)
    if len(set(hashes)) != len(hashes):
        raise MalformedEvent(f"{name} repeats a block hash")


@dataclass(frozen=True, slots=True)
class Stored:
    """``block_hashes`` (a chain, parent first) were installed under ``parent_hash``."""

    worker: WorkerId
    event_id: int
    parent_hash: BlockHash | None
    block_hashes: tuple[BlockHash, ...]

    def __post_init__(self) -> None:
        _check_worker(self.worker)
        _check_event_id("event_id", self.event_id, 1)
        if self.parent_hash is not None:
            _check_hash("parent_hash", self.parent_hash)
        _check_hashes("block_hashes", self.block_hashes)
        if self.parent_hash is not None and self.parent_hash in self.block_hashes:
            raise MalformedEvent("parent_hash also appears in block_hashes (a cycle)")

    @classmethod
    def trusted(cls, worker: WorkerId, event_id: int, parent_hash: BlockHash | None,
                block_hashes: tuple[BlockHash, ...]) -> Stored:
        """Build *without* validation (speed), for a producer that guarantees the schema by
        construction: :class:`services.rankd.blockcache.BlockCache` (validated worker id,
        event ids counting from 1, a non-empty tuple of distinct int hashes it validated on
        input, hanging under a cached parent that is not among them). Anything else --
        wire input, tests, other producers -- must use the validating constructor.
        """
        ev = object.__new__(cls)
        _set(ev, "worker", worker)
        _set(ev, "event_id", event_id)
        _set(ev, "parent_hash", parent_hash)
        _set(ev, "block_hashes", block_hashes)
        return ev

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "stored",
            "worker": self.worker,
            "event_id": self.event_id,
            "parent_hash": self.parent_hash,
            "block_hashes": list(self.block_hashes),
        }


@dataclass(frozen=True, slots=True)
class Removed:
    """The worker no longer holds ``block_hashes`` (any order)."""

    worker: WorkerId
    event_id: int
    block_hashes: tuple[BlockHash, ...]

    def __post_init__(self) -> None:
        _check_worker(self.worker)
        _check_event_id("event_id", self.event_id, 1)
        _check_hashes("block_hashes", self.block_hashes)

    @classmethod
    def trusted(cls, worker: WorkerId, event_id: int,
                block_hashes: tuple[BlockHash, ...]) -> Removed:
        """Build *without* validation (speed); same contract as :meth:`Stored.trusted`."""
        ev = object.__new__(cls)
        _set(ev, "worker", worker)
        _set(ev, "event_id", event_id)
        _set(ev, "block_hashes", block_hashes)
        return ev

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "removed",
            "worker": self.worker,
            "event_id": self.event_id,
            "block_hashes": list(self.block_hashes),
        }


@dataclass(frozen=True, slots=True)
class Cleared:
    """The worker dropped its whole cache."""

    worker: WorkerId
    event_id: int

    def __post_init__(self) -> None:
        _check_worker(self.worker)
        _check_event_id("event_id", self.event_id, 1)

    def to_wire(self) -> dict[str, Any]:
        return {"type": "cleared", "worker": self.worker, "event_id": self.event_id}


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The worker's whole cache index after its event ``last_event_id`` (0: before any event).

    ``blocks`` are ``(hash, parent_hash | None)`` pairs in any order. NOTE: the set is closed
    under parents (every non-None parent is itself listed) and acyclic -- a worker's cache only
    ever holds whole prefixes, so anything else is malformed.
    """

    worker: WorkerId
    last_event_id: int
    blocks: tuple[tuple[BlockHash, BlockHash | None], ...]

    def __post_init__(self) -> None:
        _check_worker(self.worker)
        _check_event_id("last_event_id", self.last_event_id, 0)
        if not isinstance(self.blocks, tuple):
            raise MalformedEvent(f"blocks must be a tuple, got {type(self.blocks).__name__}")
        if len(self.blocks) > MAX_BLOCKS_PER_EVENT:
            raise MalformedEvent(f"snapshot has more than {MAX_BLOCKS_PER_EVENT} blocks")
        parents: dict[int, int | None] = {}
        for i, pair in enumerate(self.blocks):
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise MalformedEvent(f"blocks[{i}] must be a (hash, parent) pair, got {pair!r}")
            h, p = pair
            _check_hash(f"blocks[{i}].hash", h)
            if p is not None:
                _check_hash(f"blocks[{i}].parent", p)
            if h in parents:
                raise MalformedEvent(f"blocks lists hash {h} twice")
            parents[h] = p
        for h, p in parents.items():
            if p is not None and p not in parents:
                raise MalformedEvent(f"block {h} has parent {p}, which the snapshot does not list")
        if topological_order(parents) is None:
            raise MalformedEvent("snapshot blocks form a cycle")

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "snapshot",
            "worker": self.worker,
            "last_event_id": self.last_event_id,
            "blocks": [[h, p] for h, p in self.blocks],
        }


CacheEvent: TypeAlias = Stored | Removed | Cleared | Snapshot


def topological_order(parents: Mapping[int, int | None]) -> list[int] | None:
    """Hashes ordered parents-first, or ``None`` if ``parents`` has a cycle.

    Parents outside the mapping count as roots. Iterative (prefixes are hundreds of blocks deep).
    """
    order: list[int] = []
    state: dict[int, int] = {}  # 1: on the current chain, 2: emitted
    for start in parents:
        if state.get(start) == 2:
            continue
        chain: list[int] = []
        h: int | None = start
        while h is not None and h in parents and state.get(h) != 2:
            if state.get(h) == 1:
                return None
            state[h] = 1
            chain.append(h)
            h = parents[h]
        for x in reversed(chain):
            state[x] = 2
            order.append(x)
    return order


def _field(d: Mapping[str, Any], name: str) -> Any:
    if name not in d:
        raise MalformedEvent(f"{d.get('type', 'event')} event lacks field {name!r}")
    return d[name]


def _hash_tuple(name: str, value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list | tuple):
        raise MalformedEvent(f"{name} must be a list of block hashes, got {value!r}")
    return tuple(value)


_FIELDS: Final[dict[str, frozenset[str]]] = {
    "stored": frozenset({"type", "worker", "event_id", "parent_hash", "block_hashes"}),
    "removed": frozenset({"type", "worker", "event_id", "block_hashes"}),
    "cleared": frozenset({"type", "worker", "event_id"}),
    "snapshot": frozenset({"type", "worker", "last_event_id", "blocks"}),
}


def event_from_wire(d: Any) -> CacheEvent:
    """Parse a wire dict into an event; raises :class:`MalformedEvent` naming the problem."""
    if not isinstance(d, Mapping):
        raise MalformedEvent(f"cache event must be a JSON object, got {type(d).__name__}")
    kind = d.get("type")
    if not isinstance(kind, str) or kind not in _FIELDS:  # (a dict or list is unhashable)
        raise MalformedEvent(
            f"unknown cache event type {kind!r}; expected one of {sorted(_FIELDS)}")
    extra = set(d) - _FIELDS[kind]
    if extra:
        raise MalformedEvent(f"{kind} event has unexpected fields {sorted(extra)}")
    worker = _field(d, "worker")
    if kind == "stored":
        return Stored(
            worker,
            _field(d, "event_id"),
            _field(d, "parent_hash"),
            _hash_tuple("block_hashes", _field(d, "block_hashes")),
        )
    if kind == "removed":
        return Removed(
            worker, _field(d, "event_id"), _hash_tuple("block_hashes", _field(d, "block_hashes"))
        )
    if kind == "cleared":
        return Cleared(worker, _field(d, "event_id"))
    raw = _field(d, "blocks")
    if not isinstance(raw, list | tuple):
        raise MalformedEvent(f"blocks must be a list of [hash, parent] pairs, got {raw!r}")
    pairs = []
    for i, pair in enumerate(raw):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise MalformedEvent(f"blocks[{i}] must be a [hash, parent] pair, got {pair!r}")
        pairs.append((pair[0], pair[1]))
    return Snapshot(worker, _field(d, "last_event_id"), tuple(pairs))


def event_from_json(payload: bytes) -> CacheEvent:
    """A cache event from a NATS payload (JSON): design.md's form or shared.schemas' (a
    ``schema_version`` other than 1 is rejected, else dropped; ``worker_id`` is accepted for
    ``worker``). Raises :class:`MalformedEvent` naming the problem, whatever the bytes."""
    try:
        d = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MalformedEvent(f"cache event is not JSON: {exc}") from None
    if isinstance(d, dict):
        d = dict(d)
        if d.pop("schema_version", 1) != 1:
            raise MalformedEvent("unsupported schema_version")
        if "worker_id" in d and "worker" not in d:
            d["worker"] = d.pop("worker_id")
    return event_from_wire(d)


def snapshot_reply(worker: str, payload: bytes) -> Snapshot:
    """The :class:`Snapshot` in a reply to a request for ``worker``'s cache snapshot
    (``cache_snapshot`` subject, the rank daemon's answer). Raises :class:`MalformedEvent`
    when the payload is no cache event, or is another kind of event or another worker's
    snapshot: a view that applied it would hold the wrong worker's cache."""
    event = event_from_json(payload)
    if not isinstance(event, Snapshot) or event.worker != worker:
        raise MalformedEvent(f"snapshot reply for {worker} is not its snapshot")
    return event
