"""Why requests failed, in the results: ``sim.metrics.failure_reason`` names the reason of the
text the simulator records for a failed request (the scheduler's ``NoEligibleWorker``
message), a results row's ``failed_by_reason`` counts them, and the results table's line and
results.csv say them (before, the line said only how many failed: "vertumnus ×1 139 of 200").
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.scheduler.decision import Exclusion
from services.scheduler.errors import NoEligibleWorker, SequenceTooLong
from shared.ids import RequestId, WorkerId
from sim import runner as sim_runner
from sim.metrics import (
    NO_WORKERS,
    OTHER,
    UNFINISHED,
    failure_reason,
    failure_reasons,
    failures_by_reason,
    format_failed_by_reason,
)
from vertumnus.cli import app


def _no_worker(**why: Exclusion) -> str:
    """The text the simulator records: the scheduler's own exception's message."""
    return str(NoEligibleWorker(RequestId("synthetic-000001"),
                                {WorkerId(w): str(e) for w, e in why.items()}))


@pytest.mark.parametrize(("text", "key"), [
    (_no_worker(w0=Exclusion.NO_MEMORY, w1=Exclusion.NO_MEMORY), "no_memory"),
    (_no_worker(w0=Exclusion.TOO_LONG), "too_long"),
    (_no_worker(w0=Exclusion.NO_MEMORY, w1=Exclusion.TOO_LONG), "too_long+no_memory"),
    (_no_worker(w0=Exclusion.DRAINING, w1=Exclusion.SWITCHING, w2=Exclusion.UNAVAILABLE),
     "unavailable+draining+switching"),
    (str(SequenceTooLong(RequestId("r"), 300_000, 131_072, {})), "too_long"),
    (str(NoEligibleWorker(RequestId("r"), {})), NO_WORKERS),
    ("", UNFINISHED),
    ("the engine fell over", OTHER),
])
def test_a_failure_text_names_its_reason(text: str, key: str) -> None:
    assert failure_reason(text) == key
    assert all(part in failure_reasons() for part in key.split("+"))


def test_a_request_id_that_looks_like_a_reason_does_not_count() -> None:
    """Only a worker's part ("<worker>: <reason>" before "; " or the closing bracket) is read."""
    text = str(NoEligibleWorker(RequestId("draining; x"), {WorkerId("w0"): Exclusion.NO_MEMORY}))
    assert failure_reason(text) == "no_memory"


@dataclass
class _Rec:
    ttft_s: float
    failed: str = ""


def test_failures_are_counted_by_reason_and_add_up_to_the_failed() -> None:
    recs = [_Rec(0.5), _Rec(-1.0, _no_worker(w0=Exclusion.NO_MEMORY)),
            _Rec(-1.0, _no_worker(w0=Exclusion.NO_MEMORY)),
            _Rec(-1.0, _no_worker(w0=Exclusion.TOO_LONG)), _Rec(-1.0)]
    counts = failures_by_reason(recs)
    assert counts == {"no_memory": 2, "too_long": 1, UNFINISHED: 1}
    assert list(counts) == sorted(counts)
    assert sum(counts.values()) == sum(r.ttft_s < 0 for r in recs)
    assert failures_by_reason([_Rec(0.1)]) == {}
    assert format_failed_by_reason(counts) == "no_memory=2;too_long=1;unfinished=1"
    assert format_failed_by_reason({"no_memory": 4 / 3}) == "no_memory=1.33"
    assert format_failed_by_reason({}) == ""


ROW = {"policy": "vertumnus", "rate_scale": 1.0, "request_rate": 4.72, "requests": 200,
       "completed": 5, "failed": 195, "mean_ttft_s": 0.216, "p50_ttft_s": 0.211,
       "p90_ttft_s": 0.253, "p99_ttft_s": 0.268, "slo_attainment": 0.005, "hit_rate": 0.0,
       "reconfigurations": 0, "oracle_mean_ttft_s": 0.454}


def _table(rows: list[dict]) -> str:
    buf = io.StringIO()
    sim_runner.print_table({"rows": rows, "meta": {}, "comparison": []}, buf)
    return " ".join(buf.getvalue().split())


def test_the_failure_line_names_the_reasons() -> None:
    text = _table([{**ROW, "failed_by_reason": {"no_memory": 194, "too_long": 1}}])
    assert "failed requests: vertumnus ×1 195 of 200 (no_memory 194, too_long 1)." in text
    # each reason explained once, in the scheduler's words
    assert f"no_memory: {Exclusion.NO_MEMORY.value}" in text
    assert f"too_long: {Exclusion.TOO_LONG.value}" in text
    assert "They count as SLO misses" in text


def test_a_combined_reason_is_explained_by_its_parts_and_a_mean_reads_as_one() -> None:
    rows = [{**ROW, "failed": 2.5, "failed_by_reason": {"too_long+no_memory": 2.5}},
            {**ROW, "policy": "homo", "failed": 1, "failed_by_reason": {"no_memory": 1}}]
    text = _table(rows)
    assert "vertumnus ×1 2.50 of 200 (too_long+no_memory 2.50)" in text
    assert "homo ×1 1 of 200 (no_memory 1)" in text
    assert text.count(f"no_memory: {Exclusion.NO_MEMORY.value}") == 1
    assert f"too_long: {Exclusion.TOO_LONG.value}" in text


def test_a_row_without_reasons_keeps_the_line_it_had() -> None:
    """An older results.json (``vertumnus report``): the count, no reasons."""
    text = _table([ROW])
    assert "failed requests: vertumnus ×1 195 of 200. They count as SLO misses" in text


def _results(tmp_path: Path, row: dict) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "results.json").write_text(json.dumps([row]))
    return d


def test_report_shows_and_writes_the_reasons(tmp_path: Path) -> None:
    d = _results(tmp_path, {**ROW, "failed_by_reason": {"no_memory": 195}})
    res = CliRunner().invoke(app, ["report", str(d)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "vertumnus ×1 195 of 200 (no_memory 195)" in text
    with (d / "results.csv").open() as fh:
        (got,) = list(csv.DictReader(fh))
    assert got["failed"] == "195" and got["failed_by_reason"] == "no_memory=195"


@pytest.mark.parametrize("bad", [["no_memory"], {"no_memory": "many"}, {"no_memory": -1},
                                 {"no_memory": True}])
def test_report_refuses_reasons_that_are_not_counts(tmp_path: Path, bad: object) -> None:
    d = _results(tmp_path, {**ROW, "failed_by_reason": bad})
    res = CliRunner().invoke(app, ["report", str(d)])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "row 0 (vertumnus): failed_by_reason is" in text
    assert "not counts of failed requests by reason" in text
    assert "Traceback" not in res.output
