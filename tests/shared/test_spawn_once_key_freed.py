"""``shared.tasks.spawn_once`` frees a key as its work ends, not a loop step later: a caller
that asks again once the work is over -- a cache manager or scheduler handling the next event
of a worker right after its snapshot was applied, and finding a gap -- gets a new run.

Found by a review of the shared tasks helpers: the key was freed by a done callback only
(so that a task cancelled before its first step frees it too), and a task's done callbacks
run in the loop step after it ended. A handler that ran in between -- scheduled before those
callbacks -- found the key still taken by work already over, and its request was dropped:
nothing ran it, and nothing would ask again until the next gap."""

from __future__ import annotations

import asyncio
import gc
import warnings
from typing import Any

from shared.tasks import spawn_once


async def test_asked_again_once_the_work_has_ended_it_runs_again() -> None:
    tasks: list[asyncio.Task[Any]] = []
    running: set[str] = set()
    runs: list[int] = []

    async def work(n: int) -> None:
        runs.append(n)

    loop = asyncio.get_running_loop()
    asked: asyncio.Future[tuple[bool, bool]] = loop.create_future()
    assert spawn_once(tasks, running, "w", lambda: work(1), "snapshot-1")
    first = tasks[0]

    def ask_again() -> None:
        # Runs after the task's one step (scheduled after it) and before its done callbacks
        # (scheduled as it ends): the work is over, and the key must be free.
        asked.set_result((first.done(), spawn_once(tasks, running, "w", lambda: work(2),
                                                   "snapshot-2")))

    loop.call_soon(ask_again)
    ended, spawned = await asked
    assert ended, "the first run should have ended before it was asked again"
    assert spawned, "asked again after the work ended, nothing ran"  # before: dropped
    await asyncio.gather(*list(tasks))
    assert runs == [1, 2]


async def test_the_end_of_a_run_does_not_free_the_key_of_the_next_one() -> None:
    """The key freed as a run ends may be taken at once by the next run of it; what remains of
    the first run's end (its done callbacks) must leave the next one's key alone."""
    tasks: list[asyncio.Task[Any]] = []
    running: set[str] = set()
    gate = asyncio.Event()

    async def quick() -> None:
        return None

    async def slow() -> None:
        await gate.wait()

    loop = asyncio.get_running_loop()
    taken: asyncio.Future[bool] = loop.create_future()
    assert spawn_once(tasks, running, "w", quick, "quick")
    first = tasks[0]
    loop.call_soon(lambda: taken.set_result(spawn_once(tasks, running, "w", slow, "slow")))
    assert await taken
    await first
    await asyncio.sleep(0)  # the first run's done callbacks
    assert running == {"w"}  # the slow run still holds it
    assert not spawn_once(tasks, running, "w", slow, "slow-again")
    gate.set()
    await asyncio.gather(*list(tasks))
    await asyncio.sleep(0)
    assert running == set()


async def test_a_run_cancelled_before_its_first_step_leaves_no_coroutine_unawaited() -> None:
    tasks: list[asyncio.Task[Any]] = []
    running: set[str] = set()

    async def work() -> None:
        raise AssertionError("never runs")

    assert spawn_once(tasks, running, "w", work, "work")
    task = tasks[0]
    task.cancel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # the done callbacks
        gc.collect()
    assert running == set()
    assert not [w for w in caught if "never awaited" in str(w.message)], caught
