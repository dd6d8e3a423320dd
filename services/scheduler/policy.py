"""The interface every placement policy implements (Vertumnus and each baseline).

Shaped after the llm-d scheduler: a policy is a small object looked up by name in the registry
(:mod:`services.scheduler.registry`); inside, it is a filter (eligibility, shared by all) then
its own scorer and picker.

Contract of :meth:`Policy.place`:

* inputs — the request; the cluster view; ``held_blocks[w]`` = worker w's longest fully held,
  valid prefix of the request in blocks (from the prefix trie; absent = 0; workers outside the
  view ignored); the load tracker of every worker in the view; the current time ``now``;
* output — a :class:`~services.scheduler.decision.Decision` naming one eligible worker, with
  P, R and the fitted-model prediction s that the caller reserves on it;
* errors — :class:`~shared.ids.InvalidInput` / :class:`~shared.ids.UnknownWorker` on bad input,
  :class:`~services.scheduler.errors.NoEligibleWorker` when nothing may serve it; on error the
  policy's own state is unchanged;
* it never mutates ``loads``: reserving is the caller's job (:class:`SchedulerCore` does it), so
  a policy can also be asked "what would you do" without side effects on the cluster. A policy
  may update its *own* state (SGLang's approximate trees, vLLM's count snapshot, round-robin's
  cursor) — that is what it would do in production on routing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from services.scheduler.decision import Decision
from services.scheduler.load import WorkerLoad
from services.scheduler.view import ClusterView, RequestInfo
from shared.ids import RequestId, WorkerId


@runtime_checkable
class Policy(Protocol):
    """A request-placement policy. ``name`` is its registry name."""

    @property
    def name(self) -> str: ...

    def place(
        self,
        request: RequestInfo,
        view: ClusterView,
        held_blocks: Mapping[WorkerId, int],
        loads: Mapping[WorkerId, WorkerLoad],
        now: float,
    ) -> Decision: ...

    def on_finish(self, request_id: RequestId, worker: WorkerId, now: float) -> None:
        """The request finished on ``worker`` (prefill done). Stateless policies ignore it."""
        ...
