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
to rank, as an intra-degree copy), else the lowest id; never a holder whose copy of those
blocks a reclaim in flight is removing (the copy would race the removal at its source, as the
scan's own source choice knows; none is made when every holder is one). Like every copy it is
recorded as in flight and becomes visible only with the destination's ``Stored`` event; the
request uses it when it starts after the copy has landed (a queued request, the case that
matters under load), and otherwise recomputes the prefix as it would have. The paper's J does
not count on a pull that may come too late; J's pull credit (on in the calibrated settings)
does, where the queue lets the copy land (services/scheduler/placement.py, "Pull credit").

A pull can be a move (``PullConfig.demote_source``: a bare config leaves it off, the
calibrated one turns it on). Once the copy has landed, the source's copy of the copied blocks
that belong to one line of requests is *demoted* (:func:`demotion`: a :class:`Demote`, the
live ``DemoteCommand``): moved to the old end of the source's LRU, so that it is the first to
go when the source needs room. Nothing is removed (a request that reuses it there makes it
recent again), and shared blocks -- those with two continuations cached somewhere, and their
ancestors -- are left where they are. Why: the pull follows one consumer (a session's next
turn, an agent's next call) away from its holder, and the old copy, still recent, pushes
other prefixes out in its place. With J's pull credit, which moves sessions far more often,
that cost the reconfiguration preset's long phases their documents; with the demotion it
does not, and J's price per copied block (``PullCredit.displace_block_s``) keeps a move for
when it saves enough queueing -- without it, small caches under overload lost the second copy
a returning session needed (docs/evaluation.md "A pull as a move").

Not pulled: a prefix the destination cannot hold whole (longer than its capacity), or the
part of one with a copy already in flight to the destination (from an earlier request of the
same session, the scan, or a reconcile): what lies beyond the copies in flight is pulled on
its own. ``min_blocks`` gates the whole gap (the longest held prefix against the chosen
worker's), not that rest: the rest completes a prefix J may have counted on, so it is sent
whatever its length. Pure: reads and records in-flight copies on the trie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.cachemgr.actions import Demote, Replicate
from services.cachemgr.trie import MatchResult, PrefixTrie
from shared.ids import BlockHash, Degree, InvalidInput, WorkerId


@dataclass(frozen=True, slots=True)
class PullConfig:
    """``min_blocks``: the chosen worker must lack at least this many blocks of the longest
    held prefix for a pull (a shorter gap is cheap to recompute, and every copy costs a
    command round trip and link time). ``demote_source``: once a pull has landed, the
    source's copy of the copied blocks is demoted (:func:`demotion`; module docstring,
    "A pull can be a move")."""

    min_blocks: int
    demote_source: bool = False

    def __post_init__(self) -> None:
        m = self.min_blocks
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidInput(f"PullConfig.min_blocks must be an integer >= 1, got {m!r}")
        if not isinstance(self.demote_source, bool):
            raise InvalidInput(f"PullConfig.demote_source must be a bool, "
                               f"got {self.demote_source!r}")


def demotion(action: Replicate, config: PullConfig, trie: PrefixTrie, *,
             landed: int | None = None) -> Demote | None:
    """What follows a copy ``action`` that has landed (its destination's ``Stored`` event or
    an ok reply): for a route-time pull with ``config.demote_source``, a :class:`Demote` at
    the source of the copied blocks that are private to one line of requests; None when
    there are none, for any other copy (the scan's replicas exist *because* a prefix is
    wanted in more places, and a reconcile copy's source is retired) or with demotion off.

    Private: below the deepest block of the copy that has two or more children in ``trie``
    (a branch point: two different continuations of it are cached somewhere, so it and its
    ancestors are shared -- a tool description, a system prompt, a document with several
    questions -- and the source is as likely to reuse them as the destination). The copy's
    last block counts as one as soon as it has a child held anywhere but at the
    destination: the request's own continuation is not cached yet, so that child is another
    line of requests through the whole copy (at the source, its cached child would also
    keep it from going first: ``BlockCache.demote``). Only a linear tail, one session's own
    history, is demoted. A block the trie has collected meanwhile ends the walk (what is
    below it is demoted).

    ``landed``: how many of the copy's blocks (leading ``action.blocks``) the destination
    took (None: all). A destination short of room takes only the leading part that fits
    (its pinned blocks stay), and the rest must stay recent at the source, whose copy is
    still the only one. Pure: reads ``trie``; raises :class:`InvalidInput` for arguments of
    the wrong type or a ``landed`` that is not an integer in [0, len(action.blocks)]."""
    if not isinstance(action, Replicate):
        raise InvalidInput(f"action must be a Replicate, got {type(action).__name__}")
    if not isinstance(config, PullConfig):
        raise InvalidInput(f"config must be a PullConfig, got {type(config).__name__}")
    if not isinstance(trie, PrefixTrie):
        raise InvalidInput(f"trie must be a PrefixTrie, got {type(trie).__name__}")
    if landed is not None and (landed.__class__ is not int
                               or not 0 <= landed <= len(action.blocks)):
        raise InvalidInput(f"landed must be an integer in [0, {len(action.blocks)}] "
                           f"(the copy's blocks), got {landed!r}")
    if action.kind != "route" or not config.demote_source:
        return None
    blocks = action.blocks
    nodes = trie._nodes
    start = last = len(blocks) - 1
    dest = action.dest
    while start >= 0:
        n = nodes.get(blocks[start])
        if n is None or len(n.children) > 1:
            break
        if start == last and any(c.holders - {dest} for c in n.children.values()):
            # The copy's last block already goes on elsewhere than at the destination (as a
            # rule the source's own longer history): with the request's own continuation,
            # once cached, it is a branch point too.
            break
        start -= 1
    start += 1
    # The branch point is sought in the whole copy: a block the destination did not take may
    # still make the blocks above it shared.
    private = blocks[start:landed]
    return Demote(action.source, private) if private else None


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
        coming: set[BlockHash] = set()
        for a in inflight.values():
            if not want.isdisjoint(a.blocks):
                coming.update(a.blocks)
        if coming:
            # No second copy of a block already on its way, but the part of the prefix beyond
            # the copies in flight is still pulled (after a split or merge the worker's
            # reconcile copies bring the part its old self held; J's pull credit counted on
            # the whole prefix, and without the rest the request recomputed it: seed 305 of
            # the reconfiguration preset, a 100K-token document's last 36K tokens, 13 s). The
            # rest lands after them (copies to one worker go one after another) and then
            # completes the path. A gap between copies in flight is left alone, as before.
            k = 0
            while k < len(wanted) and wanted[k] in coming:
                k += 1
            if k == len(wanted) or not coming.isdisjoint(wanted[k:]):
                return ()
            wanted = wanted[k:]
    want = set(wanted)
    reclaiming = trie._reclaiming
    holders = [w for w, k in held.items() if k == best and w != worker
               and not any(not want.isdisjoint(r.blocks)
                           for r in reclaiming.get(w, {}).values())]
    if not holders:
        return ()
    same = [w for w in holders if trie.worker_degree(w) == view.degree]
    source = min(same or holders)
    action = Replicate(wanted[-1], Degree(view.degree), source, worker, tuple(wanted), "route")
    trie._begin(action)
    return (action,)
