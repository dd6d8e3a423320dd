"""Route-time prefix pull (our addition to §7): copy a request's prefix to the worker it was
routed to, from the worker that holds the most of it.

Why. J (§5) weighs a worker's queue against its cached prefix, so under load it often routes a
request away from the worker holding its prefix, and that request then recomputes the prefix
-- GPU time that near saturation is the pool's capacity. On the Mooncake conversation trace
at ×4.8, an infinite global cache would reuse 37.4% of the input tokens; Vertumnus's routing
reused 31.8% with per-worker caches of unbounded size and 30.8% with the real ones (34.4%
with this pull; docs/evaluation.md "Route-time prefix pull"). §7.2's replication is
periodic (one scan per H = 20 s) and driven by accumulated demand, which a multi-turn
session's prefix -- reused once a turn, by one client -- never accumulates. A copy over the
RDMA / NVLink links costs a small fraction of recomputing the prefix (40 GB/s per rank pair
against seconds of prefill for long prefixes) and no GPU time.

What. When the cache manager learns a placement (the scheduler's RequestStats, or the
simulator's placement), :func:`pull_on_route` compares the longest prefix of the request the
chosen worker holds with the longest any worker holds. When the chosen worker lacks at least
``PullConfig.min_blocks`` blocks of it, one ``Replicate(kind="route")`` copies just those
blocks from a holder -- one of the chosen worker's degree when there is one (pages move rank
to rank, as an intra-degree copy), else the lowest id. Like every copy it is recorded as in
flight and becomes visible only with the destination's ``Stored`` event; the request uses it
when it starts after the copy has landed (a queued request, the case that matters under
load), and otherwise recomputes the prefix as it would have. J is the paper's, unchanged: it
does not count on a pull that may come too late.

Not pulled: a prefix the destination cannot hold whole (longer than its capacity), or one
with a copy already in flight to the destination (from an earlier request of the same
session, the scan, or a reconcile). Pure: reads and records in-flight copies on the trie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.cachemgr.actions import Replicate
from services.cachemgr.trie import MatchResult, PrefixTrie
from shared.ids import BlockHash, Degree, InvalidInput, WorkerId


@dataclass(frozen=True, slots=True)
class PullConfig:
    """``min_blocks``: the chosen worker must lack at least this many blocks of the longest
    held prefix for a pull (a shorter gap is cheap to recompute, and every copy costs a
    command round trip and link time)."""

    min_blocks: int

    def __post_init__(self) -> None:
        m = self.min_blocks
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidInput(f"PullConfig.min_blocks must be an integer >= 1, got {m!r}")


def pull_on_route(trie: PrefixTrie, match: MatchResult, worker: WorkerId,
                  config: PullConfig) -> tuple[Replicate, ...]:
    """The route-time pull for a request matched as ``match`` (on ``trie``, just now) and
    routed to ``worker``: at most one ``Replicate(kind="route")``, recorded as in flight
    (module docstring). Raises :class:`~shared.ids.UnknownWorker` for an untracked worker and
    :class:`InvalidInput` for a config that is not a :class:`PullConfig`."""
    if not isinstance(config, PullConfig):
        raise InvalidInput(f"config must be a PullConfig, got {type(config).__name__}")
    view = trie._view(worker)
    if view.stale:  # its holdings are unknown until its snapshot: it may hold the prefix
        return ()
    held = match.held_blocks
    mine = held.get(worker, 0)
    best = max(held.values(), default=0)
    if best - mine < config.min_blocks or best > view.capacity_blocks \
            or best > len(match.path):
        return ()
    wanted: Sequence[BlockHash] = match.path[mine:best]
    inflight = trie._replicating.get(worker)
    if inflight:
        want = set(wanted)
        if any(not want.isdisjoint(a.blocks) for a in inflight.values()):
            return ()
    holders = [w for w, k in held.items() if k == best and w != worker]
    if not holders:
        return ()
    same = [w for w in holders if trie.worker_degree(w) == view.degree]
    source = min(same or holders)
    action = Replicate(wanted[-1], Degree(view.degree), source, worker, tuple(wanted), "route")
    trie._begin(action)
    return (action,)
