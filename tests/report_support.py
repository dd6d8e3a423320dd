"""What every result row of an experiment carries, as the tests expect it (unique module name
for ``--import-mode=importlib``; importable from every folder: ``tests/conftest.py`` puts the
top of the test tree on ``sys.path``). Shared by the rows of ``sim.experiments.summarize_run``
and of ``vertumnus simulate``'s results."""

from __future__ import annotations

ROW_KEYS = {
    "policy",
    "rate_scale",
    "requests",
    "completed",
    "mean_ttft_s",
    "p50_ttft_s",
    "p90_ttft_s",
    "p99_ttft_s",
    "slo_attainment",
    "hit_rate",
    "gpu_seconds",
    "reconfigurations",
    "oracle_mean_ttft_s",
}
