"""The cache-aware prefill-time model of §3.2 and its profile file.

    W(R, P)    = R·P + R(R+1)/2                                   (Eq. 1)
    Ê_C(R, P)  = d + a·R + b·P + (c·R + α·W(R, P)) / C            (Eq. 2)

R is the uncached suffix (tokens, R ≥ 1: a request always recomputes its last token), P the
cached prefix (tokens, P ≥ 0), C the CP degree. Coefficients are fitted from queue-free
profiles by least squares on *relative* error (short and long requests count alike), one set
for all degrees or, optionally, one per degree.

Every coefficient is >= 0, finite and at most its bound in :data:`COEFFICIENT_BOUNDS`, so every
request within the project's token limits has a finite, non-negative predicted time (see
there), and every κ_C is > 0 and at most :data:`MAX_KAPPA_S`, so the capacities the controller
scales and sums from it stay finite; a profile outside them is refused
(:class:`~shared.ids.InvalidInput`).

The profile file is JSON (see :meth:`Profile.to_dict`): coefficients (global and optionally per
degree), κ_C per degree (seconds of predicted service time per window that one degree-C worker
serves within the SLO target, §6.1), the window H it was measured with, block size, model and
hardware names, optionally a fingerprint of the hardware table it was fitted on
(``hardware_fingerprint``, a profile of the simulated backend), and the fit's MAPE overall
and per degree. Readers ignore keys they do not know, so a file with a key added since stays
readable by older code without a new ``schema_version``.

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

from shared.files import NotJson, parse_json, path_kind, write_text_atomic
from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput
from shared.schemas import MAX_TOKENS

PROFILE_SCHEMA_VERSION: Final[int] = 1

KAPPA_FALLBACK_SHARE: Final[float] = 0.7
"""κ_C of a degree the profile has no κ for, as a share of the window (``Profile.kappa_for``)."""


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


MAX_TERM_S: Final[float] = 1e15
"""Bound on each of the five terms of Eq. 2 for the largest request there is (seconds)."""

MAX_WORK: Final[float] = attention_work(MAX_TOKENS, MAX_TOKENS)
"""W(MAX_TOKENS, MAX_TOKENS) = 2^48 + 2^47 + 2^23 ~ 4.2e14: the most attention work of any
request within the token limits (W grows with R and with P)."""

COEFFICIENT_BOUNDS: Final[Mapping[str, float]] = {
    "d": MAX_TERM_S,
    "a": MAX_TERM_S / MAX_TOKENS,
    "b": MAX_TERM_S / MAX_TOKENS,
    "c": MAX_TERM_S / MAX_TOKENS,
    "alpha": MAX_TERM_S / MAX_WORK,
}
"""The largest value of each coefficient: d <= 1e15 s, a, b, c <= 1e15 / 2^24 ~ 6.0e7 s per
token, alpha <= 1e15 / W(2^24, 2^24) ~ 2.37 s per query-key pair.

Derivation: a request within the project's limits has 1 <= R <= MAX_TOKENS, 0 <= P <=
MAX_TOKENS (``shared.schemas.MAX_TOKENS`` = 2^24, the bound of every prompt and count derived
from it) and C >= 1. With every coefficient >= 0 each term of Eq. 2 is >= 0 and grows with R
and P and shrinks with C, so each is largest at R = P = MAX_TOKENS, C = 1: d, a·2^24, b·2^24,
c·2^24 and alpha·MAX_WORK, each at most :data:`MAX_TERM_S` under these bounds. Hence every
such request is predicted a time in [0, :data:`MAX_PREDICTED_S`] -- finite, and so are the
sums, differences and squares of predictions the services form (sums of up to ~1e290 of
them). The bounds leave room: the H20 fit below has alpha = 6.6e-9 (3.6e8 times smaller) and
a = 5.3e-5 s (1e12 times smaller)."""

MAX_PREDICTED_S: Final[float] = 5 * MAX_TERM_S
"""The largest time any profile within :data:`COEFFICIENT_BOUNDS` predicts for a request
within the token limits (5e15 s)."""


def _check_coefficients(co: Coefficients, where: str) -> None:
    """Raise :class:`InvalidInput` naming ``{where}.{name}`` unless each coefficient of ``co``
    is a finite number in [0, its bound of :data:`COEFFICIENT_BOUNDS`]."""
    for name, v in co.as_dict().items():
        bound = COEFFICIENT_BOUNDS[name]
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= bound):
            raise InvalidInput(
                f"{where}.{name} must be a finite number >= 0 and at most {bound:.6g} (the "
                f"bound under which every request within the token limits is predicted a "
                f"finite time), got {v!r}")


MAX_KAPPA_S: Final[float] = MAX_TERM_S
"""The largest κ_C (seconds of predicted service per window that one degree-C worker
serves): 1e15 s, the bound of each term of Eq. 2.

Why a bound: κ is multiplied and summed after it is read. The controller judges capacity with
κ_C × ``kappa_scale`` (2.2 calibrated), per window of its own length
(:meth:`Profile.for_window`: × the ratio of the windows, 20 with a 0.05 time scale), and sums
it over the pool's workers (``services/controller/composition.py``, ``planner.py``). A κ that
is merely finite (1e308) overflows there: to an infinite capacity that absorbs any demand, or
to a scaled profile refused for an infinite κ the file does not hold. Under this bound
κ × 2.2 × 20 is below 4.4e16 and its sum over 10^12 workers below 4.4e28: finite, with factors
up to ~1e280 to spare. The bound leaves room too: measured κ are seconds to tens of seconds
per 20 s window (κ_2, κ_4 ≈ 10-18 s on the conversation trace; a pooled κ on the bursty Azure
code trace ≈ 2 s), some 1e13 times smaller. A κ above it is no measurement (31 million years
of service per window) but a corrupt or mistyped file."""


def _check_kappa(kappa: Mapping[int, float], where: str, sep: tuple[str, str]) -> None:
    """Raise :class:`InvalidInput` naming ``{where}{sep[0]}{C}{sep[1]}`` (``kappa[2]``, or a
    file's ``kappa.2``) unless each κ_C is a finite number in (0, :data:`MAX_KAPPA_S`] of a
    CP degree C >= 1."""
    for c, k in kappa.items():
        name = f"{where}{sep[0]}{c}{sep[1]}"
        if c < 1:
            raise InvalidInput(f"{name}: {c!r} is not a CP degree (an integer >= 1)")
        # A comparison chain, not isinstance: numpy numbers (a fitted κ) are welcome; NaN
        # fails every comparison.
        if not (0 < k <= MAX_KAPPA_S and math.isfinite(k)):
            raise InvalidInput(
                f"{name} must be a finite number > 0 and at most {MAX_KAPPA_S:.6g} s per window "
                f"(the bound under which the controller's scaled and summed capacities stay "
                f"finite), got {k!r}")


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
    kappa_pooled: bool = False
    """How κ was measured. False: one degree-C worker alone (§6.1's ramp, ``vertumnus profile``);
    a pool behind the J scheduler sustains more, so the controller judges capacity with
    κ × a calibrated pool factor (``kappa_scale``). True: on a routed pool replaying a trace
    (κ on a trace, what ``vertumnus simulate`` measures and writes), already a pool's capacity:
    judged as it is (:meth:`capacity_scale`)."""
    hardware_fingerprint: str | None = None
    """A digest of every figure of the hardware the profile was fitted on (the simulator's
    ground-truth table: ``sim.profiling.hardware_fingerprint``), or None (a profile of a real
    engine, or a file written before it was recorded). ``model`` and ``hardware`` are only
    names: a hardware file that changes the default table's figures keeps them, and a run
    compares this digest to tell the tables apart (``sim.runner.check_profile_hardware``).
    Written to the file only when set."""

    def __post_init__(self) -> None:
        _check_coefficients(self.coefficients, "coefficients")
        for c, co in self.per_degree.items():
            _check_coefficients(co, f"per_degree.{c}")
        if self.block_size < 1:
            raise InvalidInput(f"block_size must be >= 1, got {self.block_size}")
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise InvalidInput(f"window_s must be finite and > 0, got {self.window_s}")
        _check_kappa(self.kappa, "kappa", ("[", "]"))
        if self.hardware_fingerprint is not None:
            _check_fingerprint(self.hardware_fingerprint, "hardware_fingerprint")

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
        """κ_C; a degree never profiled falls back to 70% of the window (documented default).

        The fallback is deliberate: profiles of the torch backend carry no κ, and the live
        controller runs on them. A caller that wants measured κ for its degrees checks with
        :meth:`check_degrees` (or :meth:`missing_kappa`) first.
        """
        return float(self.kappa.get(degree, KAPPA_FALLBACK_SHARE * self.window_s))

    def missing_kappa(self, degrees: Iterable[int]) -> tuple[int, ...]:
        """The degrees among ``degrees`` (sorted, each once) that have no κ of their own, i.e.
        those :meth:`kappa_for` answers with the 0.7·window fallback."""
        return tuple(sorted({int(c) for c in degrees} - set(self.kappa)))

    def check_degrees(self, degrees: Iterable[int], *, source: str = "profile") -> None:
        """Raise :class:`InvalidInput` unless every degree in ``degrees`` has a measured κ.

        For a run that sizes its pool from κ (the simulator's sweeps): a profile without κ
        for a degree in use would silently get the fallback of :meth:`kappa_for`. The message
        starts with ``source`` (e.g. ``"profile runs/p/profile.json"``) and names the missing
        degrees and those the profile has.
        """
        missing = self.missing_kappa(degrees)
        if not missing:
            return
        have = ", ".join(str(c) for c in sorted(self.kappa)) or "none"
        raise InvalidInput(
            f"{source} has no kappa for CP degree(s) {', '.join(map(str, missing))} (it has "
            f"kappa for: {have}); without it each would be assumed to serve "
            f"{KAPPA_FALLBACK_SHARE:g} x window_s = {KAPPA_FALLBACK_SHARE * self.window_s:g} s "
            f"per window. Profile those degrees (vertumnus profile --degrees ...) or run "
            f"without them"
        )

    def with_kappa(self, kappa: Mapping[int, float]) -> Profile:
        return replace(self, kappa=dict(kappa))

    def for_window(self, window_s: float) -> Profile:
        """This profile with κ per window of ``window_s`` seconds. κ_C is seconds of service
        a worker sustains per window of :attr:`window_s` (a rate measured over windows of that
        length), so a controller judging windows of another length H must compare its D(k)
        with κ_C·H/window_s: unscaled, a 10 s window would see half the demand against the
        whole κ and merge a pool that is as loaded as before. The fallback κ (a share of the
        window) follows the new window too.

        The scaled κ is a profile's κ like any other, within :data:`MAX_KAPPA_S` (every
        profile the controller sums holds to it); one past it raises
        :class:`~shared.ids.InvalidInput` naming what was given -- this profile's κ, its
        window, the window asked and the factor -- not only the scaled κ, which no file
        holds."""
        if not (window_s > 0 and math.isfinite(window_s)):
            raise InvalidInput(f"window_s must be finite and > 0, got {window_s!r}")
        if window_s == self.window_s:
            return self
        f = window_s / self.window_s
        scaled = {c: k * f for c, k in self.kappa.items()}
        for c, k in sorted(scaled.items()):
            if not (0 < k <= MAX_KAPPA_S and math.isfinite(k)):
                raise InvalidInput(
                    f"kappa[{c}] = {self.kappa[c]!r} s per {self.window_s:g} s window is "
                    f"{k!r} s per window of {window_s:g} s (x {f:.6g}): it must be a finite "
                    f"number > 0 and at most {MAX_KAPPA_S:.6g} s per window (the bound under "
                    f"which the controller's scaled and summed capacities stay finite)")
        return replace(self, window_s=window_s, kappa=scaled)

    def capacity_scale(self, pool_factor: float) -> float:
        """The factor κ is multiplied by to judge a pool's capacity: ``pool_factor`` for a
        single worker's κ, 1 for a pooled one (:attr:`kappa_pooled`)."""
        return 1.0 if self.kappa_pooled else pool_factor

    # --- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PROFILE_SCHEMA_VERSION,
            "model": self.model,
            "hardware": self.hardware,
            # Only when known: a profile without one writes the file it always wrote.
            **({"hardware_fingerprint": self.hardware_fingerprint}
               if self.hardware_fingerprint is not None else {}),
            "block_size": self.block_size,
            "window_s": self.window_s,
            "coefficients": self.coefficients.as_dict(),
            "per_degree": {str(c): co.as_dict() for c, co in sorted(self.per_degree.items())},
            "kappa": {str(c): k for c, k in sorted(self.kappa.items())},
            "kappa_pooled": self.kappa_pooled,
            "fit": {
                "mape": self.fit_mape,
                "mape_per_degree": {
                    str(c): m for c, m in sorted(self.fit_mape_per_degree.items())
                },
            },
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "profile") -> Profile:
        """The profile a parsed profile file describes (the shape :meth:`to_dict` writes).

        Every value is checked where it is read, so an error names the field in the file's
        terms, prefixed by ``source`` (e.g. ``"profile runs/p/profile.json: 'coefficients'
        is missing"``): the file must be an object with a ``coefficients`` object of the five
        coefficients, each a finite number >= 0 and at most its bound in
        :data:`COEFFICIENT_BOUNDS` (so that every request within the token limits is
        predicted a finite time), not all of ``d``, ``a``, ``c``, ``alpha``
        zero (a request with no cached prefix would be predicted to take no time; ``b`` alone
        only prices cached tokens); ``per_degree`` likewise per CP degree; ``kappa`` a
        finite number > 0 and at most :data:`MAX_KAPPA_S` per degree (so that the
        capacities the controller scales and sums stay finite); ``kappa_pooled`` true or
        false (default false); ``window_s`` > 0 and ``block_size`` >= 1;
        ``hardware_fingerprint`` absent, null or a string of 1 to
        :data:`MAX_FINGERPRINT_CHARS` characters. Other keys are ignored (the file format's
        policy for additions: module docstring).
        Raises :class:`InvalidInput`. Missing κ for a degree is *not* an error here (see
        :meth:`kappa_for`, :meth:`check_degrees`).
        """
        if not isinstance(data, Mapping):
            raise InvalidInput(f"{source}: expected a JSON object, got {_json_kind(data)}")
        version = data.get("schema_version", PROFILE_SCHEMA_VERSION)
        if isinstance(version, bool) or version != PROFILE_SCHEMA_VERSION:
            raise InvalidInput(f"{source}: unsupported schema_version {version!r} (this version "
                               f"reads {PROFILE_SCHEMA_VERSION})")
        if "coefficients" not in data:
            raise InvalidInput(f"{source}: 'coefficients' is missing")
        co = _coefficients(data["coefficients"], f"{source}: coefficients")
        per = {
            c: _coefficients(d, f"{source}: per_degree.{c}")
            for c, d in _degree_items(data.get("per_degree", {}), f"{source}: per_degree")
        }
        kappa = {
            c: _number(k, f"{source}: kappa.{c}", positive=True)
            for c, k in _degree_items(data.get("kappa", {}), f"{source}: kappa")
        }
        # Here, not only in __post_init__: the message names the file and the field in its
        # terms (kappa.4), as for the coefficients.
        _check_kappa(kappa, f"{source}: kappa", (".", ""))
        fit = data.get("fit", {})
        if fit is None:
            fit = {}
        elif not isinstance(fit, Mapping):
            raise InvalidInput(f"{source}: 'fit' must be an object, got {_json_kind(fit)}")
        # The fit's MAPE is a report, not an input to any decision: any number (NaN when a
        # degree had no samples) or null.
        mape_all = fit.get("mape")
        mape_per_raw = fit.get("mape_per_degree") or {}
        block_size = data.get("block_size", DEFAULT_BLOCK_SIZE)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidInput(f"{source}: block_size must be an integer >= 1, got "
                               f"{block_size!r}")
        pooled = data.get("kappa_pooled", False)
        if not isinstance(pooled, bool):
            raise InvalidInput(f"{source}: kappa_pooled must be true or false, got "
                               f"{_json_kind(pooled)}")
        fingerprint = data.get("hardware_fingerprint")
        if fingerprint is not None:
            _check_fingerprint(fingerprint, f"{source}: hardware_fingerprint")
        return cls(
            coefficients=co,
            per_degree=per,
            kappa=kappa,
            window_s=_number(data.get("window_s", 20.0), f"{source}: window_s", positive=True),
            block_size=block_size,
            model=str(data.get("model", "unknown")),
            hardware=str(data.get("hardware", "unknown")),
            fit_mape=None if mape_all is None else _number(
                mape_all, f"{source}: fit.mape", finite=False),
            fit_mape_per_degree={
                c: _number(m, f"{source}: fit.mape_per_degree.{c}", finite=False)
                for c, m in _degree_items(mape_per_raw, f"{source}: fit.mape_per_degree")
            },
            kappa_pooled=pooled,
            hardware_fingerprint=fingerprint,
        )

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, *, degrees: Iterable[int] | None = None) -> Profile:
        """Read a profile file (UTF-8 JSON, :meth:`from_dict`). Raises :class:`InvalidInput`
        naming the file: missing, a directory, unreadable, not UTF-8, not JSON, or malformed.

        ``degrees``: the CP degrees the caller will run; when given, each must have its own κ
        (:meth:`check_degrees`). None (the services' use) accepts the fallback of
        :meth:`kappa_for`.
        """
        p = Path(path)
        where = f"profile {p}"
        if path_kind(p, "profile") == "dir":  # a path it cannot look at: InvalidInput too
            raise InvalidInput(f"{where} is a directory, not a profile file")
        try:
            raw = p.read_bytes()
        except FileNotFoundError as exc:
            raise InvalidInput(f"profile file not found: {p}") from exc
        except OSError as exc:
            raise InvalidInput(f"cannot read {where}: {exc.strerror or exc}") from exc
        try:
            text = raw.decode("utf-8-sig")  # tolerate a byte-order mark
        except UnicodeDecodeError:
            raise InvalidInput(f"{where}: not JSON (not valid UTF-8 text)") from None
        try:
            data = parse_json(text)
        except NotJson as exc:
            raise InvalidInput(f"{where}: not JSON ({exc})") from None
        prof = cls.from_dict(data, source=where)
        if degrees is not None:
            prof.check_degrees(degrees, source=where)
        return prof


MAX_FINGERPRINT_CHARS: Final[int] = 128
"""The longest ``hardware_fingerprint`` a profile holds (what writes one writes 16 hex
digits; the bound only keeps a corrupt file's text out of every message that quotes it)."""


def _check_fingerprint(v: Any, where: str) -> None:
    """Raise :class:`InvalidInput` naming ``where`` unless ``v`` is a string of 1 to
    :data:`MAX_FINGERPRINT_CHARS` characters."""
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_FINGERPRINT_CHARS:
        shown = _json_kind(v) if not isinstance(v, str) else f"a string of {len(v)} characters"
        raise InvalidInput(f"{where} must be a string of 1 to {MAX_FINGERPRINT_CHARS} "
                           f"characters (a digest of the hardware the profile was fitted on), "
                           f"got {shown}")


def _json_kind(v: Any) -> str:
    """How a JSON reader would name ``v``'s type, for messages about a file's shape."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({'true' if v else 'false'})"
    if isinstance(v, (int, float)):
        return f"a number ({v!r})"
    if isinstance(v, str):
        return f"a string ({v!r})"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, Mapping):
        return "an object"
    return type(v).__name__


def _number(v: Any, where: str, *, positive: bool = False, finite: bool = True) -> float:
    """``v`` as a float: a JSON number (not a boolean or string), finite unless ``finite`` is
    False, and > 0 (``positive``) or >= 0 (otherwise; NaN passes only when not ``finite``).
    An integer no float holds (JSON allows any number of digits) is refused either way."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidInput(f"{where} must be a number, got {_json_kind(v)}")
    try:
        x = float(v)
    except OverflowError:
        digits = int(v.bit_length() * math.log10(2)) + 1
        raise InvalidInput(f"{where} is too large: an integer of about {digits} digits (a "
                           "number must fit a float, below ~1.8e308)") from None
    if not finite:
        return x
    if not math.isfinite(x):
        raise InvalidInput(f"{where} must be finite, got {x!r}")
    if x < 0 or (positive and x == 0):
        raise InvalidInput(f"{where} must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return x


def _coefficients(v: Any, where: str) -> Coefficients:
    """One coefficient set from its JSON object (see :meth:`Profile.from_dict`)."""
    if not isinstance(v, Mapping):
        raise InvalidInput(f"{where} must be an object of {', '.join(_COEFF_NAMES)}, got "
                           f"{_json_kind(v)}")
    missing = [k for k in _COEFF_NAMES if k not in v]
    if missing:
        raise InvalidInput(f"{where} lacks {', '.join(map(repr, missing))}")
    unknown = sorted(str(k) for k in v if k not in _COEFF_NAMES)
    if unknown:
        raise InvalidInput(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; "
                           f"known: {', '.join(_COEFF_NAMES)}")
    co = Coefficients(**{k: _number(v[k], f"{where}.{k}") for k in _COEFF_NAMES})
    _check_coefficients(co, where)
    # With R >= 1 and C >= 1, Ê > 0 for every request exactly when one of these is > 0
    # (W(R, P) >= 1); b alone prices only cached tokens, and a request may have none.
    if not (co.d > 0 or co.a > 0 or co.c > 0 or co.alpha > 0):
        raise InvalidInput(f"{where}: d, a, c and alpha are all 0, so a request without a "
                           f"cached prefix would be predicted to take no time; at least one "
                           f"must be > 0")
    return co


def _degree_items(v: Any, where: str) -> list[tuple[int, Any]]:
    """The (CP degree, value) pairs of a JSON object keyed by degree (``{"2": ...}``)."""
    if not isinstance(v, Mapping):
        raise InvalidInput(f"{where} must be an object keyed by CP degree, got {_json_kind(v)}")
    out: list[tuple[int, Any]] = []
    for key, value in v.items():
        try:
            c = int(key)
        except (TypeError, ValueError):
            c = 0
        if c < 1 or str(key).strip() != str(c):
            raise InvalidInput(f"{where}: key {key!r} is not a CP degree (an integer >= 1)")
        out.append((c, value))
    return out


_COEFF_NAMES: Final[tuple[str, ...]] = ("d", "a", "b", "c", "alpha")


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
