"""Fault injection for ``vertumnus up``: crash a service during the replay, start it again.

(Apart from injection, ``up`` also supervises its children during the run, as compose's
``restart: unless-stopped`` would: one that exits on its own -- a crash, or a torch rank host
exiting 75 after a rank died -- is started again, at most ``MAX_RESTARTS`` times;
:meth:`vertumnus.live.stack.LiveStack.restart_exited`. Both kinds are :class:`FaultEvent`s of
the summary's ``faults``.)

``vertumnus up --kill-at S [--restart-after D] [--kill-service NAME]``: S wall seconds after
the replay starts the orchestrator SIGKILLs the service's child (its whole process group: a
crash, no shutdown handler runs), and D wall seconds after the kill starts it again from the
very same child spec. Several services, comma-separated, each get a :class:`CrashPlan` of
their own (``--kill-service scheduler,rankd --kill-at 20,21.5 --restart-after 1``: a rank
daemon dies while the restarted scheduler has not yet got back the requests its predecessor
dispatched). What each service's crash costs, and what brings it back:

* ``rankd`` (the default; sim backend: one process hosts every worker, each with its queue):
  the new process re-adopts the current epoch record and brings every worker back under its
  old id with a new incarnation; the scheduler hands the requests the dead one held back to
  intake (``services/scheduler/ledger.py``), so a run with a restart should lose no request.
* ``scheduler``: intake is a JetStream work queue, so arrivals wait for the new process;
  assignments in flight are re-sent from their records (exactly once: the rank daemons
  de-duplicate by intake message); the requests it had dispatched come back from intake after
  ``ack_wait`` (their messages were held until their results) and the new process adopts
  those their workers still hold, so a worker lost after that is recovered too.
* ``controller``: no placement stops; a reconfiguration in progress is finished or rolled
  back from its epoch record by the new process.
* ``cachemgr``: no placement stops; replication and reclamation pause, and the new process
  rebuilds its trie from the workers' snapshots.
* ``gateway``: the HTTP front door, started again on the same port: a client whose request
  was open on it, or whose connection is refused meanwhile, sends it again under the same id
  (the replay does, ``ReplayConfig.retry_s``); the intake de-duplicates it and the gateway
  answers with the original's result.
* ``nats``: the server itself, started again on its port and JetStream store: every service
  reconnects; the intake, consumers and buckets are recovered from the store; KV watches are
  made again (``shared.service.KvWatch``).
* ``nats-empty``: the server, started again on its port with an *empty* store (one without a
  persistent volume): every service makes its streams, buckets and consumers again after the
  reconnect (``MicroService.ensure_jetstream``), the controller its epoch record, each rank
  daemon its state; what the lost store held (queued intake messages, records) is gone.

:func:`run_crash` is the injection itself, independent of processes: it calls a ``kill`` and a
``restart`` callable at the planned moments and records what it did as :class:`FaultEvent`
(``at_s`` = wall seconds since the replay started, the clock of the report's composition
changes). It runs as a task alongside the replay and is cancelled at the replay's end; what has
fired by then is in the list, what has not fired never happens.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

RANKD: Final[str] = "rankd"
"""The default child to crash (the sim backend's one rank-daemon host)."""
NATS: Final[str] = "nats"
"""The nats-server itself (started again on its port and JetStream store)."""
NATS_EMPTY: Final[str] = "nats-empty"
"""The nats-server, started again on its port with an empty JetStream store."""


@dataclass(frozen=True, slots=True)
class CrashPlan:
    """Kill ``service`` ``kill_at_s`` wall seconds after the replay starts; start it again
    ``restart_after_s`` wall seconds after the kill (None: never)."""

    kill_at_s: float
    restart_after_s: float | None = None
    service: str = RANKD

    def __post_init__(self) -> None:
        for name in ("kill_at_s", "restart_after_s"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One injected fault, as it happened."""

    action: str
    """``"kill"`` (injected), ``"exit"`` (a child ended on its own during the run: a crash, or a
    rank host's exit for a restart after a worker fault) or ``"restart"`` (injected, or the
    orchestrator's supervision after an exit)."""
    service: str
    at_s: float
    """Wall seconds since the replay started."""
    pid: int
    """The killed process, or the restarted (new) one."""
    status: int | None = None
    """kill / exit: the process' exit status (-9: a SIGKILL ended it; 75: a rank daemon that
    met a worker fault asks for a restart)."""

    def as_dict(self) -> dict[str, Any]:
        """The summary's ``faults`` entry (``status`` only for a kill or an exit)."""
        out: dict[str, Any] = {"action": self.action, "service": self.service,
                               "at_s": round(self.at_s, 3), "pid": self.pid}
        if self.action in ("kill", "exit"):
            out["status"] = self.status
        return out


async def run_crash(plan: CrashPlan, *, kill: Callable[[], tuple[int, int | None]],
                    restart: Callable[[], int], events: list[FaultEvent],
                    t0: float | None = None,
                    on_event: Callable[[FaultEvent], None] | None = None) -> None:
    """Carry out ``plan``: at ``t0 + kill_at_s`` call ``kill()`` (returns the killed pid and
    its exit status), then, ``restart_after_s`` after it returned, ``restart()`` (returns the
    new pid). Each event is appended to ``events`` (and passed to ``on_event``) as soon as it
    happened, so a cancelled run leaves exactly what was done. ``t0`` is the replay's start on
    the ``time.monotonic()`` clock (default: now).

    ``kill`` and ``restart`` run on the event loop's thread, synchronously: the child set is
    not thread-safe, and a child forked from a worker thread would get its parent-death
    signal when that thread ends (:meth:`vertumnus.live.procs.ChildSet.start`)."""
    t0 = time.monotonic() if t0 is None else t0

    def record(action: str, pid: int, status: int | None = None) -> None:
        ev = FaultEvent(action, plan.service, time.monotonic() - t0, pid, status)
        events.append(ev)
        if on_event is not None:
            on_event(ev)

    await asyncio.sleep(max(0.0, t0 + plan.kill_at_s - time.monotonic()))
    pid, status = kill()
    record("kill", pid, status)
    if plan.restart_after_s is None:
        return
    await asyncio.sleep(plan.restart_after_s)
    record("restart", restart())


def killed_for_good(events: Iterable[Mapping[str, Any]]) -> list[str]:
    """The services an injected kill left down: those whose last injected event
    (:meth:`FaultEvent.as_dict` entries, in order) is a ``kill`` -- no ``--restart-after``,
    or the replay ended before it was due. Sorted, each once. (A supervised ``exit`` does not
    count: ``up`` restarts it, or reports it in ``services_down`` past its restarts.)"""
    last: dict[str, str] = {}
    for d in events:
        if d.get("action") in ("kill", "restart"):
            last[str(d.get("service"))] = str(d["action"])
    return sorted(name for name, action in last.items() if action == "kill")


def describe(events: Iterable[Mapping[str, Any]]) -> str:
    """One line of :meth:`FaultEvent.as_dict` entries: ``'kill rankd (pid 812) at 30.0 s,
    restart rankd (pid 901) at 35.0 s'`` (``'none'`` for none)."""
    return ", ".join(
        f"{d['action']} {d['service']} (pid {d['pid']}"
        + (f", status {d['status']}" if d["action"] == "exit" else "")
        + f") at {d['at_s']:.1f} s" for d in events) or "none"


__all__ = ["NATS", "RANKD", "CrashPlan", "FaultEvent", "describe", "killed_for_good",
           "run_crash"]
