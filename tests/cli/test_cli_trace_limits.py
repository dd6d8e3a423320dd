"""Out-of-range numbers in traces, results and options: exit 2 naming the problem (the file and
line for a trace), never a traceback, an overflow, or a run that stalls or exhausts memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import SIM, _refused
from typer.testing import CliRunner

from sim.runner import MAX_GPUS
from sim.workloads.parsing import MAX_SPAN_S, MAX_TOKENS
from vertumnus.cli import app


def _row(ts: int | str, inp: int | str = 1024, out: int | str = 1, hids: str = "[1, 2]") -> str:
    return (f'{{"timestamp": {ts}, "input_length": {inp}, "output_length": {out}, '
            f'"hash_ids": {hids}}}')


@pytest.mark.parametrize("line2, words", [
    (_row("9" * 5000), ["digits"]),  # more digits than Python converts: was a ValueError
    # overflowed int64: was an OverflowError, then an integer bound (<= 2**63)
    (_row(10**30), ["timestamp 1000000000000000000000000000000 ms", "366 days"]),
    (_row(2**62), ["timestamp", "366 days"]),  # a span of aeons: was a MemoryError
    (_row(1_700_000_000_000), ["Unix time"]),  # epoch ms: a span from 0 that never ended
    (_row(2000, out=10**30), ["'output_length'", "<="]),  # overflowed the statistics
    (_row(500), ["goes backwards"]),  # was silently re-sorted
])
def test_mooncake_numbers_out_of_range_name_the_line(runner: CliRunner, tmp_path: Path,
                                                     profile_file: Path, line2: str,
                                                     words: list[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([_row(1000, hids="[3, 4]"), line2, _row(9000, hids="[5, 6]")])
                     + "\n")
    res = runner.invoke(app, [*SIM, "--trace", str(trace), "--profile", str(profile_file),
                              "--out", str(tmp_path / "out")])
    _refused(res, f"{trace}:2", *words)


def test_mooncake_limits_are_far_above_real_traces(tmp_path: Path) -> None:
    from sim.workloads import read_mooncake

    trace = tmp_path / "t.jsonl"
    last = int(MAX_SPAN_S * 1000)
    trace.write_text("\n".join([_row(0), _row(last, out=MAX_TOKENS)]) + "\n")
    wl = read_mooncake(trace, tick_s=0)
    assert wl[1].arrival_s == MAX_SPAN_S and wl[1].output_len == MAX_TOKENS


@pytest.mark.parametrize("row2, words", [
    ("2023-11-16 18:17:05," + "9" * 40 + ",1", ["ContextTokens", "<="]),  # was a hang
    ("2023-11-16 18:17:05,10," + "9" * 40, ["GeneratedTokens", "<="]),
    ("9999-12-31 23:59:59,10,1", ["days"]),  # a span of millennia: was a MemoryError
])
def test_azure_numbers_out_of_range_name_the_line(runner: CliRunner, tmp_path: Path,
                                                  profile_file: Path, row2: str,
                                                  words: list[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     f"2023-11-16 18:17:03.1234567,1000,10\n{row2}\n")
    res = runner.invoke(app, [*SIM, "--trace", str(trace), "--profile", str(profile_file),
                              "--out", str(tmp_path / "out")])
    _refused(res, f"{trace}:3", *words)


def test_leval_output_count_out_of_range_names_the_line(tmp_path: Path) -> None:
    from sim.workloads import TraceFormatError, read_leval

    trace = tmp_path / "l.jsonl"
    trace.write_text(json.dumps({"llama3_tokens": 100, "doc_llama3_tokens": 50,
                                 "ref_output_llama3_tokens": 10**30, "doc_sha1": "a"}) + "\n")
    with pytest.raises(TraceFormatError, match=r"l\.jsonl:1: ref_output"):
        read_leval(trace, rate=1.0)


@pytest.mark.parametrize("args", [
    ["--rate-scale", "1e-300"],  # was an OverflowError
    ["--rate-scale", "1,1e-9"],  # 60,000 simulated days: was a run of hours
])
def test_a_rate_scale_that_stretches_the_trace_beyond_a_year_is_refused(
        runner: CliRunner, tmp_path: Path, profile_file: Path, args: list[str]) -> None:
    res = runner.invoke(app, [*SIM, *args, "--profile", str(profile_file),
                              "--out", str(tmp_path / "out")])
    _refused(res, "--rate-scale", "days")


def test_a_tiny_rate_on_a_timed_trace_is_refused(runner: CliRunner, tmp_path: Path,
                                                 profile_file: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([_row(0), _row(1000, hids="[3, 4]")]) + "\n")
    res = runner.invoke(app, [*SIM, "--trace", str(trace), "--rate", "1e-300",
                              "--profile", str(profile_file), "--out", str(tmp_path / "out")])
    _refused(res, "--rate", "days")


def test_a_synthetic_rate_beyond_memory_is_refused(runner: CliRunner, tmp_path: Path) -> None:
    res = runner.invoke(app, [*SIM, "--rate", "1e300", "--out", str(tmp_path / "out")])
    _refused(res, "rate", "1,000,000 requests")  # was a hang that exhausted memory


@pytest.mark.parametrize("args, words", [
    (["simulate", "--gpus", "1000000000"], ["--gpus", str(MAX_GPUS)]),  # was a hang
    (["tune", "--gpus", "1000000000"], ["--gpus", str(MAX_GPUS)]),
    (["size", "--gpus-max", "1000000000"], ["--gpus-max", str(MAX_GPUS)]),
])
def test_a_pool_beyond_the_largest_is_refused(runner: CliRunner, tmp_path: Path,
                                              args: list[str], words: list[str]) -> None:
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "out")])
    _refused(res, *words)


def test_report_refuses_a_json_integer_python_cannot_convert(runner: CliRunner,
                                                             tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text("[" + "9" * 5000 + "]")  # was a ValueError
    res = runner.invoke(app, ["report", str(tmp_path)])
    _refused(res, "results.json", "not valid JSON")
