"""A rank host's initial workers (``VTM_INITIAL_WORKERS``, run when no epoch record exists)
must lie in its GPU range (``VTM_HOST_GPUS``) and share no GPU. Before, only the host's
constructor checked the range, after the settings had loaded (a torch host had already
spawned its world by then: an IndexError, or through a negative index a world in the wrong
degrees), and two workers sharing a GPU were both started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.rankd.host import RankdHost
from services.rankd.settings import RankdSettings, initial_workers_problem
from shared.ids import InvalidInput

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("ids", "gpus", "problem"), [
    (["w-cp2-g0", "w-cp2-g2"], range(0, 4), None),
    (["w-cp4-g4"], range(4, 8), None),
    ([], range(0, 2), None),
    (["w-cp2-g0"], None, None),  # no range to check
    (["w-cp2-g0"], range(4, 6),
     "initial worker w-cp2-g0 (GPUs 0-1) is outside the host's GPUs 4-5"),
    (["w-cp4-g0"], range(2, 4), "outside the host's GPUs 2-3"),  # before: a negative index
    (["w-cp4-g0"], range(0, 2), "outside the host's GPUs 0-1"),  # one past the end
    (["w-cp4-g0", "w-cp2-g2"], range(0, 4), "initial workers w-cp4-g0 and w-cp2-g2 share GPU 2"),
    (["w-cp2-g0", "w-cp2-g0"], range(0, 4), None),  # the same worker named twice: one worker
], ids=["disjoint", "offset-range", "none", "no-range", "outside", "below", "past-end",
        "overlap", "repeated"])
def test_initial_workers_problem(ids: list[str], gpus: range | None,
                                 problem: str | None) -> None:
    got = initial_workers_problem(ids, gpus)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


def test_the_settings_refuse_initial_workers_the_host_cannot_run() -> None:
    with pytest.raises(ValidationError, match="share GPU 2") as e:
        RankdSettings(host_gpus="0-3", initial_workers="w-cp4-g0,w-cp2-g2")
    assert e.value.errors()[0]["loc"] == ("initial_workers",)
    with pytest.raises(ValidationError, match="outside the host's GPUs 4-5"):
        RankdSettings(host_gpus="4-5", initial_workers="w-cp2-g0")
    ok = RankdSettings(host_gpus="0-3", initial_workers="w-cp2-g0, w-cp2-g2")
    assert ok.initial_worker_ids == ["w-cp2-g0", "w-cp2-g2"]


def test_the_host_refuses_overlapping_initial_workers() -> None:
    settings = RankdSettings(host_gpus="0-3")
    with pytest.raises(InvalidInput, match="share GPU"):
        RankdHost(settings, range(0, 4), lambda *a: None,  # type: ignore[arg-type,return-value]
                  initial=["w-cp4-g0", "w-cp2-g0"])


def test_rankd_exits_2_naming_the_variable() -> None:
    """As an operator starts it: one line naming VTM_INITIAL_WORKERS, before any connect."""
    proc = subprocess.run(
        [sys.executable, "-m", "vertumnus", "rankd"], cwd=REPO, capture_output=True, text=True,
        timeout=60, env={**os.environ, "VTM_NATS_URL": "nats://127.0.0.1:9",
                         "VTM_HOST_GPUS": "4-5", "VTM_INITIAL_WORKERS": "w-cp2-g0"})
    assert proc.returncode == 2, proc.stderr
    assert "VTM_INITIAL_WORKERS" in proc.stderr and "outside the host's GPUs 4-5" in proc.stderr
    assert "Traceback" not in proc.stderr
