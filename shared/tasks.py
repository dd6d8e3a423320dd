"""Stopping background tasks reliably (every service's teardown).

Why not ``for t in tasks: t.cancel()`` then ``await asyncio.gather(*tasks)``: on Python 3.11
``asyncio.wait_for`` — inside every nats-py request (JetStream publish, KV put/get, pull
fetch, micro request) — returns the result and *drops* a cancel that lands in the loop
iteration in which the awaited reply arrives (the inner future is done, so wait_for returns
it; fixed in 3.12 by the rewrite on ``asyncio.timeout``). The task carries on with
``cancelling() > 0`` but no CancelledError pending; a background loop (``while True: await
fetch()/put()/sleep()``) then never ends and the gather waits forever: a stop that hangs until
the process is killed, with whatever was in flight lost.

:func:`cancel_and_wait` cancels again whatever ignored the first cancel, a bounded number of
times; :func:`cancel_requested` lets a loop notice a swallowed cancel itself and leave.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import structlog

T = TypeVar("T")

_log = structlog.get_logger("vertumnus.tasks")


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], log: Any = None, *,
                          grace_s: float = 1.0, attempts: int = 10) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait until they end, cancelling again any still running after
    ``grace_s`` (a cancel swallowed inside ``wait_for``, see the module docstring).

    Bounded: after ``attempts`` rounds it logs the tasks left and returns them (still
    running); normally the empty set. Exceptions and results of the tasks are not raised (as
    ``gather(..., return_exceptions=True)``); a task that failed is logged at debug level."""
    if grace_s <= 0 or attempts < 1:
        raise ValueError("grace_s must be > 0 and attempts >= 1")
    log = log if log is not None else _log
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    for _ in range(attempts):
        if not pending:
            break
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=grace_s)
        if pending:
            log.warning("task ignored cancellation; cancelling again",
                        tasks=sorted(t.get_name() for t in pending))
    if pending:
        log.error("tasks still running after repeated cancellation",
                  tasks=sorted(t.get_name() for t in pending))
    for t in tasks:  # retrieve failures (no "exception never retrieved" noise); not raised
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.debug("task had failed before its stop", task=t.get_name(),
                      error=repr(t.exception()))
    return pending


async def unless_stopped(coro: Coroutine[Any, Any, T], stop: asyncio.Event,
                         log: Any = None) -> tuple[bool, T | None]:
    """Run ``coro`` unless ``stop`` is set first: ``(True, its result)`` when it finished
    (its exception, if any, is raised), ``(False, None)`` when ``stop`` came first (``coro``
    is then cancelled and awaited).

    Why: a service's start waits for its NATS server (nats-py retries an unreachable one, or
    one that refuses its credentials, for as long as the service lets it). A SIGTERM in that
    wait must stop the process at once, not after the server shows up (or a supervisor's
    SIGKILL)."""
    work = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            await cancel_and_wait([work], log)
        await cancel_and_wait([stopped], log)
    if work.cancelled():
        return False, None
    return True, work.result()  # raises what coro raised


async def finish_first(step: Awaitable[T],
                       undo: Callable[[T], Awaitable[Any]] | None = None) -> T:
    """Await ``step`` to its end even when cancelled meanwhile; then, if a cancel landed, undo
    what it made (``undo(result)``, when it succeeded) and raise the cancel, its result or
    error dropped (retrieved: not logged as never retrieved). For work that a cancel would
    leave half done and running: a thread that goes on after its awaiter is cancelled, a
    subscription made but not yet handed back. Every cancel that lands meanwhile is held, not
    only the first (a stop cancels again). Without a cancel: ``step``'s result or error."""
    work = asyncio.ensure_future(step)
    cancelled = False
    while not work.done():
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:
            cancelled = True
    if not cancelled:
        return work.result()
    if not work.cancelled() and work.exception() is None and undo is not None:
        await undo(work.result())
    raise asyncio.CancelledError


def spawn_tracked(tasks: list[asyncio.Task[Any]], coro: Coroutine[Any, Any, Any],
                  name: str) -> asyncio.Task[Any]:
    """Run ``coro`` as a task named ``name`` that stands in ``tasks`` while it runs: appended
    now, removed once it ends (however it ends). Returns the task.

    Why: a service's teardown cancels what its ``tasks`` list holds (:func:`cancel_and_wait`);
    a short-lived task started while it serves (a snapshot fetch, a command) must be in that
    list to be stopped with the rest, and must leave it when done, or the list would grow for
    as long as the process lives."""
    task = asyncio.create_task(coro, name=name)
    tasks.append(task)
    task.add_done_callback(lambda t: tasks.remove(t) if t in tasks else None)
    return task


def spawn_once(tasks: list[asyncio.Task[Any]], running: set[str], key: str,
               start: Callable[[], Coroutine[Any, Any, Any]], name: str) -> bool:
    """Run ``start()`` as a task of ``tasks`` (:func:`spawn_tracked`) named ``name``, unless
    the task of ``key`` runs already: ``running`` holds the keys whose task runs -- added
    here, removed as the task ends, however it ends. Returns whether a task was started
    (``start`` is called only then: a coroutine made and never awaited would be warned of).

    For work of which one at a time is enough, asked for again and again while it runs: a
    worker's cache snapshot, the recovery of a lost worker's requests. The key is free again
    as soon as the work has ended (in the task's last step): a call after that starts a new
    task."""
    if key in running:
        return False
    coro = start()  # before the key is taken: should it raise, nothing is left behind
    running.add(key)
    began = False

    async def run() -> Any:
        nonlocal began
        began = True
        try:
            return await coro
        finally:
            # Freed as the work ends, not by a done callback alone: those run a loop step
            # later, and a caller asking in between (the next event of the worker, handled
            # first) would find the key taken by work already over, its request dropped.
            running.discard(key)

    def never_ran(_: asyncio.Task[Any]) -> None:
        # A task cancelled before its first step (a teardown right after the spawn) never
        # runs ``run``: its key is freed here (else taken for good) and ``coro`` closed (else
        # warned of as never awaited). Only then: once ``run`` began, the key is freed by it,
        # and may belong to the next task of the key by now.
        if not began:
            running.discard(key)
            coro.close()

    task = spawn_tracked(tasks, run(), name)
    task.add_done_callback(never_ran)
    return True


def cancel_requested() -> bool:
    """True if the current task was cancelled but the CancelledError was swallowed on the way
    (see the module docstring): a loop checks it so it stops all the same."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


__all__ = ["cancel_and_wait", "cancel_requested", "spawn_once", "spawn_tracked",
           "unless_stopped"]
