"""Stopping ``vertumnus simulate --jobs 2`` while its sweep runs in worker processes.

A sweep's cells used to run in a ``with ProcessPoolExecutor`` block: a Ctrl-C to the parent
exited 130 only once every queued cell had been computed (26 s on the review's run); SIGTERM
killed the parent alone and left the spawn workers and the resource tracker orphaned, asleep
for good; a Ctrl-C to the process group made every worker print a KeyboardInterrupt traceback.
Now (sim.experiments.run_in_processes) the workers ignore SIGINT, the parent cancels what has
not started and ends them: exit 130 (SIGINT) or 143 (SIGTERM, what a shell shows for a
single-process ``simulate`` that SIGTERM ends), no traceback, no process left.

Real ``vertumnus simulate`` processes; each signal is sent once the sweep's workers exist (seen
in /proc), never after a fixed sleep. A sweep long enough that it cannot finish meanwhile
(6 rates × 4 policies, each cell writing its per-request log when it ends: the logs count the
cells that ran).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("vertumnus", "homo", "homo_cp2", "vllm")
RATES = ("1", "1.5", "2", "2.5", "3", "3.5")
CELLS = len(POLICIES) * len(RATES)
WAIT_S = 120.0  # a bound for every wait below (a busy 2-core machine), not a timing claim


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _children(pid: int) -> dict[int, str]:
    """The live children of ``pid`` (pid: start time, to tell a reused pid apart)."""
    out: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None and int(st[1]) == pid:
            out[int(d)] = st[19]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int, start: str) -> bool:
    """Still running (a zombie has ended: only its parent's wait is missing)."""
    st = _stat(pid)
    return st is not None and st[19] == start and st[0] != "Z"


def _wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _simulate(out: Path, err: Path) -> subprocess.Popen[bytes]:
    """``simulate --jobs 2`` in a session of its own (a group signal reaches it alone)."""
    with open(err, "w") as fe, open(err.with_suffix(".out"), "w") as fo:
        return subprocess.Popen(
            [sys.executable, "-m", "vertumnus", "simulate", "--trace", "synthetic",
             "--policies", ",".join(POLICIES), "--rate-scale", ",".join(RATES), "--jobs", "2",
             "--requests", "--out", str(out)],
            cwd=REPO, stdout=fo, stderr=fe, start_new_session=True)


def _workers(proc: subprocess.Popen[bytes]) -> dict[int, str]:
    return {p: s for p, s in _children(proc.pid).items()
            if "multiprocessing.spawn" in _cmdline(p)}


def _logs(out: Path) -> list[Path]:
    """The per-request logs written so far: one per cell that has finished."""
    return sorted((out / "requests").glob("*.csv")) if (out / "requests").is_dir() else []


def _importing(pid: int) -> bool:
    """The worker has got as far as numpy (its start-up's imports, or the cells)."""
    try:
        return "numpy" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize(("sig", "group", "status"), [
    (signal.SIGINT, False, 130),   # Ctrl-C to the parent alone (kill -INT), cells running
    (signal.SIGINT, True, 130),    # Ctrl-C at a terminal: the whole group, workers starting
    (signal.SIGTERM, False, 143),  # kill PID, cells running
])
def test_a_signal_stops_the_sweep_and_its_workers(tmp_path: Path, sig: signal.Signals,
                                                  group: bool, status: int) -> None:
    out, err = tmp_path / "out", tmp_path / "stderr.txt"
    proc = _simulate(out, err)
    seen: dict[int, str] = {}
    try:
        _wait_until(lambda: len(_workers(proc)) == 2 or proc.poll() is not None,
                    "the sweep's worker processes")
        if group:
            # Both workers in their start-up's imports (or past them).
            _wait_until(lambda: all(map(_importing, _workers(proc))) or proc.poll() is not None,
                        "the workers' imports")
        else:
            _wait_until(lambda: bool(_logs(out)) or proc.poll() is not None, "a first cell")
        assert proc.poll() is None, err.read_text()
        seen = _children(proc.pid)  # the workers and the resource tracker
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        proc.wait(timeout=WAIT_S)
        stderr = err.read_text()
        assert proc.returncode == status, stderr
        for word in ("Traceback", "KeyboardInterrupt", "Exception ignored"):
            assert word not in stderr, stderr
        # No child outlives it (the resource tracker ends once the workers are gone).
        _wait_until(lambda: not any(_alive(p, s) for p, s in seen.items()),
                    f"the children {sorted(seen)} to end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p, s in seen.items():  # what a failure left behind
            if _alive(p, s):
                os.kill(p, signal.SIGKILL)
    # Stopped, not finished: the cells not started were cancelled (each writes its log).
    assert len(_logs(out)) < CELLS, [p.name for p in _logs(out)]
    assert not (out / "results.json").exists()
