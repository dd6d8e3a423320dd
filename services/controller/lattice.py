"""The topology-aware grouping lattice (§6) and worker compositions over it (§3.1).

Rules (the buddy lattice):

* The pool has G GPUs, ids 0..G-1, in nodes of ``gpus_per_node`` consecutive GPUs (the last
  node may be partial when G is not a multiple of the node size).
* A degree-C worker occupies an *aligned* group [kC, (k+1)C) that lies inside one node and
  inside [0, G). Degrees are powers of two drawn from a configured set (e.g. {2, 4}).
* A :class:`Composition` is a set of disjoint lattice groups covering all G GPUs
  (Σ_w C_w = G, §3.1).
* Two operations move between *adjacent* compositions, each preserving the GPU count (§6.2):
  **split** one degree-2C group into its two aligned degree-C halves, and **merge** two
  aligned sibling degree-C groups back into their degree-2C parent; both C and 2C must be in
  the degree set and the parent must be a lattice group (so it never crosses a node).

Everything here is a pure value: compositions are frozen and operations return new ones.
Invalid input raises :class:`shared.ids.InvalidInput` and builds nothing.

Because a composition never changes, what is derived from it (its adjacent operations, the
composition each of them leads to, its capacity under a profile) is computed once per
composition object and kept on it (:class:`_Derived`). The controller judges the same
composition window after window and evaluates every adjacent operation each time; the memo
turns that into dictionary look-ups. Only successful results are kept: an operation that does
not apply raises every time it is tried.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Final

from shared.ids import GPUS_PER_NODE, InvalidInput, UnknownWorker, WorkerId
from shared.worker import GpuGroup

# Enumerating per-node tilings is exponential in the node size; a node this large with many
# degrees is not a real machine and would make the lattice unusable, so reject it early.
_MAX_TILINGS_PER_NODE: Final[int] = 100_000


class OpKind(StrEnum):
    SPLIT = "split"  # one degree-2C worker -> two degree-C workers (more concurrency)
    MERGE = "merge"  # two degree-C siblings -> one degree-2C worker (more parallelism)


def _is_power_of_two(x: int) -> bool:
    return x >= 1 and not (x & (x - 1))


@dataclass(frozen=True, slots=True)
class LatticeOp:
    """One adjacent operation: ``sources`` are replaced by ``targets`` (same GPUs).

    Split: one source of degree 2C, two targets of degree C (lower half first).
    Merge: two sources of degree C (lower first), one target of degree 2C.
    """

    kind: OpKind
    sources: tuple[GpuGroup, ...]
    targets: tuple[GpuGroup, ...]

    @property
    def source_ids(self) -> tuple[WorkerId, ...]:
        return tuple(g.worker_id for g in self.sources)

    @property
    def target_ids(self) -> tuple[WorkerId, ...]:
        return tuple(g.worker_id for g in self.targets)

    @property
    def gpus(self) -> range:
        first = min(g.first_gpu for g in self.sources)
        return range(first, first + sum(g.degree for g in self.sources))

    def describe(self) -> str:
        src = "+".join(g.worker_id for g in self.sources)
        dst = "+".join(g.worker_id for g in self.targets)
        return f"{self.kind.value} {src} -> {dst}"


@dataclass(frozen=True)
class Lattice:
    """The pool's GPU budget, node size and allowed CP degrees.

    Contract: ``degrees`` are powers of two, none larger than a node; G and every node's GPU
    count are multiples of the smallest degree, so the all-smallest-degree composition always
    exists.
    """

    num_gpus: int
    degrees: frozenset[int]
    gpus_per_node: int = GPUS_PER_NODE

    def __init__(
        self, num_gpus: int, degrees: Iterable[int], gpus_per_node: int = GPUS_PER_NODE
    ) -> None:
        degs = frozenset(degrees)
        if not isinstance(num_gpus, int) or num_gpus < 1:
            raise InvalidInput(f"num_gpus must be an integer >= 1, got {num_gpus!r}")
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise InvalidInput(f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
        if not degs:
            raise InvalidInput("the degree set must not be empty")
        for c in degs:
            if not isinstance(c, int) or not _is_power_of_two(c):
                raise InvalidInput(f"every degree must be a power of two >= 1, got {c!r}")
            if c > gpus_per_node:
                raise InvalidInput(
                    f"degree {c} exceeds the node size {gpus_per_node}: it would cross a node"
                )
        cmin = min(degs)
        if num_gpus % cmin:
            raise InvalidInput(
                f"num_gpus={num_gpus} is not a multiple of the smallest degree {cmin}"
            )
        if gpus_per_node % cmin:
            raise InvalidInput(
                f"gpus_per_node={gpus_per_node} is not a multiple of the smallest degree {cmin}"
            )
        object.__setattr__(self, "num_gpus", num_gpus)
        object.__setattr__(self, "degrees", degs)
        object.__setattr__(self, "gpus_per_node", gpus_per_node)
        # Fail now (not on first use) if the node tilings would be unmanageable.
        _ = self._node_tilings

    # --- geometry ---------------------------------------------------------------------
    @property
    def sorted_degrees(self) -> tuple[int, ...]:
        return tuple(sorted(self.degrees))

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def node_range(self, node: int) -> range:
        start = node * self.gpus_per_node
        return range(start, min(start + self.gpus_per_node, self.num_gpus))

    def is_group(self, group: GpuGroup) -> bool:
        """True iff ``group`` is a node of this lattice (degree in set, aligned, in one node)."""
        return (
            group.degree in self.degrees
            and group.first_gpu + group.degree <= self.num_gpus
            and group.within_node(self.gpus_per_node)
        )

    def check_group(self, group: GpuGroup) -> None:
        if not isinstance(group, GpuGroup):
            raise InvalidInput(f"expected a GpuGroup, got {group!r}")
        if group.degree not in self.degrees:
            raise InvalidInput(
                f"{group.worker_id}: degree {group.degree} not in the degree set "
                f"{sorted(self.degrees)}"
            )
        if group.first_gpu + group.degree > self.num_gpus:
            raise InvalidInput(f"{group.worker_id}: extends past the last GPU {self.num_gpus - 1}")
        if not group.within_node(self.gpus_per_node):
            raise InvalidInput(
                f"{group.worker_id}: crosses a node boundary ({self.gpus_per_node} GPUs per node)"
            )

    # --- per-node tilings (used to enumerate compositions by counts) ---------------------
    @cached_property
    def _node_tilings(self) -> tuple[tuple[tuple[GpuGroup, ...], ...], ...]:
        """For each node, every tiling of its GPUs by lattice groups (largest degrees first)."""
        return tuple(
            _tilings(self.node_range(node), self.degrees) for node in range(self.num_nodes)
        )

    def _counts_of(self, groups: Iterable[GpuGroup]) -> tuple[int, ...]:
        degs = self.sorted_degrees
        counts = [0] * len(degs)
        for g in groups:
            counts[degs.index(g.degree)] += 1
        return tuple(counts)

    @cached_property
    def _node_count_options(self) -> tuple[dict[tuple[int, ...], tuple[GpuGroup, ...]], ...]:
        """Per node: achievable count vector -> one representative tiling."""
        opts = []
        for tilings in self._node_tilings:
            by_counts: dict[tuple[int, ...], tuple[GpuGroup, ...]] = {}
            for t in tilings:
                by_counts.setdefault(self._counts_of(t), t)
            opts.append(by_counts)
        return tuple(opts)

    @cached_property
    def _suffix_reachable(self) -> tuple[frozenset[tuple[int, ...]], ...]:
        """reach[n] = count vectors achievable by nodes n..end (reach[num_nodes] = {0})."""
        zero = tuple(0 for _ in self.degrees)
        reach: list[frozenset[tuple[int, ...]]] = [frozenset({zero})]
        for opts in reversed(self._node_count_options):
            nxt = {tuple(a + b for a, b in zip(o, r, strict=True)) for o in opts for r in reach[-1]}
            reach.append(frozenset(nxt))
        return tuple(reversed(reach))

    def achievable_counts(self) -> frozenset[tuple[int, ...]]:
        """Every achievable vector of worker counts, indexed like :attr:`sorted_degrees`.

        Capacity and the initial-composition rule depend only on counts, so enumerating
        counts (polynomial) instead of compositions (exponential in nodes) is enough.
        """
        return self._suffix_reachable[0]


def _tilings(rng: range, degrees: frozenset[int]) -> tuple[tuple[GpuGroup, ...], ...]:
    """Every tiling of the GPUs ``rng`` (one node) by aligned groups of the given degrees."""
    out: list[tuple[GpuGroup, ...]] = []
    by_size = sorted(degrees, reverse=True)

    def rec(pos: int, acc: list[GpuGroup]) -> None:
        if len(out) > _MAX_TILINGS_PER_NODE:
            raise InvalidInput(
                f"lattice too large: more than {_MAX_TILINGS_PER_NODE} tilings per node"
            )
        if pos == rng.stop:
            out.append(tuple(acc))
            return
        for c in by_size:
            if pos % c == 0 and pos + c <= rng.stop:
                acc.append(GpuGroup(pos, c))
                rec(pos + c, acc)
                acc.pop()

    rec(rng.start, [])
    return tuple(out)


def _describe_counts(degrees: tuple[int, ...], counts: Iterable[int]) -> str:
    parts = [f"{n}CP{c}" for c, n in zip(degrees, counts, strict=True) if n]
    return "/".join(parts) if parts else "empty"


class _Derived:
    """Values derived from one (frozen) composition, filled on first use; never stale.

    * ``adjacent``: :func:`adjacent`'s answer, or None before the first call;
    * ``applied``: operation -> the composition :func:`apply` built for it (only operations
      that applied; equal operations share an entry);
    * ``capacity``: (id of a profile, excluded workers) -> (that profile, capacity), for
      :func:`services.controller.composition.capacity`. The profile is kept to check identity
      (an id may be reused once an object is gone) and has no hash of its own (it holds dicts).

    Not part of a composition's equality, hash, repr or pickled state.
    """

    __slots__ = ("adjacent", "applied", "capacity")

    def __init__(self) -> None:
        self.adjacent: tuple[LatticeOp, ...] | None = None
        self.applied: dict[LatticeOp, Composition] = {}
        self.capacity: dict[tuple[int, frozenset[WorkerId]], tuple[object, float]] = {}


@dataclass(frozen=True)
class Composition:
    """A valid worker composition: disjoint lattice groups covering all G GPUs.

    ``groups`` is kept sorted by first GPU, so equal compositions compare equal.
    """

    lattice: Lattice
    groups: tuple[GpuGroup, ...]
    _by_id: Mapping[WorkerId, GpuGroup] = field(init=False, repr=False, compare=False)
    _derived: _Derived = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lattice, Lattice):
            raise InvalidInput(f"expected a Lattice, got {self.lattice!r}")
        try:
            groups = tuple(sorted(self.groups))
        except TypeError as exc:
            raise InvalidInput(f"groups must be GpuGroups: {exc}") from exc
        covered = 0
        for g in groups:
            self.lattice.check_group(g)
            if g.first_gpu != covered:
                if g.first_gpu < covered:
                    raise InvalidInput(f"{g.worker_id} overlaps another group")
                raise InvalidInput(f"GPUs [{covered}, {g.first_gpu}) are not covered")
            covered = g.first_gpu + g.degree
        if covered != self.lattice.num_gpus:
            raise InvalidInput(f"GPUs [{covered}, {self.lattice.num_gpus}) are not covered")
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "_by_id", {g.worker_id: g for g in groups})
        object.__setattr__(self, "_derived", _Derived())

    def __getstate__(self) -> dict[str, object]:
        # The memo may reach many neighbouring compositions; a copy starts without it.
        return {k: v for k, v in self.__dict__.items() if k != "_derived"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_derived", _Derived())

    # --- constructors ------------------------------------------------------------------
    @classmethod
    def uniform(cls, lattice: Lattice, degree: int) -> Composition:
        """Every worker of one degree (e.g. the Homo baseline: all degree 4)."""
        if degree not in lattice.degrees:
            raise InvalidInput(f"degree {degree} not in {sorted(lattice.degrees)}")
        groups = []
        for node in range(lattice.num_nodes):
            rng = lattice.node_range(node)
            if len(rng) % degree:
                raise InvalidInput(
                    f"node {node} has {len(rng)} GPUs, not a multiple of degree {degree}"
                )
            groups.extend(GpuGroup(s, degree) for s in range(rng.start, rng.stop, degree))
        return cls(lattice, tuple(groups))

    @classmethod
    def from_counts(cls, lattice: Lattice, counts: Mapping[int, int]) -> Composition:
        """A canonical composition with ``counts[C]`` degree-C workers (missing degree = 0).

        Larger degrees are placed on lower GPU ids (first feasible per-node choice), so the
        same counts always give the same layout. Raises if the counts are not achievable.
        """
        degs = lattice.sorted_degrees
        for c, n in counts.items():
            if c not in lattice.degrees:
                raise InvalidInput(f"degree {c} not in {sorted(lattice.degrees)}")
            if not isinstance(n, int) or n < 0:
                raise InvalidInput(f"count for degree {c} must be an integer >= 0, got {n!r}")
        want = tuple(int(counts.get(c, 0)) for c in degs)
        reach = lattice._suffix_reachable
        if want not in reach[0]:
            raise InvalidInput(
                f"no composition of {lattice.num_gpus} GPUs has "
                f"{_describe_counts(degs, want)} ({dict(zip(degs, want, strict=True))})"
            )
        groups: list[GpuGroup] = []
        rest = want
        for node, opts in enumerate(lattice._node_count_options):
            # Prefer tilings with more large-degree workers first: canonical and buddy-friendly.
            for vec in sorted(opts, key=lambda v: tuple(reversed(v)), reverse=True):
                left = tuple(a - b for a, b in zip(rest, vec, strict=True))
                if min(left) >= 0 and left in reach[node + 1]:
                    groups.extend(opts[vec])
                    rest = left
                    break
        return cls(lattice, tuple(groups))

    @classmethod
    def parse(cls, lattice: Lattice, text: str) -> Composition:
        """The canonical composition for the paper's notation, e.g. ``"8CP4/1CP8"``."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput(f"expected a composition like '8CP4/1CP8', got {text!r}")
        counts: dict[int, int] = {}
        for part in text.strip().split("/"):
            n, sep, c = part.strip().upper().partition("CP")
            if not sep or not n.isdigit() or not c.isdigit():
                raise InvalidInput(f"bad composition term {part!r} in {text!r} (want e.g. 8CP4)")
            counts[int(c)] = counts.get(int(c), 0) + int(n)
        return cls.from_counts(lattice, counts)

    # --- queries -----------------------------------------------------------------------
    @property
    def worker_ids(self) -> tuple[WorkerId, ...]:
        return tuple(self._by_id)

    def group(self, worker: WorkerId) -> GpuGroup:
        try:
            return self._by_id[worker]
        except KeyError:
            raise UnknownWorker(f"{worker!r} is not a worker of {self.describe()}") from None

    def __contains__(self, item: object) -> bool:
        if isinstance(item, GpuGroup):
            return item.worker_id in self._by_id and self._by_id[item.worker_id] == item
        return item in self._by_id

    def counts(self) -> dict[int, int]:
        """Workers per degree, every degree of the set present (possibly 0)."""
        return dict(
            zip(self.lattice.sorted_degrees, self.lattice._counts_of(self.groups), strict=True)
        )

    def count_vector(self) -> tuple[int, ...]:
        return self.lattice._counts_of(self.groups)

    def describe(self) -> str:
        """The paper's notation, smaller degrees first: e.g. ``"8CP4/1CP8"``."""
        return _describe_counts(self.lattice.sorted_degrees, self.count_vector())

    def __str__(self) -> str:
        return self.describe()

    # --- adjacency ---------------------------------------------------------------------
    def adjacent(self) -> tuple[LatticeOp, ...]:
        """Every split and merge leading to an adjacent composition, in GPU order
        (computed once per composition)."""
        return adjacent(self)

    def apply(self, op: LatticeOp) -> Composition:
        """The adjacent composition after ``op``; raises if ``op`` does not apply here.

        Memoised per composition: applying an equal operation again returns the same
        (equal, validated) composition object."""
        return apply(self, op)


def _split_of(lattice: Lattice, g: GpuGroup) -> LatticeOp | None:
    half = g.degree // 2
    if g.degree < 2 or half not in lattice.degrees:
        return None
    return LatticeOp(
        OpKind.SPLIT, (g,), (GpuGroup(g.first_gpu, half), GpuGroup(g.first_gpu + half, half))
    )


def _merge_of(lattice: Lattice, lo: GpuGroup, hi: GpuGroup) -> LatticeOp | None:
    c = lo.degree
    if (
        hi.degree != c
        or 2 * c not in lattice.degrees
        or lo.first_gpu % (2 * c)
        or hi.first_gpu != lo.first_gpu + c
    ):
        return None
    parent = GpuGroup(lo.first_gpu, 2 * c)
    if not lattice.is_group(parent):
        return None
    return LatticeOp(OpKind.MERGE, (lo, hi), (parent,))


def adjacent(composition: Composition) -> tuple[LatticeOp, ...]:
    """Enumerate the split and merge operations applicable to ``composition``.

    Order: by first GPU, splits before merges at the same GPU (deterministic for tie-breaks).
    Computed once per composition object (the same tuple is returned after that).
    """
    derived = composition._derived
    ops = derived.adjacent
    if ops is None:
        ops = derived.adjacent = _enumerate_adjacent(composition)
    return ops


def _enumerate_adjacent(composition: Composition) -> tuple[LatticeOp, ...]:
    lat = composition.lattice
    ops: list[LatticeOp] = []
    gs = composition.groups
    for i, g in enumerate(gs):
        split = _split_of(lat, g)
        if split is not None:
            ops.append(split)
        if i + 1 < len(gs):
            merge = _merge_of(lat, g, gs[i + 1])
            if merge is not None:
                ops.append(merge)
    return tuple(ops)


def apply(composition: Composition, op: LatticeOp) -> Composition:
    """Replace ``op.sources`` by ``op.targets``; the result is validated like any composition.

    Memoised per composition (see the module doc): an operation equal to one that already
    applied returns that result; anything else is checked and built as below, and kept only
    if it succeeds.
    """
    if not isinstance(op, LatticeOp):
        raise InvalidInput(f"expected a LatticeOp, got {op!r}")
    applied = composition._derived.applied
    try:
        return applied[op]
    except KeyError:
        pass
    except TypeError:  # unhashable parts (e.g. a list of sources): validation rejects it
        return _apply_checked(composition, op)
    after = _apply_checked(composition, op)
    applied[op] = after
    return after


def _apply_checked(composition: Composition, op: LatticeOp) -> Composition:
    lat = composition.lattice
    expected = (
        _split_of(lat, op.sources[0])
        if op.kind is OpKind.SPLIT and len(op.sources) == 1
        else _merge_of(lat, *op.sources)
        if op.kind is OpKind.MERGE and len(op.sources) == 2
        else None
    )
    if expected != op:
        raise InvalidInput(f"not a lattice {op.kind} operation: {op!r}")
    for g in op.sources:
        if g not in composition:
            raise InvalidInput(f"{g.worker_id} is not a worker of {composition.describe()}")
    kept = tuple(g for g in composition.groups if g not in op.sources)
    return Composition(lat, kept + op.targets)
