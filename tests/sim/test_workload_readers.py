"""Trace readers on small files written by the tests: formats, spreading, errors with file:line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.ids import InvalidInput
from sim.workloads import (
    Request,
    TraceFormatError,
    Workload,
    load_workload,
    read_azure,
    read_leval,
    read_mooncake,
    scale_rate,
    truncate,
    workload_stats,
)
from sim.workloads.mooncake import detect_tick_ms


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mc(ts: int, inp: int, ids: list[int], out: int = 10) -> dict:
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids}


# --- Mooncake --------------------------------------------------------------------------
def test_mooncake_full_blocks_only_and_ids(tmp_path: Path) -> None:
    f = _write_jsonl(
        tmp_path / "t.jsonl",
        [_mc(0, 1100, [1, 2, 3]), _mc(1000, 1024, [1, 2]), _mc(2500, 5, [9])],
    )
    wl = read_mooncake(f, tick_s=0)
    assert [r.block_hashes for r in wl] == [(1, 2), (1, 2), ()]
    assert [r.arrival_s for r in wl] == [0.0, 1.0, 2.5]
    assert [r.request_id for r in wl] == ["t-0", "t-1", "t-2"]
    assert wl.block_size == 512 and wl.metadata["format"] == "mooncake"


def test_mooncake_tick_spreading_seeded_and_order_preserving(tmp_path: Path) -> None:
    rows = [_mc(3000 * (i // 10), 500, [i]) for i in range(100)]
    f = _write_jsonl(tmp_path / "ticks.jsonl", rows)
    a = read_mooncake(f, seed=1)
    b = read_mooncake(f, seed=1)
    c = read_mooncake(f, seed=2)
    assert a.metadata["tick_s"] == pytest.approx(3.0)
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    # Each request stays inside its own tick, and file order is kept.
    for i, r in enumerate(a):
        tick = 3.0 * (i // 10)
        assert tick <= r.arrival_s < tick + 3.0
    assert [r.request_id for r in a] == [f"ticks-{i}" for i in range(100)]
    assert len({r.arrival_s for r in a}) == 100


def test_detect_tick() -> None:
    assert detect_tick_ms(np.array([0, 0, 0, 3000, 3000, 5999, 5999, 9000])) == 3000
    assert detect_tick_ms(np.array([0, 17, 40, 95])) == 0.0  # distinct stamps: not quantised
    assert detect_tick_ms(np.array([0, 0, 0])) == 0.0


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "hash_ids"),
        (
            '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}',
            "missing field 'output_length'",
        ),
        ('{"timestamp": -5, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', ">= 0"),
        (
            '{"timestamp": 0, "input_length": "600", "output_length": 1, "hash_ids": [1, 2]}',
            "integer",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, "x"]}',
            "integers",
        ),
        ("[1, 2, 3]", "JSON object"),
        ('{"timestamp": 0, "input_length": 600, "output_len', "not valid JSON"),
    ],
)
def test_mooncake_bad_line_names_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    good = json.dumps(_mc(0, 600, [1, 2]))
    f = tmp_path / "bad.jsonl"
    f.write_text(f"{good}\n\n{line}")  # blank line 2 is skipped; the bad one is line 3
    with pytest.raises(TraceFormatError) as ei:
        read_mooncake(f)
    assert f"{f}:3" in str(ei.value) and problem in str(ei.value)
    assert isinstance(ei.value, InvalidInput) and ei.value.line == 3


def test_mooncake_missing_file_is_typed(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot open"):
        read_mooncake(tmp_path / "nope.jsonl")


def test_mooncake_truncation_options(tmp_path: Path) -> None:
    f = _write_jsonl(tmp_path / "t.jsonl", [_mc(1000 * i, 600, [i, 100 + i]) for i in range(10)])
    assert len(read_mooncake(f, tick_s=0, max_requests=3)) == 3
    wl = read_mooncake(f, tick_s=0, start_s=2.0, end_s=5.0)
    assert [r.arrival_s for r in wl] == [2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("rows", "line", "words"),
    [
        # id 2 follows 1 on line 1, then 4 on line 3
        ([[1, 2, 3], [4, 5], [4, 2]], 3, ["hash id 2 follows 4 here", "follows 1 on line 1"]),
        # a later block on line 1 is a request's first block on line 2
        ([[1, 2, 3], [2, 7]], 2, ["hash id 2 is a first block here", "follows 1 on line 1"]),
        # a first block on line 1 is a later block on line 2
        ([[1, 2, 3], [9, 1]], 2, ["hash id 1 follows 9 here", "is a first block on line 1"]),
        # the earlier line is the one that listed the id first (line 2), not a later user
        ([[1, 2], [1, 5, 6, 7], [1, 5, 6], [8, 6]], 4, ["hash id 6 follows 8 here",
                                                        "follows 5 on line 2"]),
        # an id repeated within one request
        ([[1, 2, 3], [5, 6, 5]], 2, ["repeat id 5", "blocks 0 and 2"]),
        ([[5, 5]], 1, ["repeat id 5", "blocks 0 and 1"]),
    ],
)
def test_mooncake_ids_must_be_prefix_chained(tmp_path: Path, rows: list[list[int]], line: int,
                                            words: list[str]) -> None:
    """A block id stands for its whole prefix (the trie keys a block under its parent): one
    id after two predecessors would merge two prefixes into one cache entry. The old reader
    accepted all of these."""
    f = _write_jsonl(tmp_path / "c.jsonl",
                     [_mc(1000 * i, 512 * len(ids), ids) for i, ids in enumerate(rows)])
    for read in (lambda p: read_mooncake(p, tick_s=0), lambda p: read_leval(p, rate=1.0)):
        with pytest.raises(TraceFormatError) as ei:
            read(f)
        assert ei.value.line == line and str(ei.value).startswith(f"{f}:{line}: ")
        assert all(w in str(ei.value) for w in words), ei.value


def test_mooncake_chained_ids_across_requests_read(tmp_path: Path) -> None:
    """Shared prefixes, branches and a partial last block's id are all fine."""
    rows = [[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3, 7]]
    f = _write_jsonl(tmp_path / "ok.jsonl",
                     [_mc(1000 * i, 512 * len(ids) - 1, ids) for i, ids in enumerate(rows)])
    assert [r.block_hashes for r in read_mooncake(f, tick_s=0)] == \
        [tuple(ids[:-1]) for ids in rows]


@pytest.mark.parametrize("bad", [2**64, 2**64 + 5, 10**30, -1, -(2**63), True, False, 1.0])
def test_mooncake_ids_must_be_unsigned_64_bit_ints(tmp_path: Path, bad: object) -> None:
    """An id past 64 bits (or negative) would be folded into 64 bits downstream and alias
    another block; the old reader accepted them (bools and floats it refused already)."""
    f = tmp_path / "ids.jsonl"
    f.write_text(json.dumps(_mc(0, 1000, [7, 8])) + "\n" + json.dumps(_mc(1000, 1000, [3, bad]))
                 + "\n")
    for read in (lambda p: read_mooncake(p, tick_s=0), lambda p: read_leval(p, rate=1.0)):
        with pytest.raises(TraceFormatError) as ei:
            read(f)
        assert ei.value.line == 2 and "hash_ids" in ei.value.problem
    f.write_text(json.dumps(_mc(0, 1000, [2**64 - 1, 0])) + "\n")
    assert read_mooncake(f).requests[0].block_hashes == (2**64 - 1,)


# --- Azure -----------------------------------------------------------------------------
AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_azure_parse_and_unique_hashes(tmp_path: Path) -> None:
    f = tmp_path / "az.csv"
    f.write_text(
        AZ_HEADER
        + "2023-11-16 18:17:03.9799600,1100,10\n"
        + "2023-11-16 18:17:04.0319600,1100,8\n"
        + "2023-11-16 18:17:05,30,0\n"
    )
    wl = read_azure(f)
    assert [r.arrival_s for r in wl] == pytest.approx([0.0, 0.052, 1.02004])
    assert [r.input_len for r in wl] == [1100, 1100, 30]
    assert len(wl[0].block_hashes) == 2 and wl[2].block_hashes == ()
    # Same length, no prefix info: nothing shared.
    assert not set(wl[0].block_hashes) & set(wl[1].block_hashes)
    assert workload_stats(wl)["oracle_reuse"] == 0.0


@pytest.mark.parametrize(
    ("body", "line", "problem"),
    [
        ("2023-11-16 18:17:03.1,abc,1\n", 2, "ContextTokens"),
        ("2023-11-16 18:17:03.1,10\n", 2, "fields"),
        ("2023-13-16 18:17:03.1,10,1\n", 2, "TIMESTAMP"),
        ("2023-11-16 18:17:03.1,10,1\n2023-11-16 18:17:02.1,10,1\n", 3, "backwards"),
        ("2023-11-16 18:17:03.1,0,1\n", 2, ">= 1"),
        ("2023-11-16 18:17:03.1,-5,1\n", 2, ">= 1"),
        ("2023-11-16 18:17:03.1,10,1\n2023-11-16 18:17:04.1,10,1\n"
         "2023-11-16 18:17:05.1,10," + "9" * 5000 + "\n", 4, "column GeneratedTokens must be <="),
        # int() takes all of these; a count is plain ASCII digits (the real traces have
        # nothing else, not even spaces)
        ("2023-11-16 18:17:03.1,1_000,1\n", 2, "column ContextTokens must be a plain decimal"),
        ("2023-11-16 18:17:03.1, 12 ,1\n", 2, "column ContextTokens must be a plain decimal"),
        ("2023-11-16 18:17:03.1,12 ,1\n", 2, "column ContextTokens must be a plain decimal"),
        ("2023-11-16 18:17:03.1,+5,1\n", 2, "column ContextTokens must be a plain decimal"),
        ("2023-11-16 18:17:03.1,\u0661\u0662,1\n", 2, "column ContextTokens must be a plain"),
        ("2023-11-16 18:17:03.1,\uff11\uff12,1\n", 2, "column ContextTokens must be a plain"),
        ("2023-11-16 18:17:03.1,10,1\n2023-11-16 18:17:04.1,10,\u0663\n", 3,
         "column GeneratedTokens must be a plain decimal"),
        # an unmatched quote swallows the lines after it: named where it starts (it was the
        # file's last line)
        ("2023-11-16 18:17:03.1,10,1\n\"2023-11-16 18:17:04.1,10,1\n"
         + "2023-11-16 18:17:05.1,10,1\n" * 5, 3, "unmatched"),
    ],
)
def test_azure_bad_rows(tmp_path: Path, body: str, line: int, problem: str) -> None:
    f = tmp_path / "az.csv"
    f.write_text(AZ_HEADER + body)
    with pytest.raises(TraceFormatError) as ei:
        read_azure(f)
    assert f"{f}:{line}" in str(ei.value) and problem in str(ei.value)


def test_azure_bad_header(tmp_path: Path) -> None:
    f = tmp_path / "az.csv"
    f.write_text("TIME,Context\n1,2\n")
    with pytest.raises(TraceFormatError, match=r"az.csv:1: header lacks"):
        read_azure(f)


# --- L-Eval ----------------------------------------------------------------------------
def _lv(sha: str, idx: int, doc: int, instr: int, out: int = 3) -> dict:
    return {
        "task": "t",
        "doc_sha1": sha,
        "instr_idx": idx,
        "doc_llama3_tokens": doc,
        "instr_llama3_tokens": instr,
        "llama3_tokens": doc + instr,
        "ref_output_llama3_tokens": out,
    }


def test_leval_lengths_share_document_blocks(tmp_path: Path) -> None:
    f = _write_jsonl(
        tmp_path / "lv.jsonl",
        [_lv("a", 0, 2000, 600), _lv("a", 1, 2000, 30), _lv("b", 0, 2000, 600)],
    )
    wl = read_leval(f, rate=2.0, seed=3)
    a0, a1, b0 = sorted(wl, key=lambda r: r.request_id)
    assert len(a0.block_hashes) == 5 and len(a1.block_hashes) == 3
    assert a0.block_hashes[:3] == a1.block_hashes  # the document's 3 full blocks
    assert a0.block_hashes[3:] and not set(a0.block_hashes[3:]) & set(b0.block_hashes)
    assert not set(a0.block_hashes) & set(b0.block_hashes)
    assert [r.output_len for r in wl] == [3, 3, 3]
    # Seeded Poisson arrivals, increasing.
    assert [r.arrival_s for r in wl] == [r.arrival_s for r in read_leval(f, rate=2.0, seed=3)]
    assert all(
        x.arrival_s < y.arrival_s for x, y in zip(wl.requests, wl.requests[1:], strict=False)
    )


def test_leval_mooncake_format_and_shuffle(tmp_path: Path) -> None:
    rows = [dict(_mc(0, 1025 + i, [0, 1, 10 + i]), doc_sha1="d") for i in range(20)]
    f = _write_jsonl(tmp_path / "lvm.jsonl", rows)
    wl = read_leval(f, rate=5.0, seed=0)
    assert wl.metadata["format"] == "leval-mooncake"
    assert [r.request_id for r in wl] == [f"lvm-{i}" for i in range(20)]
    sh = read_leval(f, rate=5.0, seed=0, order="shuffle")
    assert sorted(r.request_id for r in sh) == sorted(r.request_id for r in wl)
    assert [r.request_id for r in sh] != [r.request_id for r in wl]
    # load_workload picks the L-Eval reader and insists on a rate.
    with pytest.raises(InvalidInput, match="rate"):
        load_workload(f)
    assert len(load_workload(f, rate=5.0)) == 20


def test_leval_errors(tmp_path: Path) -> None:
    f = _write_jsonl(
        tmp_path / "lv.jsonl",
        [_lv("a", 0, 2000, 600), {**_lv("a", 1, 2000, 5), "doc_llama3_tokens": 9000}],
    )
    with pytest.raises(TraceFormatError, match=r"lv.jsonl:2: doc_llama3_tokens"):
        read_leval(f, rate=1.0)
    with pytest.raises(InvalidInput, match="rate"):
        read_leval(f, rate=0.0)
    with pytest.raises(InvalidInput, match="order"):
        read_leval(f, rate=1.0, order="random")  # type: ignore[arg-type]


# --- Workload, scaling, truncation, stats -----------------------------------------------
def _wl(n: int = 5) -> Workload:
    reqs = [Request(f"r{i}", float(2 * i), 600, 1, (i,)) for i in range(n)]
    return Workload.from_requests("w", reqs)


def test_workload_invariants() -> None:
    with pytest.raises(InvalidInput, match="block hashes"):
        Workload("w", (Request("a", 0.0, 1100, 1, (1,)),))
    with pytest.raises(InvalidInput, match="duplicate"):
        Workload("w", (Request("a", 0.0, 10, 1), Request("a", 1.0, 10, 1)))
    with pytest.raises(InvalidInput, match="sorted"):
        Workload("w", (Request("a", 2.0, 10, 1), Request("b", 1.0, 10, 1)))
    with pytest.raises(InvalidInput):
        Request("a", -1.0, 10, 1)
    with pytest.raises(InvalidInput):
        Request("a", 0.0, 0, 1)
    ordered = Workload.from_requests("w", [Request("b", 2.0, 10, 1), Request("a", 1.0, 10, 1)])
    assert [r.request_id for r in ordered] == ["a", "b"]


def test_scale_rate_compresses_interarrivals() -> None:
    wl = _wl()
    fast = scale_rate(wl, 2.0)
    assert [r.arrival_s for r in fast] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert fast.metadata["rate_scale"] == 2.0
    assert scale_rate(fast, 0.5).metadata["rate_scale"] == 1.0
    with pytest.raises(InvalidInput):
        scale_rate(wl, 0)


def test_truncate() -> None:
    wl = _wl(10)
    assert len(truncate(wl, max_requests=4)) == 4
    win = truncate(wl, start_s=4.0, end_s=10.0, rebase=True)
    assert [r.arrival_s for r in win] == [0.0, 2.0, 4.0]
    with pytest.raises(InvalidInput):
        truncate(wl, start_s=5.0, end_s=1.0)


def test_oracle_reuse_counts_leading_seen_blocks() -> None:
    reqs = [
        Request("a", 0.0, 1536, 1, (1, 2, 3)),
        Request("b", 1.0, 1600, 1, (1, 2, 9)),  # reuses 2 blocks
        Request("c", 2.0, 1536, 1, (1, 2, 3)),  # all 3 full blocks: capped at L - 1
        Request("d", 3.0, 1100, 1, (7, 2)),  # first block unseen: nothing reused
    ]
    st = workload_stats(Workload("w", tuple(reqs)))
    assert st["oracle_reuse"] == pytest.approx((1024 + 1535) / (1536 + 1600 + 1536 + 1100))
    assert st["oracle_reuse_full_blocks"] == pytest.approx((1024 + 1536) / (512 * 11))
    assert st["requests"] == 4 and st["long_share"] == 0.0


def test_load_workload_dispatch_and_rate(tmp_path: Path) -> None:
    mc = _write_jsonl(tmp_path / "m.jsonl", [_mc(1000 * i, 600, [i, 50 + i]) for i in range(11)])
    wl = load_workload(mc)
    assert wl.metadata["format"] == "mooncake" and len(wl) == 11
    fast = load_workload(mc, rate=2.0)  # native 1 req/s (10 gaps of 1 s) -> twice as fast
    assert (len(fast) - 1) / fast.duration_s == pytest.approx(2.0)  # mean gap 1/rate
    az = tmp_path / "a.csv"
    az.write_text(AZ_HEADER + "2023-11-16 18:17:03.1,10,1\n")
    assert load_workload(az).metadata["format"] == "azure"
    syn = load_workload("synthetic", seed=2)
    assert syn.name == "synthetic" and len(syn) > 100
    with pytest.raises(InvalidInput, match="neither"):
        load_workload(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    ("name", "rows", "fmt"),
    [
        # L-Eval lengths rows in a file not named *.jsonl: the CLI's old test looked at
        # *.jsonl only (then load_workload, without a rate, refused it)
        ("lv.json", [_lv("a", i, 2000, 600) for i in range(3)], "leval"),
        ("lv", [_lv("a", i, 2000, 600) for i in range(3)], "leval"),
        # Mooncake-format L-Eval rows that name their document by doc_id: the CLI read them
        # as L-Eval, load_workload as Mooncake (and refused the file: all timestamps 0)
        ("lvm.jsonl", [dict(_mc(0, 1025 + i, [0, 1, 10 + i]), doc_id=f"d:{i}")
                       for i in range(3)], "leval"),
        # a timed Mooncake trace that mentions doc_sha1 only inside a value: both old tests
        # matched the text and replayed it with Poisson arrivals, dropping its timestamps
        ("mc.jsonl", [dict(_mc(1000 * i, 600, [i, 50 + i]), meta={"doc_sha1": "x"})
                      for i in range(3)], "mooncake"),
        ("mc2.jsonl", [dict(_mc(1000 * i, 600, [i, 50 + i]), source="doc_id")
                       for i in range(3)], "mooncake"),
    ],
)
def test_one_format_detection_for_the_loader_and_the_cli(tmp_path: Path, name: str,
                                                         rows: list[dict], fmt: str) -> None:
    """load_workload and ``--format auto`` (runner.load_trace) both use detect_format, so they
    read every file alike; each of these files was read differently by the two before."""
    from sim import runner

    f = _write_jsonl(tmp_path / name, rows)
    # Without --rate the CLI reads L-Eval at 1 req/s; load_workload needs that rate given.
    via_cli = runner.load_trace(str(f), "auto", seed=0, rate=None, max_requests=None)
    via_loader = load_workload(f, rate=1.0 if fmt == "leval" else None)
    assert via_cli.metadata["format"].startswith(fmt)
    assert via_loader.metadata["format"] == via_cli.metadata["format"]
    assert [r.arrival_s for r in via_loader] == [r.arrival_s for r in via_cli]
    from sim.workloads import detect_format

    assert detect_format(f) == fmt


@pytest.mark.parametrize("fmt", ["auto", "mooncake"])
def test_a_timed_traces_rate_is_the_one_asked_whatever_the_format_and_cut(
        tmp_path: Path, fmt: str) -> None:
    """``--rate`` rescales a Mooncake (or Azure) trace the same way whether its format is
    named or detected (named, it was dropped: a 3x different load under the same flags), and
    the requests kept by ``--max-requests`` arrive at that rate (the rescale used the whole
    file's mean rate before the cut)."""
    from sim import runner

    # 40 requests over 39 s, the first 10 of them over 3 s (a burst, then a lull)
    ts = [300 * i for i in range(10)] + [2700 + 1000 * i for i in range(1, 31)]
    f = _write_jsonl(tmp_path / "mc.jsonl",
                     [_mc(t, 600, [i, 100 + i]) for i, t in enumerate(ts)])
    for cut in (None, 10):
        wl = runner.load_trace(str(f), fmt, seed=0, rate=5.0, max_requests=cut)
        assert len(wl) == (cut or 40)
        assert (len(wl) - 1) / wl.duration_s == pytest.approx(5.0)  # mean gap 1/rate
    own = runner.load_trace(str(f), fmt, seed=0, rate=None, max_requests=None)
    assert len(own) / own.duration_s < 1.5  # its own ~1 req/s


def test_detect_format_edge_cases(tmp_path: Path) -> None:
    from sim.workloads import detect_format

    az = tmp_path / "A.CSV"
    az.write_text(AZ_HEADER)
    assert detect_format(az) == "azure"
    bad = tmp_path / "b.jsonl"
    bad.write_text('\n{"doc_sha1": "a", "llama3_tok\n')  # not JSON: the reader names line 2
    assert detect_format(bad) == "mooncake"
    with pytest.raises(TraceFormatError, match=r"b\.jsonl:2: not valid JSON"):
        load_workload(bad, rate=1.0)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    assert detect_format(empty) == "mooncake"
    listed = tmp_path / "l.jsonl"
    listed.write_text('["doc_sha1"]\n')
    assert detect_format(listed) == "mooncake"


def test_default_traces_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sim.workloads import TRACES_ENV, default_traces_dir

    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    assert default_traces_dir() == tmp_path
    monkeypatch.delenv(TRACES_ENV)
    assert default_traces_dir().parts[-3:] == ("shared", "data", "traces")
