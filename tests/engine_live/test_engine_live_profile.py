"""``vertumnus profile --backend torch`` on a tiny grid: a real gloo world of 2 ranks measures
the engine, both fits are reported and a loadable profile is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from services.rankd.engine.profiling import torch_profile_command
from services.rankd.torch_backend import TINY_MODEL
from shared.costmodel import Profile
from shared.ids import InvalidInput

# The project's tiny random Qwen3 (TINY_MODEL), with a smaller vocabulary and context.
TINY = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": 256}


def test_torch_profile_refuses_an_unknown_estimator(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="estimator must be one of"):
        torch_profile_command(tmp_path, estimator="mean", model_config=TINY, max_world=2)
    assert not (tmp_path / "profile.json").exists()


def test_torch_profile_writes_a_loadable_profile(tmp_path: Path) -> None:
    path = torch_profile_command(
        tmp_path,
        degrees=(1, 2, 8),  # 8 does not fit a world of 2: dropped with a note
        seed=0,
        lengths=(8, 16, 32, 64, 96),
        prefixes=(0, 32),
        repeats=1,
        model_config=TINY,
        block_size=16,
        max_world=2,
        estimator="min",
    )
    assert path == tmp_path / "profile.json"
    prof = Profile.load(path)
    report = json.loads((tmp_path / "profile_report.json").read_text())
    assert report["degrees"] == [1, 2]
    assert report["estimator"] == "min" and report["warmup_passes"] == 1
    assert report["repeat_spread"] == 0.0  # one repeat: no spread to measure
    by_point = {(r["degree"], r["r"], r["p"]): r["seconds"] for r in report["raw"]}
    assert all(s["seconds"] == by_point[(s["degree"], s["r"], s["p"])] for s in report["samples"])
    assert any("[8] ignored" in n for n in report["notes"])
    assert {(s["degree"], s["p"]) for s in report["samples"]} == {
        (c, p) for c in (1, 2) for p in (0, 32)
    }
    assert all(r["prefix_reused"] == r["p"] for r in report["raw"])  # P really came from cache
    single, per = report["single_set"]["mape"], report["per_degree_fit"]["mape"]
    assert math.isfinite(single) and math.isfinite(per)
    assert set(report["per_degree_fit"]["mape_per_degree"]) == {"1", "2"}
    stored = report["stored"]
    assert stored == ("per_degree" if per < single else "single")
    assert report["mape_vs_measured"] == (per if stored == "per_degree" else single)
    assert prof.fit_mape == report["mape_vs_measured"]
    assert bool(prof.per_degree) == (stored == "per_degree")
    assert prof.block_size == 16 and prof.predict(64, 32, 2) > 0
    assert (tmp_path / "profile_fit.png").stat().st_size > 0
    assert (tmp_path / "profile_samples.csv").read_text().startswith("degree,r,p")
    print(f"torch profile MAPE: single set {single:.3f}, per degree {per:.3f}, stored {stored}")
