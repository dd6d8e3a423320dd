"""InterruptGuard (``up``, ``replay``) with real signals to this process: the first cancels
the task, later ones (once stopping) only call the notice, whatever the moment they were
queued; remove() gives SIGINT back to Python's default handler."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from vertumnus.live.interrupt import SIGNALS, InterruptGuard


async def _until(cond: object) -> None:
    async with asyncio.timeout(10):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name.lower() for s in SIGNALS])
async def test_the_first_signal_cancels_later_ones_only_say_so(sig: signal.Signals) -> None:
    notices: list[str] = []
    guard = InterruptGuard(lambda: notices.append("already stopping"))
    guard.install()
    try:
        with pytest.raises(asyncio.CancelledError):
            os.kill(os.getpid(), sig)
            await asyncio.sleep(10)
        me = asyncio.current_task()
        assert me is not None and me.cancelling() == 1
        guard.stopping(handled=True)  # the command caught it: the count is cleared
        assert me.cancelling() == 0
        os.kill(os.getpid(), sig)
        await _until(lambda: notices)
        os.kill(os.getpid(), sig)
        await _until(lambda: len(notices) == 2)
        assert me.cancelling() == 0  # the stop goes on
    finally:
        guard.remove()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


async def test_a_signal_queued_before_the_stop_only_says_so() -> None:
    """The race CI hit in ``up``: the loop queued the handler of a second Ctrl-C, then the
    command began its stop; the handler, run after that, must not cancel the stop."""
    notices: list[str] = []
    guard = InterruptGuard(lambda: notices.append("already stopping"))
    guard.install()
    try:
        loop = asyncio.get_running_loop()
        handle = loop._signal_handlers[signal.SIGINT]  # type: ignore[attr-defined]
        loop.call_soon(handle._run)  # queued, as the loop queues a signal's handler
        guard.stopping()  # ... and the stop begins before it runs
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert notices == ["already stopping"]
        me = asyncio.current_task()
        assert me is not None and me.cancelling() == 0
    finally:
        guard.remove()
