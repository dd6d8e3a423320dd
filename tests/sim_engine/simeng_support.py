"""Helpers of the simulator tests (unique module name: pytest runs with import-mode=importlib)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import pytest

from services.controller.lattice import Composition, Lattice
from shared.costmodel import Profile
from sim.groundtruth import GroundTruth
from sim.simulator import RequestRecord, SimConfig, SimResult, Simulator
from sim.workloads import Phase, Request, SyntheticConfig, Workload

WORKER_ID = re.compile(r"^w-(cp|tp)(\d+)-g(\d+)$")

# A calm phase (few, mostly short requests) followed by a heavy, longer-request phase: the
# controller has reasons to move (measured: splits and merges on a 16-GPU {2,4} pool).
CALM_THEN_HEAVY = SyntheticConfig(
    duration_s=200.0,
    rate=4.0,
    phases=(Phase(100.0, 0.2, 0.0), Phase(100.0, 3.0, 0.3)),
)

B = 512
HANG_GUARD_EVENTS = 2_000_000  # timed events; a test run schedules thousands


def uniform(gpus: int, degrees: tuple[int, ...], degree: int) -> Composition:
    return Composition.uniform(Lattice(gpus, degrees), degree)


class SimulationHung(AssertionError):
    pass


@contextmanager
def hang_guard(max_events: int = HANG_GUARD_EVENTS) -> Iterator[None]:
    """Turn a simulation that never terminates into a failure instead of a stuck suite.

    Counts the timed events (windows, scans, transfers, drains: every ``Simulator._push``)
    the simulations in the block schedule, in this process, and fails at ``max_events``: an
    endless event loop (see test_failed_placement_terminates) reschedules its window or scan
    for ever, while a run of these tests schedules a few thousand. A bound on work done, not
    on wall time, so a slow machine cannot fail it. Simulations in worker processes are not
    counted (pytest-timeout stops those)."""
    orig = Simulator._push
    count = 0

    def counted(self: Simulator, t: float, kind: int, a: object = None, b: object = None) -> None:
        nonlocal count
        count += 1
        if count > max_events:
            raise SimulationHung(f"over {max_events} events scheduled (simulated time {t:.0f} "
                                 "s): endless event loop")
        orig(self, t, kind, a, b)

    Simulator._push = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        Simulator._push = orig  # type: ignore[method-assign]


def run(
    workload: Workload,
    profile: Profile,
    composition: Composition | None = None,
    truth: GroundTruth | None = None,
    max_events: int = HANG_GUARD_EVENTS,
    **cfg: object,
) -> SimResult:
    """Simulate ``workload``; ``composition`` defaults to all of the largest degree."""
    conf = SimConfig(**cfg)  # type: ignore[arg-type]
    comp = composition or uniform(conf.gpus, conf.degrees, max(conf.degrees))
    with hang_guard(max_events):
        return Simulator(conf, profile, truth).run(workload, comp)


def worker_geometry(worker: str) -> tuple[str, int, int]:
    """(kind, degree, first GPU) parsed from a worker id like ``w-cp4-g8``."""
    m = WORKER_ID.match(worker)
    assert m, f"unexpected worker id {worker!r}"
    return m.group(1), int(m.group(2)), int(m.group(3))


def worker_gpus(worker: str) -> range:
    """The GPUs ``worker`` (an id like ``w-cp4-g8``) runs on."""
    _, c, first = worker_geometry(worker)
    return range(first, first + c)


PHASED_GPUS = 16
PHASED_WINDOW_S = 20.0


def phased_adaptive_run(workload: Workload, profile: Profile, start: str,
                        **cfg: object) -> SimResult:
    """The reconfiguring run of the controller tests: a :data:`PHASED_GPUS`-GPU {2, 4} pool
    starting at composition ``start`` (``"4CP4"``), under the controller (windows of
    :data:`PHASED_WINDOW_S`) and the cache manager, seed 0; ``cfg``: more SimConfig fields."""
    comp = Composition.parse(Lattice(PHASED_GPUS, (2, 4)), start)
    return run(workload, profile, composition=comp, gpus=PHASED_GPUS, degrees=(2, 4),
               adaptive=True, cache_manager=True, window_s=PHASED_WINDOW_S, seed=0, **cfg)


def by_id(workload: Workload) -> dict[str, Request]:
    return {r.request_id: r for r in workload.requests}


def record_tuple(r: RequestRecord) -> tuple:
    return (
        r.request_id,
        r.arrival_s,
        r.input_len,
        r.worker,
        r.degree,
        r.reused_tokens,
        r.predicted_s,
        r.actual_s,
        r.start_s,
        r.finish_s,
        r.ttft_s,
        r.redirected,
        r.failed,
    )


def result_signature(res: SimResult) -> tuple:
    """Everything observable of a run, as plain comparable data."""
    return (
        tuple(record_tuple(r) for r in res.records),
        tuple(
            (rc.kind, rc.sources, rc.targets, rc.decided_s, rc.drained_s, rc.exposed_s, rc.reason)
            for rc in res.reconfigurations
        ),
        tuple((t, tuple(sorted(c.items()))) for t, c in res.composition_timeline),
        res.gpu_seconds,
        res.replications,
        res.reclamations,
        res.reconcile_transfers,
        res.end_s,
    )


def unique_prefix_workload(
    lengths: Iterable[int], gap_s: float, *, start_s: float = 0.0, name: str = "unique"
) -> Workload:
    """Requests with pairwise-disjoint block ids (no prefix sharing), ``gap_s`` apart."""
    reqs = []
    next_id = 1
    for i, L in enumerate(lengths):
        n = L // B
        ids = tuple(range(next_id, next_id + n))
        next_id += n + 1
        reqs.append(Request(f"u{i}", start_s + i * gap_s, L, 1, ids))
    return Workload(name, tuple(reqs))


def prefix_candidates(profile: Profile, L: int, degree: int) -> set[float]:
    """Ê_C(L − P, P) for every P the scheduler could have matched (whole blocks, ≤ L − 1)."""
    ps = {min(k * B, L - 1) for k in range(L // B + 1)}
    return {profile.predict(L - p, p, degree) for p in ps}


def degree_counts_cover(counts: Mapping[int, int]) -> int:
    return sum(d * n for d, n in counts.items())


def check_records(
    res: SimResult, workload: Workload, *, gpus: int, truth: GroundTruth | None = None
) -> None:
    """The conservation / sanity invariants every run must satisfy."""
    gt = truth or GroundTruth()
    reqs = by_id(workload)
    ids = [r.request_id for r in res.records]
    assert len(ids) == len(set(ids)), "a request has more than one record"
    assert set(ids) == set(reqs), "records and workload requests differ"
    per_worker: dict[str, list[tuple[float, float]]] = defaultdict(list)
    gpu_s = 0.0
    for r in res.records:
        req = reqs[r.request_id]
        assert r.arrival_s == req.arrival_s and r.input_len == req.input_len
        assert r.ttft_s >= 0 and not r.failed, f"{r.request_id} did not complete: {r.failed}"
        assert r.start_s >= r.arrival_s
        assert r.actual_s > 0
        assert r.finish_s == pytest.approx(r.start_s + r.actual_s, rel=0, abs=1e-9)
        ext = gt.external_time(r.input_len, r.degree)
        assert r.ttft_s == pytest.approx(r.finish_s + ext - r.arrival_s, rel=0, abs=1e-9)
        assert 0 <= r.reused_tokens <= r.input_len - 1
        # Only whole blocks are reused; a full-prefix hit is capped at L − 1 (R ≥ 1).
        assert r.reused_tokens % B == 0 or r.reused_tokens == r.input_len - 1
        assert r.reused_tokens <= len(req.block_hashes) * B
        kind, degree, first = worker_geometry(r.worker)
        assert degree == r.degree, f"{r.worker} is not a degree-{r.degree} worker"
        assert first % degree == 0 and first + degree <= gpus, f"{r.worker} not in the lattice"
        assert r.predicted_s > 0
        per_worker[r.worker].append((r.start_s, r.finish_s))
        gpu_s += r.actual_s * r.degree
    assert res.gpu_seconds == pytest.approx(gpu_s, rel=1e-9)
    # A worker runs one prefill at a time (batch 1): its executions never overlap.
    for w, spans in per_worker.items():
        spans.sort()
        for (s0, f0), (s1, _) in zip(spans, spans[1:], strict=False):
            assert s1 >= f0 - 1e-9, f"{w} ran two prefills at once ({s0}-{f0} and {s1})"
    assert res.end_s >= max(r.finish_s for r in res.records) - 1e-9
