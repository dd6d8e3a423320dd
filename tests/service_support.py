"""Running an in-process service for the length of a test (unique module name for
``--import-mode=importlib``; importable from every folder: ``tests/conftest.py`` puts the top
of the test tree on ``sys.path``).

* :func:`service_running` -- the async context manager most tests want: run, wait for the
  start, stop and wait on the way out;
* :func:`until_started` -- the start wait alone, for code that keeps run tasks itself;
* :class:`ServiceTasks` -- services started one after another, stopped together at the end.

Every bound here is a hang guard for correctness waits; nothing asserts on speed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nats.aio.client import Client

from shared.subjects import Subjects

WAIT_S = 30.0  # default hang guard (a loaded 2-core machine); never a speed check


async def until_started(svc: Any, task: asyncio.Task[None], *,
                        timeout_s: float = WAIT_S) -> None:
    """Wait until ``svc.started`` is set, watching ``task`` (its ``run``) meanwhile.

    Started: returns (even if the run ended since; its outcome is the caller's to see). The
    run ending first (a start that failed, a stop before the start) raises what the run
    raised, or AssertionError when it returned. Neither within ``timeout_s``: AssertionError
    (the service did not start). Leaves ``task`` as it is in every case."""
    started = asyncio.create_task(svc.started.wait())
    try:
        done, _ = await asyncio.wait({started, task}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        started.cancel()
    if started in done:
        return
    name = type(svc).__name__
    if task in done:
        task.result()  # the startup error
        raise AssertionError(f"{name} ended before it started")
    raise AssertionError(f"{name} did not start within {timeout_s} s")


@contextlib.asynccontextmanager
async def service_running(svc: Any, nc: Client | None = None, *,
                          timeout_s: float = WAIT_S) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``svc`` (a MicroService or a rank host) for the body of the ``async with``.

    Entry: starts ``svc.run(nc, handle_signals=False)`` in a task (``nc``: the caller's
    connection, which the caller keeps owning; None: the service connects itself) and waits
    for ``svc.started`` as :func:`until_started` does (the run's own startup error, or
    AssertionError, when it does not start). Yields the run's task, to look at
    (``task.done()``); the exit awaits it.

    Exit -- the body done, the body raising, the start failing, or the run already over:
    ``svc.request_stop()`` (nothing, for a run that ended), then the task is awaited at most
    ``timeout_s`` (past that it is cancelled and TimeoutError raised). Whatever the run
    raised is raised from the ``async with`` (a WorkerFault, say: ``pytest.raises`` around
    the block expects it); when the body raised as well, the run's exception propagates
    with the body's as its ``__context__`` (both in the traceback), as a plain
    ``try``/``finally`` does."""
    task = asyncio.create_task(svc.run(nc, handle_signals=False))
    try:
        await until_started(svc, task, timeout_s=timeout_s)
        yield task
    finally:
        svc.request_stop()
        await asyncio.wait_for(task, timeout=timeout_s)


@dataclass
class ServiceTasks:
    """Services started on the test server (``url``, subject prefix ``prefix``) by
    :meth:`run`, each running until :meth:`stop` or :meth:`close` (the owner's teardown)."""

    wait_s: ClassVar[float] = WAIT_S

    url: str
    prefix: str
    tasks: list[tuple[Any, asyncio.Task[None]]] = field(default_factory=list, init=False)

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    async def run(self, svc: Any, nc: Client | None = None) -> Any:
        """Start ``svc`` (on ``nc`` if given) and wait for it (:func:`until_started`)."""
        task = asyncio.create_task(svc.run(nc, handle_signals=False))
        self.tasks.append((svc, task))
        await until_started(svc, task, timeout_s=self.wait_s)
        return svc

    async def stop(self, svc: Any) -> None:
        """Stop ``svc`` and wait for its run (what it raised is raised here)."""
        for s, task in list(self.tasks):
            if s is svc:
                s.request_stop()
                await asyncio.wait_for(task, timeout=self.wait_s)
                self.tasks.remove((s, task))

    async def close(self) -> None:
        """Stop every service still running, the last started first."""
        for svc, task in reversed(self.tasks):
            svc.request_stop()
            try:
                await asyncio.wait_for(task, timeout=self.wait_s)
            except Exception:  # pragma: no cover - shutdown noise must not mask a failure
                task.cancel()
        self.tasks.clear()
