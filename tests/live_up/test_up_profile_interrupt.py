"""An interrupt during ``vertumnus up``'s start-up profiling ends the run without waiting for
the profile: the report, the JSON, exit 130, and nothing of the profile left running.

The profile used to run in a thread (``asyncio.to_thread``): the report came at once, but the
process then waited for the thread to finish its profile (``asyncio.run``'s executor shutdown;
about 2 s on the sim backend, 15 s on the torch engine) before it exited. It now runs in a
child process that the interrupt kills, with the processes it started
(vertumnus/live/startup_profile.py).

The test holds the profile where it cannot go on: the file the sim profile writes its
samples to is a named pipe no one reads, so opening it blocks for ever. ``up`` must exit
while the profile is blocked there. (Before, it never exited: the test's bounded wait ran
out.) Real ``vertumnus up`` processes; the torch case is slow (rank processes of the engine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from live_up_support import REPO, WAIT_S, alive, cli, descendants, kill_leftovers, wait_until

from sim.profiling import PROFILE_FILE, REPORT_FILE, SAMPLES_FILE


def _interrupted(proc: subprocess.Popen[str], err: Path, out: Path, phase: str) -> str:
    """SIGINT ``proc`` and wait (bounded) for its end; assert the interrupted start-up's
    report, JSON and exit status. Returns its stdout."""
    proc.send_signal(signal.SIGINT)
    try:
        stdout, _ = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"up did not exit within {WAIT_S:g} s of the interrupt: it waits for the "
                    f"profile; stderr:\n{err.read_text()}")
    text = " ".join(stdout.split())
    assert proc.returncode == 130, err.read_text() + stdout
    assert f"interrupted during start-up: {phase}: no request was sent" in text, text
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and data["requests"] == 0
    assert data["interrupted_during"] == f"start-up: {phase}", data
    return stdout


def _interrupt_once(proc: subprocess.Popen[str], err: Path, out: Path, logs: Path,
                    ready: Callable[[], bool], what: str, phase: str) -> set[int]:
    """Wait (bounded) until ``ready()`` (``what``), then interrupt ``proc`` during ``phase``
    (:func:`_interrupted`); returns the processes below it at the interrupt. Whatever
    happens, nothing of the run is left running afterwards (killed, for the next tests)."""
    profiling: set[int] = set()
    try:
        wait_until(lambda: ready() or proc.poll() is not None, what)
        assert proc.poll() is None, err.read_text()
        profiling = descendants(proc.pid)
        _interrupted(proc, err, out, phase)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(logs)
        for pid in descendants(proc.pid) | profiling:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    return profiling


def test_an_interrupt_ends_up_while_its_hardware_profile_is_blocked(tmp_path: Path) -> None:
    logs, err, out = tmp_path / "logs", tmp_path / "stderr.txt", tmp_path / "r.json"
    prof = logs / "hardware-profile"
    prof.mkdir(parents=True)
    os.mkfifo(prof / SAMPLES_FILE)  # the gate: never read, so never opened for writing
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            cli("up", "--duration", "30", "--max-requests", "4", "--log-dir", str(logs),
                "--no-progress", "--stop-timeout", "10", "--json", str(out)),
            cwd=REPO, stdout=subprocess.PIPE, stderr=fh, text=True)
    # The fit is saved just before the samples: from here the profile is at the gate or on
    # its way to it (its plot), and can never get past it.
    profiling = _interrupt_once(proc, err, out, logs, lambda: (prof / PROFILE_FILE).exists(),
                                "the profile to reach its gate", "profiling the modelled hardware")
    # It exited while the profile was still held: the gate is as the test made it and the
    # profile never finished.
    assert (prof / SAMPLES_FILE).is_fifo() and not (prof / REPORT_FILE).exists()
    assert "hardware profile" not in err.read_text() and "healthy:" not in err.read_text()
    left = [pid for pid in profiling if alive(pid)]
    assert not left, f"still running after up exited: {left}"
    assert not (logs / "pids.json").exists()  # no service was started


@pytest.mark.slow
@pytest.mark.torch
def test_an_interrupt_ends_up_s_engine_profile_and_its_rank_processes(tmp_path: Path) -> None:
    """The torch engine's profile runs rank processes of its own: the interrupt ends them
    with it, the run exits without waiting for the profile."""
    pytest.importorskip("torch")
    logs, err, out = tmp_path / "logs", tmp_path / "stderr.txt", tmp_path / "r.json"
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            cli("up", "--backend", "torch", "--gpus", "2", "--degrees", "2", "--duration",
                "30", "--max-requests", "2", "--log-dir", str(logs), "--no-progress",
                "--stop-timeout", "10", "--json", str(out)),
            cwd=REPO, stdout=subprocess.PIPE, stderr=fh, text=True)
    # The profile's child and its two rank processes (and multiprocessing's helper).
    profiling = _interrupt_once(proc, err, out, logs, lambda: len(descendants(proc.pid)) >= 3,
                                "the engine profile's rank processes", "profiling the torch engine")
    assert "engine profile" not in err.read_text()
    left = [pid for pid in profiling if alive(pid)]
    assert not left, f"still running after up exited: {left}"
    # The rank processes' rendezvous directory went with the profile's temporary directory.
    assert not (logs / "engine-profile" / "tmp").exists()
