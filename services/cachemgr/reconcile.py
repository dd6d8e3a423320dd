"""Cache reconciliation after a split or merge (§6.2; design.md "Prefix pages under CP").

Layout rule: page p (block index p, 0-based along the prefix) of a cached prefix lives on rank
p mod C of its worker. A degree-2C parent over GPUs [k, k+2C) splits into a *left* child over
[k, k+C) and a *right* child over [k+C, k+2C). Page p sits on GPU k + (p mod 2C), and the left
child's rank p mod C is GPU k + (p mod C): so after the split the left child physically holds,
on the correct rank already, exactly the pages with (p mod 2C) < C, the right child those with
(p mod 2C) >= C. Nothing moves on the critical path.

NOTE: invariant kept by both operations -- a worker's *valid* blocks are whole prefixes (every
ancestor valid too), exactly what its own LRU cache index (services/rankd/blockcache.py) can
hold, so seeding the new workers' caches with ``PrefixTrie.held_nodes`` keeps the event streams
and the trie in step. Resident pages that are not part of a whole prefix are either *pending*
(the worker will index them once their ancestors arrive; source hint: itself) or *donors*
(resident copies kept only as sources for the sibling; released by
``PrefixTrie.release_donors`` when the worker frees them). Both are copy sources; a merge
keeps both resident on the merged worker (a resident pending page stays pending there).

Which blocks are valid on a new worker is decided by one pure function,
:func:`reconciled_index`, over the predecessors' resident pages: the trie's reconciliation
calls it, and so does a rank host seeding the new worker's BlockCache from its predecessors'
caches (services/rankd/host.py ``seed_pages``). The rank daemons know only their indexed
pages, not the trie's donors, so the two agree exactly when the predecessors hold no donors
(see ``reconciled_index``).

Split: each *retained prefix* of the parent (a node it holds with no held child there, i.e. a
maximal cached prefix) is assigned to one child, by demand and capacity (greedy, heaviest demand
first, to the child with less demand assigned so far among those with room for the pages to
copy; ties to the child with fewer pages to reconcile, then left). On the assigned child every
page of the prefix outside its whole prefixes becomes *pending*: hint "itself" when resident
there, else the sibling. A prefix neither child has room for is left unassigned (its resident
pages become donors; the rest is an ordinary miss).

Merge: the merged degree-2C worker holds the union. A page from the left child is already on its
new rank iff (p mod 2C) < C, from the right child iff (p mod 2C) >= C; the whole prefixes of
such pages are valid, every other resident page is pending (hint: the merged worker itself --
it only moves between its own ranks or gets indexed).

Lazy transfer (§6.2): nothing is copied at reconfiguration time. :func:`on_reuse` is called
when a request is routed to a worker; for the pending pages on that request's cached run it
issues ``Replicate(kind="reconcile")`` actions (one per source; ``source == dest`` means "move
between own ranks / index a resident page") for just those pages, from the hinted copy if still
resident, else from any worker that has the page valid or as a donor. A pending page with no
copy left is dropped from pending (an ordinary miss; the request recomputes it). A pending page
becomes valid on the worker's ``Stored`` event for it, or on
:meth:`PrefixTrie.confirm_installed`.

Re-homing (our addition; :func:`rehome_on_split`): when a split *starts*, the parent's long
retained prefixes are copied to the other workers of its degree, which keep them where the
smaller children would evict them. Both callers issue the copies from the draining parent at
the split's start: the simulator at the plan's start, the live cache manager on the
controller's DrainNotice (which precedes the switch). Its mirror, :func:`rehome_on_merge`: when
a merge's worker is exposed, the long prefixes the other workers of its degree hold are copied
to it, so that the long requests it was made for find their documents there (the simulator at
the switch, the live cache manager on the epoch record that shows the merge).

The children (or merged worker) are registered with ``last_event_id = 0``: their event streams
start afresh at 1 under their new ids; the parent (children) are removed, cancelling their
in-flight operations (returned in the plan so the adapter can abort them).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, NamedTuple

from services.cachemgr.actions import CacheAction, Demote, Replicate
from services.cachemgr.trie import PrefixTrie, TrieNode, WorkerView
from shared.ids import BlockHash, Degree, InvalidInput, WorkerId
from shared.worker import GpuGroup


@dataclass(frozen=True, slots=True)
class SplitPlan:
    parent: WorkerId
    children: tuple[WorkerId, WorkerId]
    assignment: Mapping[BlockHash, WorkerId]  # retained prefix (its last node) -> child
    unassigned: tuple[BlockHash, ...]  # retained prefixes no child had room for
    valid: Mapping[WorkerId, frozenset[BlockHash]]  # whole prefixes each child starts with
    pending: Mapping[WorkerId, frozenset[BlockHash]]
    donors: Mapping[WorkerId, frozenset[BlockHash]]  # resident, outside the index: sources only
    cancelled: tuple[CacheAction, ...]


@dataclass(frozen=True, slots=True)
class MergePlan:
    children: tuple[WorkerId, WorkerId]
    parent: WorkerId
    valid: frozenset[BlockHash]  # whole prefixes on their correct ranks
    pending: frozenset[BlockHash]
    cancelled: tuple[CacheAction, ...]


def _check_id(name: str, w: object) -> WorkerId:
    if not isinstance(w, str) or not w:
        raise InvalidInput(f"{name} must be a non-empty worker id, got {w!r}")
    return WorkerId(w)


def _check_cap(name: str, c: object) -> int:
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise InvalidInput(f"{name} must be an integer >= 1, got {c!r}")
    return c


def guess_capacity(degree: int, known: Iterable[tuple[int, int]], default: int) -> int:
    """The cache capacity (blocks) to plan with for a degree-``degree`` worker whose own
    WorkerState has not arrived yet -- a worker a split or merge has just made. Pure.

    ``known``: (degree, kv_total_blocks) of workers whose states did arrive. Why guess at all:
    the reconciliation's depth cut and the split's assignment depend on the new worker's
    capacity, and the rank host seeding that worker cuts with its real one
    (:func:`reconciled_index`), so a fixed default makes the trie and the worker disagree
    whenever the retained prefixes exceed either figure; the worker's snapshot settles it
    later, but requests routed before then see the wrong holders.

    A rank daemon's capacity is its backend's (C times one GPU's for the sim and torch
    backends) unless ``VTM_KV_TOTAL_BLOCKS`` sets one figure for every worker. So: when every
    known worker holds the same per GPU, that times ``degree``; else when every known worker
    holds the same, that; else the (upper) median per GPU times ``degree``; ``default`` with nothing
    known. Never below 1.
    """
    d = _check_cap("degree", degree)
    pairs = [(_check_cap("known degree", kd), _check_cap("known capacity", kc))
             for kd, kc in known]
    if not pairs:
        return _check_cap("default", default)
    d0, c0 = pairs[0]
    if all(c * d0 == c0 * kd for kd, c in pairs):  # one capacity per GPU, compared exactly
        return max(1, c0 * d // d0)
    if all(c == c0 for _, c in pairs):
        return c0
    per_gpu = sorted(c / kd for kd, c in pairs)
    return max(1, int(per_gpu[len(per_gpu) // 2] * d))


def _on_left(depth: int, child_degree: int) -> bool:
    """Page ``depth`` of a degree-2C prefix is on the left child's GPUs."""
    return depth % (2 * child_degree) < child_degree


def _by_depth(trie: PrefixTrie, hs: set[BlockHash]) -> list[TrieNode]:
    return sorted((trie._nodes[h] for h in hs), key=lambda n: (n.depth, n.hash))


class ResidentPage(NamedTuple):
    """One page a predecessor worker physically holds, as reconciliation sees it.

    ``parent``: the block before it on its prefix (None for a root block); ``depth``: its block
    index along the prefix (0 = root), which places it on a rank (layout rule); ``indexed``:
    in the worker's own cache index (valid), else a *donor* (resident outside the index, known
    to the cache manager's trie only).
    """

    parent: BlockHash | None
    depth: int
    indexed: bool = True


NewWorker = Literal["left", "right", "merged"]
"""Which worker :func:`reconciled_index` computes: a split's left / right child, or a merge's
merged worker."""


def index_pages(index: Mapping[BlockHash, BlockHash | None]) -> dict[BlockHash, ResidentPage]:
    """The pages of one worker's own cache index (hash -> parent; e.g. a rank daemon's
    BlockCache), all ``indexed``, with depths from the parent links.

    Contract: ``index`` holds whole prefixes (every parent is None or in ``index``), what a
    BlockCache holds; raises InvalidInput otherwise (a parent outside it, a cycle).
    """
    depth: dict[BlockHash, int] = {}
    for h in index:
        path: list[BlockHash] = []
        x: BlockHash | None = h
        while x is not None and x not in depth:
            if x not in index:
                raise InvalidInput(f"block {path[-1]}'s parent {x} is not in the index")
            path.append(x)
            if len(path) > len(index):
                raise InvalidInput("the index's parent links form a cycle")
            x = index[x]
        d = -1 if x is None else depth[x]
        for y in reversed(path):
            d += 1
            depth[y] = d
    return {h: ResidentPage(p, depth[h]) for h, p in index.items()}


def reconciled_index(
    predecessors: Sequence[Mapping[BlockHash, ResidentPage]],
    *,
    child_degree: int,
    new: NewWorker,
    capacity_blocks: int,
) -> tuple[tuple[BlockHash, BlockHash | None], ...]:
    """The blocks a worker made by a split or merge starts with *valid*: its cache index, as
    ``(hash, parent)`` pairs, shallowest first (ready for ``BlockCache.adopt``).

    Shared by :func:`reconcile_split` / :func:`reconcile_merge` (the trie's valid blocks of the
    new worker) and by the rank host that seeds the new worker's BlockCache, so that for equal
    inputs the two agree by construction. Pure.

    ``predecessors``: the resident pages of the worker(s) it replaces -- ``(parent,)`` for a
    split (degree ``2 * child_degree``; ``new`` is ``"left"`` or ``"right"``), ``(left,
    right)`` for a merge (each of degree ``child_degree``; ``new`` is ``"merged"``).
    ``capacity_blocks``: the new worker's cache capacity; the result never exceeds it.

    Split: the child's pages are those on its GPUs by the layout rule ((depth mod 2C) < C on
    the left); valid are their whole prefixes (every ancestor among them), the shallowest
    ``capacity_blocks`` of them when more (a depth cut keeps whole prefixes). Merge: a page is
    on its new rank iff it came from the left child and (depth mod 2C) < C, or from the right
    and >= C; valid are the whole prefixes of those; when more than fit, only the children's
    *indexed* pages count (their own cached pages win over donors), then the shallowest.
    Ties of the depth cut go by hash.

    Agreement: the trie passes each predecessor's valid *and donor* pages; a rank daemon knows
    only its indexed pages. They give the same result when the predecessors hold no donors
    (workers not made by a split, or split children whose donors are gone). A split leaves
    the non-assigned child's pages of a retained prefix as donors, so merging split children
    back can make the trie's index of the merged worker larger than the rank daemon's seed.
    """
    cap = _check_cap("capacity_blocks", capacity_blocks)
    c = _check_cap("child_degree", child_degree)
    if new in ("left", "right"):
        if len(predecessors) != 1:
            raise InvalidInput("a split child has one predecessor (its parent)")
        (pages,) = predecessors
        want_left = new == "left"
        on_rank = {h: pg for h, pg in pages.items() if _on_left(pg.depth, c) == want_left}
        valid = _whole(on_rank)
    elif new == "merged":
        if len(predecessors) != 2:
            raise InvalidInput("a merged worker has two predecessors (left, right)")
        on_rank = {}
        for pages, is_left in zip(predecessors, (True, False), strict=True):
            for h, pg in pages.items():
                if _on_left(pg.depth, c) == is_left:
                    on_rank[h] = pg
        valid = _whole(on_rank)
        if len(valid) > cap:
            # Donor pages are leftovers of an earlier split kept outside the children's LRU
            # caches; when the merged worker cannot index them all, the children's own
            # cached pages win.
            valid = _whole({h: pg for h, pg in on_rank.items() if pg.indexed})
    else:
        raise InvalidInput(f"new must be 'left', 'right' or 'merged', got {new!r}")
    order = sorted(valid, key=lambda h: (valid[h].depth, h))
    return tuple((h, valid[h].parent) for h in order[:cap])


def _whole(pages: Mapping[BlockHash, ResidentPage]) -> dict[BlockHash, ResidentPage]:
    """The pages whose whole root path is among ``pages``."""
    out: dict[BlockHash, ResidentPage] = {}
    for h in sorted(pages, key=lambda h: pages[h].depth):
        pg = pages[h]
        if pg.parent is None or pg.parent in out:
            out[h] = pg
    return out


def _resident_pending(view: WorkerView) -> set[BlockHash]:
    """``view``'s pending pages that sit on the worker itself (hint: the worker): a split
    child's pages of its assigned prefixes waiting for their ancestors, a merged worker's
    pages on another of its ranks. Resident like donors and outside the worker's index, but
    not placed by the layout rule: a merged worker's may sit on the wrong rank, at the place
    the child's layout gave it, which the trie does not record."""
    w = view.worker
    return {h for h, hint in view.pending.items() if hint == w}


def _trie_pages(trie: PrefixTrie, view: WorkerView) -> dict[BlockHash, ResidentPage]:
    """What the trie knows ``view``'s worker physically holds where the layout rule puts it:
    its valid and donor blocks (its resident pending pages are left out, see
    :func:`_resident_pending`)."""
    nodes = trie._nodes
    out: dict[BlockHash, ResidentPage] = {}
    for hs, indexed in ((view.valid, True), (view.donors, False)):
        for h in hs:
            n = nodes[h]
            out[h] = ResidentPage(None if n.parent is None else n.parent.hash, n.depth, indexed)
    return out


def _with_halves(
    side: Mapping[WorkerId, GpuGroup],
) -> list[tuple[WorkerId, WorkerId, WorkerId]]:
    """(worker, left half's id, right half's id) for the workers of ``side`` of degree >= 2,
    by first GPU."""
    out = []
    for w, g in sorted(side.items(), key=lambda x: x[1].first_gpu):
        if g.degree >= 2:
            half = g.degree // 2
            out.append((w, GpuGroup(g.first_gpu, half).worker_id,
                        GpuGroup(g.first_gpu + half, half).worker_id))
    return out


def diff_compositions(
    old: Mapping[WorkerId, GpuGroup], new: Mapping[WorkerId, GpuGroup]
) -> tuple[
    list[tuple[WorkerId, tuple[WorkerId, WorkerId]]],
    list[tuple[tuple[WorkerId, WorkerId], WorkerId]],
    list[WorkerId],
    list[WorkerId],
]:
    """(splits, merges, removed, added) between two compositions: a removed degree-2C group
    whose halves appeared is a split; two removed halves whose parent appeared a merge. Pure:
    the cache manager reconciles its trie by it and a rank host seeds new workers by it."""
    gone = {w: g for w, g in old.items() if w not in new}
    came = {w: g for w, g in new.items() if w not in old}
    splits = [(w, (lo, hi)) for w, lo, hi in _with_halves(gone) if lo in came and hi in came]
    merges = [((lo, hi), w) for w, lo, hi in _with_halves(came) if lo in gone and hi in gone]
    used = {p for p, _ in splits} | {c for cs, _ in merges for c in cs}
    made = {c for _, cs in splits for c in cs} | {p for _, p in merges}
    removed = [w for w in gone if w not in used]
    added = [w for w in came if w not in made]
    return splits, merges, removed, added


def reconcile_split(
    trie: PrefixTrie,
    parent: WorkerId,
    children: tuple[WorkerId, WorkerId],
    capacity_blocks: Mapping[WorkerId, int],
    demand: Mapping[BlockHash, float] | None = None,
) -> SplitPlan:
    """Replace ``parent`` (degree 2C) by ``children = (left, right)`` (degree C); see module doc.

    ``demand``: retained prefix (last node) -> recent demand; default: the node's access summed
    over degrees (what the trie measured: §6.2 assigns "according to prefix demand", and the
    access statistics are that demand as decayed counts of requests).
    """
    pv = trie._view(parent)
    if not isinstance(children, tuple | list) or len(children) != 2:
        raise InvalidInput(f"children must be (left, right), got {children!r}")
    left, right = (_check_id("child", c) for c in children)
    if left == right or parent in (left, right):
        raise InvalidInput(f"children must be two new distinct ids, got {children!r}")
    for c in (left, right):
        if c in trie._workers:
            raise InvalidInput(f"child {c} is already registered")
    if pv.degree % 2 or pv.degree // 2 not in trie._deg_idx:
        raise InvalidInput(
            f"cannot split degree {pv.degree}: half of it is not one of {trie.degrees}")
    if not isinstance(capacity_blocks, Mapping):
        raise InvalidInput("capacity_blocks must map each child to its capacity in blocks")
    caps = {c: _check_cap(f"capacity_blocks[{c}]", capacity_blocks.get(c)) for c in (left, right)}
    if demand is not None:
        if not isinstance(demand, Mapping):
            raise InvalidInput("demand must map prefix hashes to numbers")
        for h, x in demand.items():
            if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) \
                    or x < 0:
                raise InvalidInput(f"demand[{h!r}] must be a finite number >= 0, got {x!r}")
    c = pv.degree // 2
    nodes = trie._nodes

    # --- plan (no mutation) ------------------------------------------------------------
    physical: dict[WorkerId, set[BlockHash]] = {left: set(), right: set()}
    # NOTE: the parent's resident pending pages are given up: on a merged worker they may sit
    # on either half, whatever their depth (_resident_pending).
    for h in pv.valid | pv.donors:
        physical[left if _on_left(nodes[h].depth, c) else right].add(h)
    # The valid index of each child: the shared rule (reconciled_index), which the rank host
    # also applies to seed the child's BlockCache. The layout rule puts pages by depth, so one
    # child can hold more whole-prefix pages than its cache index has room for (a parent full
    # of one- and two-block prompts: all on the left): the shallowest are indexed; the rest
    # stay resident, pending when a retained prefix is assigned here, else donors.
    ppages = (_trie_pages(trie, pv),)
    whole = {
        x: {h for h, _ in reconciled_index(ppages, child_degree=c, new=side,
                                             capacity_blocks=caps[x])}
        for x, side in ((left, "left"), (right, "right"))
    }
    held = [nodes[h] for h in pv.valid if parent in nodes[h].holders]
    leaves = [n for n in held if not any(parent in ch.holders for ch in n.children.values())]

    def weight(n: TrieNode) -> float:
        if demand is not None:
            return float(demand.get(n.hash, 0.0))
        # NOTE: access only. ``missed`` is seconds of predicted benefit (§7.1), not a count;
        # adding it to the counts mixed units (a prefix missed at its preferred degree outranked
        # one reused more often).
        return float(sum(n.access))

    leaves.sort(key=lambda n: (-weight(n), -n.depth, n.hash))
    pending: dict[WorkerId, set[BlockHash]] = {left: set(), right: set()}
    # Resident pages need no room; only pages copied from the sibling do.
    room = {x: caps[x] - len(physical[x]) for x in (left, right)}
    assigned_demand = {left: 0.0, right: 0.0}
    assignment: dict[BlockHash, WorkerId] = {}
    unassigned: list[BlockHash] = []
    for leaf in leaves:
        path = leaf.path()
        best = None
        for rank, x in enumerate((left, right)):
            need = [n.hash for n in path if n.hash not in whole[x] and n.hash not in pending[x]]
            copies = sum(1 for h in need if h not in physical[x])
            if copies <= room[x]:
                key = (assigned_demand[x], len(need), rank)
                if best is None or key < best[0]:
                    best = (key, x, need, copies)
        if best is None:
            unassigned.append(leaf.hash)
            continue
        _, x, need, copies = best
        pending[x].update(need)
        room[x] -= copies
        assigned_demand[x] += weight(leaf)
        assignment[leaf.hash] = x

    # --- commit --------------------------------------------------------------------------
    cancelled = trie.remove_worker(parent)
    sibling = {left: right, right: left}
    for x in (left, right):
        trie.add_worker(x, c, caps[x])
        xv = trie._workers[x]
        for n in _by_depth(trie, whole[x]):
            trie._add_valid(xv, n)
        for n in _by_depth(trie, pending[x]):
            # resident here (only needs indexing once its ancestors arrive) or on the sibling
            trie._add_pending(xv, n, x if n.hash in physical[x] else sibling[x])
        for n in _by_depth(trie, physical[x] - whole[x] - pending[x]):
            trie._add_donor(xv, n)
    return SplitPlan(
        parent, (left, right), MappingProxyType(assignment), tuple(unassigned),
        MappingProxyType({x: frozenset(s) for x, s in whole.items()}),
        MappingProxyType({x: frozenset(s) for x, s in pending.items()}),
        MappingProxyType({x: frozenset(physical[x] - whole[x] - pending[x]) for x in whole}),
        cancelled)


def reconcile_merge(
    trie: PrefixTrie,
    children: tuple[WorkerId, WorkerId],
    parent: WorkerId,
    capacity_blocks: int,
) -> MergePlan:
    """Replace ``children = (left, right)`` (degree C) by ``parent`` (degree 2C); see module doc."""
    if not isinstance(children, tuple | list) or len(children) != 2:
        raise InvalidInput(f"children must be (left, right), got {children!r}")
    left, right = children
    lv, rv = trie._view(left), trie._view(right)
    parent = _check_id("parent", parent)
    if left == right:
        raise InvalidInput("cannot merge a worker with itself")
    if parent in trie._workers:
        raise InvalidInput(f"merged worker {parent} is already registered")
    if lv.degree != rv.degree or 2 * lv.degree not in trie._deg_idx:
        raise InvalidInput(
            f"cannot merge degrees {lv.degree} and {rv.degree} into one of {trie.degrees}")
    cap = _check_cap("capacity_blocks", capacity_blocks)
    c = lv.degree

    pages = (_trie_pages(trie, lv), _trie_pages(trie, rv))
    resident = set(pages[0]) | set(pages[1])
    on_rank = {h: pg for side, is_left in zip(pages, (True, False), strict=True)
               for h, pg in side.items() if _on_left(pg.depth, c) == is_left}
    # The merged worker's valid index: the shared rule (reconciled_index), which the rank host
    # also applies to seed its BlockCache.
    valid = {h for h, _ in reconciled_index(pages, child_degree=c, new="merged",
                                            capacity_blocks=cap)}
    if len(_whole(on_rank)) > cap:
        # Donor pages are leftovers of an earlier split kept outside the children's LRU caches;
        # when the merged worker cannot index them all, the children's own cached pages win
        # (reconciled_index) and the donors are given up, and so are the children's resident
        # pending pages: only the children's own pages stay resident (pending below when not
        # valid).
        resident = lv.valid | rv.valid
    else:
        # The children's resident pending pages are on the merged worker's GPUs, on some
        # rank of it (_resident_pending): pending there, to index or to move between its own
        # ranks, never valid at once.
        resident |= _resident_pending(lv) | _resident_pending(rv)
    # Every other resident page is pending on the merged worker itself: it either sits on the
    # wrong rank or waits for an ancestor that does.
    pend: dict[BlockHash, WorkerId | None] = {h: parent for h in resident - valid}
    for view in (lv, rv):
        for h, hint in view.pending.items():
            if h not in valid and h not in pend:
                # A hint at either child would have made the page resident above; the copy is
                # gone, so any valid copy in the pool will do.
                pend[h] = None if hint in (left, right) else hint

    cancelled = trie.remove_worker(left) + trie.remove_worker(right)
    trie.add_worker(parent, 2 * c, cap)
    pvw = trie._workers[parent]
    for n in _by_depth(trie, valid):
        trie._add_valid(pvw, n)
    for n in _by_depth(trie, set(pend)):
        trie._add_pending(pvw, n, pend[n.hash])
    return MergePlan((left, right), parent, frozenset(valid), frozenset(pend), cancelled)


def on_reuse(trie: PrefixTrie, worker: WorkerId,
             block_hashes: Sequence[BlockHash]) -> tuple[Replicate, ...]:
    """Issue the lazy reconcile copies for a request just routed to ``worker`` (§6.2).

    Walks the request's chain while the worker has each block valid or pending; for the pending
    ones not already in flight, picks a source (hint, else any valid copy) and returns one
    ``Replicate(kind="reconcile")`` per source, recorded as in flight. Stops at the first pending
    page with no valid copy anywhere, which is dropped from pending (ordinary miss).
    """
    view = trie._view(worker)
    if not isinstance(block_hashes, Sequence) or isinstance(block_hashes, str | bytes):
        raise InvalidInput(f"block_hashes must be a sequence of ints, got {block_hashes!r}")
    if not view.pending:
        return ()
    groups: dict[WorkerId, list[BlockHash]] = {}
    for h, state, src in _reconcile_walk(trie, view, block_hashes):
        if state != "copy":
            continue  # valid there, or a copy is on its way
        if src is None:
            trie._drop_block(view, h)  # no valid copy left: an ordinary miss
            break
        groups.setdefault(src, []).append(h)
    out = []
    for src, hs in groups.items():
        a = Replicate(hs[-1], Degree(view.degree), src, worker, tuple(hs), "reconcile")
        trie._begin(a)
        out.append(a)
    return tuple(out)


def _reconcile_walk(
    trie: PrefixTrie, view: WorkerView, block_hashes: Sequence[BlockHash],
    gone: Container[WorkerId] = (),
) -> Iterator[tuple[BlockHash, Literal["valid", "coming", "copy"], WorkerId | None]]:
    """The walk :func:`on_reuse` and :func:`pending_reach` share: along the request's chain
    (from its first block, while each block hangs under the one before) while the worker has
    each block valid or pending, yield ``(hash, state, source)``: ``"valid"``; ``"coming"``
    (pending, a copy to the worker already in flight); ``"copy"`` (pending, to be copied from
    ``source``; None: no copy left anywhere, and the walk ends after it; workers in
    ``gone`` are no source). Raises :class:`InvalidInput` for a hash that is not hashable
    as an int."""
    nodes = trie._nodes
    valid, pending = view.valid, view.pending
    inflight: set[BlockHash] | None = None  # made at the first pending block (speed)
    prev: TrieNode | None = None
    for h in block_hashes:
        try:
            n = nodes.get(h)
        except TypeError as exc:
            raise InvalidInput(f"block hashes must be ints: {exc}") from exc
        if n is None or n.parent is not prev:
            return
        prev = n
        if h in valid:
            yield h, "valid", None
            continue
        if h not in pending:
            return
        if inflight is None:
            inflight = set()
            for a in trie._replicating.get(view.worker, {}).values():
                inflight.update(a.blocks)
        if h in inflight:
            yield h, "coming", None
            continue
        src = _source(trie, view, n, gone)
        yield h, "copy", src
        if src is None:
            return


def pending_reach(trie: PrefixTrie, block_hashes: Sequence[BlockHash],
                  held: Mapping[WorkerId, int], *,
                  gone: Container[WorkerId] = ()) -> dict[WorkerId, int]:
    """How many leading blocks of a request each worker with pending blocks will hold once the
    reconcile copies :func:`on_reuse` would issue for it there have landed, for the workers
    where that is more than ``held`` (each worker's valid prefix of the request, as
    :meth:`PrefixTrie.match` counts it; absent: 0). For J's credit of a pending prefix
    (services/scheduler/placement.py "A pending prefix"): §6.2 leaves a split's or merge's
    prefixes pending until their first reuse, and J, counting only valid blocks, sent the
    requests that would reuse them elsewhere, to recompute them (docs/evaluation.md "J counts
    a pending prefix").

    The walk is :func:`on_reuse`'s without its side effects: along the request's chain while
    the worker has each block valid, or pending and either on its way there or with a copy
    source; a pending block with no source ends it (on_reuse would drop it). ``gone``:
    workers that are no copy source although the trie still has them (a scheduler's
    replica keeps a worker whose lease has lapsed, which the cache manager has removed, or
    will). Pure; raises :class:`InvalidInput` for hashes that are not a sequence of ints."""
    if not isinstance(block_hashes, Sequence) or isinstance(block_hashes, str | bytes):
        raise InvalidInput(f"block_hashes must be a sequence of ints, got {block_hashes!r}")
    out: dict[WorkerId, int] = {}
    for w, view in trie._workers.items():
        if not view.pending:
            continue
        k = 0
        for _, state, src in _reconcile_walk(trie, view, block_hashes, gone):
            if state == "copy" and src is None:
                break
            k += 1
        if k > held.get(w, 0):
            out[w] = k
    return out


ReconciledEntry = tuple[BlockHash, BlockHash | None, Literal["pending", "donor", "path"],
                        WorkerId | None]
"""(hash, parent or None, role, source or None): one entry of a worker's reconcile as the cache
manager publishes it (shared/schemas.py ``ReconciledNotice``)."""


def reconciled_blocks(trie: PrefixTrie, worker: WorkerId) -> list[ReconciledEntry]:
    """What a replica of the trie needs to know of ``worker``'s reconcile (§6.2) that the
    worker's own events and snapshots will not tell it: its pending blocks with their copy
    sources and its donor pages, with every block on the chains above them (``path``: the
    worker's valid blocks and any other links, so a replica that never saw them can hang the
    pages in place). Parents come before children (by depth, then hash: the same list for
    the same trie). The live cache manager publishes it after each split or merge
    (services/cachemgr/service.py ``on_record``); :func:`mark_reconciled` applies it to a
    replica. Pure; raises :class:`UnknownWorker` for an unregistered worker."""
    view = trie._view(worker)
    nodes = trie._nodes
    roles: dict[BlockHash, tuple[Literal["pending", "donor", "path"], WorkerId | None]] = {
        h: ("pending", src) for h, src in view.pending.items()}
    for h in view.donors:
        roles[h] = ("donor", None)
    chain: set[TrieNode] = set()
    for h in roles:
        n: TrieNode | None = nodes[h]
        while n is not None and n not in chain:
            chain.add(n)
            n = n.parent
    out: list[ReconciledEntry] = []
    for n in sorted(chain, key=lambda x: (x.depth, x.hash)):
        role, src = roles.get(n.hash, ("path", None))
        out.append((n.hash, None if n.parent is None else n.parent.hash, role, src))
    return out


def reconciled_parts(entries: Sequence[ReconciledEntry],
                     max_entries: int) -> list[list[ReconciledEntry]]:
    """Cut :func:`reconciled_blocks`' list into parts that each stand alone: a part starts
    with the chain above its own entries that earlier parts listed, repeated as ``path``
    entries, so a replica can apply each part on its own, whatever happened in between
    (the scheduler's housekeeping collects childless unreferenced nodes, so the ``path``
    links one part created may be gone when the next arrives). A part has at most
    ``max_entries`` entries, unless the chain above its first own entry is longer than that
    alone; parents come first; the parts' own entries are ``entries`` in order, each once.
    Pure; raises :class:`InvalidInput` for ``max_entries`` < 1 or an entry whose parent is
    not listed before it."""
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise InvalidInput(f"max_entries must be an integer >= 1, got {max_entries!r}")
    parent_of: dict[BlockHash, BlockHash | None] = {}
    pos: dict[BlockHash, int] = {}
    for k, (h, p, _, _) in enumerate(entries):
        if p is not None and p not in parent_of:
            raise InvalidInput(f"entry {h}: its parent {p} is not listed before it")
        parent_of[h] = p
        pos[h] = k
    parts: list[list[ReconciledEntry]] = []
    i = 0
    while i < len(entries):
        own: list[ReconciledEntry] = []
        have: set[BlockHash] = set()
        above: set[BlockHash] = set()  # the chain repeated from earlier parts
        while i < len(entries):
            h, p, _, _ = entries[i]
            missing: list[BlockHash] = []
            q = p
            while q is not None and q not in have and q not in above:
                missing.append(q)
                q = parent_of[q]
            if own and len(own) + len(above) + len(missing) + 1 > max_entries:
                break
            above.update(missing)
            own.append(entries[i])
            have.add(h)
            i += 1
        # The repeated links in the list's own order: a parent before its children.
        links = sorted(above, key=pos.__getitem__)
        parts.append([(x, parent_of[x], "path", None) for x in links] + own)
    return parts


@dataclass(frozen=True, slots=True)
class Marked:
    """What :func:`mark_reconciled` did: pending and donor blocks marked, nodes created (path
    links included), and entries skipped (their chain contradicts the trie, or their parent
    is neither in the trie nor listed before them; everything below a skipped entry is
    skipped too)."""

    pending: int
    donors: int
    created: int
    skipped: int


def mark_reconciled(trie: PrefixTrie, worker: WorkerId,
                    blocks: Iterable[ReconciledEntry]) -> Marked:
    """Apply the cache manager's reconcile of ``worker`` (:func:`reconciled_blocks`, published
    as a ``ReconciledNotice``) to a replica of the trie: create the blocks it does not know
    (parents first), mark the pending ones pending with their source hint and the donor
    pages as donors. A block the worker already has valid stays valid (its event came
    first); one it has pending takes the new source. The replica then forgets them as the
    manager's trie does: a block becomes valid with the worker's ``Stored`` event, a
    ``Cleared`` event or the worker's removal drops them.

    What the replica cannot learn this way: a pending block the manager later drops (its
    last source gone, :func:`on_reuse`), and copies in flight. J may then count a pending
    block no copy will bring; the request then waits at most the rank daemon's bounded pull
    hold and recomputes the rest (services/scheduler/placement.py "A pending prefix").

    Entries whose chain contradicts the trie (a hash under another parent: another
    deployment's blocks, a corrupt notice) or whose parent is unknown are skipped with
    everything below them; the rest is applied. Raises :class:`UnknownWorker` for an
    unregistered worker and :class:`InvalidInput` for an entry that is not one; either way
    before anything changes (every entry is checked first)."""
    view = trie._view(worker)
    nodes = trie._nodes
    entries = list(blocks)
    for e in entries:
        if not isinstance(e, tuple | list) or len(e) != 4:
            raise InvalidInput(f"a reconciled entry is (hash, parent, role, source), got {e!r}")
        h, p, role, src = e
        if isinstance(h, bool) or not isinstance(h, int) \
                or (p is not None and (isinstance(p, bool) or not isinstance(p, int))):
            raise InvalidInput(f"block and parent hashes must be ints, got {h!r} and {p!r}")
        if role not in ("pending", "donor", "path"):
            raise InvalidInput(f"role must be pending, donor or path, got {role!r}")
        if src is not None and not isinstance(src, str):
            raise InvalidInput(f"source must be a worker id or None, got {src!r}")
    skipped: set[BlockHash] = set()
    pending = donors = created = 0
    for h, p, role, src in entries:
        if p is not None and p in skipped:
            skipped.add(h)
            continue
        parent = None if p is None else nodes.get(p)
        n = nodes.get(h)
        if n is None:
            if p is not None and parent is None:
                skipped.add(h)  # its parent is neither in the trie nor listed before it
                continue
            n = trie._create(h, parent)
            trie._unref.add(n)  # refs == 0 until marked below (the collector's invariant)
            created += 1
        elif n.parent is not parent or (p is not None and parent is None):
            skipped.add(h)  # the trie has it under another parent
            continue
        if role == "pending" and h not in view.valid:
            trie._add_pending(view, n, None if src is None else WorkerId(src))
            pending += 1
        elif role == "donor" and h not in view.valid and h not in view.pending:
            trie._add_donor(view, n)
            donors += 1
    return Marked(pending, donors, created, len(skipped))


def _source(trie: PrefixTrie, view: WorkerView, n: TrieNode,
            gone: Container[WorkerId] = ()) -> WorkerId | None:
    """Where ``view``'s pending page ``n`` is copied from: the worker itself when resident
    there; the hinted worker while it holds the page; else the first (by id) worker holding
    it. Held = valid, donor, or pending there and resident (a sibling's page of a prefix
    assigned to it, waiting for its ancestors: the copy is on its GPUs all the same). None:
    no copy left outside ``gone``."""
    hint = view.pending[n.hash]
    if hint == view.worker:
        return hint  # resident here: to index, or to move between its own ranks
    h = n.hash

    def holds(w: WorkerId, v: WorkerView) -> bool:
        return not v.stale and (h in v.valid or h in v.donors or v.pending.get(h, 0) == w)

    if hint is not None and hint not in gone:
        hv = trie._workers.get(hint)
        if hv is not None and holds(hint, hv):
            return hint
    best: WorkerId | None = None
    for w, v in trie._workers.items():
        if w != view.worker and (best is None or w < best) and w not in gone and holds(w, v):
            best = w
    return best


@dataclass(frozen=True, slots=True)
class RehomeConfig:
    """Re-homing a split's long prefixes (:func:`rehome_on_split`; our addition to §6.2).

    ``min_blocks``: retained prefixes of at least this many blocks are re-homed (long documents;
    shorter ones are cheap to recompute and belong on the smaller degree anyway). ``fill``: a
    peer takes a copy only while its used blocks (in-flight copies included) stay within
    ``fill`` × its capacity, so the copies do not push out what the peer itself serves.
    ``displace`` (a split's copies only): beyond that bound a peer still takes a copy when as
    many of its own blocks as the copy takes over the bound are *colder* than the copied
    prefix (the scan's access statistics); those blocks are demoted at the peer, so that its
    LRU evicts them, and not what it serves, to make room (:func:`rehome_on_split`).
    """

    min_blocks: int
    fill: float
    displace: bool = False

    def __post_init__(self) -> None:
        m = self.min_blocks
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidInput(f"RehomeConfig.min_blocks must be an integer >= 1, got {m!r}")
        f = self.fill
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 < f <= 1.0:
            raise InvalidInput(f"RehomeConfig.fill must be in (0, 1], got {f!r}")
        if not isinstance(self.displace, bool):
            raise InvalidInput(f"RehomeConfig.displace must be a bool, got {self.displace!r}")


def _rehome_views(trie: PrefixTrie, config: object, role: str, worker: WorkerId,
                  peers: Sequence[WorkerId]) -> tuple[WorkerView, list[WorkerView]]:
    """Checked inputs of a re-homing: the worker's view and its peers' (itself left out).
    Raises InvalidInput (a bad config, a peer of another degree) or UnknownWorker."""
    if not isinstance(config, RehomeConfig):
        raise InvalidInput(f"expected a RehomeConfig, got {config!r}")
    wview = trie._view(_check_id(role, worker))
    views = []
    for p in peers:
        v = trie._view(_check_id("peer", p))
        if v.degree != wview.degree:
            raise InvalidInput(
                f"peer {p!r} has degree {v.degree}, the {role} {worker!r} {wview.degree}")
        if p != worker:
            views.append(v)
    return wview, views


def rehome_on_split(
    trie: PrefixTrie, parent: WorkerId, peers: Sequence[WorkerId], config: RehomeConfig
) -> tuple[Replicate | Demote, ...]:
    """Copies of ``parent``'s long retained prefixes to ``peers``, issued when a split starts.

    Why: the split's children are workers of half the degree, and on the reconfiguration preset
    a short-request burst is what calls for the split: the children's caches fill and evict,
    and by the next long phase they hold none of the parent's documents (seed 3: 884 document
    blocks at the split, 0 five minutes later), while the remaining workers of the parent's
    degree never fill their larger caches. Copying the documents to them before the parent
    goes keeps them where the long requests will be served.

    Contract: ``peers`` are workers of ``parent``'s degree that stay (not sources of the same
    plan); unknown ids raise :class:`~shared.ids.UnknownWorker`, a peer of another degree
    :class:`InvalidInput`. Retained prefixes of ``parent`` (held nodes with no held child there)
    of at least ``config.min_blocks`` blocks are taken hottest first (access summed over
    degrees along the root->node path, from the scan's statistics; ties: longer first, then
    hash); each goes to the peer with the most free room (capacity − used, in-flight copies
    included; ties by id), as the blocks that peer misses on its path, if they fit under
    ``config.fill`` × that peer's capacity; it is skipped when that peer already holds it
    whole, and when they do not fit -- unless ``config.displace`` and the peer has enough
    colder blocks (below). The copies (``kind="intra"``: another replica at the same degree)
    are recorded as in flight, so the next choice sees the room they take; the caller
    carries them out and reports ``replication_done`` / ``replication_failed`` as for the
    scan's actions.

    Displacement (``config.displace``). Why: a split after a long phase finds the peers'
    caches full of that phase's documents (the reconfiguration preset's S3→S4 split: every
    CP4 worker at 100%), so under the bound nothing is copied, the parent's documents go to
    the children, whose short-request burst evicts them, and the next long phase recomputes
    them on the few large workers left, where its other requests queue behind them. A copy
    that takes the peer k blocks over the bound (this call's earlier copies to it included)
    is taken when the peer's k coldest blocks are all colder than the copied prefix (heat:
    the access of its last block, summed over degrees -- the demand for the prefix as a
    whole; a block is never colder than a block below it, so the coldest blocks are evicted
    leaves first).
    Those blocks are returned as one :class:`Demote` per peer, after the copies: the caller
    issues it *before* the copies (they make the peer's LRU evict the demoted blocks first;
    nothing is removed, and a block a request reuses meanwhile becomes recent again). A
    prefix no request has reused (access 0) displaces nothing.

    Inputs are the cache manager's own (held prefixes, capacities, access statistics). Callers:
    the simulator when a split starts, and the live cache manager on the controller's
    DrainNotice of a split (services/cachemgr/service.py ``on_drain``), while the draining
    parent still holds its pages.
    """
    pview, views = _rehome_views(trie, config, "parent", parent, peers)
    if not views:
        return ()
    held = trie.held_nodes(parent)
    nodes = trie._nodes
    leaves = []
    for h in held:
        n = nodes[h]
        if n.depth + 1 < config.min_blocks or any(c in held for c in n.children):
            continue
        path = n.path()
        heat = sum(sum(x.access) for x in path)
        leaves.append((-heat, -(n.depth + 1), h, path))
    leaves.sort()
    out: list[Replicate | Demote] = []
    colder: dict[WorkerId, list[tuple[float, int, BlockHash]]] = {}
    promised: dict[WorkerId, int] = {}
    for _, _, h, path in leaves:
        room = sorted(
            ((v.capacity_blocks - trie.used_blocks(v.worker), v.worker, v) for v in views),
            key=lambda r: (-r[0], r[1]),
        )
        free, _, v = room[0]
        missing = tuple(x.hash for x in path if x.hash not in v.valid)
        if not missing:
            continue  # the roomiest peer already holds it whole
        over = trie.used_blocks(v.worker) + len(missing) - config.fill * v.capacity_blocks
        if over > 0:
            if not config.displace:
                continue
            cold = colder.get(v.worker)
            if cold is None:
                cold = colder[v.worker] = _coldest_first(trie, v.worker)
            # ``over`` counts this call's earlier copies to the peer too (in flight, they are
            # in its used blocks): the peer's ``need`` coldest blocks in all must go, the
            # hottest of them colder than this copy.
            need = math.ceil(over)
            if need > promised.get(v.worker, 0):
                if need > len(cold) or not cold[need - 1][0] < sum(nodes[h].access):
                    continue
                promised[v.worker] = need
        a = Replicate(h, Degree(v.degree), parent, v.worker, missing, "intra")
        trie._begin(a)
        out.append(a)
    for w, k in sorted(promised.items()):
        # Hottest of them first: BlockCache.demote moves each to the old end in turn, so the
        # coldest (and, among equals, the deepest) ends up first to go.
        out.append(Demote(w, tuple(b for _, _, b in reversed(colder[w][:k]))))
    return tuple(out)


def _coldest_first(trie: PrefixTrie, worker: WorkerId) -> list[tuple[float, int, BlockHash]]:
    """(access summed over degrees, −depth, hash) of every block ``worker`` holds, coldest
    first, deeper first among equals. A block is at least as hot as any block below it (a
    request's access counts along its reused path from the root), so every leading run of
    this order is closed downwards: it can be evicted in this order, leaves first."""
    nodes = trie._nodes
    return sorted((sum(nodes[b].access), -nodes[b].depth, b) for b in trie.held_nodes(worker))


def rehome_on_merge(
    trie: PrefixTrie, merged: WorkerId, peers: Sequence[WorkerId], config: RehomeConfig
) -> tuple[Replicate, ...]:
    """Copies of the long prefixes ``merged``'s peers hold to ``merged``, issued when a merge's
    new worker is exposed (the mirror of :func:`rehome_on_split`).

    Why: a merge into degree 2C is made for long requests, but the merged worker starts with
    its children's caches, which hold what the smaller degree served (short prompts), while
    the long requests' documents sit on the workers already at 2C. J places a long request
    where its document is cached, so the new worker gets almost none of them and its peers
    queue (reconfiguration preset, seed 3, the S2→S3 merge: 7, 2, 1, 1, 0 long requests per
    window on the merged worker against 11-16 on each peer, whose long requests waited 1-3 s).

    Contract: ``merged`` is registered (after ``reconcile_merge``); ``peers`` are the other
    workers of its degree that stay (unknown ids raise :class:`~shared.ids.UnknownWorker`, a
    peer of another degree :class:`InvalidInput`; ``merged`` itself is ignored). Retained
    prefixes of the peers (held nodes with no held child at that peer) of at least
    ``config.min_blocks`` blocks are taken hottest first (access summed over degrees along the
    root->node path; ties: longer first, then hash), each once; a prefix is skipped when
    ``merged`` already holds it whole or has any of its blocks pending (the lazy reconcile
    brings those), or when its missing blocks would take the blocks copied by this call past
    ``config.fill`` × ``merged``'s capacity. Unlike a split's peers, the merged worker's own
    cache does not limit the copies: it is its children's, full of what the smaller degree
    served, and its LRU makes room as the copies land. The source is the holder among the
    peers with the fewest copies issued by this call (ties by id), so the copies spread over
    the peers. The returned actions (``kind="intra"``) are recorded as in flight; the caller
    carries them out and reports ``replication_done`` / ``replication_failed``.
    """
    mview, views = _rehome_views(trie, config, "merged worker", merged, peers)
    views = [v for v in views if not v.stale]  # a stale view holds nothing to copy from
    if not views:
        return ()
    nodes = trie._nodes
    leaves: dict[BlockHash, tuple[float, int, list[TrieNode]]] = {}
    for v in views:
        held = trie.held_nodes(v.worker)
        for h in held:
            if h in leaves:
                continue
            n = nodes[h]
            if n.depth + 1 < config.min_blocks or any(c in held for c in n.children):
                continue
            path = n.path()
            leaves[h] = (sum(sum(x.access) for x in path), n.depth + 1, path)
    order = sorted(leaves, key=lambda h: (-leaves[h][0], -leaves[h][1], h))
    sources = {v.worker: 0 for v in views}
    room = config.fill * mview.capacity_blocks
    out: list[Replicate] = []
    for h in order:
        path = leaves[h][2]
        if any(x.hash in mview.pending for x in path):
            continue
        missing = tuple(x.hash for x in path if x.hash not in mview.valid)
        if not missing:
            continue
        if len(missing) > room:
            continue
        room -= len(missing)
        holders = path[-1].holders
        src = min((w for w in sources if w in holders), key=lambda w: (sources[w], w))
        sources[src] += 1
        a = Replicate(h, Degree(mview.degree), src, merged, missing, "intra")
        trie._begin(a)
        out.append(a)
    return tuple(out)
