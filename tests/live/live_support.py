"""Helpers of the live tests that take a nats-server away from its clients (``own_nats_server``
of ``conftest.py``): freeze it (SIGSTOP) so that a round trip waits for its answer, resume it
(SIGCONT), or crash it with :meth:`shared.natsserver.EmbeddedNats.kill` (SIGKILL: the clients
see their connections drop, with any round trip still outstanding).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from nats.aio.client import Client

from services.rankd.host import RankdHost
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


async def until_a_round_trip_waits(nc: Client, timeout_s: float) -> None:
    """Return once ``nc`` waits for a PONG (a flush, say of a stop or a drain)."""
    async with asyncio.timeout(timeout_s):
        while not nc._pongs:  # nats-py's outstanding PINGs (no public view of them)
            await asyncio.sleep(0.005)


async def until_started(host: RankdHost, timeout_s: float) -> None:
    """Return once ``host`` has its worker services, all of them started."""
    async with asyncio.timeout(timeout_s):
        while not (host.services and all(s.started.is_set() for s in host.services.values())):
            await asyncio.sleep(0.05)
