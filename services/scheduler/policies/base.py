"""What the baseline policies share: the ``place`` shell, an argument check and the tie draw.

Every baseline of §9.1 and peer-routing.md (``static``, ``vllm``, ``sglang``, ``dynamo``,
``llmd``, ``round_robin``) places the same way up to its own rule: evaluate every worker
(:func:`~services.scheduler.evaluate.evaluate`: eligibility, P, R, q and s), refuse a request
no worker may serve, then score and pick among the eligible workers. :class:`BaselinePolicy`
is that shell; a baseline supplies only the scoring and picking (:meth:`BaselinePolicy.choose`).
The J family (:mod:`services.scheduler.policies.vertumnus`) has its own loop and does not use it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import ClassVar, TypeVar

from services.scheduler.decision import Decision
from services.scheduler.evaluate import Evaluation, evaluate
from services.scheduler.load import WorkerLoad
from services.scheduler.view import ClusterView, RequestInfo
from shared.costmodel import Profile
from shared.ids import InvalidInput, RequestId, WorkerId

T = TypeVar("T")


class BaselinePolicy:
    """The :class:`~services.scheduler.policy.Policy` shell of a baseline.

    Contract for a subclass: set ``policy_name`` (its registry name, reported as ``name`` and
    as the decision's policy), set ``self.profile`` (the *fitted* model) in its constructor,
    and implement :meth:`choose`. :meth:`place` validates the inputs and raises
    :class:`~services.scheduler.errors.NoEligibleWorker` *before* calling :meth:`choose`, so
    on those errors the policy's own state is unchanged (the Policy contract). A policy whose
    ``place`` takes more inputs (Dynamo's in-flight blocks) overrides it whole.
    :meth:`on_finish` does nothing: the baselines keep no per-request state (in-flight counts
    live in the caller's load tracker).
    """

    policy_name: ClassVar[str]
    profile: Profile

    @property
    def name(self) -> str:
        return self.policy_name

    def place(
        self,
        request: RequestInfo,
        view: ClusterView,
        held_blocks: Mapping[WorkerId, int],
        loads: Mapping[WorkerId, WorkerLoad],
        now: float,
    ) -> Decision:
        """Evaluate every worker under ``self.profile`` (bad input: InvalidInput /
        UnknownWorker), refuse with NoEligibleWorker when none may serve, else
        :meth:`choose`."""
        ev = evaluate(request, view, held_blocks, loads, now, self.profile)
        ev.require_eligible()
        return self.choose(ev, loads)

    def choose(self, ev: Evaluation, loads: Mapping[WorkerId, WorkerLoad]) -> Decision:
        """Score and pick among ``ev.eligible`` (never empty); ``ev`` carries the request,
        the view and the time. May update the policy's own state, never ``loads``."""
        raise NotImplementedError

    def on_finish(self, request_id: RequestId, worker: WorkerId, now: float) -> None:
        return None


def check_int_at_least(name: str, value: object, minimum: int) -> None:
    """InvalidInput unless ``value`` is an ``int`` (a bool is not) of at least ``minimum``;
    the message names the parameter as the policy's keyword argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(f"{name} must be an integer >= {minimum}, got {value!r}")


def draw_tie(rng: random.Random, tied: Sequence[T]) -> T:
    """The single element of ``tied``, or one drawn with ``rng`` among several. The rng
    advances only on an actual tie: the baselines' documented draw order (and so a seeded
    run's results) depends on it."""
    return tied[0] if len(tied) == 1 else rng.choice(tied)
