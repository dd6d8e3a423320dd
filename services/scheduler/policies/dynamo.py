"""``dynamo``: NVIDIA Dynamo's KV router cost (peer-routing.md, "NVIDIA Dynamo KV router").

Source: Dynamo ``docs/components/router/router-concepts.md`` and ``router-design.md``:

    raw_prefill_blocks      = active_prefill_blocks + incoming_prompt_blocks
    adjusted_prefill_blocks = max(raw_prefill_blocks − overlap_credit·device_overlap_blocks, 0)
    decode_blocks           = active_decode_blocks + incoming_active_blocks
    cost = prefill_load_scale·adjusted_prefill_blocks + decode_blocks          (lowest wins)

Defaults: overlap_score_credit 1.0, prefill_load_scale 1.0, router_temperature 0 (greedy, ties
drawn at random); temperature > 0 samples from softmax(−cost/temperature) with the costs first
normalised by their range (max − min), as Dynamo's softmax sampler does, using the seeded rng.

Mapping to a prefill-only pool (peer-routing.md: "the decode term is the worker's active
blocks"):

* ``active_prefill_blocks`` = Σ uncached tokens R of the worker's unfinished requests / B
  (Dynamo tracks prefill *tokens* until the request's prefill completes, converted to blocks);
* ``incoming_prompt_blocks`` = L / B; ``device_overlap_blocks`` = the worker's exact held blocks
  (Dynamo's global index is exact, fed by KV events — our ``held_blocks`` is that index);
* ``active_decode_blocks`` = the distinct KV blocks the worker's unfinished requests occupy,
  and ``incoming_active_blocks`` = the request's blocks not among them: Dynamo's
  ``ActiveSequences`` keeps the *unique* blocks of a worker's active sequences, and its
  ``new_blocks`` counts only the request's blocks missing from that set (``lib/kv-router``
  ``sequence.rs``), so a worker already prefilling the request's prefix is charged less. A
  full block is its prefix-chained hash; a partial last block belongs to one request only.
  Through :class:`~services.scheduler.core.SchedulerCore` (``reads_inflight_blocks``) the
  active set is the core's in-flight index (with several scheduler replicas, the others'
  requests too, as Dynamo's router replica sync shares active sequences). Called without it
  (a direct ``place``), the decode term falls back to Σ ⌈L_j/B⌉ + ⌈L/B⌉, no de-duplication.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from services.scheduler.decision import Decision
from services.scheduler.evaluate import decide, evaluate
from services.scheduler.load import WorkerLoad
from services.scheduler.policies.base import BaselinePolicy, draw_tie
from services.scheduler.registry import register_policy
from services.scheduler.view import ClusterView, RequestInfo
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import BlockHash, InvalidInput, WorkerId


def dynamo_cost(
    *,
    active_prefill_tokens: int,
    active_blocks: int,
    length: int,
    overlap_blocks: int,
    block_size: int,
    overlap_credit: float = 1.0,
    prefill_load_scale: float = 1.0,
    active_shared_blocks: int = 0,
) -> float:
    """Dynamo's cost of one worker for one request (module docstring), in blocks.
    ``active_blocks``: the worker's distinct active blocks; ``active_shared_blocks``: how many
    of the request's blocks are among them (not new: not charged again)."""
    raw_prefill = active_prefill_tokens / block_size + length / block_size
    adjusted = max(raw_prefill - overlap_credit * overlap_blocks, 0.0)
    decode = active_blocks + -(-length // block_size) - active_shared_blocks
    return prefill_load_scale * adjusted + decode


@register_policy("dynamo")
class DynamoPolicy(BaselinePolicy):
    """Lowest Dynamo cost (or softmax sampling at temperature > 0). Overrides
    :meth:`~BaselinePolicy.place` for the in-flight block index."""

    policy_name = "dynamo"

    reads_inflight_blocks = True
    """SchedulerCore passes its in-flight block index (``inflight_blocks``,
    ``inflight_tails``): Dynamo's active sequences (module docstring)."""

    def __init__(
        self,
        *,
        profile: Profile = DEFAULT_PROFILE,
        rng: random.Random | None = None,
        overlap_credit: float = 1.0,
        prefill_load_scale: float = 1.0,
        temperature: float = 0.0,
    ) -> None:
        for nm, v in (
            ("overlap_credit", overlap_credit),
            ("prefill_load_scale", prefill_load_scale),
            ("temperature", temperature),
        ):
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
            ):
                raise InvalidInput(f"{nm} must be a finite number >= 0, got {v!r}")
        self.profile = profile
        self.rng = rng if rng is not None else random.Random(0)
        self.overlap_credit = float(overlap_credit)
        self.prefill_load_scale = float(prefill_load_scale)
        self.temperature = float(temperature)

    def place(
        self,
        request: RequestInfo,
        view: ClusterView,
        held_blocks: Mapping[WorkerId, int],
        loads: Mapping[WorkerId, WorkerLoad],
        now: float,
        *,
        inflight_blocks: Mapping[WorkerId, Mapping[BlockHash, int]] | None = None,
        inflight_tails: Mapping[WorkerId, int] | None = None,
    ) -> Decision:
        """``inflight_blocks[w]``: the full blocks of the unfinished requests on w (hash ->
        how many hold it); ``inflight_tails[w]``: how many of them end in a partial block.
        Both or neither (None: no de-duplication; module docstring)."""
        if (inflight_blocks is None) != (inflight_tails is None):
            raise InvalidInput("inflight_blocks and inflight_tails go together")
        ev = evaluate(request, view, held_blocks, loads, now, self.profile)
        ev.require_eligible()
        B = view.block_size
        mine = request.block_hashes[: request.length // B]
        scores: list[float | None] = [None] * len(ev.workers)
        costs: list[float] = []
        for i in ev.eligible:
            wid = ev.workers[i].worker_id
            ld = loads[wid]
            if inflight_blocks is None or inflight_tails is None:
                active, shared = ld.inflight_blocks, 0
            else:
                idx = inflight_blocks.get(wid)
                if idx:
                    active = len(idx) + inflight_tails.get(wid, 0)
                    shared = sum(1 for h in mine if h in idx)
                else:
                    active, shared = inflight_tails.get(wid, 0), 0
            c = dynamo_cost(
                active_prefill_tokens=ld.inflight_uncached_tokens,
                active_blocks=active,
                length=request.length,
                overlap_blocks=ev.held[i],
                block_size=B,
                overlap_credit=self.overlap_credit,
                prefill_load_scale=self.prefill_load_scale,
                active_shared_blocks=shared,
            )
            scores[i] = c
            costs.append(c)
        if self.temperature == 0.0:
            lo = min(costs)
            tied = [k for k, c in enumerate(costs) if c == lo]
            k = draw_tie(self.rng, tied)
            note = "greedy"
        else:
            lo, hi = min(costs), max(costs)
            if hi == lo:
                weights = [1.0] * len(costs)
            else:
                z = [-(c / (hi - lo)) / self.temperature for c in costs]
                m = max(z)
                weights = [math.exp(v - m) for v in z]
            k = self.rng.choices(range(len(costs)), weights=weights)[0]
            note = f"softmax sample at temperature {self.temperature}"
        return decide(
            self.name,
            ev,
            ev.eligible[k],
            scores,
            objective="min",
            score_label="cost_blocks",
            note=note,
        )
