"""The sweep's ``sglang`` cell reports the stronger of its two variants (bounded and unbounded
radix cache, services/scheduler/policies/sglang.py): a variant that completed requests beats
one that completed none, whatever the order. The choice compared mean TTFTs alone, and a run
with no completed request has a NaN mean, which no comparison beats: a first variant with
none was kept over a second that completed some. Among variants that completed none, the
first (bounded) is kept.

A run that completes nothing is not easily drawn from the simulator, so the row of the run
named is rewritten as such a run's (summarize_run's own figures of an empty run: NaN means,
``completed`` 0); the runs themselves are real."""

from __future__ import annotations

import math
from typing import Any

import pytest

import sim.experiments as experiments
from sim.experiments import ExperimentSpec, sweep
from sim.profiling import run_profile
from sim.workloads import generate
from sim.workloads.synthetic import SyntheticConfig

SPEC = ExperimentSpec(gpus=8, degrees=(2, 4), seed=0)


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Any:
    prof, _ = run_profile(tmp_path_factory.mktemp("prof"), degrees=(1, 2, 4), seed=0,
                          measure_kappas=False)
    return prof


def _empty_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as a run's with no completed request (summarize_run's NaN figures)."""
    nan = {k: math.nan for k in ("mean_ttft_s", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s",
                                 "queue_s_mean", "prefill_s_mean", "handoff_s_mean")}
    return {**row, **nan, "completed": 0, "failed": row["requests"]}


def _sglang_row(monkeypatch: pytest.MonkeyPatch, profile: Any, empty: set[int]) -> dict:
    """The sweep's sglang row when the variants' runs numbered in ``empty`` (0: bounded, the
    first; 1: unbounded) completed nothing."""
    real = experiments.summarize_run
    calls: list[int] = []

    def summarize(*args: Any, **kwargs: Any) -> dict[str, Any]:
        row = real(*args, **kwargs)
        calls.append(len(calls))
        return _empty_row(row) if calls[-1] in empty else row

    monkeypatch.setattr(experiments, "summarize_run", summarize)
    wl = generate(SyntheticConfig(duration_s=20.0, rate=2.0, phases=()), seed=1)
    rows, _ = sweep(wl, ("sglang",), (1.0,), profile, SPEC)
    assert len(calls) == 2  # both variants ran
    (row,) = rows
    return row


def test_a_variant_with_completions_wins_over_a_first_without(
        monkeypatch: pytest.MonkeyPatch, profile: Any) -> None:
    row = _sglang_row(monkeypatch, profile, empty={0})
    assert row["variant"] == "sglang_unbounded", row
    assert row["completed"] > 0 and math.isfinite(row["mean_ttft_s"])


def test_a_first_variant_with_completions_is_kept_over_one_without(
        monkeypatch: pytest.MonkeyPatch, profile: Any) -> None:
    row = _sglang_row(monkeypatch, profile, empty={1})
    assert row["variant"] == "sglang" and row["completed"] > 0, row


def test_without_completions_in_either_the_first_is_kept(
        monkeypatch: pytest.MonkeyPatch, profile: Any) -> None:
    row = _sglang_row(monkeypatch, profile, empty={0, 1})
    assert row["variant"] == "sglang" and row["completed"] == 0, row

