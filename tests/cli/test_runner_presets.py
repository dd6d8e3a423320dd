"""``sim.runner`` (load_trace, run_simulate, print_table) and the §9.3 / §9.4 presets, small."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from shared.ids import InvalidInput
from sim import presets, runner
from sim.groundtruth import GroundTruth
from sim.workloads import default_traces_dir, read_mooncake, truncate

CONV = default_traces_dir() / "mooncake" / "conversation_trace.jsonl"


def test_load_trace_synthetic_and_truncation() -> None:
    a = runner.load_trace("synthetic", "auto", seed=0, rate=None, max_requests=50)
    b = runner.load_trace("synthetic", "auto", seed=0, rate=None, max_requests=50)
    c = runner.load_trace("synthetic", "auto", seed=1, rate=None, max_requests=50)
    assert len(a) == 50
    assert [r.block_hashes for r in a] == [r.block_hashes for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    fast = runner.load_trace("synthetic", "auto", seed=0, rate=16.0, max_requests=50)
    assert fast.requests[-1].arrival_s < a.requests[-1].arrival_s


def test_load_trace_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="not found"):
        runner.load_trace(
            str(tmp_path / "missing.jsonl"), "auto", seed=0, rate=None, max_requests=None
        )
    f = tmp_path / "t.jsonl"
    f.write_text(
        json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}) + "\n"
    )
    with pytest.raises(InvalidInput, match="format"):
        runner.load_trace(str(f), "parquet", seed=0, rate=None, max_requests=None)
    assert len(runner.load_trace(str(f), "mooncake", seed=0, rate=None, max_requests=None)) == 1
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InvalidInput, match="no requests"):
        runner.load_trace(str(empty), "mooncake", seed=0, rate=None, max_requests=None)


@pytest.mark.skipif(not CONV.is_file(), reason="conversation trace not available")
def test_load_trace_mooncake_matches_reader() -> None:
    wl = runner.load_trace(str(CONV), "mooncake", seed=0, rate=None, max_requests=120)
    ref = read_mooncake(CONV, seed=0, max_requests=120)
    assert [(r.request_id, r.input_len, r.block_hashes) for r in wl] == [
        (r.request_id, r.input_len, r.block_hashes) for r in ref
    ]


def test_run_simulate_rejects_unknown_policy_before_writing(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="known: vertumnus"):
        runner.run_simulate(
            trace="synthetic", policies=["vertumnus", "nope"], rate_scales=[1.0], out=tmp_path / "o"
        )
    assert not (tmp_path / "o").exists()
    with pytest.raises(InvalidInput):
        runner.run_simulate(trace="synthetic", policies=[], rate_scales=[1.0], out=tmp_path / "o2")


def test_run_simulate_and_print_table(tmp_path: Path, profile_file: Path) -> None:
    wl = truncate(
        runner.load_trace("synthetic", "auto", seed=0, rate=None, max_requests=None),
        max_requests=120,
    )
    summary = runner.run_simulate(
        trace="synthetic",
        policies=["homo_cp2", "round_robin"],
        rate_scales=[1.0],
        gpus=8,
        degrees=(2, 4),
        out=tmp_path,
        profile_path=profile_file,
        workload=wl,
    )
    rows = summary["rows"]
    assert [r["policy"] for r in rows] == ["homo_cp2", "round_robin"]
    assert rows[0]["composition_start"] == {"2": 4}
    assert rows[1]["composition_start"] == {"4": 2}
    assert json.loads((tmp_path / "results.json").read_text())[0]["policy"] == "homo_cp2"
    buf = io.StringIO()
    runner.print_table(summary, file=buf)
    text = buf.getvalue()
    assert "homo_cp2" in text and "round_robin" in text
    assert f"{rows[0]['mean_ttft_s']:.3f}" in text


def test_presets_are_listed_and_unknown_is_rejected(tmp_path: Path) -> None:
    names = runner.preset_descriptions()
    assert {"conversation", "leval", "azure-code", "reconfig", "ablation"} <= set(names)
    with pytest.raises(InvalidInput, match="reconfig"):
        runner.run_preset("nope", out=tmp_path)


def test_reconfig_preset_small(tmp_path: Path) -> None:
    fixed = ("4CP2/2CP4", "2CP2/3CP4")
    s = presets.run_reconfig(out=tmp_path, seed=0, base_rate=0.6, gpus=16, fixed=fixed)
    rows = {r["policy"]: r for r in s["rows"]}
    assert set(rows) == {"vertumnus", *fixed}
    n = rows["vertumnus"]["requests"]
    for label, r in rows.items():
        assert r["requests"] == r["completed"] == n, label
    for f in fixed:  # fixed compositions never move
        assert rows[f]["reconfigurations"] == 0
        assert rows[f]["composition_start"] == rows[f]["composition_end"]
    assert rows["vertumnus"]["composition_start"] == rows[fixed[0]]["composition_start"]
    meta = json.loads((tmp_path / "reconfig.json").read_text())
    assert len(meta["reconfigurations"]) == rows["vertumnus"]["reconfigurations"] >= 1
    # Every operation names the controller rule that decided it.
    assert {rc["trigger"] for rc in meta["reconfigurations"]} <= {
        "capacity", "long_fraction", "preference_shift", "long_shift", "long_drop"}
    sw = GroundTruth().surroundings
    for rc in meta["reconfigurations"]:
        assert rc["drain_s"] >= 0
        assert sw.switch_min_s <= rc["switch_s"] <= sw.switch_max_s
    assert all(len(v) == len(presets.RECONFIG_PHASES) for v in meta["phase_mean_ttft_s"].values())
    assert all(x is None or isinstance(x, int) for x in meta["windows_to_first_reaction"])
    follow = meta["windows_to_follow"]
    assert len(follow) == len(presets.RECONFIG_PHASES) - 1
    assert all(x is None or (isinstance(x, int) and x >= 0) for x in follow)
    buf = io.StringIO()
    runner.print_table(s, buf)
    text = buf.getvalue()
    assert "mean TTFT (s) by phase" in text and "vs better fixed" in text
    want = " ".join("none" if x is None else str(x) for x in follow)
    line = next(ln for ln in text.splitlines() if "windows to follow" in ln)
    assert " ".join(c.strip() for c in line.split("│")[3:-1]) == want
    for name in ("reconfig.png", "results.json", "results.csv", "ttft_mean.png"):
        assert (tmp_path / name).is_file(), name


def test_reconfig_preset_on_three_degrees(tmp_path: Path) -> None:
    # The other lattice, {2, 4, 8}, on a small pool: runs, compares, and writes the
    # degrees and pools it ran.
    fixed = ("4CP2/2CP4", "2CP2/1CP4/1CP8")
    s = presets.run_reconfig(out=tmp_path, seed=0, base_rate=0.6, gpus=16, degrees=(2, 4, 8),
                             fixed=fixed)
    rows = {r["policy"]: r for r in s["rows"]}
    assert set(rows) == {"vertumnus", *fixed}
    assert all(r["completed"] == r["requests"] for r in rows.values())
    assert rows["2CP2/1CP4/1CP8"]["composition_start"] == {"2": 2, "4": 1, "8": 1}
    meta = json.loads((tmp_path / "reconfig.json").read_text())
    assert meta["degrees"] == [2, 4, 8]
    assert len(meta["windows_to_follow"]) == len(presets.RECONFIG_PHASES) - 1


def test_reconfig_defaults_per_degree_set() -> None:
    assert presets.reconfig_fixed((4, 2)) == ((2, 4), ("12CP2/4CP4", "4CP2/8CP4"))
    assert presets.reconfig_fixed((8, 4)) == ((4, 8), ("6CP4/2CP8", "4CP4/3CP8"))  # §9.3's
    assert presets.reconfig_fixed((2, 4, 8))[1] == ("12CP2/2CP4/1CP8", "4CP2/4CP4/2CP8")
    # Given pools come back in the canonical notation.
    assert presets.reconfig_fixed((2, 4), ("4CP4/12CP2", "8cp4/4cp2"))[1] == (
        "12CP2/4CP4", "4CP2/8CP4")
    # The base rate per degree set, else by the smallest degree, or the caller's.
    assert presets.reconfig_base_rate((2, 4)) == 24.0
    assert presets.reconfig_base_rate((2, 4, 8)) == 24.0
    assert presets.reconfig_base_rate((8, 4)) == 14.0
    assert presets.reconfig_base_rate((2, 8)) == 24.0
    assert presets.reconfig_base_rate((1, 2)) == 48.0
    assert presets.reconfig_base_rate((4, 8), 7) == 7.0
    for bad in (0, -1.0, float("nan"), True, "3"):
        with pytest.raises(InvalidInput, match="rate must be"):
            presets.reconfig_base_rate((2, 4), bad)  # type: ignore[arg-type]
    for degs in ((), "24", None):
        with pytest.raises(InvalidInput):
            presets.reconfig_fixed(degs)  # type: ignore[arg-type]


def test_reconfig_preset_run_refuses_what_it_fixes(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="does not take workload"):
        presets.run("reconfig", out=tmp_path, workload="x")
    with pytest.raises(InvalidInput, match="does not take degrees"):
        presets.run("ablation", out=tmp_path, degrees=(2, 4))


@pytest.mark.skipif(not CONV.is_file(), reason="conversation trace not available")
def test_ablation_preset_small(tmp_path: Path) -> None:
    wl = read_mooncake(CONV, seed=0, max_requests=200)
    s = presets.run_ablation(
        out=tmp_path, seed=0, rate_scales=(1.0, 2.0), cache_blocks_per_gpu=200, workload=wl
    )
    rows = s["rows"]
    assert [(r["policy"], r["rate_scale"]) for r in rows] == [
        (p, sc) for sc in (1.0, 2.0) for p in ("full", "no_replication")
    ]
    for r in rows:
        assert r["completed"] == r["requests"] == 200
        assert r["reconfigurations"] == 0
        assert r["composition_start"] == {"2": 8, "4": 6}
        assert math.isfinite(r["mean_ttft_s"])
        if r["policy"] == "no_replication":
            assert r["replications"] == r["reclamations"] == 0
    assert json.loads((tmp_path / "meta.json").read_text())["cache_blocks_per_gpu"] == 200


def test_ablation_preset_defaults_to_the_tool_agent_shaped_workload(tmp_path: Path) -> None:
    # The default workload is the one docs/workloads/tool-agent-shaped.toml describes (same
    # parameters, same name: the same requests), and on its recurring tool prefixes the full
    # manager copies prefixes where the ablated one cannot (a minute at ×3 is three scans).
    from sim.workloads.synthetic import TOOL_AGENT_NAME, TOOL_AGENT_SHAPED
    from sim.workloads.synthetic_file import load_synthetic_config

    f = Path(__file__).resolve().parents[2] / "docs" / "workloads" / "tool-agent-shaped.toml"
    assert load_synthetic_config(f) == TOOL_AGENT_SHAPED and f.stem == TOOL_AGENT_NAME
    s = runner.run_preset("ablation", out=tmp_path, max_requests=2000, rate_scales=[3.0])
    full, ablated = s["rows"]
    assert (full["policy"], ablated["policy"]) == ("full", "no_replication")
    assert full["requests"] == ablated["requests"] == 2000
    assert full["replications"] >= 1 and ablated["replications"] == 0
    assert json.loads((tmp_path / "meta.json").read_text())["workload"] == TOOL_AGENT_NAME
    assert presets.ABLATION_RATE_SCALES[-1] == 4.5


def test_ablation_preset_on_a_named_workload(tmp_path: Path) -> None:
    # How a user with the paper's Tool-Agent trace runs §9.4 on it: any trace or 'synthetic'.
    s = runner.run_preset("ablation", out=tmp_path, trace="synthetic", rate=4.0,
                          max_requests=120, rate_scales=[1.0, 1.5], cache_blocks_per_gpu=50)
    rows = s["rows"]
    assert [(r["policy"], r["rate_scale"]) for r in rows] == [
        (p, sc) for sc in (1.0, 1.5) for p in ("full", "no_replication")]
    assert all(r["requests"] == r["completed"] == 120 for r in rows)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["cache_blocks_per_gpu"] == 50 and meta["workload"].startswith("synthetic")
    # The same requests whichever variant: only the cache manager differs.
    assert rows[0]["oracle_mean_ttft_s"] == rows[1]["oracle_mean_ttft_s"]


@pytest.mark.parametrize(("value", "cell"), [
    (None, "-"), (0, "0"), (12, "12"), (1234, "1234"), (3.0, "3"),
    (10 / 3, "3.33"), (2 / 3, "0.67"),
])
def test_a_count_cell_is_an_integer_or_a_mean_to_two_decimals(value, cell) -> None:
    """Reconfigurations: a count, or with --repeats the mean over the seeds."""
    assert runner._count(value) == cell


def test_print_table_shows_the_summarys_comparison(tmp_path: Path) -> None:
    """print_table shows the comparison the run computed (``summary["comparison"]``) rather
    than computing it again."""
    row = {"policy": "vertumnus", "rate_scale": 1.0, "request_rate": 1.0,
           "mean_ttft_s": 0.5, "p50_ttft_s": 0.5, "p90_ttft_s": 0.6, "p99_ttft_s": 0.7,
           "slo_attainment": 0.9, "hit_rate": 0.1, "reconfigurations": 0,
           "oracle_mean_ttft_s": 0.4}
    comparison = [{"subject": "vertumnus", "rate_scale": 1.0, "mean_ttft_s": 0.5,
                   "strongest_baseline": "made_up_peer", "strongest_mean_ttft_s": 0.625,
                   "mean_change": -0.2, "p90_ttft_s": 0.6, "best_p90_baseline": "made_up_peer",
                   "p90_change": -0.25, "slo_attainment": 0.9,
                   "best_slo_baseline": "made_up_peer", "slo_points": 5.0,
                   "mean_over_oracle": 1.25}]
    buf = io.StringIO()
    runner.print_table({"rows": [row], "meta": {}, "comparison": comparison}, file=buf)
    text = buf.getvalue()
    assert "made_up_peer" in text and "-20.0%" in text and "0.625" in text
