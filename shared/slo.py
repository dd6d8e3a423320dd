"""TTFT service-level objectives: a deadline τ(L) by prompt length (paper Table 2), and the
``--slo`` / ``VTM_SLO`` text that names one. Shared by the simulator's metrics, the live report
and the gateway's metrics (the services may not import the simulator package)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from shared.ids import InvalidInput


@dataclass(frozen=True, slots=True)
class SloTable:
    """TTFT deadline τ(L) by input length: the first (upper bound, τ) with L < bound wins.

    ``bounds`` must be increasing; a final bound of ``math.inf`` covers every length.
    """

    bounds: tuple[tuple[float, float], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        if not self.bounds:
            raise InvalidInput("an SLO table needs at least one (bound, deadline) pair")
        prev = -math.inf
        for bound, tau in self.bounds:
            if not bound > prev:
                raise InvalidInput(f"SLO bounds must increase, got {bound} after {prev}")
            if not (tau > 0 and math.isfinite(tau)):
                raise InvalidInput(f"SLO deadline must be finite and > 0 s, got {tau}")
            prev = bound
        if not math.isinf(self.bounds[-1][0]):
            raise InvalidInput("the last SLO bound must be inf so every length has a deadline")

    def deadline(self, input_len: int) -> float:
        """τ(L) in seconds."""
        for bound, tau in self.bounds:
            if input_len < bound:
                return tau
        return self.bounds[-1][1]  # unreachable: last bound is inf

    def __call__(self, input_len: int) -> float:
        return self.deadline(input_len)


QWEN3_SLO: Final[SloTable] = SloTable(
    ((8192, 1.0), (32768, 5.0), (math.inf, 10.0)), "qwen3-30b-a3b"
)
"""Paper Table 2, Qwen3-30B-A3B."""
DEEPSEEK_V4_SLO: Final[SloTable] = SloTable(
    ((8192, 0.5), (32768, 2.0), (math.inf, 5.0)), "deepseek-v4-flash"
)
"""Paper Table 2, DeepSeek-V4-Flash-FP8."""

SLO_TABLES: Final[dict[str, SloTable]] = {t.name: t for t in (QWEN3_SLO, DEEPSEEK_V4_SLO)}
"""The named tables ``--slo`` accepts (paper Table 2)."""


def parse_slo(text: str) -> SloTable:
    """An SLO table from a name of :data:`SLO_TABLES` or ``BOUND:SECONDS,…,inf:SECONDS``
    (a prompt shorter than BOUND tokens must see its first token within SECONDS; the first
    bound it is under wins; the last bound is ``inf``), e.g. ``8192:1,32768:5,inf:10`` (the
    Qwen3 table). Raises :class:`InvalidInput` naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidInput("an SLO is a table name or BOUND:SECONDS pairs, got nothing")
    name = text.strip()
    if name in SLO_TABLES:
        return SLO_TABLES[name]
    if ":" not in name:
        raise InvalidInput(f"unknown SLO table {name!r}; known: {', '.join(SLO_TABLES)}, or "
                           "BOUND:SECONDS pairs such as 8192:1,32768:5,inf:10")
    pairs: list[tuple[float, float]] = []
    for part in name.split(","):
        bound_s, sep, tau_s = part.strip().partition(":")
        if not sep:
            raise InvalidInput(f"SLO entry {part.strip()!r} is not BOUND:SECONDS")
        try:
            bound = math.inf if bound_s.strip().lower() == "inf" else int(bound_s)
        except ValueError:
            raise InvalidInput(f"SLO bound {bound_s.strip()!r} is not a whole number of tokens "
                               "or 'inf'") from None
        try:
            tau = float(tau_s)
        except ValueError:
            raise InvalidInput(f"SLO deadline {tau_s.strip()!r} is not a number of seconds"
                               ) from None
        if not bound > 0:
            raise InvalidInput(f"SLO bound must be > 0 tokens, got {bound_s.strip()!r}")
        pairs.append((bound, tau))
    return SloTable(tuple(pairs), name)


def slo_to_dict(slo: SloTable) -> dict[str, Any]:
    """The table as JSON can hold it (``inf`` written as the string "inf")."""
    return {"name": slo.name,
            "bounds": [["inf" if math.isinf(b) else int(b), tau] for b, tau in slo.bounds]}
