"""Profiled capacity and the initial worker composition (§6.1).

Capacity: κ_C is the largest window demand (seconds of predicted service per window of H)
one degree-C worker serves within the SLO-attainment target; a composition's capacity is
Σ_w κ_{C_w} (design.md, "Windows and capacity"). κ comes from the profile
(:meth:`shared.costmodel.Profile.kappa_for`).

Initial composition — the rule we implement for the paper's prose ("historical information
determines the expected mixture of small- and large-degree workers ... among historically
suitable compositions with sufficient capacity, the controller favors compositions
containing more large-degree workers. If none ... provides sufficient capacity, it selects
the composition with the largest aggregate profiled capacity"):

1. **Preferred degree of a request.** Starting at the smallest degree C, a request moves up
   to 2C while 2C is in the set and Ê_C / Ê_2C ≥ ``speedup_threshold`` (default 1.4, i.e.
   doubling the GPUs buys at least 70% parallel efficiency). Short requests stay small;
   compute-heavy long ones climb.
2. **Expected mixture.** t_C = the share of historical *GPU-seconds* (C·Ê_C at the preferred
   degree, times the sample's weight) that prefers degree C. GPU-seconds, not seconds,
   because a composition hands out GPUs.
3. **Suitable.** A composition's GPU share per degree is s_C = C·n_C / G. Its distance to the
   mixture is max over C of |Σ_{C'≥C} s_C' − Σ_{C'≥C} t_C'| (cumulative from the large end,
   so "too few large GPUs" and "too many" are both measured). Suitable means distance ≤
   max(``mixture_tolerance``, the smallest distance achievable) — the closest mixtures are
   always suitable, so the granularity of G never leaves the set empty.
4. **Sufficient capacity** means capacity ≥ ``headroom`` × expected demand (default 1.2).
5. Among suitable compositions with sufficient capacity pick the most large-degree workers
   (count vectors compared from the largest degree down). If none, pick the largest
   capacity among *all* compositions (ties: closer mixture, then more large-degree workers).

Only worker counts matter for all of this, so the search runs over achievable count vectors
(:meth:`Lattice.achievable_counts`) and returns the canonical layout for the winner.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from services.controller.lattice import Composition, Lattice
from shared.costmodel import Profile
from shared.ids import InvalidInput, WorkerId

DEFAULT_SPEEDUP_THRESHOLD: Final[float] = 1.4
DEFAULT_MIXTURE_TOLERANCE: Final[float] = 0.25
DEFAULT_HEADROOM: Final[float] = 1.2


def capacity_of_counts(degrees: Sequence[int], counts: Sequence[int], profile: Profile) -> float:
    """Σ n_C κ_C for a count vector aligned with ``degrees``."""
    return float(sum(n * profile.kappa_for(c) for c, n in zip(degrees, counts, strict=True)))


def capacity(
    composition: Composition, profile: Profile, exclude: Collection[WorkerId] = ()
) -> float:
    """Aggregate profiled capacity Σ_w κ_{C_w} of ``composition`` (seconds per window).

    Workers in ``exclude`` (e.g. failed ones) contribute nothing: they serve no demand.
    With ``exclude`` a frozenset (or empty), the value is kept on the composition per (profile
    object, exclude) and computed once: the planner asks for the capacity of the same
    compositions window after window. A profile is frozen, so its κ cannot change.
    """
    if exclude.__class__ is frozenset or not exclude:
        key = (id(profile), exclude if exclude.__class__ is frozenset else frozenset())
        memo = composition._derived.capacity
        hit = memo.get(key)
        if hit is not None and hit[0] is profile:
            return hit[1]
        value = _capacity(composition, profile, key[1])
        memo[key] = (profile, value)
        return value
    return _capacity(composition, profile, exclude)


def _capacity(composition: Composition, profile: Profile, exclude: Collection[WorkerId]) -> float:
    return float(
        sum(profile.kappa_for(g.degree) for g in composition.groups if g.worker_id not in exclude)
    )


@dataclass(frozen=True, slots=True)
class HistoricalSample:
    """One historical request (or histogram bin): length and predicted service per degree.

    ``service_s[C]`` = Ê_C(R, P) in seconds, for every degree of the lattice; ``weight`` is
    how many requests the sample stands for (1 for a raw sample, the bin count for a
    histogram).
    """

    input_len: int
    service_s: Mapping[int, float]
    weight: float = 1.0


@dataclass(frozen=True)
class HistoricalWorkload:
    """A representative history: expected window demand and the request-length mix.

    ``demand_s`` is the window demand to provision for, in D(k) units (seconds of predicted
    service per window); a high percentile of the history's windows (see
    :func:`demand_percentile`) is the sensible input.
    """

    demand_s: float
    samples: tuple[HistoricalSample, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not (isinstance(self.demand_s, (int, float)) and math.isfinite(self.demand_s)):
            raise InvalidInput(f"demand_s must be a finite number, got {self.demand_s!r}")
        if self.demand_s < 0:
            raise InvalidInput(f"demand_s must be >= 0, got {self.demand_s}")
        object.__setattr__(self, "samples", tuple(self.samples))


def samples_from_lengths(
    lengths: Iterable[int], profile: Profile, degrees: Iterable[int], cached_fraction: float = 0.0
) -> tuple[HistoricalSample, ...]:
    """Build samples from input lengths with the profile's Ê_C.

    ``cached_fraction`` of each input (rounded down, leaving R ≥ 1) is taken as the cached
    prefix P — a crude stand-in for the history's hit rate.
    """
    if not (0.0 <= cached_fraction < 1.0):
        raise InvalidInput(f"cached_fraction must be in [0, 1), got {cached_fraction!r}")
    degs = sorted(set(degrees))
    out = []
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidInput(f"input length must be an integer >= 1, got {n!r}")
        p = min(int(n * cached_fraction), n - 1)
        out.append(HistoricalSample(n, {c: profile.predict(n - p, p, c) for c in degs}))
    return tuple(out)


def demand_percentile(window_demands: Sequence[float], q: float = 0.9) -> float:
    """The q-quantile (nearest rank) of historical window demands."""
    if not window_demands:
        raise InvalidInput("need at least one historical window demand")
    if not (0.0 < q <= 1.0):
        raise InvalidInput(f"q must be in (0, 1], got {q!r}")
    xs = sorted(float(x) for x in window_demands)
    if xs[0] < 0 or not all(math.isfinite(x) for x in xs):
        raise InvalidInput("window demands must be finite and >= 0")
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def preferred_degree(
    sample: HistoricalSample, degrees: Sequence[int], speedup_threshold: float
) -> int:
    """Rule 1: climb from the smallest degree while doubling speeds up by the threshold."""
    degs = sorted(degrees)
    c = degs[0]
    while 2 * c in degs and sample.service_s[c] >= speedup_threshold * sample.service_s[2 * c]:
        c *= 2
    return c


def expected_mixture(
    samples: Sequence[HistoricalSample],
    degrees: Sequence[int],
    speedup_threshold: float = DEFAULT_SPEEDUP_THRESHOLD,
) -> dict[int, float]:
    """Rule 2: share of historical GPU-seconds preferring each degree (sums to 1).

    With no samples every GPU-second is assigned to the smallest degree (no evidence that
    parallelism pays).
    """
    degs = sorted(degrees)
    _check_samples(samples, degs)
    gpu_s = dict.fromkeys(degs, 0.0)
    for s in samples:
        c = preferred_degree(s, degs, speedup_threshold)
        gpu_s[c] += s.weight * c * s.service_s[c]
    total = sum(gpu_s.values())
    if total <= 0:
        return {c: (1.0 if c == degs[0] else 0.0) for c in degs}
    return {c: v / total for c, v in gpu_s.items()}


def _check_samples(samples: Sequence[HistoricalSample], degs: Sequence[int]) -> None:
    for i, s in enumerate(samples):
        if not isinstance(s, HistoricalSample):
            raise InvalidInput(f"sample {i} is not a HistoricalSample: {s!r}")
        if not (s.weight >= 0 and math.isfinite(s.weight)):
            raise InvalidInput(f"sample {i}: weight must be finite and >= 0, got {s.weight!r}")
        for c in degs:
            v = s.service_s.get(c)
            if v is None or not (v > 0 and math.isfinite(v)):
                raise InvalidInput(
                    f"sample {i}: service_s[{c}] must be a positive finite time, got {v!r}"
                )


def mixture_distance(
    degrees: Sequence[int], counts: Sequence[int], num_gpus: int, target: Mapping[int, float]
) -> float:
    """Rule 3: max |cumulative GPU share − cumulative target| from the large end."""
    dist = 0.0
    cum_s = cum_t = 0.0
    for c, n in sorted(zip(degrees, counts, strict=True), reverse=True):
        cum_s += c * n / num_gpus
        cum_t += target.get(c, 0.0)
        dist = max(dist, abs(cum_s - cum_t))
    return dist


@dataclass(frozen=True, slots=True)
class InitialChoice:
    """The chosen composition and why (for logs and reports)."""

    composition: Composition
    capacity_s: float
    required_s: float
    mixture: Mapping[int, float]
    distance: float
    sufficient: bool
    reason: str


def initial_composition(
    lattice: Lattice,
    profile: Profile,
    history: HistoricalWorkload,
    *,
    headroom: float = DEFAULT_HEADROOM,
    speedup_threshold: float = DEFAULT_SPEEDUP_THRESHOLD,
    mixture_tolerance: float = DEFAULT_MIXTURE_TOLERANCE,
) -> InitialChoice:
    """Choose the starting composition from ``history`` (rules 1–5 of the module doc)."""
    if not isinstance(history, HistoricalWorkload):
        raise InvalidInput(f"expected a HistoricalWorkload, got {history!r}")
    if not (headroom >= 1.0 and math.isfinite(headroom)):
        raise InvalidInput(f"headroom must be a finite factor >= 1, got {headroom!r}")
    if not (speedup_threshold >= 1.0 and math.isfinite(speedup_threshold)):
        raise InvalidInput(f"speedup_threshold must be >= 1, got {speedup_threshold!r}")
    if not (0.0 <= mixture_tolerance <= 1.0):
        raise InvalidInput(f"mixture_tolerance must be in [0, 1], got {mixture_tolerance!r}")
    degs = lattice.sorted_degrees
    mix = expected_mixture(history.samples, degs, speedup_threshold)
    required = headroom * history.demand_s

    def large_first(v: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(reversed(v))

    rows = [
        (
            v,
            capacity_of_counts(degs, v, profile),
            mixture_distance(degs, v, lattice.num_gpus, mix),
        )
        for v in lattice.achievable_counts()
    ]
    # A small epsilon keeps float noise in the shares from splitting ties.
    best_dist = min(d for _, _, d in rows)
    bound = max(mixture_tolerance, best_dist) + 1e-9
    ok = [r for r in rows if r[2] <= bound and r[1] >= required]
    if ok:
        v, cap, dist = max(ok, key=lambda r: (large_first(r[0]), -r[2]))
        reason = (
            f"suitable mixture (distance {dist:.2f}) with capacity {cap:.1f} s >= "
            f"{required:.1f} s required; most large-degree workers"
        )
        sufficient = True
    else:
        v, cap, dist = max(rows, key=lambda r: (r[1], -r[2], large_first(r[0])))
        sufficient = cap >= required
        reason = f"no suitable composition reaches {required:.1f} s; largest capacity {cap:.1f} s"
    comp = Composition.from_counts(lattice, dict(zip(degs, v, strict=True)))
    return InitialChoice(comp, cap, required, mix, dist, sufficient, reason)
