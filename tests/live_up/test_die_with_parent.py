"""``vertumnus.live.procs.die_with_parent``: the public ``preexec_fn`` every child of ``up``
starts with (its own children and the start-up profile's child). It was the private
``_child_preexec``, imported across modules by ``startup_profile``.

A real process tree: an intermediate Python process starts ``sleep`` with it, in a session of
its own (as ``up`` starts its children, so no process-group signal reaches it), and is then
SIGKILLed; the kernel must end the orphaned ``sleep``."""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vertumnus.live import procs
from vertumnus.live.procs import pid_alive

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 30.0
"""How long the orphan may take to go (a bound on a wait, not a measured figure)."""

_PARENT = """
import subprocess, sys
from vertumnus.live.procs import die_with_parent
child = subprocess.Popen(["sleep", "300"], start_new_session=True,
                         preexec_fn=die_with_parent if sys.argv[1] == "on" else None)
print(child.pid, flush=True)
sys.stdin.read()  # until killed
"""


def _orphan(mode: str) -> int:
    """Start the intermediate process, SIGKILL it once its ``sleep`` runs; the sleep's pid."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, mode], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert pid_alive(pid)
    finally:
        parent.kill()
        parent.wait()
    return pid


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_it_ends_when_its_parent_is_killed() -> None:
    pid = _orphan("on")
    try:
        assert _gone(pid), f"sleep {pid} outlived its SIGKILLed parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _signals_pending(pid: int) -> int:
    """The signals sent to ``pid`` and not yet handled (its thread's and its process's)."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
def test_without_it_the_orphan_would_stay() -> None:
    """The control: the same tree without it leaves ``sleep`` running after the kill. The
    kernel sends a parent-death signal as the parent exits, before the parent is reaped
    (which ``_orphan`` waits for): a ``sleep`` still alive with no signal pending then has
    none coming. (Alive alone proved nothing: a signal sent may not have ended it yet.)"""
    pid = _orphan("off")
    try:
        assert pid_alive(pid) and _signals_pending(pid) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_it_is_public_and_the_live_modules_import_no_private_name() -> None:
    assert "die_with_parent" in procs.__all__ and procs.die_with_parent.__doc__
    private = []
    for f in sorted((REPO / "vertumnus" / "live").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                    "vertumnus", "services", "shared", "sim"):
                private += [f"{f.name}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert private == []
