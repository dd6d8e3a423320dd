"""Helpers of the tests in tests/live_up: run the CLI, bounded waits, process checks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120.0  # bound on correctness waits only; nothing asserts on speed


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "vertumnus", *args]


def run_cli(args: Sequence[str], *, timeout_s: float = 240.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "COLUMNS": "120", **(env or {})})


def wait_until(pred: Callable[[], bool], what: str, timeout_s: float = WAIT_S,
               poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    """Every live process whose parent chain reaches ``pid`` (Linux /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[-1].split()
                parent[int(d.name)] = int(fields[1])
            except (OSError, ValueError, IndexError):
                continue
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        nxt = {c for c, p in parent.items() if p in frontier and c not in out}
        out |= nxt
        frontier = nxt
    return {p for p in out if alive(p)}


def kill_leftovers(logs: Path) -> None:
    """After a failed test: SIGKILL what ``vertumnus up`` started (its pids.json in ``logs``),
    so nothing leaks."""
    with contextlib.suppress(OSError, ValueError):
        for name, pid in json.loads((logs / "pids.json").read_text()).items():
            if name != "orchestrator" and alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def healthy_up(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], Path, Path]]:
    """``vertumnus up args`` (results to ``tmp_path/results.json``, logs in ``tmp_path/logs``,
    stderr to ``tmp_path/stderr.txt``) started and waited for until healthy -- the replay
    starts right after it; yields (the process, its log dir, its stderr file). On the way
    out, whatever is left of it is killed."""
    logs = tmp_path / "logs"
    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            cli("up", *args, "--log-dir", str(logs), "--json", str(tmp_path / "results.json"),
                "--no-progress", "--stop-timeout", "10"),
            cwd=REPO, stdout=subprocess.PIPE, stderr=fh, text=True)
    try:
        # "healthy:" is printed when every service (the controller last) is up.
        wait_until(lambda: "healthy:" in err.read_text() or proc.poll() is not None,
                   "the stack to become healthy")
        assert proc.poll() is None, err.read_text()
        yield proc, logs, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(logs)
