"""shared/tasks.py: stopping tasks whose cancel was swallowed by ``asyncio.wait_for``."""

from __future__ import annotations

import asyncio
import sys

import pytest
from nats.aio.client import Client

from shared.tasks import cancel_and_wait, cancel_requested, unless_stopped


def _loop_task(replies: list[asyncio.Future[int]], seen: list[str]) -> asyncio.Task[None]:
    """A background loop as the services have: awaits replies through wait_for (as nats-py
    requests do), forever, until cancelled."""

    async def loop() -> None:
        while True:
            fut = asyncio.get_running_loop().create_future()
            replies.append(fut)
            await asyncio.wait_for(fut, 60)
            seen.append("reply")
            if cancel_requested():
                seen.append("noticed")

    return asyncio.create_task(loop(), name="loop")


async def _start(replies: list[asyncio.Future[int]], seen: list[str]) -> asyncio.Task[None]:
    task = _loop_task(replies, seen)
    while not replies:  # the loop waits on its first reply
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    return task


async def test_cancel_racing_a_reply_is_repeated_until_the_task_ends() -> None:
    replies: list[asyncio.Future[int]] = []
    seen: list[str] = []
    task = await _start(replies, seen)
    replies[0].set_result(1)  # the reply and the stop's cancel land in one loop iteration
    left = await cancel_and_wait([task], grace_s=0.2)
    assert left == set() and task.done() and task.cancelled()
    if sys.version_info < (3, 12):
        # The first cancel was swallowed: the loop saw its reply (and the pending cancel
        # count) and went on to wait for the next; only the repeated cancel ended it.
        assert seen == ["reply", "noticed"] and len(replies) == 2


async def test_a_plain_cancel_and_wait_would_hang_on_311() -> None:
    if sys.version_info >= (3, 12):
        pytest.skip("wait_for no longer drops a cancel")
    replies: list[asyncio.Future[int]] = []
    seen: list[str] = []
    task = await _start(replies, seen)
    replies[0].set_result(1)
    task.cancel()
    # The loop's next step shows what became of the cancel (a hang bound, not a speed check).
    async with asyncio.timeout(20):
        while len(replies) < 2 and not task.done():
            await asyncio.sleep(0)
    # wait_for handed the reply over and dropped the cancel: the loop saw the reply, noticed
    # the cancel only by its count, and now waits for a reply nobody will give -- a gather
    # here would never return.
    assert not task.done(), task
    assert seen == ["reply", "noticed"] and len(replies) == 2 and not replies[1].done()
    assert task.cancelling() == 1  # the cancel was requested, its CancelledError swallowed
    assert await cancel_and_wait([task], grace_s=0.2) == set()
    assert task.cancelled()


async def test_bounded_and_quiet_about_finished_tasks() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:  # ignores every cancel until released
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    async def failed() -> None:
        raise RuntimeError("boom")

    s = asyncio.create_task(stubborn(), name="stubborn")
    f = asyncio.create_task(failed(), name="failed")
    await asyncio.sleep(0)
    left = await cancel_and_wait([s, f], grace_s=0.05, attempts=3)
    assert left == {s} and not s.done() and f.done()
    release.set()
    await s
    with pytest.raises(ValueError):
        await cancel_and_wait([], grace_s=0)


async def test_a_kv_watch_leaves_on_a_swallowed_cancel(nc: Client, uniq: str) -> None:
    """A service's watch loop ends on its stop's first cancel even when a wait_for inside the
    watcher swallowed it (the entry and the cancel landed in one loop iteration). A real
    nats-server bucket and watcher; the test hands the watcher's queue an entry read from the
    bucket in the very step it cancels, which a write over the wire cannot time exactly."""
    from shared.service import KvWatch, epoch_kv
    from shared.subjects import Subjects

    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), b"1")
    watch = await KvWatch(nc, kv, s.epoch_key(), check_s=60).start()
    seen: list[object] = []

    async def follow() -> None:
        async for entry in watch:
            seen.append(None if entry is None else entry.value)

    task = asyncio.create_task(follow())
    queue = watch._watcher._updates  # the real watcher's queue, read through wait_for
    try:
        async with asyncio.timeout(20):
            while seen != [b"1", None] or not queue._getters:  # replayed; waits for the next
                await asyncio.sleep(0.01)
        queue.put_nowait(await kv.get(s.epoch_key()))  # an update arrives ...
        task.cancel()  # ... in the loop step of the stop's cancel
        # A hang bound, well below the watcher's own wait (check_s=60), after which the loop
        # would end all the same: ended by then means ended on this cancel.
        async with asyncio.timeout(20):
            await asyncio.wait({task})
        assert task.cancelled()
        assert not queue._getters  # it did not wait for another entry
        if sys.version_info < (3, 12):
            # The race did happen: wait_for handed the entry over and dropped the cancel.
            assert seen == [b"1", None, b"1"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watch.stop()


async def test_unless_stopped_gives_the_result_or_stops_the_wait() -> None:
    stop = asyncio.Event()

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert await unless_stopped(answer(), stop) == (True, 42)

    async def fails() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await unless_stopped(fails(), stop)

    cleaned: list[str] = []
    forever = asyncio.Event()

    async def waits_for_a_server() -> None:
        try:
            await forever.wait()
        finally:
            cleaned.append("cancelled and awaited")

    waiting = asyncio.create_task(unless_stopped(waits_for_a_server(), stop))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    stop.set()
    assert await asyncio.wait_for(waiting, 5) == (False, None)
    assert cleaned == ["cancelled and awaited"]
    # Stopped already: the work is not left running.
    assert await unless_stopped(forever.wait(), stop) == (False, None)
