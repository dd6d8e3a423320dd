"""A workload: requests with arrival times, lengths and prefix-block identities.

Every reader (Mooncake, Azure, L-Eval) and the synthetic generator produce the same
:class:`Workload`, so the simulator, the replay client and the statistics never care where a
workload came from.

Units: seconds for time, tokens for lengths. ``block_hashes`` holds the identities of the
request's *full* blocks only (``input_len // block_size`` of them): only full blocks are cached
and reused (design.md), so a trailing partial block has no identity here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput


@dataclass(frozen=True, slots=True)
class Request:
    """One prefill request of a workload.

    ``block_hashes[j]`` is the chained identity of tokens [j·B, (j+1)·B): equal id ⇔ equal
    prefix up to and including that block.
    """

    request_id: str
    arrival_s: float
    input_len: int
    output_len: int
    block_hashes: tuple[int, ...] = ()
    session_id: str | None = None

    def __post_init__(self) -> None:
        # numpy integers are welcome (generators draw them); store plain ints.
        for name in ("input_len", "output_len"):
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
                object.__setattr__(self, name, int(v))
        if isinstance(self.arrival_s, numbers.Real) and type(self.arrival_s) is not float:
            object.__setattr__(self, "arrival_s", float(self.arrival_s))
        if not self.request_id:
            raise InvalidInput("request_id must be a non-empty string")
        if not (isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s)):
            raise InvalidInput(
                f"{self.request_id}: arrival_s must be finite, got {self.arrival_s!r}"
            )
        if self.arrival_s < 0:
            raise InvalidInput(f"{self.request_id}: arrival_s must be >= 0, got {self.arrival_s}")
        if (
            isinstance(self.input_len, bool)
            or not isinstance(self.input_len, int)
            or self.input_len < 1
        ):
            raise InvalidInput(
                f"{self.request_id}: input_len must be an int >= 1, got {self.input_len!r}"
            )
        if (
            isinstance(self.output_len, bool)
            or not isinstance(self.output_len, int)
            or self.output_len < 0
        ):
            raise InvalidInput(
                f"{self.request_id}: output_len must be an int >= 0, got {self.output_len!r}"
            )
        if not isinstance(self.block_hashes, tuple):
            raise InvalidInput(f"{self.request_id}: block_hashes must be a tuple of ints")


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival (ties keep their given order), plus a name and metadata.

    Invariants checked at construction: arrivals non-decreasing, request ids unique, and each
    request has exactly ``input_len // block_size`` block hashes.
    """

    name: str
    requests: tuple[Request, ...]
    block_size: int = DEFAULT_BLOCK_SIZE
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise InvalidInput(f"block_size must be >= 1, got {self.block_size}")
        if not isinstance(self.requests, tuple):
            object.__setattr__(self, "requests", tuple(self.requests))
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        seen: set[str] = set()
        prev = -math.inf
        for r in self.requests:
            if r.arrival_s < prev:
                raise InvalidInput(
                    f"workload {self.name!r}: requests not sorted by arrival at {r.request_id}"
                )
            prev = r.arrival_s
            if r.request_id in seen:
                raise InvalidInput(f"workload {self.name!r}: duplicate request id {r.request_id}")
            seen.add(r.request_id)
            if len(r.block_hashes) != r.input_len // self.block_size:
                raise InvalidInput(
                    f"workload {self.name!r}: {r.request_id} has {len(r.block_hashes)} block "
                    f"hashes, expected input_len // block_size = {r.input_len // self.block_size}"
                )

    @classmethod
    def from_requests(
        cls,
        name: str,
        requests: Iterable[Request],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        metadata: Mapping[str, Any] | None = None,
    ) -> Workload:
        """Build a workload from requests in any order (stable sort by arrival)."""
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        return cls(name, tuple(reqs), block_size, dict(metadata or {}))

    def __reduce__(self) -> tuple[Any, ...]:
        # The read-only metadata view cannot be pickled (a sweep ships the workload to its
        # worker processes): rebuild from a plain dict, through the same checks.
        return (type(self), (self.name, self.requests, self.block_size, dict(self.metadata)))

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> Request:
        return self.requests[i]

    @property
    def duration_s(self) -> float:
        """Last arrival − first arrival (s); 0 for fewer than two requests."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def with_metadata(self, **extra: Any) -> Workload:
        return replace(self, metadata={**self.metadata, **extra})


def history_hit_blocks(workload: Workload) -> list[int]:
    """For each request in arrival order, how many of its leading blocks some earlier request
    also had: its hit in an infinite cache that saw every earlier request (block identities
    are chained, so an equal id means an equal prefix up to it)."""
    seen: set[int] = set()
    out: list[int] = []
    for r in workload.requests:
        hit = 0
        for h in r.block_hashes:
            if h not in seen:
                break
            hit += 1
        seen.update(r.block_hashes)
        out.append(hit)
    return out


def history_reuse(workload: Workload) -> list[int]:
    """Tokens of each request's prompt that history already held, in arrival order: its
    :func:`history_hit_blocks` in tokens, capped at ``input_len − 1`` so at least one token is
    computed.

    The one definition of "the reuse the history showed" that the zero-queue oracle, the
    initial composition (§6.1) and κ's ramp on a trace all use.
    """
    B = workload.block_size
    return [min(k * B, r.input_len - 1)
            for r, k in zip(workload.requests, history_hit_blocks(workload), strict=True)]


def _as_float(x: numbers.Real) -> float:
    """``x`` as a float; an integer too large for one is infinity (float() raises)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


def scale_rate(workload: Workload, factor: float) -> Workload:
    """Multiply the request rate by ``factor`` by compressing inter-arrival times.

    Arrival order and the first arrival are kept: t' = t0 + (t − t0) / factor. The cumulative
    factor is recorded in ``metadata["rate_scale"]``.
    """
    # Any real number (numpy's too), not a bool (True would scale by 1); a comparison, not
    # math.isfinite, which overflows on a huge int (NaN fails it too).
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) \
            or not 0 < factor < math.inf or not math.isfinite(_as_float(factor)):
        raise InvalidInput(f"rate scale factor must be a finite number > 0, got {factor!r}")
    factor = float(factor)
    if not workload.requests:
        return workload
    t0 = workload.requests[0].arrival_s
    reqs = tuple(replace(r, arrival_s=t0 + (r.arrival_s - t0) / factor) for r in workload.requests)
    scale = float(workload.metadata.get("rate_scale", 1.0)) * factor
    return replace(workload, requests=reqs, metadata={**workload.metadata, "rate_scale": scale})


def scale_to_rate(workload: Workload, rate: float) -> Workload:
    """Rescale a timed workload's arrivals to a mean rate of ``rate`` req/s (what ``--rate``
    does to a Mooncake or Azure trace).

    The rate's definition: a mean inter-arrival gap of 1/``rate``, so the n requests span
    (n − 1)/``rate`` from the first arrival to the last. That is what Poisson arrivals of
    that rate (L-Eval's, the synthetic generator's) give on average, whatever n: ``rate``
    req/s with two requests is one gap of 1/``rate``. (It is not n/span = ``rate``, the
    mean rate ``workload_stats`` reports as stats.json defines it: that convention gives
    a mean gap of n/((n − 1)·``rate``), twice too long for two requests; on a trace of
    thousands the two differ by n/(n − 1), under 0.1%.)

    Every gap is scaled by one factor (:func:`scale_rate` by ``rate``·span/(n − 1)), so the
    trace's own proportions (bursts, lulls) and its first arrival are kept. Fewer than two
    requests, or all at one instant, have no gap to scale and are returned as they are.
    Raises :class:`InvalidInput` for a ``rate`` that is not a finite number > 0, or one so
    far from the trace's own that the factor is no finite number > 0.
    """
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) \
            or not 0 < rate < math.inf or not math.isfinite(_as_float(rate)):
        raise InvalidInput(f"arrival rate must be a finite number > 0 req/s, got {rate!r}")
    span = workload.duration_s
    if len(workload) < 2 or span <= 0:
        return workload
    factor = float(rate) * span / (len(workload) - 1)
    if not 0 < factor < math.inf:
        raise InvalidInput(f"arrival rate {float(rate):g} req/s is out of range for workload "
                           f"{workload.name!r} ({len(workload)} requests over {span:g} s)")
    return scale_rate(workload, factor)


def truncate(
    workload: Workload,
    *,
    max_requests: int | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
    rebase: bool = False,
) -> Workload:
    """Keep requests arriving in [start_s, end_s), then at most the first ``max_requests``.

    ``rebase=True`` shifts arrivals so the window starts at 0 (at ``start_s`` when given,
    else at the first kept arrival).
    """
    if max_requests is not None and max_requests < 0:
        raise InvalidInput(f"max_requests must be >= 0, got {max_requests}")
    if start_s is not None and end_s is not None and end_s < start_s:
        raise InvalidInput(f"time window end {end_s} is before its start {start_s}")
    reqs = [
        r
        for r in workload.requests
        if (start_s is None or r.arrival_s >= start_s) and (end_s is None or r.arrival_s < end_s)
    ]
    if max_requests is not None:
        reqs = reqs[:max_requests]
    if rebase and reqs:
        origin = start_s if start_s is not None else reqs[0].arrival_s
        reqs = [replace(r, arrival_s=max(0.0, r.arrival_s - origin)) for r in reqs]
    meta = dict(workload.metadata)
    meta["truncation"] = {
        "max_requests": max_requests,
        "start_s": start_s,
        "end_s": end_s,
        "rebase": rebase,
    }
    return replace(workload, requests=tuple(reqs), metadata=meta)
