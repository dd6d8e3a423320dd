"""``vertumnus report DIR`` checks the count fields its table shows -- a row's ``failed``
(the table's column, the line under it) and ``requests`` (that line) -- as it checks the
figures of REPORT_KEYS: a results.json whose ``failed`` or ``requests`` is no number is
refused with exit 2 naming the file, the row and the field, before anything is written.
They were added to the table (failures shown) without a check: ``"failed": "x"`` ended
``report`` in a ValueError traceback, after the CSV and plots had been rewritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vertumnus.cli import app


def _row(policy: str, **extra: object) -> dict[str, object]:
    return {"policy": policy, "rate_scale": 1.0, "request_rate": 5.0, "requests": 200,
            "completed": 190, "failed": 10, "mean_ttft_s": 0.5, "p50_ttft_s": 0.4,
            "p90_ttft_s": 0.9, "p99_ttft_s": 1.2, "slo_attainment": 0.9, "hit_rate": 0.3,
            "reconfigurations": 0, "oracle_mean_ttft_s": 0.3, **extra}


def test_a_well_formed_row_is_redrawn(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps([_row("vertumnus"), _row("homo")]))
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "vertumnus ×1 10 of 200" in " ".join(res.output.split())


@pytest.mark.parametrize(("field", "value"), [("failed", "x"), ("failed", True),
                                               ("requests", "many"), ("failed", [1])])
def test_a_count_that_is_no_number_is_refused(tmp_path: Path, field: str,
                                              value: object) -> None:
    (tmp_path / "results.json").write_text(json.dumps([_row("vertumnus"),
                                                       _row("homo", **{field: value})]))
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2, (res.output, res.exception)
    assert not isinstance(res.exception, (ValueError, TypeError)), res.exception
    text = " ".join(res.output.split())
    assert "results.json: row 1 (homo)" in text and field in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # nothing written
