"""Smoke reads of the real public traces and a comparison with their stats.json.

The traces are third-party inputs kept outside the repository (``$VERTUMNUS_TRACES`` or
``../shared/data/traces``); these tests skip cleanly where they are absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.workloads import (
    default_traces_dir,
    detect_format,
    read_azure,
    read_leval,
    read_mooncake,
    workload_stats,
)

TRACES = default_traces_dir()


def _trace(rel: str) -> Path:
    path = TRACES / rel
    if not path.is_file():
        pytest.skip(f"trace {path} not present")
    return path


def _stats(rel: str, **match: str) -> dict:
    f = TRACES / "stats.json"
    if not f.is_file():
        pytest.skip("stats.json not present")
    for entry in json.loads(f.read_text()):
        if entry["file"] == rel and all(entry.get(k) == v for k, v in match.items()):
            return entry
    pytest.skip(f"no stats for {rel}")


def test_first_lines_of_every_trace() -> None:
    mc = read_mooncake(_trace("mooncake/conversation_trace.jsonl"), max_requests=50)
    assert len(mc) == 50 and mc[0].input_len == 6758 and mc[0].block_hashes[0] == 0
    az = read_azure(_trace("azure2023/AzureLLMInferenceTrace_code.csv"), max_requests=50)
    assert len(az) == 50 and az[0].input_len == 4808 and az[0].arrival_s == 0.0
    lv = read_leval(_trace("leval/leval_requests.jsonl"), rate=1.0, max_requests=20)
    assert len(lv) == 20
    lvm = read_leval(_trace("leval/leval_llama3_mooncake.jsonl"), rate=1.0, max_requests=20)
    assert [r.input_len for r in lvm] == [r.input_len for r in lv]


def test_mooncake_conversation_matches_stats_json() -> None:
    rel = "mooncake/conversation_trace.jsonl"
    wl = read_mooncake(_trace(rel), seed=0)
    ref = _stats(rel)
    st = workload_stats(wl)
    assert st["requests"] == ref["requests"]
    assert st["input_mean"] == pytest.approx(ref["input_mean"])
    assert st["input_p99"] == pytest.approx(ref["input_p99"])
    assert st["long_share"] == pytest.approx(ref["frac_gt_32k"])
    assert st["long_token_share"] == pytest.approx(ref["tok_share_gt_32k"])
    # Full-block reuse is stats.json's definition exactly; token-level reuse differs only by
    # the trailing partial blocks stats.json also counts (and our L−1 cap).
    assert st["oracle_reuse_full_blocks"] == pytest.approx(
        ref["token_reuse_fullblock_only"], abs=1e-9
    )
    assert st["oracle_reuse"] == pytest.approx(ref["token_reuse_trie"], abs=0.002)
    # 3 s ticks detected and spread: duration within one tick of the raw one.
    assert wl.metadata["tick_s"] == pytest.approx(3.0)
    assert abs(st["duration_s"] - ref["duration_s"]) < 3.0
    assert len({r.arrival_s for r in wl}) > 0.99 * len(wl)


@pytest.mark.parametrize(
    "rel",
    ["azure2023/AzureLLMInferenceTrace_code.csv", "azure2023/AzureLLMInferenceTrace_conv.csv"],
)
def test_azure_matches_stats_json(rel: str) -> None:
    wl = read_azure(_trace(rel))
    ref = _stats(rel)
    st = workload_stats(wl)
    assert st["requests"] == ref["requests"]
    assert st["input_mean"] == pytest.approx(ref["input_mean"])
    assert st["duration_s"] == pytest.approx(ref["duration_s"], abs=1e-3)
    assert st["rate_req_per_s"] == pytest.approx(ref["mean_rate_req_per_s"], rel=1e-4)
    assert st["oracle_reuse"] == 0.0


def test_leval_both_formats_match_stats_json() -> None:
    real = read_leval(_trace("leval/leval_llama3_mooncake.jsonl"), rate=4.0, seed=1)
    derived = read_leval(_trace("leval/leval_requests.jsonl"), rate=4.0, seed=1)
    ref = _stats("leval/leval_llama3_mooncake.jsonl")
    s_real, s_der = workload_stats(real), workload_stats(derived)
    assert s_real["requests"] == s_der["requests"] == ref["requests"]
    assert s_der["input_mean"] == pytest.approx(ref["input_mean"])
    assert s_real["oracle_reuse_full_blocks"] == pytest.approx(
        ref["token_reuse_fullblock_only"], abs=1e-9
    )
    # Document-as-shared-prefix from lengths alone lands close to the real token hashes.
    assert s_der["oracle_reuse"] == pytest.approx(s_real["oracle_reuse"], abs=0.01)
    assert s_real["rate_req_per_s"] == pytest.approx(4.0, rel=0.1)


@pytest.mark.parametrize(("rel", "fmt"), [
    ("mooncake/conversation_trace.jsonl", "mooncake"),
    ("azure2023/AzureLLMInferenceTrace_code.csv", "azure"),
    ("azure2023/AzureLLMInferenceTrace_conv.csv", "azure"),
    ("leval/leval_requests.jsonl", "leval"),
    ("leval/leval_llama3_mooncake.jsonl", "leval"),
])
def test_every_trace_is_detected_as_its_format(rel: str, fmt: str) -> None:
    """The one detection load_workload and ``--format auto`` share (the full reads above pass
    the readers' checks: Mooncake ids prefix-chained and 64-bit, Azure counts plain digits)."""
    assert detect_format(_trace(rel)) == fmt
