"""Shared per-candidate evaluation for the baselines: eligibility, P, R, q and s per worker.

The J-family (:mod:`services.scheduler.placement`) has its own specialised loop because it is
the hot path; the baselines share this one, which is written for clarity. ``s`` is always the
*fitted* model Ê (the baselines never see ground truth); a baseline that does not use s still
reports it so the scheduler can reserve the predicted work and traces compare like with like.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.scheduler.decision import CandidateColumns, Decision, Exclusion
from services.scheduler.eligibility import check_place_inputs, exclusion, reusable_prefix
from services.scheduler.errors import NoEligibleWorker
from services.scheduler.load import WorkerLoad
from services.scheduler.view import ClusterView, RequestInfo, WorkerView
from shared.costmodel import Profile
from shared.ids import WorkerId


@dataclass(slots=True)
class Evaluation:
    """Per-worker inputs of one placement, index-aligned with ``view.workers``."""

    request: RequestInfo
    view: ClusterView
    now: float
    workers: tuple[WorkerView, ...]
    excluded: list[Exclusion | None]
    held: list[int]
    prefix: list[int | None]
    uncached: list[int | None]
    q: list[float | None]
    s: list[float | None]
    eligible: list[int]  # indices of eligible workers, in view order

    def require_eligible(self) -> None:
        if not self.eligible:
            raise NoEligibleWorker(
                self.request.request_id,
                # The exclusions themselves, carried as data (every worker has one here: one
                # without is eligible).
                {w.worker_id: e for w, e in zip(self.workers, self.excluded, strict=True)
                 if e is not None},
            )


def evaluate(
    request: RequestInfo,
    view: ClusterView,
    held_blocks: Mapping[WorkerId, int],
    loads: Mapping[WorkerId, WorkerLoad],
    now: float,
    profile: Profile,
) -> Evaluation:
    """Validate the inputs and compute every worker's eligibility, P, R, q and s."""
    check_place_inputs(request, view, held_blocks, loads, now)
    L = request.length
    B = view.block_size
    n = len(view.workers)
    ev = Evaluation(
        request,
        view,
        now,
        view.workers,
        [None] * n,
        [0] * n,
        [None] * n,
        [None] * n,
        [None] * n,
        [None] * n,
        [],
    )
    for i, w in enumerate(view.workers):
        h = held_blocks.get(w.worker_id, 0)
        ev.held[i] = h
        reason = exclusion(w, L)
        if reason is not None:
            ev.excluded[i] = reason
            continue
        p = reusable_prefix(h, B, L)
        r = L - p
        ev.prefix[i] = p
        ev.uncached[i] = r
        ev.q[i] = loads[w.worker_id].queue_delay(now)
        ev.s[i] = profile.predict_fast(r, p, w.degree)
        ev.eligible.append(i)
    return ev


def decide(
    policy: str,
    ev: Evaluation,
    chosen: int,
    scores: Sequence[float | None],
    *,
    objective: str,
    score_label: str,
    note: str = "",
) -> Decision:
    """Build the :class:`Decision` of a baseline that picked index ``chosen``.

    A baseline has no preferred degree of its own: it reports the chosen worker's.
    """
    w = ev.workers[chosen]
    p = ev.prefix[chosen]
    r = ev.uncached[chosen]
    s = ev.s[chosen]
    assert p is not None and r is not None and s is not None  # chosen is eligible
    cols = CandidateColumns(
        workers=tuple(x.worker_id for x in ev.workers),
        degrees=tuple(x.degree for x in ev.workers),
        excluded=tuple(ev.excluded),
        q=tuple(ev.q),
        s=tuple(ev.s),
        extra_gpu=(None,) * len(ev.workers),
        score=tuple(scores),
        prefix_tokens=tuple(ev.prefix),
        uncached_tokens=tuple(ev.uncached),
    )
    return Decision(
        policy=policy,
        request_id=ev.request.request_id,
        length=ev.request.length,
        now=float(ev.now),
        worker=w.worker_id,
        degree=w.degree,
        prefix_tokens=p,
        uncached_tokens=r,
        predicted_s=s,
        reused_blocks=p // ev.view.block_size,
        preferred_degree=w.degree,
        preferred_worker=w.worker_id,
        objective="max" if objective == "max" else "min",
        score_label=score_label,
        columns=cols,
        note=note,
        epoch=w.epoch,
    )
