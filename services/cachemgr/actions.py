"""Cache operations the manager issues to workers (§7.2, §6.2): replicate and reclaim (and
demote, after a route-time pull: services/cachemgr/pull.py).

They are plain values; the cachemgr adapter turns them into commands. None changes the trie's
holder metadata by itself: a replica counts only after the destination's own ``Stored`` event
(its confirmation), and a reclaimed replica leaves the holders only on the worker's ``Removed``
event (§7.2, last paragraph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from shared.ids import BlockHash, Degree, WorkerId

ReplicateKind: TypeAlias = Literal["inter", "intra", "reconcile", "route"]


@dataclass(frozen=True, slots=True)
class Replicate:
    """Copy ``blocks`` of the prefix ending at ``node_hash`` from ``source`` to ``dest``.

    ``blocks`` are only what ``dest`` misses on the root->``node_hash`` path (root first), so
    ``dest`` can install them with one ``insert`` of the whole path. ``degree`` is ``dest``'s
    degree. ``kind``: "inter" (first replica at ``degree``), "intra" (another one at the same
    degree), "reconcile" (pending pages after a split/merge; ``source`` may equal ``dest``
    when the pages only move between the ranks of one merged worker) or "route" (a request's
    prefix pulled to the worker it was routed to: services/cachemgr/pull.py).
    """

    node_hash: BlockHash
    degree: Degree
    source: WorkerId
    dest: WorkerId
    blocks: tuple[BlockHash, ...]
    kind: ReplicateKind

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "replicate",
            "node_hash": self.node_hash,
            "degree": self.degree,
            "source": self.source,
            "dest": self.dest,
            "blocks": list(self.blocks),
            "kind": self.kind,
        }


@dataclass(frozen=True, slots=True)
class Reclaim:
    """Delete ``blocks`` (``node_hash`` first, then ancestors that only it kept) at ``worker``.

    NOTE: no block in ``blocks`` has a descendant retained at ``worker`` outside ``blocks``, so
    removing them leaves the worker's cache a set of whole prefixes.
    """

    worker: WorkerId
    node_hash: BlockHash
    blocks: tuple[BlockHash, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "reclaim",
            "worker": self.worker,
            "node_hash": self.node_hash,
            "blocks": list(self.blocks),
        }


@dataclass(frozen=True, slots=True)
class Demote:
    """Make ``blocks`` (root first) the first to be evicted at ``worker``; nothing is removed
    (``BlockCache.demote``). Follows a route-time pull that landed: the source's copy of what
    was copied (services/cachemgr/pull.py, "A pull can be a move"). Not tracked in flight and not
    visible in the trie (holders do not change); a failed one is only reported."""

    worker: WorkerId
    blocks: tuple[BlockHash, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"type": "demote", "worker": self.worker, "blocks": list(self.blocks)}


CacheAction: TypeAlias = Replicate | Reclaim
