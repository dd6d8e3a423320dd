"""Freezing a nats-server under its clients (SIGSTOP) and resuming it (SIGCONT): a round trip
sent meanwhile waits for its answer, which comes late once resumed. Used by the live stop tests
and the client's late-PONG tests; :func:`until_stopped` also by the engine's fault test, whose
stopped process is a rank of the torch world.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from shared.natsserver import EmbeddedNats


def freeze(server: EmbeddedNats) -> None:
    """SIGSTOP ``server``: it answers nothing until resumed (or killed: SIGKILL is delivered to
    a stopped process too)."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    until_stopped(server.pid)


def until_stopped(pid: int, timeout_s: float = 30.0) -> None:
    """Return once every thread of ``pid`` is stopped. Why: kill() returns once SIGSTOP is
    sent, not once it took hold; a server thread running on another core can still answer a
    PING sent in between (a CI run saw a flush answered right after the freeze)."""
    tasks = Path(f"/proc/{pid}/task")
    deadline = time.monotonic() + timeout_s
    while True:
        states = [_state(t / "stat") for t in tasks.iterdir()]
        if all(s in ("T", "t", None) for s in states):
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"nats-server {pid} not stopped after SIGSTOP: {states}")
        time.sleep(0.001)


def _state(stat: Path) -> str | None:
    """The state letter of a /proc stat file (after the parenthesised name, which may hold
    spaces); None for a thread gone meanwhile."""
    try:
        text = stat.read_text()
    except FileNotFoundError:
        return None
    return text[text.rindex(")") + 2]


def resume(server: EmbeddedNats) -> None:
    """SIGCONT a frozen ``server``: what it was sent meanwhile is answered now."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGCONT)
