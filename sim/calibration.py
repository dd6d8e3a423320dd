"""Calibrated settings of Vertumnus for the simulated Qwen3-30B-A3B / H20 pool, with reasons.

design.md leaves θ_inter, θ_intra, θ_reclaim, the decay, the per-list bound, the split / merge
thresholds and persistence, β and λ to us: they are chosen here on the traces in
``../shared/data/traces`` (never on a trace reported as held out) and every experiment reads
them from this one place. Calibration trace: the Mooncake conversation trace (β/λ at ×2 and
×3.5; thresholds over ×1…×4.5). NOTE: the live services still start from their own documented
defaults (services/*/settings.py); pass these values to them explicitly.

κ scale. ``vertumnus profile`` measures κ_C as §6.1 says: one degree-C worker, a FIFO queue, the
workload's length mix, the largest window demand that keeps 90% token-weighted SLO attainment.
A single FIFO worker has no one to route around a long request, so short requests queue behind
it and κ comes out at 25-35% utilisation. A pool behind the J scheduler sustains much more: on
the conversation trace the all-CP4 pool keeps its light-load TTFT up to a window demand of
D/Σκ ≈ 2.0-2.2 and collapses at ≈ 2.9 (simulated at rates ×1…×3.5 with the controller pinned:
median D/Σκ 0.74, 1.52, 2.38, 2.89 at ×1, ×2, ×3, ×3.5; mean TTFT 0.92, 0.94, 1.78, 39 s).
The controller therefore judges capacity with κ × ``KAPPA_SCALE``; the thresholds below are
fractions of that pooled capacity.
"""

from __future__ import annotations

from typing import Final

from services.cachemgr.scan import ScanConfig
from services.controller.planner import ControllerConfig

KAPPA_SCALE: Final[float] = 2.2
"""Pooled capacity over single-worker κ (conversation trace, all-CP4 knee at D/Σκ ≈ 2.0-2.2)."""

CONTROLLER: Final[ControllerConfig] = ControllerConfig(
    window_s=20.0,
    upper=1.0,
    lower=0.75,
    merge_headroom=0.8,
    long_fraction_delta=0.15,
    demand_stability=0.3,
    persistence=2,
)
"""Split above the pooled capacity; merge below 75% of it when the merged pool stays under 80%:
on these traces a larger degree is faster for almost every length, so parallelism is the
default and concurrency is bought only when the load needs it."""

SCAN: Final[ScanConfig] = ScanConfig(
    theta_inter=2.0, theta_intra=16.0, theta_reclaim=1.0, decay=0.5, max_actions_per_list=1
)

BETA: Final[float] = 2.0
"""β ∈ {1, 1.5, 2, 3} × λ ∈ {0, 0.25, 0.5, 1} on the conversation trace: β = 2, λ = 0.25 had the
lowest P90 at ×2 (2.10 s vs 2.13-2.54 s) and was within 1% of the best mean at ×3.5 (1.41 s for
all of them): the J terms matter far less than the composition on this trace."""
LAM: Final[float] = 0.25

SPEEDUP_THRESHOLD: Final[float] = 1.1
"""§6.1 initial composition: a request counts toward the larger degree's share of the expected
mixture when Ê_C / Ê_2C ≥ 1.1. On the Qwen3/H20 ground truth CP4 is faster than CP2 for every
length above ~2K tokens; a higher threshold (1.4 keeps only > 40K-token requests) made the start
CP2-heavy and cost light-load TTFT (conversation ×1: 6CP2/7CP4 then three merges)."""
