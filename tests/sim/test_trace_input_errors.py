"""Trace files that are not what the reader expects: bad bytes, binary or compressed files,
directories, and files whose requests all arrive at one instant. Each is a typed error naming
the file (and line where there is one), never a decoding traceback."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.ids import InvalidInput
from sim.workloads import (
    TraceFormatError,
    default_traces_dir,
    load_workload,
    read_azure,
    read_leval,
    read_mooncake,
)


def _mc(ts: int, inp: int = 600, ids: tuple[int, int] = (1, 2)) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": inp, "output_length": 1, "hash_ids": list(ids)}
    )


def _lv(sha: str, instr: int) -> str:
    return json.dumps({"doc_sha1": sha, "instr_idx": instr, "doc_llama3_tokens": 900,
                       "llama3_tokens": 1000, "ref_output_llama3_tokens": 3})


AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _with_bad_byte(lines: list[str], bad_line: int) -> bytes:
    """``lines`` as UTF-8 with a stray 0xff inside 1-based line ``bad_line``."""
    raw = [ln.encode() for ln in lines]
    raw[bad_line - 1] = raw[bad_line - 1][:5] + b"\xff" + raw[bad_line - 1][5:]
    return b"\n".join(raw) + b"\n"


# --- bytes that are not UTF-8 text -------------------------------------------------------
@pytest.mark.parametrize(
    ("suffix", "lines", "read"),
    [
        (".jsonl", [_mc(0), _mc(1000), _mc(2000), _mc(3000)],
         lambda p: read_mooncake(p, tick_s=0)),
        (".csv", [AZ_HEADER.strip(), "2023-11-16 18:17:03.1,10,1",
                  "2023-11-16 18:17:04.1,10,1", "2023-11-16 18:17:05.1,10,1"], read_azure),
        (".jsonl", [_lv("a", 0), _lv("a", 1), _lv("b", 0), _lv("b", 1)],
         lambda p: read_leval(p, rate=1.0)),
    ],
    ids=["mooncake", "azure", "leval"],
)
def test_a_stray_byte_names_file_and_line(tmp_path: Path, suffix: str, lines: list[str],
                                          read: Callable[[Path], object]) -> None:
    f = tmp_path / f"t{suffix}"
    f.write_bytes(_with_bad_byte(lines, 3))
    with pytest.raises(TraceFormatError) as ei:
        read(f)
    assert str(ei.value).startswith(f"{f}:3: not valid UTF-8 text"), ei.value
    assert ei.value.line == 3 and "0xff" in str(ei.value)
    # load_workload (also `vertumnus profile --workload`) reads through the same readers.
    with pytest.raises(TraceFormatError, match=r":3: not valid UTF-8"):
        load_workload(f, rate=1.0)


def test_a_bad_byte_on_the_first_line_is_reported_while_detecting_the_format(
    tmp_path: Path,
) -> None:
    f = tmp_path / "t.jsonl"
    f.write_bytes(_with_bad_byte([_mc(0), _mc(1000)], 1))
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: not valid UTF-8"):
        load_workload(f)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (bytes(range(256)) * 8, "binary data"),
        (gzip.compress((_mc(0) + "\n" + _mc(1000) + "\n").encode()), "gzip-compressed"),
        ((_mc(0) + "\n").encode("utf-16"), "UTF-16"),
    ],
    ids=["binary", "gzip", "utf16"],
)
@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_that_is_not_text_says_so(tmp_path: Path, content: bytes, words: str,
                                         suffix: str) -> None:
    f = tmp_path / f"t{suffix}"
    f.write_bytes(content)
    for read in (read_mooncake, read_azure, lambda p: read_leval(p, rate=1.0), load_workload):
        with pytest.raises(TraceFormatError) as ei:
            read(f)
        assert str(ei.value).startswith(f"{f}: not a text trace"), ei.value
        assert words in str(ei.value)


def test_a_nul_byte_past_the_first_block_names_its_line(tmp_path: Path) -> None:
    lines = [_mc(1000 * i) for i in range(300)]  # > 8 KiB before the bad line
    raw = "\n".join(lines).encode() + b"\n" + b'{"timestamp": \x00}\n'
    f = tmp_path / "t.jsonl"
    f.write_bytes(raw)
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:301: has a NUL byte"):
        read_mooncake(f)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    f = tmp_path / "az.csv"
    f.write_bytes(b"\xef\xbb\xbf" + (AZ_HEADER + "2023-11-16 18:17:03.1,10,1\n"
                                     "2023-11-16 18:17:04.1,20,1\n").encode())
    assert [r.input_len for r in read_azure(f)] == [10, 20]


# --- directories -------------------------------------------------------------------------
def test_a_directory_is_not_reported_as_missing(tmp_path: Path) -> None:
    for read in (read_mooncake, read_azure, lambda p: read_leval(p, rate=1.0), load_workload):
        with pytest.raises(InvalidInput, match="is a directory") as ei:
            read(tmp_path)
        assert "not found" not in str(ei.value)


# --- all requests at one instant -----------------------------------------------------------
def test_mooncake_rows_all_at_one_timestamp_are_rejected_with_a_hint(tmp_path: Path) -> None:
    f = tmp_path / "lv.jsonl"
    f.write_text("".join(_mc(0, 600 + i) + "\n" for i in range(5)))
    for kwargs in ({}, {"tick_s": 0.0}, {"max_requests": 3}, {"end_s": 10.0}):
        with pytest.raises(TraceFormatError) as ei:
            read_mooncake(f, **kwargs)
        msg = str(ei.value)
        assert msg.startswith(f"{f}: all 5 requests have the same arrival time"), msg
        assert "--format leval" in msg and "Poisson" in msg
    with pytest.raises(TraceFormatError, match="same arrival time"):
        load_workload(f)
    # Read as L-Eval (lengths, Poisson arrivals) the same file is fine.
    assert len(read_leval(f, rate=2.0)) == 5
    # Asking for the one tick to be spread is a deliberate choice.
    assert len({r.arrival_s for r in read_mooncake(f, tick_s=3.0)}) == 5


def test_one_request_or_a_leading_burst_is_not_one_instant(tmp_path: Path) -> None:
    one = tmp_path / "one.jsonl"
    one.write_text(_mc(0) + "\n")
    assert len(read_mooncake(one)) == 1
    # The first requests share a tick but the file goes on: stopping at max_requests inside
    # the burst must not reject it.
    burst = tmp_path / "burst.jsonl"
    burst.write_text("".join(_mc(0) + "\n" for _ in range(4)) + _mc(3000) + "\n")
    assert len(read_mooncake(burst, max_requests=2)) == 2
    assert len(read_mooncake(burst)) == 5


def test_requests_kept_inside_the_first_tick_are_still_spread_over_it(tmp_path: Path) -> None:
    """A 3 s-quantised trace cut to requests that all fall in its first tick: the tick is
    detected on the records read past them, and they are spread within it. Before, the cut
    showed one timestamp, no tick, and every request arrived at once (a burst at t = 0)."""
    f = tmp_path / "ticks.jsonl"
    f.write_text("".join(_mc(3000 * (k // 4)) + "\n" for k in range(40)))
    cut = read_mooncake(f, max_requests=3)
    assert cut.metadata["tick_s"] == 3.0 == read_mooncake(f).metadata["tick_s"]
    arrivals = [r.arrival_s for r in cut]
    assert len(set(arrivals)) == 3 and all(0.0 <= a < 3.0 for a in arrivals)
    assert arrivals == sorted(arrivals)


def test_azure_rows_all_at_one_timestamp_are_rejected(tmp_path: Path) -> None:
    f = tmp_path / "az.csv"
    f.write_text(AZ_HEADER + "2023-11-16 18:17:03.1,10,1\n" * 3)
    with pytest.raises(TraceFormatError, match=r"az\.csv: all 3 requests have the same arrival "
                                               r"time \(TIMESTAMP 2023-11-16 18:17:03\.1\)"):
        read_azure(f)
    with pytest.raises(TraceFormatError, match="same arrival time"):
        read_azure(f, max_requests=2)
    f.write_text(AZ_HEADER + "2023-11-16 18:17:03.1,10,1\n" * 3 + "2023-11-16 18:17:04.1,10,1\n")
    assert len(read_azure(f, max_requests=2)) == 2


def test_the_real_leval_file_read_as_mooncake_is_rejected() -> None:
    f = default_traces_dir() / "leval" / "leval_llama3_mooncake.jsonl"
    if not f.is_file():
        pytest.skip("L-Eval trace not present")
    with pytest.raises(TraceFormatError, match="same arrival time.*--format leval"):
        read_mooncake(f)
    assert len(read_leval(f, rate=1.0, max_requests=5)) == 5
