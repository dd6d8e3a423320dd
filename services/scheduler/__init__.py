"""Request-level scheduler (§5): pure core (view, load, placement, policies) + NATS adapter.

Public core API::

    from services.scheduler import (
        RequestInfo, WorkerView, ClusterView, WorkerLoad, Decision, SchedulerCore,
        make_policy, policy_names, register_policy, NoEligibleWorker, SequenceTooLong,
    )
"""

from services.scheduler.core import SchedulerCore
from services.scheduler.decision import CandidateTerms, Decision, Exclusion
from services.scheduler.errors import (
    DuplicateRequest,
    IllegalTransition,
    NoEligibleWorker,
    SequenceTooLong,
    UnknownPolicy,
    UnknownRequest,
)
from services.scheduler.load import LoadSnapshot, WorkerLoad
from services.scheduler.placement import place_j
from services.scheduler.policy import Policy
from services.scheduler.registry import make_policy, policy_names, register_policy
from services.scheduler.view import ClusterView, RequestInfo, WorkerView

__all__ = [
    "CandidateTerms",
    "ClusterView",
    "Decision",
    "DuplicateRequest",
    "Exclusion",
    "IllegalTransition",
    "LoadSnapshot",
    "NoEligibleWorker",
    "Policy",
    "RequestInfo",
    "SchedulerCore",
    "SequenceTooLong",
    "UnknownPolicy",
    "UnknownRequest",
    "WorkerLoad",
    "WorkerView",
    "make_policy",
    "place_j",
    "policy_names",
    "register_policy",
]
