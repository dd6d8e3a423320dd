"""``round_robin``: the next eligible worker in view order after the last one chosen.

Source: the simplest router of every serving stack (e.g. vLLM production-stack ``roundrobin``,
peer-routing.md "Others"); a floor for comparisons, blind to load, cache and degree.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from services.scheduler.decision import Decision
from services.scheduler.evaluate import decide, evaluate
from services.scheduler.load import WorkerLoad
from services.scheduler.registry import register_policy
from services.scheduler.view import ClusterView, RequestInfo
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import RequestId, WorkerId


@register_policy("round_robin")
class RoundRobinPolicy:
    """Cycle over the view's workers, skipping ineligible ones."""

    def __init__(
        self, *, profile: Profile = DEFAULT_PROFILE, rng: random.Random | None = None
    ) -> None:
        self.profile = profile
        self._cursor = 0  # index into view.workers of the next worker to try

    @property
    def name(self) -> str:
        return "round_robin"

    def place(
        self,
        request: RequestInfo,
        view: ClusterView,
        held_blocks: Mapping[WorkerId, int],
        loads: Mapping[WorkerId, WorkerLoad],
        now: float,
    ) -> Decision:
        ev = evaluate(request, view, held_blocks, loads, now, self.profile)
        ev.require_eligible()
        n = len(ev.workers)
        start = self._cursor % n
        eligible = set(ev.eligible)
        chosen = next(i % n for i in range(start, start + n) if i % n in eligible)
        scores: list[float | None] = [None] * n
        scores[chosen] = 1.0
        self._cursor = chosen + 1  # mutate only after everything that can fail
        return decide("round_robin", ev, chosen, scores, objective="max", score_label="turn")

    def on_finish(self, request_id: RequestId, worker: WorkerId, now: float) -> None:
        return None
