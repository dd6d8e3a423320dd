"""How a service process stops: SIGINT/SIGTERM start a graceful stop, which is bounded in
time; a process told its parent's pid stops once that parent is gone.

* :func:`handle_stop_signals` (each service's ``run``): a first SIGINT or SIGTERM sets the
  service's stop event -- the graceful stop (stop endpoints, hand work back, drain) -- and arms
  the stop deadline.
* The **stop deadline** exists only in a service *process* (:func:`bound_stops`, called by
  :func:`shared.servicemain.run_service`; a service run inside another program, e.g. a test,
  is never ended by it). ``stop_timeout_s`` after the signal, a stop still not done logs an
  error listing the asyncio tasks it still waits for (with where each one waits) and ends the
  process with status :data:`STOP_TIMEOUT_EXIT`; should the event loop itself be stuck, the
  interpreter's fault handler writes every thread's stack to stderr a little later and ends
  it with status 1. A stop that cannot finish (a server gone mid-drain, a peer that never
  answers) would otherwise keep the process, and whatever it holds, alive for ever.
* :func:`watch_parent` (``parent_pid``, which ``vertumnus up`` sets for its children): once
  that process is no longer this one's parent -- it died, even by SIGKILL -- the process sends
  itself SIGTERM, so the graceful stop above runs. On Linux the kernel's parent-death signal
  does the same (vertumnus/live/procs.py); this check is the portable one, and the one that
  still works should that signal be lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, Final

import structlog

STOP_SIGNALS: Final[tuple[signal.Signals, ...]] = (signal.SIGINT, signal.SIGTERM)
STOP_TIMEOUT_EXIT: Final[int] = 70
"""Exit status of a process whose graceful stop outlasted its ``stop_timeout_s``."""
HARD_GRACE_S: Final[float] = 5.0
"""After the deadline, how long the event loop has to report before the fault handler ends
the process regardless (a loop blocked in a call never runs the report)."""
PARENT_POLL_S: Final[float] = 0.5

log = structlog.get_logger("vertumnus.stopping")

_lock = threading.Lock()
_timeout_s: float | None = None  # None: not a service process (no deadline)
_armed = False
_deadline_at: float | None = None  # time.monotonic() of the armed stop deadline
_signalled = False  # a stop signal reached handle_stop_signals' handler (the stop is under way)


def bound_stops(timeout_s: float) -> None:
    """Give this process's graceful stops a deadline of ``timeout_s`` seconds (a process's
    main calls it once; until then a stop is unbounded). The settings bound it
    (``stop_timeout_s``, at most a day); a larger finite one is taken, and
    :func:`arm_stop_deadline` arms what of it the process's timers can hold."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be > 0 and finite, got {timeout_s!r}")
    global _timeout_s
    with _lock:
        _timeout_s = float(timeout_s)


def handle_stop_signals(stack: AsyncExitStack, stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set ``stop`` and arm the stop deadline (:func:`arm_stop_deadline`),
    until ``stack`` closes; in a service process (:func:`bound_stops`) that received one,
    they are ignored from then on (its stop is done; the deadline still bounds the exit).
    Call from the running event loop."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        # A callback of the loop: whatever fails here must not keep the stop from starting
        # (an exception would only be logged by the loop, the deadline left unarmed).
        global _signalled
        _signalled = True
        stop.set()
        with contextlib.suppress(Exception):
            log.info("stop signal received", signal=sig.name)
        try:
            arm_stop_deadline()
        except Exception as exc:  # noqa: BLE001 - reported; the stop goes on regardless
            with contextlib.suppress(Exception):
                log.error("the stop deadline could not be armed", error=repr(exc))

    def restore(sig: signal.Signals) -> None:
        loop.remove_signal_handler(sig)
        if _signalled and _timeout_s is not None:
            # A service process whose graceful stop is done is on its way out (bounded by the
            # deadline's fault handler): a later SIGTERM -- the kernel's parent-death signal
            # or the parent watch after the stop that a supervisor's signal began -- would end
            # it by the signal, its exit status (a clean 0) lost.
            signal.signal(sig, signal.SIG_IGN)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
        stack.callback(restore, sig)


def arm_stop_deadline() -> bool:
    """Start the stop deadline of this process (once; later calls do nothing). Returns
    whether it was armed by this call: False in a process without :func:`bound_stops` or
    when already armed. Call from the running event loop.

    Each of its two bounds is armed as far as it can be: a ``timeout_s`` beyond what the
    fault handler's clock takes (about 1e10 s; the settings allow a day) leaves the process
    without the hard bound (a warning says so) but with the loop's deadline; it never
    raises for the size of the bound."""
    global _armed, _deadline_at
    with _lock:
        if _timeout_s is None or _armed:
            return False
        _armed = True
        timeout_s = _timeout_s
        _deadline_at = time.monotonic() + timeout_s
    # The hard bound first: it holds even if the loop never runs the report below.
    try:
        faulthandler.dump_traceback_later(timeout_s + HARD_GRACE_S, exit=True)
    except OverflowError as exc:  # beyond the fault handler's clock (time_t)
        log.warning("no hard stop deadline (the stop timeout is too large for the fault "
                    "handler)", stop_timeout_s=timeout_s, error=repr(exc))
    except (RuntimeError, ValueError, OSError, AttributeError) as exc:  # no usable stderr
        log.warning("no hard stop deadline (the fault handler needs stderr)", error=repr(exc))
    try:
        asyncio.get_running_loop().call_later(timeout_s, _stop_overdue, timeout_s)
    except OverflowError as exc:  # a loop whose clock cannot hold it (not asyncio's own)
        log.warning("no stop deadline (the stop timeout is too large for the event loop)",
                    stop_timeout_s=timeout_s, error=repr(exc))
    return True


def stop_time_left() -> float | None:
    """Seconds left until the stop deadline (<= 0 once it has passed), or None when none is
    armed (:func:`arm_stop_deadline`: a service process that received a stop signal). What
    runs after the graceful stop, e.g. the telemetry flush at exit, bounds itself by it; the
    loop's deadline is gone with the loop by then, only the fault handler's remains."""
    with _lock:
        deadline_at = _deadline_at
    return None if deadline_at is None else deadline_at - time.monotonic()


def pending_tasks() -> list[str]:
    """Each unfinished asyncio task of the running loop but the caller's, with the innermost
    frame it waits in (``name: coroutine at file:line``)."""
    current = asyncio.current_task()
    out = []
    for task in asyncio.all_tasks():
        if task is current or task.done():
            continue
        frames = task.get_stack()
        where = (f" at {frames[-1].f_code.co_filename}:{frames[-1].f_lineno}"
                 if frames else "")
        out.append(f"{task.get_name()}: {task.get_coro()!r}{where}")
    return sorted(out)


def _stop_overdue(timeout_s: float) -> None:
    # A callback of the loop: report what the stop still waits for, then end the process.
    stacks = io.StringIO()
    for task in asyncio.all_tasks():
        if not task.done():
            task.print_stack(limit=8, file=stacks)
    log.error("graceful stop overran its deadline; exiting", stop_timeout_s=timeout_s,
              exit_status=STOP_TIMEOUT_EXIT, pending=pending_tasks(),
              stacks=stacks.getvalue())
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(STOP_TIMEOUT_EXIT)


def watch_parent(parent_pid: int, *, poll_s: float = PARENT_POLL_S,
                 on_gone: Callable[[], Any] | None = None) -> threading.Thread:
    """Start a daemon thread that calls ``on_gone`` (default: send this process SIGTERM,
    unless a stop signal has been handled already) once ``parent_pid`` is no longer this
    process's parent, then ends. A process adopted by another (its parent died before the
    check began) stops at the first check."""
    if parent_pid <= 0:
        raise ValueError(f"parent_pid must be > 0, got {parent_pid}")
    if not poll_s > 0:
        raise ValueError(f"poll_s must be > 0, got {poll_s!r}")

    def signal_self() -> None:
        if _signalled:
            # The kernel's parent-death SIGTERM came first and the stop is under way: another
            # SIGTERM adds nothing, and once the stop is done (its handler removed) it would
            # end the process by the signal instead of its own exit status.
            log.info("parent process gone; stopping already", parent_pid=parent_pid)
            return
        log.warning("parent process gone; stopping", parent_pid=parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        (on_gone or signal_self)()

    thread = threading.Thread(target=watch, name="vtm-parent-watch", daemon=True)
    thread.start()
    return thread


__all__ = ["HARD_GRACE_S", "STOP_SIGNALS", "STOP_TIMEOUT_EXIT", "arm_stop_deadline",
           "bound_stops", "handle_stop_signals", "pending_tasks", "stop_time_left", "watch_parent"]
