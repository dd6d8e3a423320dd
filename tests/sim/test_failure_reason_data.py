"""Why a simulated request failed is recorded from the scheduler's exception, not its text.

Regression: the results' ``failed_by_reason`` was derived by regex over the message of the
scheduler's :class:`NoEligibleWorker` (``sim.metrics.failure_reason``), so a refusal worded
otherwise counted as ``other``. The simulator now records the key when the request fails
(``RequestRecord.failed_reason``, from the exception's ``exclusions`` / ``no_workers``); the
per-request log carries it in a ``failed_reason`` column, and a log written before that column
(the message alone) is still read by its text.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.controller.lattice import Composition, Lattice
from services.scheduler import Exclusion, NoEligibleWorker
from services.scheduler.decision import Decision
from services.scheduler.load import WorkerLoad
from services.scheduler.registry import register_policy, unregister_policy
from services.scheduler.view import ClusterView, RequestInfo
from shared.costmodel import Coefficients, Profile
from shared.ids import RequestId, WorkerId
from shared.slo import QWEN3_SLO
from sim.experiments import summarize_run
from sim.metrics import OTHER, failures_by_reason, refusal_reason
from sim.request_log import REQUEST_KEYS, logged_failure_reason, request_rows, write_request_log
from sim.simulator import RequestRecord, SimConfig, SimResult, Simulator
from sim.workloads import Request, Workload

# A fitted model of round numbers: the runs here place nothing by it or refuse everything.
PROFILE = Profile(coefficients=Coefficients(d=0.1, a=1e-5, b=1e-6, c=2e-5, alpha=1e-9))
B = PROFILE.block_size


class _Reworded(NoEligibleWorker):
    """The scheduler's refusal with a message in other words (the data is the same)."""

    def __init__(self, request_id: RequestId,
                 reasons: Mapping[WorkerId, Exclusion | str]) -> None:
        super().__init__(request_id, reasons)
        self.args = (f"cannot place {request_id}: every worker turned it down",)


# Request index -> the exclusions the test policy refuses it with, worker by worker in turn.
_REFUSALS: tuple[tuple[Exclusion, ...], ...] = (
    (Exclusion.NO_MEMORY,),
    (Exclusion.NO_MEMORY, Exclusion.TOO_LONG),
    (Exclusion.SWITCHING, Exclusion.DRAINING),
    (),  # no workers
)
_POLICY = "test_reworded_refusal"


class _RewordedRefusal:
    """A policy that refuses every request with :class:`_Reworded` (``u<i>`` with
    ``_REFUSALS[i]``)."""

    name = _POLICY

    def __init__(self, **_: Any) -> None:
        pass

    def place(self, request: RequestInfo, view: ClusterView, held_blocks: Mapping[WorkerId, int],
              loads: Mapping[WorkerId, WorkerLoad], now: float) -> Decision:
        why = _REFUSALS[int(request.request_id[1:])]
        reasons = {w.worker_id: why[k % len(why)] for k, w in enumerate(view.workers)} \
            if why else {}
        raise _Reworded(request.request_id, reasons)

    def on_finish(self, request_id: RequestId, worker: WorkerId, now: float) -> None:
        pass


@pytest.fixture
def reworded_policy() -> Iterator[str]:
    register_policy(_POLICY)(_RewordedRefusal)
    try:
        yield _POLICY
    finally:
        unregister_policy(_POLICY)


def _workload(lengths: list[int]) -> Workload:
    reqs, first = [], 1
    for i, n in enumerate(lengths):
        blocks = n // B
        reqs.append(Request(f"u{i}", float(i), n, 1, tuple(range(first, first + blocks))))
        first += blocks + 1
    return Workload("unique", tuple(reqs))


def _simulate(wl: Workload, **cfg: Any) -> SimResult:
    conf = SimConfig(gpus=8, degrees=(2, 4), **cfg)
    return Simulator(conf, PROFILE).run(wl, Composition.uniform(Lattice(8, (2, 4)), 4))


def _row(res: SimResult) -> dict[str, Any]:
    return summarize_run(res, policy="x", rate_scale=1.0, slo=QWEN3_SLO,
                         oracle=np.full(len(res.records), 0.1), wall_s=1.0)


def test_a_reworded_refusal_still_counts_under_its_reason(reworded_policy: str) -> None:
    res = _simulate(_workload([4 * B] * len(_REFUSALS)), policy=reworded_policy)
    assert all(r.failed.startswith("cannot place u") for r in res.records)  # not the usual text
    row = _row(res)
    assert row["failed"] == 4
    assert row["failed_by_reason"] == {"no_memory": 1, "no_workers": 1,
                                       "draining+switching": 1, "too_long+no_memory": 1}
    assert [r.failed_reason for r in res.records] == [
        "no_memory", "too_long+no_memory", "draining+switching", "no_workers"]


def test_the_real_schedulers_refusals_are_recorded_by_key() -> None:
    # u0 fits; u1 is longer than every worker's max_seq_len; u2 fits in no worker's KV.
    wl = _workload([4 * B, 64 * B, 24 * B])
    res = _simulate(wl, max_seq_len=32 * B, cache_blocks_per_gpu=4)
    assert [r.failed_reason for r in res.records] == ["", "too_long", "no_memory"]
    assert res.records[0].ttft_s >= 0
    assert _row(res)["failed_by_reason"] == {"no_memory": 1, "too_long": 1}


def test_a_records_key_wins_over_its_text() -> None:
    """The key is what the results count; the text is for people (and old records)."""
    rec = RequestRecord("r", 0.0, 100, failed="words nobody parses", failed_reason="draining")
    old = RequestRecord("o", 0.0, 100, failed="words nobody parses")
    assert failures_by_reason([rec, old]) == {"draining": 1, OTHER: 1}


def test_refusal_reason_reads_the_exceptions_data() -> None:
    exc = _Reworded(RequestId("r"), {WorkerId("a"): Exclusion.NO_MEMORY,
                                     WorkerId("b"): Exclusion.UNAVAILABLE})
    assert refusal_reason(exc) == "unavailable+no_memory"
    assert refusal_reason(_Reworded(RequestId("r"), {})) == "no_workers"


def test_the_request_log_has_the_key_and_an_old_log_is_read_by_its_text(
        tmp_path: Path) -> None:
    wl = _workload([4 * B, 24 * B])
    res = _simulate(wl, cache_blocks_per_gpu=4)
    path = tmp_path / "log.csv"
    write_request_log(path, request_rows(res.records, QWEN3_SLO))
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == list(REQUEST_KEYS)
    assert [r["failed_reason"] for r in rows] == ["", "no_memory"]
    assert [logged_failure_reason(r) for r in rows] == ["", "no_memory"]
    # A log written before the column: the scheduler's text of that time, read by its words.
    old = [{k: v for k, v in r.items() if k != "failed_reason"} for r in rows]
    assert [logged_failure_reason(r) for r in old] == ["", "no_memory"]
