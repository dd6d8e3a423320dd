"""``--format leval`` on a timed trace: refused, naming the file and the timestamps, rather
than read with its arrivals replaced by Poisson ones (sim/workloads/__init__.py
``detect_format``'s rule: varying timestamps make a Mooncake-form file a timed trace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.workloads import detect_format, read_leval
from sim.workloads.errors import TraceFormatError
from vertumnus.cli import app


def _write(path: Path, stamps: list[int]) -> Path:
    rows = [{"timestamp": ts, "input_length": 1024, "output_length": 1,
             "hash_ids": [10 * i + 1, 10 * i + 2]} for i, ts in enumerate(stamps)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_leval_refuses_a_trace_whose_timestamps_vary(tmp_path: Path) -> None:
    timed = _write(tmp_path / "timed.jsonl", [0, 0, 500, 1500])
    assert detect_format(timed) == "mooncake"
    with pytest.raises(TraceFormatError, match="--format mooncake") as err:
        read_leval(timed, rate=1.0)
    assert err.value.path == str(timed) and err.value.line == 3
    assert "timestamp 500 differs from the first row's (0)" in str(err.value)


def test_leval_reads_its_own_mooncake_form_with_zero_timestamps(tmp_path: Path) -> None:
    wl = read_leval(_write(tmp_path / "leval.jsonl", [0, 0, 0]), rate=2.0)
    assert len(wl.requests) == 3


def test_simulate_format_leval_on_a_timed_trace_exits_2(tmp_path: Path) -> None:
    timed = _write(tmp_path / "timed.jsonl", [0, 1000, 2000])
    res = CliRunner().invoke(app, ["simulate", "--trace", str(timed), "--format", "leval",
                                   "--gpus", "8", "--policies", "vertumnus",
                                   "--out", str(tmp_path / "o")])
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert str(timed) in text and "timed trace" in text and "--format mooncake" in text
    assert not (tmp_path / "o").exists()
