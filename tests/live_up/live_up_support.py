"""Helpers of the tests in tests/live_up: run the CLI, bounded waits, process checks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
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
