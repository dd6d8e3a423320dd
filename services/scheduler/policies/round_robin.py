"""``round_robin``: the next eligible worker in view order after the last one chosen.

Source: the simplest router of every serving stack (e.g. vLLM production-stack ``roundrobin``,
peer-routing.md "Others"); a floor for comparisons, blind to load, cache and degree.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from services.scheduler.decision import Decision
from services.scheduler.evaluate import Evaluation, decide
from services.scheduler.load import WorkerLoad
from services.scheduler.policies.base import BaselinePolicy
from services.scheduler.registry import register_policy
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import WorkerId


@register_policy("round_robin")
class RoundRobinPolicy(BaselinePolicy):
    """Cycle over the view's workers, skipping ineligible ones."""

    policy_name = "round_robin"

    def __init__(
        self, *, profile: Profile = DEFAULT_PROFILE, rng: random.Random | None = None
    ) -> None:
        self.profile = profile
        self._cursor = 0  # index into view.workers of the next worker to try

    def choose(self, ev: Evaluation, loads: Mapping[WorkerId, WorkerLoad]) -> Decision:
        n = len(ev.workers)
        start = self._cursor % n
        eligible = set(ev.eligible)
        chosen = next(i % n for i in range(start, start + n) if i % n in eligible)
        scores: list[float | None] = [None] * n
        scores[chosen] = 1.0
        self._cursor = chosen + 1  # mutate only after everything that can fail
        return decide(self.name, ev, chosen, scores, objective="max", score_label="turn")
