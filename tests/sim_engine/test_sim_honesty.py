"""Honesty of evaluation (design.md): the scheduler side only ever sees the fitted profile.

* every record's ``predicted_s`` is the profile's Ê_C(R, P) at placement — not the ground truth;
* changing the ground truth changes the measured times but not the decisions made before the
  first completion (nothing the scheduler saw differs until then);
* no policy module imports ``sim`` (statically and transitively at run time).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from simeng_support import prefix_candidates, run, unique_prefix_workload

from shared.costmodel import Coefficients
from sim.groundtruth import Calibration, GroundTruth

ROOT = Path(__file__).resolve().parents[2]


def test_predictions_are_the_profile_without_prefix_sharing(profile) -> None:
    wl = unique_prefix_workload([700, 3_000, 9_000, 40_000, 1_500, 70_000, 20_000] * 6, 0.4)
    res = run(
        wl, profile, gpus=16, degrees=(2, 4), composition=None, adaptive=False, cache_manager=True
    )
    gt = GroundTruth()
    assert {r.degree for r in res.records} >= {4}
    for r in res.records:
        assert r.reused_tokens == 0
        assert r.predicted_s == pytest.approx(profile.predict(r.input_len, 0, r.degree), rel=1e-12)
    # ... and that is not the ground truth (the fit has a few percent of error).
    assert any(
        abs(r.predicted_s - gt.prefill_time(r.input_len, 0, r.degree)) > 1e-3 * r.predicted_s
        for r in res.records
    )


def test_predictions_follow_a_deliberately_wrong_profile(profile, steady_workload) -> None:
    """A profile 3× too pessimistic: predictions follow it, execution follows the truth."""
    co = profile.coefficients
    wrong = replace(
        profile,
        coefficients=Coefficients(3 * co.d, 3 * co.a, 3 * co.b, 3 * co.c, 3 * co.alpha),
        per_degree={},
    )
    res = run(
        steady_workload,
        wrong,
        gpus=8,
        degrees=(2, 4),
        adaptive=True,
        cache_manager=True,
        noise_sigma=0.0,
    )
    gt = GroundTruth()
    for r in res.records:
        assert any(
            r.predicted_s == pytest.approx(c, rel=1e-12)
            for c in prefix_candidates(wrong, r.input_len, r.degree)
        ), r
        p = r.reused_tokens
        assert r.actual_s == pytest.approx(gt.prefill_time(r.input_len - p, p, r.degree), rel=1e-12)
        assert r.predicted_s > 1.5 * r.actual_s


SLOW_TRUTH = GroundTruth(calibration=Calibration(d0=0.2, d_cp=0.1, sigma=80e-6))
KW = dict(gpus=16, degrees=(2, 4), adaptive=True, cache_manager=True, noise_sigma=0.0)


def test_changing_the_ground_truth_keeps_early_decisions(profile) -> None:
    """A burst of 24 requests arrives before any prefill can finish: with a different truth
    every one of them is placed on the same worker with the same prediction."""
    wl = unique_prefix_workload([700, 3_000, 9_000, 40_000, 1_500, 20_000] * 4, 0.004)
    a = run(wl, profile, **KW)
    b = run(wl, profile, truth=SLOW_TRUTH, **KW)
    by_b = {r.request_id: r for r in b.records}
    first_finish = min(min(r.finish_s for r in a.records), min(r.finish_s for r in b.records))
    early = [r for r in a.records if r.arrival_s < first_finish]
    assert len(early) == len(wl)
    assert len({r.worker for r in early}) > 1
    for r in early:
        o = by_b[r.request_id]
        assert (o.worker, o.degree, o.predicted_s) == (r.worker, r.degree, r.predicted_s)
        assert o.actual_s > r.actual_s  # the slower truth shows only in the measured time
        assert o.ttft_s > r.ttft_s


def test_changing_the_ground_truth_never_reaches_predictions(profile, steady_workload) -> None:
    a = run(steady_workload, profile, **KW)
    b = run(steady_workload, profile, truth=SLOW_TRUTH, **KW)
    # Over the whole run the truth matters for what actually happened ...
    assert sum(r.actual_s for r in b.records) > sum(r.actual_s for r in a.records)
    # ... and each prediction is still the profile's, never the (new) truth's.
    for r in b.records:
        assert any(
            r.predicted_s == pytest.approx(c, rel=1e-12)
            for c in prefix_candidates(profile, r.input_len, r.degree)
        )


# --- static: no policy code depends on the simulator ------------------------------------------
def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                names.add(node.module)
        elif isinstance(node, ast.Call):
            # importlib.import_module("sim.x") / __import__("sim.x") with a literal name.
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if (
                fname in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.add(node.args[0].value)
    return names


def test_no_service_module_imports_the_simulator_package() -> None:
    """Stricter than tests/sim/test_groundtruth_isolation.py: nothing under services/ (the
    rank daemon included) or shared/ imports ``sim`` at all, dynamic imports included."""
    offenders = []
    for top in ("services", "shared"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for name in _imported_modules(path):
                if name == "sim" or name.startswith("sim."):
                    offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, offenders


def test_policy_cores_do_not_load_the_ground_truth_transitively() -> None:
    code = (
        "import sys\n"
        "import services.scheduler.core, services.scheduler.registry, services.cachemgr.trie,"
        " services.cachemgr.scan, services.cachemgr.reconcile, services.controller.core,"
        " services.controller.planner, services.controller.composition\n"
        "bad = sorted(m for m in sys.modules if m == 'sim' or m.startswith('sim.'))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
