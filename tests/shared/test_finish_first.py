"""``shared.tasks.finish_first``: a step a cancel must not cut short runs to its end, what it
made is undone, and the cancel is raised then -- every cancel held, not only the first."""

from __future__ import annotations

import asyncio

import pytest

from shared.tasks import finish_first


async def test_without_a_cancel_it_is_the_steps_result_or_error() -> None:
    async def ok() -> int:
        return 7

    async def bad() -> int:
        raise ValueError("no")

    assert await finish_first(ok(), undo=lambda _: asyncio.sleep(0)) == 7
    with pytest.raises(ValueError, match="no"):
        await finish_first(bad())


async def test_a_cancelled_step_ends_is_undone_then_the_cancel_is_raised() -> None:
    gate, events = asyncio.Event(), []

    async def make() -> str:
        await gate.wait()
        events.append("made")
        return "thing"

    async def undo(what: str) -> None:
        events.append(f"undone {what}")

    waiter = asyncio.create_task(finish_first(make(), undo))
    await asyncio.sleep(0)
    for _ in range(3):  # a stop cancels again: each cancel is held
        waiter.cancel()
        await asyncio.sleep(0)
    assert not waiter.done() and events == []
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert events == ["made", "undone thing"]


async def test_a_step_that_failed_after_a_cancel_has_nothing_to_undo() -> None:
    gate, undone = asyncio.Event(), []

    async def make() -> str:
        await gate.wait()
        raise RuntimeError("lost")

    async def undo(what: str) -> None:
        undone.append(what)

    waiter = asyncio.create_task(finish_first(make(), undo))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert undone == []
