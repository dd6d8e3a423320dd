"""A placement decision and the terms behind it, for tracing and ``explain()``.

A :class:`Decision` records the chosen worker, its reusable prefix P, uncached suffix R and
predicted service s (what the scheduler reserves), the reused blocks, the request's preferred
degree (§7.1, consumed by the prefix-cache manager), and for *every* worker in the view the terms
the policy computed — or why the worker was excluded.

The per-candidate terms are stored column-wise (one tuple per term) and turned into
:class:`CandidateTerms` objects only when read: at 512 workers, building 512 objects per
placement would cost as much as the placement itself, while most decisions are never inspected.
A policy may also defer the columns themselves (:meth:`CandidateColumns.deferred`): they are then
computed on first read from values it fixed at decision time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from shared.ids import RequestId, UnknownWorker, WorkerId


class Exclusion(StrEnum):
    """Why a worker cannot serve a request (§5.2). A cache miss is never a reason."""

    UNAVAILABLE = "unavailable"
    DRAINING = "draining"
    SWITCHING = "switching"
    TOO_LONG = "sequence longer than worker's max_seq_len"
    NO_MEMORY = "request KV does not fit in worker's KV capacity"


@dataclass(frozen=True, slots=True)
class CandidateTerms:
    """One worker's terms in a decision. Terms are None for an excluded worker.

    ``score`` is the policy's own objective: J for Vertumnus and the J-family (lower wins), the
    baseline's score otherwise (see :attr:`Decision.objective`). ``extra_gpu`` is the raw
    C_w·s − C_min·Ê_{C_min}(R, P) in GPU-seconds (J adds λ times it); baselines leave it None.
    """

    worker: WorkerId
    degree: int
    excluded: Exclusion | None
    q: float | None
    s: float | None
    extra_gpu: float | None
    score: float | None
    prefix_tokens: int | None
    uncached_tokens: int | None

    @property
    def eligible(self) -> bool:
        return self.excluded is None


# The nine columns of CandidateColumns, in its constructor's order.
ColumnTuples = tuple[
    tuple[WorkerId, ...],
    tuple[int, ...],
    tuple[Exclusion | None, ...],
    tuple[float | None, ...],
    tuple[float | None, ...],
    tuple[float | None, ...],
    tuple[float | None, ...],
    tuple[int | None, ...],
    tuple[int | None, ...],
]


class CandidateColumns:
    """Column-wise candidate terms; index i is the i-th worker of the view. Immutable.

    Given directly (nine tuples), or :meth:`deferred`: computed by a pure function of values the
    policy fixed at decision time, on the first read (speed: the simulator never reads them, and
    storing nine terms per worker per placement was a sixth of the placement's cost).
    """

    __slots__ = ("_cols", "_build")

    def __init__(
        self,
        workers: tuple[WorkerId, ...],
        degrees: tuple[int, ...],
        excluded: tuple[Exclusion | None, ...],
        q: tuple[float | None, ...],
        s: tuple[float | None, ...],
        extra_gpu: tuple[float | None, ...],
        score: tuple[float | None, ...],
        prefix_tokens: tuple[int | None, ...],
        uncached_tokens: tuple[int | None, ...],
    ) -> None:
        self._cols: ColumnTuples | None = (
            workers, degrees, excluded, q, s, extra_gpu, score, prefix_tokens, uncached_tokens
        )
        self._build: Callable[[], ColumnTuples] | None = None

    @classmethod
    def deferred(cls, build: Callable[[], ColumnTuples]) -> CandidateColumns:
        """Columns computed by ``build()`` (the nine tuples, in ``__init__``'s order) when first
        read. ``build`` must be pure and must not depend on anything that changes later."""
        self = cls.__new__(cls)
        self._cols = None
        self._build = build
        return self

    def _get(self) -> ColumnTuples:
        cols = self._cols
        if cols is None:
            cols = self._cols = self._build()  # type: ignore[misc]
            self._build = None
        return cols

    @property
    def workers(self) -> tuple[WorkerId, ...]:
        return self._get()[0]

    @property
    def degrees(self) -> tuple[int, ...]:
        return self._get()[1]

    @property
    def excluded(self) -> tuple[Exclusion | None, ...]:
        return self._get()[2]

    @property
    def q(self) -> tuple[float | None, ...]:
        return self._get()[3]

    @property
    def s(self) -> tuple[float | None, ...]:
        return self._get()[4]

    @property
    def extra_gpu(self) -> tuple[float | None, ...]:
        return self._get()[5]

    @property
    def score(self) -> tuple[float | None, ...]:
        return self._get()[6]

    @property
    def prefix_tokens(self) -> tuple[int | None, ...]:
        return self._get()[7]

    @property
    def uncached_tokens(self) -> tuple[int | None, ...]:
        return self._get()[8]

    def row(self, i: int) -> CandidateTerms:
        c = self._get()
        return CandidateTerms(c[0][i], c[1][i], c[2][i], c[3][i], c[4][i], c[5][i], c[6][i],
                              c[7][i], c[8][i])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CandidateColumns):
            return NotImplemented
        return self._get() == other._get()

    def __hash__(self) -> int:
        return hash(self._get())

    def __reduce__(self) -> tuple[type[CandidateColumns], ColumnTuples]:
        # copy / pickle the values (a deferred builder may be a closure)
        return (CandidateColumns, self._get())

    def __repr__(self) -> str:
        names = ("workers", "degrees", "excluded", "q", "s", "extra_gpu", "score",
                 "prefix_tokens", "uncached_tokens")
        return "CandidateColumns(" + ", ".join(
            f"{k}={v!r}" for k, v in zip(names, self._get(), strict=True)) + ")"


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why.

    ``prefix_tokens`` = P_{i,w}, ``uncached_tokens`` = R_{i,w} = L − P_{i,w}, ``predicted_s`` =
    s_{i,w} = Ê_{C_w}(R, P) for the chosen worker w — the amount the scheduler reserves.
    ``reused_blocks`` = full blocks of the request reused at w (= P // B).
    ``preferred_degree``/``preferred_worker``: argmin over eligible workers of J − q (§7.1) for the
    J-family; a baseline has no such notion and reports its chosen worker's degree.
    """

    policy: str
    request_id: RequestId
    length: int
    now: float
    worker: WorkerId
    degree: int
    prefix_tokens: int
    uncached_tokens: int
    predicted_s: float
    reused_blocks: int
    preferred_degree: int
    preferred_worker: WorkerId
    objective: Literal["min", "max"]
    score_label: str
    columns: CandidateColumns
    note: str = ""
    epoch: int = 0
    """The chosen worker's configuration epoch at decision time (ranks reject stale ones)."""
    beta: float | None = None
    """The β the J-family's scores used: the policy's β after any load-following factor
    (:func:`services.scheduler.placement.place_j`); None for a policy without J."""
    pulled_blocks: int = 0
    """Of ``reused_blocks``, those J counted on the route-time pull bringing to the chosen
    worker (its pull credit, placement.py "Pull credit"); 0 when the credit did not apply."""
    pull_wait_s: float = 0.0
    """How much longer than its queue the request waits at the chosen worker for that pull to
    land (cost-model seconds; ``PullCredit.wait``): the worker holds it until then. 0: it
    does not wait (no credit, or the queue covers the copy)."""

    @property
    def candidates(self) -> tuple[CandidateTerms, ...]:
        cols = self.columns
        return tuple(cols.row(i) for i in range(len(cols.workers)))

    def candidate(self, worker: WorkerId) -> CandidateTerms:
        try:
            return self.columns.row(self.columns.workers.index(worker))
        except ValueError:
            raise UnknownWorker(f"worker {worker!r} was not a candidate of this decision") from None

    @property
    def chosen(self) -> CandidateTerms:
        return self.candidate(self.worker)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (span attributes, assignment messages)."""
        return {
            "policy": self.policy,
            "request_id": self.request_id,
            "length": self.length,
            "now": self.now,
            "worker": self.worker,
            "degree": self.degree,
            "prefix_tokens": self.prefix_tokens,
            "uncached_tokens": self.uncached_tokens,
            "predicted_s": self.predicted_s,
            "reused_blocks": self.reused_blocks,
            "preferred_degree": self.preferred_degree,
            "preferred_worker": self.preferred_worker,
            "objective": self.objective,
            "score_label": self.score_label,
            "note": self.note,
            "epoch": self.epoch,
            "beta": self.beta,
            "pulled_blocks": self.pulled_blocks,
            "pull_wait_s": self.pull_wait_s,
            "candidates": [
                {
                    "worker": c.worker,
                    "degree": c.degree,
                    "excluded": None if c.excluded is None else str(c.excluded),
                    "q": c.q,
                    "s": c.s,
                    "extra_gpu": c.extra_gpu,
                    "score": c.score,
                    "P": c.prefix_tokens,
                    "R": c.uncached_tokens,
                }
                for c in self.candidates
            ],
        }

    def explain(self) -> str:
        """A fixed-width table of every candidate's terms, the chosen one marked ``*``."""
        head = (
            f"{self.policy}: request {self.request_id} (L={self.length}) -> {self.worker} "
            f"(C={self.degree}, P={self.prefix_tokens}, R={self.uncached_tokens}, "
            f"s={self.predicted_s:.4f}s, reused {self.reused_blocks} blocks); "
            f"preferred degree {self.preferred_degree} ({self.preferred_worker}); "
            f"{self.objective} {self.score_label}"
        )
        if self.beta is not None:
            head += f" (β {self.beta:.4g})"
        if self.pulled_blocks:
            head += f"; counts on a pull of {self.pulled_blocks} blocks"
            if self.pull_wait_s:
                head += f", waiting {self.pull_wait_s:.4f}s for it"
        if self.note:
            head += f"; {self.note}"
        lines = [
            head,
            f"  {'worker':<16} {'C':>3} {'P':>8} {'R':>8} {'q':>9} {'s':>9} "
            f"{'extraGPU':>9} {self.score_label[:10]:>10}  excluded",
        ]

        def f(v: float | None) -> str:
            return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"

        def i(v: int | None) -> str:
            return "-" if v is None else str(v)

        for c in self.candidates:
            mark = "*" if c.worker == self.worker else " "
            lines.append(
                f"{mark} {c.worker:<16} {c.degree:>3} {i(c.prefix_tokens):>8} "
                f"{i(c.uncached_tokens):>8} {f(c.q):>9} {f(c.s):>9} {f(c.extra_gpu):>9} "
                f"{f(c.score):>10}  {'' if c.excluded is None else c.excluded}"
            )
        return "\n".join(lines)
