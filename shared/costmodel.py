"""The cache-aware prefill-time model of §3.2 and its profile file.

    W(R, P)    = R·P + R(R+1)/2                                   (Eq. 1)
    Ê_C(R, P)  = d + a·R + b·P + (c·R + α·W(R, P)) / C            (Eq. 2)

R is the uncached suffix (tokens, R ≥ 1: a request always recomputes its last token), P the
cached prefix (tokens, P ≥ 0), C the CP degree. Coefficients are fitted from queue-free
profiles by least squares on *relative* error (short and long requests count alike), one set
for all degrees or, optionally, one per degree.

The profile file is JSON (see :meth:`Profile.to_dict`): coefficients (global and optionally per
degree), κ_C per degree (seconds of predicted service time per window that one degree-C worker
serves within the SLO target, §6.1), the window H it was measured with, block size, model and
hardware names, and the fit's MAPE overall and per degree.

Pure: no IO except the explicit ``load``/``save`` helpers; no clock.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
from scipy.optimize import nnls

from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput

PROFILE_SCHEMA_VERSION: Final[int] = 1


def attention_work(r: int, p: int) -> float:
    """W(R, P) = R·P + R(R+1)/2: query-key pairs left after reusing a P-token prefix (Eq. 1)."""
    return float(r) * float(p) + float(r) * (float(r) + 1.0) / 2.0


@dataclass(frozen=True, slots=True)
class Coefficients:
    """One coefficient set of Eq. 2, in seconds per unit (α: seconds per query-key pair)."""

    d: float
    a: float
    b: float
    c: float
    alpha: float

    def predict(self, r: int, p: int, degree: int) -> float:
        return (
            self.d
            + self.a * r
            + self.b * p
            + (self.c * r + self.alpha * attention_work(r, p)) / degree
        )

    def as_dict(self) -> dict[str, float]:
        return {"d": self.d, "a": self.a, "b": self.b, "c": self.c, "alpha": self.alpha}


# The note's fit of the Qwen3-30B-A3B / H20 ground truth (ground-truth.md). Used only when no
# profile file is given (demo, unit tests); `vertumnus profile` writes a measured one.
DEFAULT_COEFFICIENTS: Final[Coefficients] = Coefficients(
    d=0.091, a=52.8e-6, b=6.9e-6, c=24.4e-6, alpha=6.63e-9
)


def _check_rpc(r: int, p: int, degree: int) -> None:
    if not isinstance(r, (int, np.integer)) or r < 1:
        raise InvalidInput(f"uncached suffix R must be an integer >= 1, got {r!r}")
    if not isinstance(p, (int, np.integer)) or p < 0:
        raise InvalidInput(f"cached prefix P must be an integer >= 0, got {p!r}")
    if not isinstance(degree, (int, np.integer)) or degree < 1:
        raise InvalidInput(f"CP degree C must be an integer >= 1, got {degree!r}")


@dataclass(frozen=True)
class Profile:
    """A fitted cost model plus the capacities the controller needs.

    ``predict(R, P, C)`` is Ê_C(R, P). Per-degree coefficients, when present for C, take
    precedence over the global set.
    """

    coefficients: Coefficients = DEFAULT_COEFFICIENTS
    per_degree: Mapping[int, Coefficients] = field(default_factory=dict)
    kappa: Mapping[int, float] = field(default_factory=dict)
    window_s: float = 20.0
    block_size: int = DEFAULT_BLOCK_SIZE
    model: str = "Qwen3-30B-A3B"
    hardware: str = "H20"
    fit_mape: float | None = None
    fit_mape_per_degree: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise InvalidInput(f"block_size must be >= 1, got {self.block_size}")
        if self.window_s <= 0:
            raise InvalidInput(f"window_s must be > 0, got {self.window_s}")
        for c, k in self.kappa.items():
            if c < 1 or not (k > 0 and math.isfinite(k)):
                raise InvalidInput(f"kappa[{c}] must be a positive finite number, got {k!r}")

    def coeffs_for(self, degree: int) -> Coefficients:
        return self.per_degree.get(degree, self.coefficients)

    def predict(self, r: int, p: int, degree: int) -> float:
        """Ê_C(R, P) in seconds. Raises :class:`InvalidInput` on R < 1, P < 0 or C < 1."""
        _check_rpc(r, p, degree)
        return self.coeffs_for(degree).predict(r, p, degree)

    def predict_fast(self, r: int, p: int, degree: int) -> float:
        """As :meth:`predict` without validation, for hot loops whose inputs are known good."""
        co = self.per_degree.get(degree, self.coefficients)
        w = r * p + r * (r + 1) * 0.5
        return co.d + co.a * r + co.b * p + (co.c * r + co.alpha * w) / degree

    def kappa_for(self, degree: int) -> float:
        """κ_C; a degree never profiled falls back to 70% of the window (documented default)."""
        return float(self.kappa.get(degree, 0.7 * self.window_s))

    def with_kappa(self, kappa: Mapping[int, float]) -> Profile:
        return replace(self, kappa=dict(kappa))

    # --- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PROFILE_SCHEMA_VERSION,
            "model": self.model,
            "hardware": self.hardware,
            "block_size": self.block_size,
            "window_s": self.window_s,
            "coefficients": self.coefficients.as_dict(),
            "per_degree": {str(c): co.as_dict() for c, co in sorted(self.per_degree.items())},
            "kappa": {str(c): k for c, k in sorted(self.kappa.items())},
            "fit": {
                "mape": self.fit_mape,
                "mape_per_degree": {
                    str(c): m for c, m in sorted(self.fit_mape_per_degree.items())
                },
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        try:
            if data.get("schema_version", PROFILE_SCHEMA_VERSION) != PROFILE_SCHEMA_VERSION:
                raise InvalidInput(
                    f"unsupported profile schema_version {data.get('schema_version')!r}"
                )
            co = Coefficients(**{k: float(v) for k, v in data["coefficients"].items()})
            per = {
                int(c): Coefficients(**{k: float(v) for k, v in d.items()})
                for c, d in data.get("per_degree", {}).items()
            }
            fit = data.get("fit", {}) or {}
            return cls(
                coefficients=co,
                per_degree=per,
                kappa={int(c): float(k) for c, k in data.get("kappa", {}).items()},
                window_s=float(data.get("window_s", 20.0)),
                block_size=int(data.get("block_size", DEFAULT_BLOCK_SIZE)),
                model=str(data.get("model", "unknown")),
                hardware=str(data.get("hardware", "unknown")),
                fit_mape=None if fit.get("mape") is None else float(fit["mape"]),
                fit_mape_per_degree={
                    int(c): float(m) for c, m in (fit.get("mape_per_degree") or {}).items()
                },
            )
        except InvalidInput:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidInput(f"malformed profile: {exc!r}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise InvalidInput(f"profile file not found: {path}") from exc
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"profile file {path} is not JSON: {exc}") from exc
        return cls.from_dict(data)


DEFAULT_PROFILE: Final[Profile] = Profile()


# --- fitting -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Sample:
    """One queue-free measurement: R new tokens, P cached, degree C, measured seconds."""

    r: int
    p: int
    degree: int
    seconds: float


def _as_samples(samples: Iterable[Sample | tuple[int, int, int, float]]) -> list[Sample]:
    out: list[Sample] = []
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            try:
                r, p, c, t = s
            except (TypeError, ValueError) as exc:
                raise InvalidInput(f"sample {i} is not (R, P, C, seconds): {s!r}") from exc
            s = Sample(int(r), int(p), int(c), float(t))
        _check_rpc(s.r, s.p, s.degree)
        if not (s.seconds > 0 and math.isfinite(s.seconds)):
            raise InvalidInput(f"sample {i} has non-positive or non-finite time {s.seconds!r}")
        out.append(s)
    if len(out) < 5:
        raise InvalidInput(f"need at least 5 samples to fit 5 coefficients, got {len(out)}")
    return out


def _fit_one(samples: list[Sample], fold_c: bool) -> Coefficients:
    """Non-negative least squares on relative error: minimise Σ((Ê − t)/t)²."""
    r = np.array([s.r for s in samples], dtype=float)
    p = np.array([s.p for s in samples], dtype=float)
    c = np.array([s.degree for s in samples], dtype=float)
    t = np.array([s.seconds for s in samples], dtype=float)
    w = r * p + r * (r + 1) / 2
    cols = [np.ones_like(r), r, p, r / c, w / c]
    if fold_c:
        # With a single degree, R and R/C are collinear: fold c into a (c = 0).
        cols[3] = np.zeros_like(r)
    x = np.stack(cols, axis=1) / t[:, None]
    # Scale columns so NNLS is well conditioned across magnitudes (1 vs 1e10 pairs).
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(x / scale, np.ones_like(t))
    coef = coef / scale
    return Coefficients(*(float(v) for v in coef))


def mape(profile: Profile, samples: Iterable[Sample]) -> tuple[float, dict[int, float]]:
    """Mean absolute percentage error (as a fraction) overall and per degree."""
    errs: dict[int, list[float]] = {}
    for s in samples:
        e = abs(profile.predict(s.r, s.p, s.degree) - s.seconds) / s.seconds
        errs.setdefault(s.degree, []).append(e)
    allv = [e for v in errs.values() for e in v]
    return (float(np.mean(allv)) if allv else math.nan), {
        c: float(np.mean(v)) for c, v in sorted(errs.items())
    }


def fit_profile(
    samples: Iterable[Sample | tuple[int, int, int, float]],
    *,
    per_degree: bool = False,
    base: Profile = DEFAULT_PROFILE,
) -> Profile:
    """Fit Ê_C from (R, P, C, seconds) samples; returns ``base`` with new coefficients and MAPE.

    ``per_degree=True`` additionally fits one coefficient set per degree (the global set is
    still fitted and used for degrees without their own).
    """
    ss = _as_samples(samples)
    glob = _fit_one(ss, fold_c=len({s.degree for s in ss}) == 1)
    per: dict[int, Coefficients] = {}
    if per_degree:
        for deg in sorted({s.degree for s in ss}):
            sub = [s for s in ss if s.degree == deg]
            if len(sub) >= 5:
                per[deg] = _fit_one(sub, fold_c=True)
    prof = replace(base, coefficients=glob, per_degree=per)
    m, m_per = mape(prof, ss)
    return replace(prof, fit_mape=m, fit_mape_per_degree=m_per)
