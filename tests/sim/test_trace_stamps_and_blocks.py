"""Trace timestamps and a synthetic file's block size, refused where they are read with an
error naming the file (and line): an Azure stamp in non-ASCII digits or with an empty
fraction, a Mooncake timestamp past the span a trace may have (said in days), and a synthetic
workload's block size that the run it is for does not count in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.ids import InvalidInput
from sim.workloads import TraceFormatError, read_azure, read_mooncake
from sim.workloads.azure import parse_timestamp
from sim.workloads.synthetic_file import check_block_size, load_synthetic_config

AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize("stamp", [
    "2023-11-16 18:15:46.",  # an empty fraction: a cut-off cell, not 46 s
    "2023-11-16 18:15:46.\u0665",  # Arabic-Indic 5: int() takes it
    "\u0662\u0660\u0662\u0663-11-16 18:15:46.1",  # the year in Arabic-Indic digits
    "2023-11-16 18:15:\uff14\uff16.1",  # fullwidth digits: strptime's \d took them
    "2023-11-16 18:15:46.1\u00b2",  # a superscript 2
    "2023-11-16 18:15:4.1",  # a field short of its width
])
def test_an_azure_stamp_not_in_ascii_digits_or_with_an_empty_fraction_names_its_line(
        tmp_path: Path, stamp: str) -> None:
    f = tmp_path / "az.csv"
    f.write_text(AZ_HEADER + "2023-11-16 18:15:40.5,10,1\n" + f"{stamp},10,1\n",
                 encoding="utf-8")
    with pytest.raises(TraceFormatError) as ei:
        read_azure(f)
    assert ei.value.line == 3, ei.value
    assert str(ei.value).startswith(f"{f}:3: bad TIMESTAMP "), ei.value
    assert "ASCII digits" in str(ei.value)
    with pytest.raises(ValueError):
        parse_timestamp(stamp)


def test_azure_stamps_as_the_files_write_them_still_read() -> None:
    base = parse_timestamp("2023-11-16 18:15:46")
    assert parse_timestamp("2023-11-16 18:15:46.6805900") == pytest.approx(base + 0.68059)
    assert parse_timestamp(" 2023-11-16 18:15:46.5 ") == base + 0.5  # blanks around
    assert parse_timestamp("2023-11-16 18:15:46.123456789") == pytest.approx(base + 0.123456789)


def _mc(ts: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": 512 * len(ids), "output_length": 1,
                       "hash_ids": ids})


@pytest.mark.parametrize(("ts", "words"), [
    # was "field 'timestamp' must be <= 9223372036854775808, got 10...0"
    (10**30, ["timestamp 1000000000000000000000000000000 ms", "about 10^22 days"]),
    (2**62, ["53,375,995,583.7 days"]),
    (1_700_000_000_000, ["19,675.9 days", "Unix time"]),
    (10**60, ["of 200 bits"]),  # not printed whole
])
def test_a_mooncake_timestamp_past_the_span_says_it_in_days(tmp_path: Path, ts: int,
                                                            words: list[str]) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text(_mc(0, [1]) + "\n" + _mc(ts, [2]) + "\n")
    with pytest.raises(TraceFormatError) as ei:
        read_mooncake(f, tick_s=0)
    text = str(ei.value)
    assert text.startswith(f"{f}:2: timestamp "), text
    assert "more than the 366 days a trace may span" in text
    assert "<=" not in text and "9223372036854775808" not in text
    for w in words:
        assert w in text, (w, text)


def test_check_block_size_names_the_file_and_the_field() -> None:
    check_block_size(512, 512, source="w.toml", whose="the profile's")
    with pytest.raises(InvalidInput) as ei:
        check_block_size(16, 512, source="w.toml", whose="the profile's")
    assert str(ei.value) == (
        "w.toml: block_size is 16, but the profile's cache blocks are 512 tokens (every "
        "request's cached prefix is counted in them); set block_size = 512 or leave it out")
    with pytest.raises(InvalidInput, match=r"set block_size = 16\Z"):
        check_block_size(512, 16, source="w.toml", whose="the stack's")


def test_a_synthetic_file_of_any_block_size_still_loads(tmp_path: Path) -> None:
    """The file alone is not wrong (a live replay against a 16-token gateway needs one): its
    reader's caller compares it (check_block_size)."""
    f = tmp_path / "w.toml"
    f.write_text("block_size = 16\n")
    assert load_synthetic_config(f).block_size == 16
