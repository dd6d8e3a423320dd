"""``llmd``: llm-d inference scheduler, recommended profile "sticky until saturated".

Source: llm-d inference scheduler / router (peer-routing.md, "llm-d inference scheduler"):
``prefix-cache-affinity-filter`` + ``token-load-scorer`` + ``max-score-picker``.

* **prefix-cache-affinity-filter**: prefix score = matched blocks / request blocks; keep the
  endpoints ("sticky") with score ≥ ``affinity_threshold`` (0.80). With probability
  ``explore_probability`` (0.01) skip the filter (explore). If there are no sticky endpoints,
  keep all. Load gate: if the best sticky endpoint's predicted TTFT exceeds the best non-sticky
  one's by more than ``max_ttft_penalty_ms`` (5000 ms), break stickiness (keep all).
  Predicted TTFT here is the *fitted model's* q_w + s_{i,w} (the latency-predictor TTFT source
  of the filter; the scheduler never sees ground truth). The filter's other TTFT source,
  in-flight uncached tokens ÷ peakPrefillThroughput, would need a throughput calibration the
  fitted model already provides.
* **token-load-scorer**: score = 1 − min(1, tokens / ``queue_threshold_tokens``) where tokens =
  the endpoint's uncached prompt tokens in flight + this request's tokens the endpoint has not
  cached (R_{i,w}). Default queueThresholdTokens = 4,194,304 ("128 requests @ 32K per request",
  llm-d ``token-load-scorer`` source).
* **max-score-picker**: highest score, ties broken at random (seeded rng).

Random draws per placement, in order: one uniform for exploration; one choice among tied scores
only if there is a tie.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from services.scheduler.decision import Decision
from services.scheduler.evaluate import Evaluation, decide
from services.scheduler.load import WorkerLoad
from services.scheduler.policies.base import BaselinePolicy, check_int_at_least, draw_tie
from services.scheduler.registry import register_policy
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import InvalidInput, WorkerId

DEFAULT_QUEUE_THRESHOLD_TOKENS = 4_194_304


@register_policy("llmd")
class LlmdPolicy(BaselinePolicy):
    """Prefix-affinity filter with TTFT load gate, then token-load scorer, max-score picker."""

    policy_name = "llmd"

    def __init__(
        self,
        *,
        profile: Profile = DEFAULT_PROFILE,
        rng: random.Random | None = None,
        affinity_threshold: float = 0.80,
        explore_probability: float = 0.01,
        max_ttft_penalty_ms: float = 5000.0,
        queue_threshold_tokens: int = DEFAULT_QUEUE_THRESHOLD_TOKENS,
    ) -> None:
        for nm, v, hi in (
            ("affinity_threshold", affinity_threshold, 1.0),
            ("explore_probability", explore_probability, 1.0),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= v <= hi):
                raise InvalidInput(f"{nm} must be in [0, {hi}], got {v!r}")
        if not (
            isinstance(max_ttft_penalty_ms, (int, float))
            and math.isfinite(max_ttft_penalty_ms)
            and max_ttft_penalty_ms >= 0
        ):
            raise InvalidInput(f"max_ttft_penalty_ms must be >= 0, got {max_ttft_penalty_ms!r}")
        check_int_at_least("queue_threshold_tokens", queue_threshold_tokens, 1)
        self.profile = profile
        self.rng = rng if rng is not None else random.Random(0)
        self.affinity_threshold = float(affinity_threshold)
        self.explore_probability = float(explore_probability)
        self.max_ttft_penalty_ms = float(max_ttft_penalty_ms)
        self.queue_threshold_tokens = queue_threshold_tokens
        self.gate_breaks = 0  # how often the TTFT gate broke stickiness (llm-d exports this)

    def choose(self, ev: Evaluation, loads: Mapping[WorkerId, WorkerLoad]) -> Decision:
        request = ev.request
        n_blocks = len(request.block_hashes) or -(-request.length // ev.view.block_size)
        elig = ev.eligible
        # --- filter ---------------------------------------------------------------------
        explore = self.rng.random() < self.explore_probability
        sticky = [
            i for i in elig if min(ev.held[i], n_blocks) / n_blocks >= self.affinity_threshold
        ]
        kept = elig
        note = "no sticky endpoint"
        if explore:
            note = "explore (filter skipped)"
        elif sticky:
            kept = sticky
            note = f"{len(sticky)} sticky endpoint(s)"
            sticky_set = set(sticky)
            non_sticky = [i for i in elig if i not in sticky_set]
            if non_sticky and self.max_ttft_penalty_ms > 0:
                ttft = {i: ev.q[i] + ev.s[i] for i in elig}  # type: ignore[operator]
                gap_ms = 1000.0 * (min(ttft[i] for i in sticky) - min(ttft[i] for i in non_sticky))
                if gap_ms > self.max_ttft_penalty_ms:
                    kept = elig
                    self.gate_breaks += 1
                    note = (
                        f"stickiness broken (TTFT gap {gap_ms:.0f} ms > "
                        f"{self.max_ttft_penalty_ms:.0f} ms)"
                    )
        # --- scorer and picker ------------------------------------------------------------
        scores: list[float | None] = [None] * len(ev.workers)
        for i in kept:
            tokens = loads[ev.workers[i].worker_id].inflight_uncached_tokens + ev.uncached[i]  # type: ignore[operator]
            scores[i] = 1.0 - min(1.0, tokens / self.queue_threshold_tokens)
        top = max(scores[i] for i in kept)  # type: ignore[type-var]
        tied = [i for i in kept if scores[i] == top]
        chosen = draw_tie(self.rng, tied)
        return decide(
            self.name, ev, chosen, scores, objective="max", score_label="token_load", note=note
        )
