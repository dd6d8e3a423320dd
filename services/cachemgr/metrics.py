"""The cache manager's metrics: the copies and deletions it commands, and the trie's size.

==========================  =======  ==================================================
name                        kind     attributes
==========================  =======  ==================================================
``vtm.cache.commands``      counter  ``kind`` (inter, intra, reconcile, route: copies;
                                     reclaim: deletions; demote: a pull's source made
                                     evict-first), ``outcome`` (ok, failed)
``vtm.cache.blocks``        counter  ``kind``: KV blocks of the commands that succeeded
``vtm.cache.trie_nodes``    gauge    -: cached blocks the global prefix trie tracks
==========================  =======  ==================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import Observation

from services.cachemgr.actions import CacheAction, Demote, Reclaim
from shared.metrics import meter, observe_gauge


def action_kind(action: CacheAction | Demote) -> str:
    """"reclaim", "demote", or the copy's kind ("inter", "intra", "reconcile", "route")."""
    if isinstance(action, Reclaim):
        return "reclaim"
    if isinstance(action, Demote):
        return "demote"
    return str(action.kind)


class CacheMetrics:
    """The instruments above; ``trie_nodes()`` gives the trie's node count now."""

    def __init__(self, trie_nodes: Callable[[], int]) -> None:
        m = meter()
        self._trie_nodes = trie_nodes
        self.commands = m.create_counter(
            "vtm.cache.commands", unit="{command}",
            description="Replication, reconciliation, reclamation and demotion commands, "
            "by outcome")
        self.blocks = m.create_counter(
            "vtm.cache.blocks", unit="{block}",
            description="KV blocks copied, deleted or demoted by commands that succeeded")
        observe_gauge("vtm.cache.trie_nodes", "{block}",
                      "Cached blocks tracked by the global prefix trie", self,
                      CacheMetrics._observe)

    def _observe(self) -> Iterable[Observation]:
        return [Observation(self._trie_nodes())]

    def done(self, action: CacheAction | Demote, ok: bool) -> None:
        kind = action_kind(action)
        self.commands.add(1, {"kind": kind, "outcome": "ok" if ok else "failed"})
        if ok:
            self.blocks.add(len(action.blocks), {"kind": kind})


__all__ = ["CacheMetrics", "action_kind"]
