"""--repeats: a row's ``failed`` is the mean over the seeds (a float where they differ), and
the comparison still carries it (sim.comparison's ``failed`` fields, the comparison table's
caption): it was dropped as "not a count", so the comparison said nothing of the failures
the results table above it named."""

from __future__ import annotations

import io

from sim.comparison import compare_with_baselines
from sim.runner import print_table


def _row(policy: str, mean: float, failed: float) -> dict:
    return {"policy": policy, "rate_scale": 1.0, "request_rate": 5.0, "requests": 200,
            "failed": failed, "mean_ttft_s": mean, "p50_ttft_s": mean, "p90_ttft_s": mean,
            "p99_ttft_s": mean, "slo_attainment": 0.5, "hit_rate": 0.4,
            "reconfigurations": 0, "oracle_mean_ttft_s": 0.4}


def test_a_mean_of_failed_requests_over_seeds_is_carried() -> None:
    # Seeds 0 and 1 failed 105 and 106 requests: the combined row has 105.5.
    rows = [_row("vertumnus", 0.243, 105.5), _row("homo", 0.245, 2.25)]
    (c,) = compare_with_baselines(rows)
    assert (c["failed"], c["strongest_failed"], c["best_p90_failed"]) == (105.5, 2.25, 2.25)


def test_the_comparison_caption_names_a_mean_of_failed_requests() -> None:
    rows = [_row("vertumnus", 0.243, 105.5), _row("homo", 0.245, 1 / 3)]
    out = io.StringIO()
    print_table({"rows": rows, "meta": {"workload": "w", "seeds": [0, 1, 2]},
                 "comparison": compare_with_baselines(rows)}, file=out)
    text = " ".join(out.getvalue().split())
    assert "failed requests (mean and P90 are over the completed ones): ×1 vertumnus " \
           "105.50, homo 0.33" in text
