"""Identities and units shared by every core and service.

Units (design.md): seconds (float) for time, tokens (int) for lengths, one cache block = B
tokens (default 512). A block's identity is a hash chained over every preceding token, so equal
hash <=> equal prefix; in traces the ``hash_ids`` are those identities.
"""

from __future__ import annotations

from typing import Final, NewType

WorkerId = NewType("WorkerId", str)
"""A prefill worker, e.g. ``"w-cp4-g8"`` (degree 4 over GPUs [8, 12))."""

RequestId = NewType("RequestId", str)
BlockHash = NewType("BlockHash", int)
"""Chained hash of one full cache block (and, through the chain, of its whole prefix)."""

Degree = NewType("Degree", int)
"""A CP degree C (number of ranks of a worker)."""

DEFAULT_BLOCK_SIZE: Final[int] = 512
"""Tokens per cache block; the Mooncake traces' block size."""

GPUS_PER_NODE: Final[int] = 8

DEFAULT_DEGREES: Final[tuple[int, ...]] = (2, 4)
"""Supported CP degrees when none are configured (the paper's Qwen3 pool, §9). The scheduler,
controller and cache manager all default to it: the controller reads the scheduler's demand
breakdown only when both use the same degrees, and the cache manager keeps statistics only
for the degrees it knows, so standalone services must agree without being told."""


class VertumnusError(Exception):
    """Base of every typed error the cores raise on bad input or illegal operations.

    NOTE: a core that raises one of these has changed nothing (validate first, then mutate).
    """


class InvalidInput(VertumnusError, ValueError):
    """An argument is malformed (negative length, degree outside the set, bad event...)."""


class WorkerFault(VertumnusError):
    """The *worker* can no longer compute (a rank process died, a device failed, its
    collectives are broken): the request that met it is not at fault and must not be failed.

    Raised by an execution backend (``services.rankd.torch_world.WorldBroken`` derives from
    it). A rank daemon hands the request back to intake with the rest of its queue, stops
    admitting and exits non-zero so that its supervisor restarts it (services/rankd/service.py).
    Unlike other VertumnusErrors it says nothing about the caller's input or the state a core
    was asked to change."""


class UnknownWorker(VertumnusError, KeyError):
    """A worker id the core has never been told about."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown worker"


def worker_name(degree: int, first_gpu: int) -> WorkerId:
    """Canonical worker id for the lattice group [first_gpu, first_gpu + degree)."""
    return WorkerId(f"w-cp{degree}-g{first_gpu}")


def tp_worker_name(degree: int, first_gpu: int) -> WorkerId:
    """Id of a tensor-parallel worker (the vLLM-like baseline's) on the same group."""
    return WorkerId(f"w-tp{degree}-g{first_gpu}")
