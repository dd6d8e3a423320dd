"""Child processes of ``vertumnus up``: start, watch, stop — and never leave one behind.

Rules this module enforces:

* every child runs in its **own session** (``start_new_session``), so a Ctrl-C on the
  terminal reaches only the orchestrator, which then stops the children stage by stage
  (:attr:`ChildSpec.stop_stage`; ``up`` gives the gateway stage 0, so no new work enters, the
  control plane 1, the rank daemons 2, so running requests finish);
* on Linux every child also asks the kernel for ``SIGTERM`` when its parent dies
  (``PR_SET_PDEATHSIG``), so even a SIGKILLed orchestrator leaves no orphan (the services also
  watch their parent themselves, ``VTM_PARENT_PID``: shared/stopping.py);
* :meth:`ChildSet.stop` sends SIGTERM to each child's whole process group, a stage at a time
  (the next once the last has exited), SIGKILLing a stage past its share of one bound; it is
  idempotent and safe on children that already exited;
* :meth:`ChildSet.kill` SIGKILLs one child's group (a crash, for fault injection) and takes it
  out of the set, so neither :meth:`~ChildSet.check` nor :meth:`~ChildSet.stop` reports it;
  :meth:`ChildSet.restart` starts the same spec again in the same place of the stop order;
* each child's stdout and stderr go to one log file (``<logdir>/<name>.log``, appended to: a
  restarted child's output follows its predecessor's), whose tail is quoted when a child dies
  early.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

_PR_SET_PDEATHSIG: Final[int] = 1
DEFAULT_STOP_TIMEOUT_S: Final[float] = 10.0


def _libc_prctl() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None


_PRCTL = _libc_prctl()


def die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """The ``preexec_fn`` of every child ``up`` starts (``subprocess.Popen``,
    ``asyncio.create_subprocess_exec``): the child asks the kernel for SIGTERM when its parent
    dies (Linux ``PR_SET_PDEATHSIG``), so even a SIGKILLed ``up`` leaves no orphan.

    Contract: call it only as a ``preexec_fn``, in the child between fork and exec (it makes
    one async-signal-safe syscall and nothing else: no allocation, lock or logging). The
    "parent" is the *thread* that forked: fork from a thread that lives as long as the
    process (the main thread, the event loop's), or the child gets its SIGTERM when that
    thread ends. The request is made before exec and kept across it (not by a set-user-ID
    program); what SIGTERM does is then the program's own handling of it. A no-op where the
    platform has no ``prctl`` (not Linux): the children's own parent watch
    (``VTM_PARENT_PID``, shared/stopping.py) remains."""
    # NOTE: runs between fork and exec: only async-signal-safe work (one syscall).
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # type: ignore[operator]


class ChildFailed(RuntimeError):
    """A child process exited while it should be running."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One process to run: ``argv`` with ``env`` added to the orchestrator's environment;
    :meth:`ChildSet.stop` stops lower ``stop_stage`` first (equal stages together)."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    stop_stage: int = 0

    @classmethod
    def module(cls, name: str, module: str, *args: str, env: Mapping[str, str] | None = None,
               python: str | None = None, stop_stage: int = 0) -> ChildSpec:
        """``python -m module args`` with this interpreter (the venv's)."""
        return cls(name, [python or sys.executable, "-m", module, *args], dict(env or {}),
                   stop_stage)


@dataclass(eq=False)  # identity: two starts of one spec are two children
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    order: int = 0
    """Start rank in its :class:`ChildSet` (stop order is the reverse); a restarted child
    keeps the rank of the one it replaces."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, limit: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return "(no log)"


class ChildSet:
    """The children of one orchestrator, stopped in reverse start order.

    Not thread-safe: call :meth:`start`, :meth:`kill` and :meth:`restart` from one thread (the
    one that forks must outlive the child, see :meth:`start`), never while :meth:`stop` runs.
    """

    def __init__(self, log_dir: Path, *, stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        if stop_timeout_s <= 0:
            raise ValueError(f"stop_timeout_s must be > 0, got {stop_timeout_s}")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stop_timeout_s = stop_timeout_s
        self.children: list[Child] = []
        """The running children (and any that exited by themselves), by start rank."""
        self._next_order = 0

    def start(self, spec: ChildSpec) -> Child:
        """Start ``spec`` as the last child (stopped first). Call it from a thread that lives
        as long as the child: on Linux the parent-death signal fires when the *thread* that
        forked ends (e.g. a worker thread of ``asyncio.to_thread``), not the process."""
        child = self._spawn(spec, self._next_order)
        self._next_order += 1
        self.children.append(child)
        return child

    def kill(self, child: Child, timeout_s: float = 5.0) -> int | None:
        """SIGKILL ``child``'s whole process group (a crash: no shutdown handler runs), reap it
        and take it out of :attr:`children`. Returns its exit status (``-9`` when the kill did
        it; its own status if it had already exited; None if it was still not reaped after
        ``timeout_s``). Raises :class:`ValueError` if ``child`` is not in this set."""
        if child not in self.children:
            raise ValueError(f"{child.name} (pid {child.pid}) is not a child of this set")
        self.children.remove(child)
        _signal_group(child.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=timeout_s)
        return child.proc.returncode

    def restart(self, child: Child) -> Child:
        """Start ``child``'s spec again (same argv and env, log appended to the same file) and
        return the new child, in ``child``'s place of the stop order. ``child`` is killed first
        (:meth:`kill`) if it is still in the set. Raises :class:`ValueError` if its place is
        taken (it was restarted already) or lies outside this set's ranks."""
        if child in self.children:
            self.kill(child)
        elif child.order >= self._next_order or any(c.order == child.order
                                                    for c in self.children):
            raise ValueError(f"{child.name} (pid {child.pid}) was restarted already or is not "
                             "a child of this set")
        new = self._spawn(child.spec, child.order)
        bisect.insort(self.children, new, key=lambda c: c.order)
        return new

    def find(self, name: str) -> Child | None:
        """The child named ``name`` (the first by start rank), or None."""
        return next((c for c in self.children if c.name == name), None)

    def _spawn(self, spec: ChildSpec, order: int) -> Child:
        env = {**os.environ, **spec.env}
        # Children must not inherit a terminal-only log format guess; they log JSON to a file.
        env.setdefault("PYTHONUNBUFFERED", "1")
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                list(spec.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        return Child(spec, proc, log_path, order)

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def check(self) -> None:
        """Raise :class:`ChildFailed` (with the log tail) if any child has exited."""
        for c in self.children:
            code = c.proc.poll()
            if code is not None:
                raise ChildFailed(
                    f"{c.name} (pid {c.pid}) exited with status {code}; "
                    f"log {c.log_path}:\n{c.log_tail()}"
                )

    def stop(self, timeout_s: float | None = None) -> dict[str, int | None]:
        """SIGTERM the children's process groups stage by stage (:attr:`ChildSpec.stop_stage`,
        lowest first; within a stage, last started first, all at once) and wait for each
        stage before the next. Stage k of n is SIGKILLed if still running at k/n of
        ``timeout_s`` (default ``stop_timeout_s``), so the whole stop stays within it.

        Returns each child's exit status (negative = killed by that signal).
        """
        bound = self.stop_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        stages = sorted({c.spec.stop_stage for c in self.children})
        for k, stage in enumerate(stages, 1):
            # Stage k must be done by k/n of the bound: a hung child costs the later stages
            # (the rank daemons finishing their requests) no more than its share, and time a
            # stage does not use passes on.
            deadline = start + bound * k / len(stages)
            members = [c for c in reversed(self.children) if c.spec.stop_stage == stage]
            for c in members:
                _signal_group(c.proc, signal.SIGTERM)
            for c in members:
                try:
                    c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(c.proc, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.proc.wait(timeout=5.0)
        for c in reversed(self.children):
            # A child's own children (if any) share its group: reap stragglers too.
            _signal_group(c.proc, signal.SIGKILL, only_if_group_alive=True)
        return {c.name: c.proc.returncode for c in self.children}


def _signal_group(proc: subprocess.Popen[bytes], sig: int, *,
                  only_if_group_alive: bool = False) -> None:
    # With start_new_session the child's pid is its process-group id.
    pgid = proc.pid
    try:
        if only_if_group_alive:
            os.killpg(pgid, 0)
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None and not only_if_group_alive:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)


def pid_alive(pid: int) -> bool:
    """True while a process with ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's pid
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


__all__ = ["Child", "ChildFailed", "ChildSet", "ChildSpec", "die_with_parent", "pid_alive"]
