"""The calibrated settings, re-exported for the simulator: they live in
:mod:`services.calibration` (with the reasons for each value) so that the live services can read
them without importing the simulator package."""

from __future__ import annotations

from services.calibration import (
    BETA,
    BETA_BUSY_POWER,
    CONTROLLER,
    KAPPA_SCALE,
    LAM,
    PENDING_CREDIT,
    PULL,
    PULL_CREDIT_BLOCKS,
    PULL_DISPLACE_BLOCK_S,
    PULL_WAIT,
    REHOME,
    SCAN,
    SPEEDUP_THRESHOLD,
    policy_params,
)

__all__ = [
    "BETA",
    "BETA_BUSY_POWER",
    "CONTROLLER",
    "KAPPA_SCALE",
    "LAM",
    "PENDING_CREDIT",
    "PULL",
    "PULL_CREDIT_BLOCKS",
    "PULL_DISPLACE_BLOCK_S",
    "PULL_WAIT",
    "REHOME",
    "SCAN",
    "SPEEDUP_THRESHOLD",
    "policy_params",
]
