"""Requests no worker can serve: they are recorded as failed and the run still terminates.

Regression: ``Simulator._run`` used to count ``remaining`` down only on a finish, so a request
whose placement failed (``NoEligibleWorker`` outside a reconfiguration, e.g. longer than
``max_seq_len`` or than every worker's KV capacity with small ``cache_blocks_per_gpu``) left it
above 0 for good, and with the controller or the cache manager on the window / scan events
rescheduled themselves for ever (``vertumnus simulate --cache-blocks-per-gpu 32`` on the
conversation trace hung). The run is bounded by its events (``simeng_support.hang_guard``).
"""

from __future__ import annotations

import pytest
from simeng_support import run, unique_prefix_workload

from sim.experiments import oracle_ttfts, summarize_run
from sim.groundtruth import GroundTruth
from sim.metrics import QWEN3_SLO

MAX_EVENTS = 10_000  # the run schedules a few dozen; an endless loop passes this at once


@pytest.mark.parametrize(
    "adaptive,cache_manager",
    [
        (False, False),
        pytest.param(False, True),
        pytest.param(True, False),
    ],
)
def test_failed_placement_terminates(profile, adaptive, cache_manager) -> None:
    wl = unique_prefix_workload([2_000, 600, 700], 1.0)
    res = run(
        wl,
        profile,
        gpus=8,
        degrees=(2, 4),
        max_seq_len=1_000,
        adaptive=adaptive,
        cache_manager=cache_manager,
        max_events=MAX_EVENTS,
    )
    failed, ok = res.records[0], res.records[1:]
    assert failed.failed and failed.ttft_s < 0 and failed.start_s < 0
    assert all(r.ttft_s >= 0 and not r.failed for r in ok)
    # The failed request counts as missing its SLO; the completed ones make the TTFT stats.
    row = summarize_run(
        res,
        policy="x",
        rate_scale=1.0,
        slo=QWEN3_SLO,
        oracle=oracle_ttfts(wl, GroundTruth(), (2, 4)),
        wall_s=1.0,
    )
    assert (row["requests"], row["completed"], row["failed"]) == (3, 2, 1)
    assert row["slo_attainment"] == pytest.approx((600 + 700) / (2_000 + 600 + 700))
