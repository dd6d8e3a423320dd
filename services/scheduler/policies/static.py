"""*Static* baseline (§9.1): a length threshold picks the degree class, cache-aware within it.

Source: the paper, §9.1 — "Static uses the same worker composition as Vertumnus ... routes
requests using an input-length threshold profiled offline for each model and worker composition.
Requests longer than the threshold are assigned to workers with the larger CP degree, whereas the
remaining [go to the smaller]". Within a class it uses the production router's rule
(peer-routing.md, "Static" and "RTP-LLM FlexLB CostBasedPrefillStrategy"): predicted prefill
given that worker's own cache hit plus its wait, minimum wins — i.e. minimum q_w + s_{i,w}. A
cache-blind static would be a straw man.

Rule: among eligible workers let C_lo / C_hi be the smallest / largest degree; L > threshold →
the class of degree C_hi, else C_lo (with one degree both are the same). Within the class,
minimum q + s, ties by smaller degree then the request's rendezvous rank of the worker (as J,
:func:`~services.scheduler.placement.tie_rank`: idle cache-missing workers tie often at light
load, and a worker-id tie-break would pile them onto the lowest ids). Degrees strictly between
C_lo and C_hi (a three-degree pool) are never used, as in the paper's two-class rule.

Its s_{i,w} sees the same reusable prefix as J's (``counts_inflight_prefixes``): the worker's
cached prefix or, if longer, one shared with a request already queued or running there (a FIFO
worker will have cached it by the time this one starts; :class:`SchedulerCore`). Homo and
Vertumnus see that prefix; a Static that did not would spread a burst on one new document over
its class and recompute the document on each worker, which is the straw man the note rules out.

``threshold_tokens`` is a parameter: the simulator profiles it offline (best mean TTFT of a few
candidate lengths at a rate below saturation, peer-routing.md). The default 16,384 is only a
placeholder for unit use.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from services.scheduler.decision import Decision
from services.scheduler.evaluate import Evaluation, decide
from services.scheduler.load import WorkerLoad
from services.scheduler.placement import tie_rank
from services.scheduler.policies.base import BaselinePolicy, check_int_at_least
from services.scheduler.registry import register_policy
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import WorkerId


@register_policy("static")
class StaticPolicy(BaselinePolicy):
    """Length-threshold degree class, then minimum q + s (FlexLB-style) inside it."""

    policy_name = "static"

    counts_inflight_prefixes = True
    """As J's: SchedulerCore adds the prefixes of unfinished requests on a worker to its
    reusable prefix (module docstring)."""

    def __init__(
        self,
        *,
        profile: Profile = DEFAULT_PROFILE,
        rng: random.Random | None = None,
        threshold_tokens: int = 16_384,
    ) -> None:
        check_int_at_least("threshold_tokens", threshold_tokens, 0)
        self.profile = profile
        self.threshold_tokens = threshold_tokens

    def choose(self, ev: Evaluation, loads: Mapping[WorkerId, WorkerLoad]) -> Decision:
        request = ev.request
        degs = [ev.workers[i].degree for i in ev.eligible]
        long_req = request.length > self.threshold_tokens
        cls = max(degs) if long_req else min(degs)
        scores: list[float | None] = [None] * len(ev.workers)
        best = -1
        best_key: tuple[float, int, int, str] | None = None
        for i in ev.eligible:
            w = ev.workers[i]
            if w.degree != cls:
                continue
            cost = ev.q[i] + ev.s[i]  # type: ignore[operator]
            scores[i] = cost
            key = (cost, w.degree, tie_rank(request.request_id, w.worker_id), w.worker_id)
            if best_key is None or key < best_key:
                best, best_key = i, key
        note = f"L {'>' if long_req else '<='} threshold {self.threshold_tokens} -> class C={cls}"
        return decide(self.name, ev, best, scores, objective="min", score_label="q+s", note=note)
