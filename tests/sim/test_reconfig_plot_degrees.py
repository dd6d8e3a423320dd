"""The reconfiguration plot (reconfig.png) draws its CP degrees in numeric order: the degree
keys are strings (as meta.json holds them) and were sorted as strings, so CP16 came before CP2
in the legend and took the first colour. Seen through ``vertumnus report``'s redraw, the
public function that draws it from a run's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.runner import redraw

ROW = {"policy": "vertumnus", "rate_scale": 1.0, "request_rate": 2.0, "requests": 10,
       "failed": 0, "mean_ttft_s": 0.5, "p50_ttft_s": 0.5, "p90_ttft_s": 0.6,
       "p99_ttft_s": 0.7, "slo_attainment": 1.0, "hit_rate": 0.1, "reconfigurations": 2,
       "oracle_mean_ttft_s": 0.4}


def test_the_reconfiguration_plot_orders_degrees_as_numbers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figures to look at them
    # 32 GPUs: 8 CP2 + 4 CP4 workers, then one CP16 from four of the CP4 and CP2 groups.
    tl = [[0.0, {"2": 8, "4": 4}], [40.0, {"16": 1, "2": 4, "4": 2}], [80.0, {"16": 1, "2": 4,
                                                                             "4": 2}]]
    meta = {"workload": "reconfig-phases", "phase_bounds": [[0.0, 40.0], [40.0, 80.0]],
            "phase_mean_ttft_s": {"vertumnus": [0.5, 0.6], "8CP4": [0.55, 0.7]},
            "all_timelines": {"vertumnus": tl, "8CP4": [[0.0, {"4": 8}], [80.0, {"4": 8}]]},
            "timelines": {"1.0": tl}}
    d = tmp_path / "run"
    d.mkdir()
    (d / "results.json").write_text(json.dumps([ROW, {**ROW, "policy": "8CP4"}]))
    (d / "meta.json").write_text(json.dumps(meta))
    redraw(d)
    assert (d / "reconfig.png").is_file()
    legends = [[t.get_text() for t in ax.get_legend().get_texts()]
               for f in figs for ax in f.axes if ax.get_legend() is not None]
    workers = [labels for labels in legends if any(x.startswith("CP") for x in labels)]
    assert workers == [["CP2 workers", "CP4 workers", "CP16 workers"]], legends
