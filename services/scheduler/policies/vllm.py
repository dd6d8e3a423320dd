"""``vllm``: vLLM's data-parallel load balancer over homogeneous TP workers (§9.1).

Source: vLLM ``vllm/v1/engine/core_client.py``, ``DPLBAsyncMPClient.get_core_engine_for_request``
(peer-routing.md, "vLLM"):

* score = waiting·4 + running, minimum wins; engines scanned from the client's start index
  (0 for a single front end), the first strict minimum kept;
* the (waiting, running) counts come from the DP coordinator, published about every 100 ms;
  between publications the client increments its local ``waiting`` for the engine it picked
  ("for better balancing between stats updates from the coordinator");
* not prefix-aware across engines: each engine has its own prefix cache (hash-keyed blocks,
  LRU) — so the request's reused prefix is whatever the *chosen* worker holds, and routing never
  looks at ``held_blocks``.

Snapshot timing: the core has no timer, so the snapshot is refreshed lazily — at the first
placement at or after each period boundary k·``refresh_period_s`` it is replaced by the true
counts at that placement's time. A harness with ticks may call :meth:`refresh` on each boundary
instead to observe the counts exactly at the boundary. The pool's workers are TP-4 (the
composition is the simulator's; ``pool_degree``/``pool_kind`` tell a harness what to build).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from services.scheduler.decision import Decision
from services.scheduler.evaluate import Evaluation, decide
from services.scheduler.load import WorkerLoad
from services.scheduler.policies.base import BaselinePolicy, check_int_at_least
from services.scheduler.registry import register_policy
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import InvalidInput, RequestId, WorkerId
from shared.worker import WorkerKind


@register_policy("vllm")
class VllmPolicy(BaselinePolicy):
    """Least ``waiting·w + running`` on a periodically refreshed count snapshot."""

    policy_name = "vllm"
    pool_kind = WorkerKind.TP

    def __init__(
        self,
        *,
        profile: Profile = DEFAULT_PROFILE,
        rng: random.Random | None = None,
        refresh_period_s: float = 0.1,
        waiting_weight: int = 4,
        pool_degree: int = 4,
    ) -> None:
        if not (
            isinstance(refresh_period_s, (int, float))
            and math.isfinite(refresh_period_s)
            and refresh_period_s > 0
        ):
            raise InvalidInput(
                f"refresh_period_s must be a positive number, got {refresh_period_s!r}"
            )
        check_int_at_least("waiting_weight", waiting_weight, 0)
        self.profile = profile
        self.refresh_period_s = float(refresh_period_s)
        self.waiting_weight = waiting_weight
        self.pool_degree = pool_degree
        self._counts: dict[WorkerId, list[int]] = {}  # worker -> [waiting, running] as seen
        self._next_refresh = -math.inf

    def counts(self, worker: WorkerId) -> tuple[int, int]:
        """The (waiting, running) the balancer currently believes for ``worker``."""
        c = self._counts.get(worker)
        return (c[0], c[1]) if c else (0, 0)

    def refresh(self, loads: Mapping[WorkerId, WorkerLoad], now: float) -> None:
        """Replace the snapshot with the true counts (a coordinator publication at ``now``)."""
        self._counts = {w: [ld.waiting, ld.running] for w, ld in loads.items()}
        self._next_refresh = (math.floor(now / self.refresh_period_s) + 1) * self.refresh_period_s

    def choose(self, ev: Evaluation, loads: Mapping[WorkerId, WorkerLoad]) -> Decision:
        now = ev.now
        if now >= self._next_refresh or any(w.worker_id not in self._counts for w in ev.workers):
            self.refresh(loads, now)
        scores: list[float | None] = [None] * len(ev.workers)
        best = -1
        best_score = math.inf
        for i in ev.eligible:  # view order = engine index order, start index 0
            waiting, running = self._counts[ev.workers[i].worker_id]
            score = waiting * self.waiting_weight + running
            scores[i] = float(score)
            if score < best_score:
                best, best_score = i, score
        self._counts[ev.workers[best].worker_id][0] += 1  # local optimistic increment
        return decide(
            self.name,
            ev,
            best,
            scores,
            objective="min",
            score_label=f"waiting*{self.waiting_weight}+running",
        )

    def on_finish(self, request_id: RequestId, worker: WorkerId, now: float) -> None:
        return None  # counts only change through the periodic snapshot, as in vLLM
