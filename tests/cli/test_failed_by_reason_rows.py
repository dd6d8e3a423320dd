"""A results row carries why its requests failed (``failed_by_reason``, from the records'
failure texts: ``sim.metrics.failures_by_reason``), and a run with --repeats means each
reason over the seeds counting a seed without it as 0. Reproduces session 64's run: a tiny KV
cache, where most requests fit no worker's cache."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from typer.testing import CliRunner

from sim.experiments import combine_repeats
from vertumnus.cli import app

SMALL = ["simulate", "--trace", "synthetic", "--gpus", "8", "--max-requests", "60"]


def test_a_tiny_kv_cache_run_says_its_requests_did_not_fit(tmp_path: Path) -> None:
    out = tmp_path / "o"
    res = CliRunner().invoke(app, [*SMALL, "--policies", "vertumnus",
                                   "--cache-blocks-per-gpu", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    (row,) = json.loads((out / "results.json").read_text())
    assert row["failed"] > 0
    assert row["failed_by_reason"] == {"no_memory": row["failed"]}
    text = " ".join(res.output.split())
    assert (f"failed requests: vertumnus ×1 {row['failed']} of {row['requests']} "
            f"(no_memory {row['failed']})") in text
    assert "no_memory: request KV does not fit in worker's KV capacity" in text
    with (out / "results.csv").open() as fh:
        (got,) = list(csv.DictReader(fh))
    assert got["failed_by_reason"] == f"no_memory={row['failed']}"


def test_a_run_without_failures_has_no_reasons(tmp_path: Path) -> None:
    out = tmp_path / "o"
    res = CliRunner().invoke(app, [*SMALL, "--policies", "vertumnus", "--out", str(out)])
    assert res.exit_code == 0, res.output
    (row,) = json.loads((out / "results.json").read_text())
    assert row["failed"] == 0 and row["failed_by_reason"] == {}


def test_repeats_mean_each_reason_over_every_seed() -> None:
    base = {"policy": "vertumnus", "rate_scale": 1.0}
    rows = combine_repeats([[{**base, "failed": 3, "failed_by_reason": {"no_memory": 3}}],
                            [{**base, "failed": 1, "failed_by_reason": {"too_long": 1}}]],
                           [0, 1])
    assert rows[0]["failed"] == 2.0
    assert rows[0]["failed_by_reason"] == {"no_memory": 1.5, "too_long": 0.5}
    same = combine_repeats([[{**base, "failed_by_reason": {"no_memory": 2}}]] * 2, [0, 1])
    assert same[0]["failed_by_reason"] == {"no_memory": 2}  # a count equal in each: an int
    old = combine_repeats([[{**base, "failed": 1}]] * 2, [0, 1])  # rows without reasons
    assert "failed_by_reason" not in old[0]
