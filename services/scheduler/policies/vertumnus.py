"""Vertumnus's placement (§5.3) and the homogeneous-pool baselines that share it (§9.1).

``vertumnus``: minimum J over eligible workers of every degree (:func:`place_j`).

``homo`` / ``homo_cp2``: the paper's *Homo* baseline (§9.1, "all prefill workers are degree-4
workers") and the all-CP2 pool of peer-routing.md ("Homogeneous pools at every degree"). The
routing is the same J scheduler; with a single degree the extra-GPU term vanishes and J reduces
to q_w + β·s_{i,w} (peer-routing.md, "Homo": "the fair reading is Vertumnus's J ... the same
scheduler, no heterogeneity"). The pool's composition is the simulator's business; the policy
exposes ``pool_degree`` so a harness can build it.

Defaults β = 1.5, λ = 0.5 are PROVISIONAL: the paper gives no values (β ≥ 1, λ ≥ 0); they are to
be calibrated on the traces and recorded in the settings documentation (design.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Final

from services.scheduler.decision import Decision
from services.scheduler.load import WorkerLoad
from services.scheduler.placement import (
    PullCredit,
    check_beta_busy,
    check_beta_queue,
    check_weights,
    place_j,
)
from services.scheduler.registry import register_policy
from services.scheduler.view import ClusterView, RequestInfo
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import InvalidInput, RequestId, WorkerId

DEFAULT_BETA: Final[float] = 1.5  # provisional, see module docstring
DEFAULT_LAMBDA: Final[float] = 0.5  # provisional, see module docstring


class JPolicy:
    """Place by minimum J = q + β·s + λ·extraGPU (§5.3). Stateless."""

    counts_inflight_prefixes = True
    """SchedulerCore adds prefixes of unfinished requests on a worker to its reusable prefix
    (a FIFO worker will have cached them by the time this request starts)."""

    def __init__(
        self,
        *,
        profile: Profile = DEFAULT_PROFILE,
        rng: random.Random | None = None,
        beta: float = DEFAULT_BETA,
        lam: float = DEFAULT_LAMBDA,
        name: str = "vertumnus",
        pool_degree: int | None = None,
        beta_queue_scale: float = 0.0,
        beta_busy_power: float = 0.0,
        pull: PullCredit | None = None,
    ) -> None:
        check_weights(beta, lam)
        if pull is not None and not isinstance(pull, PullCredit):
            raise InvalidInput(f"pull must be a PullCredit, got {type(pull).__name__}")
        check_beta_queue(beta_queue_scale)
        check_beta_busy(beta_busy_power)
        self._name = name
        self.profile = profile
        self.beta = float(beta)
        self.lam = float(lam)
        self.beta_queue_scale = float(beta_queue_scale)
        """τ of the queue-following β (:func:`place_j`); 0: off."""
        self.beta_busy_power = float(beta_busy_power)
        """k of the busy-share β (:func:`place_j`); 0: off (β fixed, as in the paper)."""
        self.pool_degree = pool_degree
        """The homogeneous pool's degree this policy is evaluated on (None: any composition)."""
        self.pull = pull
        """J's credit for the cache manager's route-time pull (placement.py "Pull credit");
        None: J counts only what is held. Set it only where the cache manager pulls
        (:meth:`with_pull`)."""

    def with_pull(self, pull: PullCredit | None) -> JPolicy:
        """This policy with J's pull credit ``pull`` (None: without): a new policy, for a
        deployment whose cache manager runs the route-time pull with ``pull.min_blocks``."""
        return JPolicy(profile=self.profile, beta=self.beta, lam=self.lam, name=self._name,
                       pool_degree=self.pool_degree, beta_queue_scale=self.beta_queue_scale,
                       beta_busy_power=self.beta_busy_power, pull=pull)

    @property
    def name(self) -> str:
        return self._name

    def place(
        self,
        request: RequestInfo,
        view: ClusterView,
        held_blocks: Mapping[WorkerId, int],
        loads: Mapping[WorkerId, WorkerLoad],
        now: float,
        *,
        holdings: Mapping[WorkerId, int] | None = None,
        pending: Mapping[WorkerId, int] | None = None,
    ) -> Decision:
        """J's decision (:func:`place_j`); ``holdings``: the trie's own counts when
        ``held_blocks`` adds in-flight prefixes (the pull credit copies only what is held);
        ``pending``: what pending reconcile copies give each worker (with the credit only)."""
        return place_j(
            request,
            view,
            held_blocks,
            loads,
            now,
            profile=self.profile,
            beta=self.beta,
            lam=self.lam,
            policy=self._name,
            beta_queue_scale=self.beta_queue_scale,
            beta_busy_power=self.beta_busy_power,
            pull=self.pull,
            holdings=holdings,
            pending=pending,
        )

    def on_finish(self, request_id: RequestId, worker: WorkerId, now: float) -> None:
        return None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self._name!r}, beta={self.beta}, lam={self.lam}, "
                f"beta_queue_scale={self.beta_queue_scale}, "
                f"beta_busy_power={self.beta_busy_power}, pull={self.pull})")


@register_policy("vertumnus")
def make_vertumnus(
    *,
    profile: Profile = DEFAULT_PROFILE,
    rng: random.Random | None = None,
    beta: float = DEFAULT_BETA,
    lam: float = DEFAULT_LAMBDA,
    beta_queue_scale: float = 0.0,
    beta_busy_power: float = 0.0,
) -> JPolicy:
    """Vertumnus (§5.3): J over a heterogeneous pool."""
    return JPolicy(profile=profile, rng=rng, beta=beta, lam=lam, name="vertumnus",
                   beta_queue_scale=beta_queue_scale, beta_busy_power=beta_busy_power)


def _register_homo(name: str, default_degree: int, doc: str) -> Callable[..., JPolicy]:
    """Register ``name`` as J over a homogeneous pool and return its factory: the parameters
    of :func:`make_vertumnus` plus ``pool_degree`` (default ``default_degree``, the degree a
    harness builds the pool of). The homogeneous baselines differ only in name, default
    degree and source (``doc``, the factory's docstring)."""

    def make(
        *,
        profile: Profile = DEFAULT_PROFILE,
        rng: random.Random | None = None,
        beta: float = DEFAULT_BETA,
        lam: float = DEFAULT_LAMBDA,
        pool_degree: int = default_degree,
        beta_queue_scale: float = 0.0,
        beta_busy_power: float = 0.0,
    ) -> JPolicy:
        return JPolicy(
            profile=profile, rng=rng, beta=beta, lam=lam, name=name, pool_degree=pool_degree,
            beta_queue_scale=beta_queue_scale, beta_busy_power=beta_busy_power,
        )

    make.__name__ = make.__qualname__ = f"make_{name}"
    make.__doc__ = doc
    return register_policy(name)(make)


make_homo = _register_homo(
    "homo", 4, "Homo (§9.1): all-CP4 pool, routed by J (= q + β·s within one degree).")
make_homo_cp2 = _register_homo(
    "homo_cp2", 2,
    'All-CP2 pool (peer-routing.md, "Homogeneous pools at every degree"), routed by J.')
