"""Execution backends of a rank daemon: what actually happens when a worker prefills.

:class:`ExecutionBackend` is the seam between the rankd adapter (NATS, FIFO, state, results)
and execution. Two implementations (design.md, layer 3), chosen by ``VTM_BACKEND``
(``RankdSettings.backend``) through :data:`BACKENDS`:

* ``sim`` (:class:`SimBackend`, here): computes nothing; sleeps for a modelled time × a time
  scale. The modelled prefill, KV handoff and first decode times come from callables given at
  construction. The simulator's ground truth (``sim.groundtruth``) is wired in by
  :mod:`vertumnus.live.rankd_sim` — what ``vertumnus rankd``, ``vertumnus up`` and
  docker-compose run — because nothing under ``services/`` imports ``sim/``
  (tests/sim_engine/test_sim_honesty.py). Without callables (:data:`BACKENDS`' ``sim``, i.e.
  ``python -m services.rankd.main``) it sleeps for the scheduler's prediction carried by the
  assignment, with 0 s of KV handoff and first decode: a harness whose time the caller sets
  through ``predicted_s``, not a model of any hardware.
* ``torch`` (:class:`services.rankd.torch_backend.TorchBackend`): real CP prefill over
  ``services/rankd/engine`` on persistent rank processes (one per GPU), KV handoff to a decode
  role and its first decode step; needs the ``engine`` extra (torch), imported lazily. One
  worker: :func:`~services.rankd.torch_backend.single_worker_backend`; a host
  (``VTM_HOST_GPUS``) shares one world among its workers:
  :func:`~services.rankd.torch_backend.serve_torch_host` (services/rankd/main.py).

Contract: ``prefill`` runs one request to completion (prefill, KV handoff, first decode) and
returns a :class:`PrefillResult` with measured wall-clock stage durations; it raises
:class:`~shared.ids.InvalidInput` for a request the backend cannot serve (then nothing ran).
Durations are wall seconds as measured (with a time scale s, modelled seconds = wall / s).
The three stages are consecutive: prefill starts at ``started_at_s``, the KV transfer at
``started_at_s + prefill_s``, the first decode after that, and the first token exists at
``finished_at_s`` (= the sum, up to clock rounding); the rank daemon turns them into the
``prefill``, ``kv_transfer`` and ``first_decode`` spans. Whatever came before the prefill
inside ``prefill`` (a lazy epoch switch: ``switch_s``, ending at ``started_at_s``) is queue
wait, in the stage breakdown and in the trace alike.

Faults: ``prefill`` raises :class:`~shared.ids.WorkerFault` (e.g. the torch world's
``WorldBroken``) when the *worker* can no longer compute — the request is not at fault; the
rank daemon hands it back to intake instead of answering it with an error, and stops for a
restart (services/rankd/service.py). Any other exception is the request's failure. A backend
may also offer ``health() -> WorkerFault | None`` (optional, non-blocking, called on the
event loop every :data:`~services.rankd.service.HEALTH_PERIOD_S`): a fault it returns is
handled the same way without waiting for a request to meet it.

Limits: a backend may offer ``max_seq_len`` (optional attribute or property, ``int | None``):
the longest prompt in tokens it serves (the torch backend: its model's
``max_position_embeddings`` once the world started), read at every state publication and
published as ``WorkerState.max_seq_len`` (:func:`services.rankd.service.backend_max_seq_len`)
so the scheduler never places a prompt the worker would refuse. Absent, None or < 1: not
known. A backend that gives one must raise :class:`~shared.ids.InvalidInput` from
``prefill`` for a longer prompt.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from shared.ids import InvalidInput
from shared.schemas import Assignment

if TYPE_CHECKING:
    from services.rankd.settings import RankdSettings

DEFAULT_VOCAB: Final[int] = 151_936  # Qwen3's vocabulary: fake tokens stay in a real range


class PrefillTimeFn(Protocol):
    """Modelled prefill time (s) of R new tokens after P cached ones on a degree-C worker.

    Matches ``sim.groundtruth.GroundTruth.prefill_time`` and ``NoisyGroundTruth.prefill_time``.
    """

    def __call__(self, r: int, p: int, degree: int, *, kind: str = "cp") -> float: ...


HandoffTimeFn = Callable[[int, int], float]
"""Modelled time (s) of a stage after the prefill for (total tokens, degree): the KV handoff
(e.g. ``GroundTruth.kv_handoff_time``) or the first decode step (e.g. a constant
``Surroundings.first_decode_s``)."""


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """Outcome of one request on one worker (service level, not the engine's per-rank result).

    ``*_s`` durations are measured wall seconds; ``modelled_*_s`` are what the backend was told
    to take before time scaling (equal to measured ones up to scheduling noise when scale = 1).
    """

    request_id: str
    token: int
    started_at_s: float
    prefill_s: float
    kv_transfer_s: float
    first_decode_s: float
    finished_at_s: float
    modelled_prefill_s: float
    modelled_handoff_s: float  # KV transfer + first decode
    rank_compute_s: tuple[float, ...] = ()
    """Measured compute seconds of each member rank in rank order (the torch engine's time in
    its step on that rank, wall seconds); empty where the ranks are not processes (sim)."""
    switch_s: float = 0.0
    """Wall seconds the worker spent bringing its ranks into the assignment's geometry (a
    lazy epoch switch: split or merge at the first step after an adoption) before the
    prefill, ending at ``started_at_s``. Part of the queue wait, not of the prefill: the
    stage breakdown counts it in ``queue_wait_s`` (it ends at ``started_at_s``) and the rank
    daemon records it as an ``epoch_switch`` span inside ``queue_wait``. 0: no switch (the
    sim backend never switches)."""


@runtime_checkable
class ExecutionBackend(Protocol):
    """What a rank daemon needs from an execution engine."""

    @property
    def name(self) -> str:
        """Registry name (``sim``, ``torch``), shown in micro metadata."""
        ...

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        """Run one assigned request to its first token. Called one at a time (FIFO)."""
        ...

    async def close(self) -> None:
        """Release resources (process groups, devices); idempotent."""
        ...


def fake_token(request_id: str, vocab: int = DEFAULT_VOCAB) -> int:
    """A deterministic stand-in first token (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % vocab


class SimBackend:
    """Sleeps for the modelled time × ``time_scale`` instead of computing.

    ``prefill_time`` (optional): modelled prefill seconds for (R, P, C, kind); default: the
    assignment's ``predicted_s`` (the scheduler's own estimate: no hardware is modelled, see
    the module docstring; :mod:`vertumnus.live.rankd_sim` passes the ground truth's).
    ``handoff_time`` (optional): modelled KV handoff seconds for (total tokens, C),
    reported as ``kv_transfer_s``; default 0. ``first_decode_time`` (optional): modelled first
    decode step for (total tokens, C), reported as ``first_decode_s``; default 0. (A caller
    with only the sum of the two, like ``external_time``, may pass it as ``handoff_time``.)

    NOTE: the scale multiplies sleeps only; a time_scale of 0.01 runs a trace 100× faster
    and every measured duration is then ~0.01× its modelled value.

    ``handoff_off_worker`` (default False): the KV handoff and first decode do not hold the
    worker. ``prefill`` then returns when the prefill ends, with the two later stages' scaled
    durations and a ``finished_at_s`` in the near future; the caller (rankd) frees the worker
    at once and publishes the first token at ``finished_at_s``. This is the simulator's
    model (sim/simulator.py frees a worker at its prefill's end and adds ``external_time`` to
    TTFT only): the KV streams to the decode side while the next prefill runs.

    ``kv_capacity_blocks`` (optional): the modelled worker's KV-cache capacity in blocks (e.g.
    the modelled GPUs' HBM budget for its degree). rankd sizes the worker's cache with it
    unless ``VTM_KV_TOTAL_BLOCKS`` is set; None leaves the setting's default.

    ``max_seq_len`` (optional): the modelled engine's context limit in tokens; a longer prompt
    is refused (:class:`~shared.ids.InvalidInput`, before any sleep) and rankd publishes the
    limit in its WorkerState. None (the default: the simulator's model, ``sim.groundtruth``,
    has no context limit) serves any length.
    """

    name: Final[str] = "sim"  # type: ignore[misc]

    def __init__(
        self,
        *,
        kind: str = "cp",
        prefill_time: PrefillTimeFn | None = None,
        handoff_time: HandoffTimeFn | None = None,
        first_decode_time: HandoffTimeFn | None = None,
        handoff_off_worker: bool = False,
        time_scale: float = 1.0,
        vocab: int = DEFAULT_VOCAB,
        clock: Callable[[], float] = time.time,
        kv_capacity_blocks: int | None = None,
        max_seq_len: int | None = None,
    ) -> None:
        if not time_scale > 0 or time_scale != time_scale:
            raise InvalidInput(f"time_scale must be > 0, got {time_scale}")
        for label, value in (("kv_capacity_blocks", kv_capacity_blocks),
                             ("max_seq_len", max_seq_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise InvalidInput(f"{label} must be an integer >= 1, got {value!r}")
        self.kv_capacity_blocks = kv_capacity_blocks
        self.max_seq_len = max_seq_len
        if vocab < 1:
            raise InvalidInput(f"vocab must be >= 1, got {vocab}")
        self._kind = kind
        self._prefill_time = prefill_time
        self._handoff_time = handoff_time
        self._first_decode_time = first_decode_time
        self.handoff_off_worker = handoff_off_worker
        self._scale = time_scale
        self._vocab = vocab
        self._clock = clock
        self._closed = False

    @property
    def time_scale(self) -> float:
        return self._scale

    def modelled_stages(self, a: Assignment) -> tuple[float, float, float]:
        """(prefill, KV transfer, first decode) modelled seconds; validates first."""
        if self.max_seq_len is not None and a.request.input_len > self.max_seq_len:
            raise InvalidInput(f"prompt of {a.request.input_len} tokens exceeds the modelled "
                               f"engine's max_seq_len {self.max_seq_len}")
        if self._prefill_time is not None:
            prefill = float(
                self._prefill_time(a.recompute_tokens, a.prefix_tokens, a.degree, kind=self._kind)
            )
        else:
            prefill = a.predicted_s
        total = a.request.input_len
        kv = float(self._handoff_time(total, a.degree)) if self._handoff_time else 0.0
        decode = float(self._first_decode_time(total, a.degree)) if self._first_decode_time else 0.0
        for label, value in (("prefill", prefill), ("KV transfer", kv), ("first decode", decode)):
            if not (value >= 0 and value != float("inf")):
                raise InvalidInput(f"modelled {label} time must be finite and >= 0, got {value}")
        return prefill, kv, decode

    def modelled_times(self, a: Assignment) -> tuple[float, float]:
        """(prefill, handoff = KV transfer + first decode) modelled seconds; validates first."""
        prefill, kv, decode = self.modelled_stages(a)
        return prefill, kv + decode

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        if self._closed:
            raise RuntimeError("backend closed")
        prefill_m, kv_m, decode_m = self.modelled_stages(assignment)
        started = self._clock()
        await asyncio.sleep(prefill_m * self._scale)
        prefilled = self._clock()
        if self.handoff_off_worker:
            kv_s, decode_s = kv_m * self._scale, decode_m * self._scale
            return PrefillResult(
                request_id=assignment.request.request_id,
                token=fake_token(assignment.request.request_id, self._vocab),
                started_at_s=started,
                prefill_s=prefilled - started,
                kv_transfer_s=kv_s,
                first_decode_s=decode_s,
                finished_at_s=prefilled + kv_s + decode_s,
                modelled_prefill_s=prefill_m,
                modelled_handoff_s=kv_m + decode_m,
            )
        if kv_m:
            await asyncio.sleep(kv_m * self._scale)
        transferred = self._clock()
        if decode_m:
            await asyncio.sleep(decode_m * self._scale)
        finished = self._clock()
        return PrefillResult(
            request_id=assignment.request.request_id,
            token=fake_token(assignment.request.request_id, self._vocab),
            started_at_s=started,
            prefill_s=prefilled - started,
            kv_transfer_s=transferred - prefilled,
            first_decode_s=finished - transferred,
            finished_at_s=finished,
            modelled_prefill_s=prefill_m,
            modelled_handoff_s=kv_m + decode_m,
        )

    async def close(self) -> None:
        self._closed = True


class BackendFactory(Protocol):
    """One worker's backend from its rank daemon's settings (``worker_id``, ``kind``, ...)."""

    def __call__(self, settings: RankdSettings) -> ExecutionBackend: ...


def sim_backend(settings: RankdSettings) -> ExecutionBackend:
    """``sim`` as the service builds it alone: timed by each assignment's ``predicted_s``
    (× ``VTM_TIME_SCALE``), no KV handoff or first decode time. ``services/`` cannot reach the
    simulator's ground truth; :mod:`vertumnus.live.rankd_sim` builds the ground-truth-timed one."""
    return SimBackend(kind=settings.kind.value, time_scale=settings.time_scale)


def torch_backend(settings: RankdSettings) -> ExecutionBackend:
    """``torch`` for one worker: a world over exactly its GPUs, started in its degree
    (blocking: spawns the rank processes)."""
    # Imported here: torch is the optional 'engine' extra, and importing it is slow.
    from services.rankd.torch_backend import single_worker_backend

    return single_worker_backend(settings)


BACKENDS: Final[Mapping[str, BackendFactory]] = MappingProxyType({
    "sim": sim_backend,
    "torch": torch_backend,
})
"""Backends by ``VTM_BACKEND`` name (the values ``RankdSettings.backend`` accepts), each as a
one-worker factory; :func:`services.rankd.main.make_backend` looks them up. NOTE: a torch
*host* does not build its workers here: they share one world (``serve_torch_host``)."""
