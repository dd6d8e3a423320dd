"""Ctrl-C, SIGTERM and SIGHUP for a command that must report what it did (``up``, ``replay``).

The first signal cancels the command's main task; the command catches that, stops what it
started and writes its report. Every later signal only says the command is already stopping:
an impatient second Ctrl-C must not abort the stop half-way (orphan processes, a lost
report). What a signal does is decided when its handler runs, not when the signal came, so a
handler the loop queued just before the stop began cannot cancel the stop (the race CI once
hit in ``up``). asyncio's own SIGINT handling (``asyncio.run``) raises KeyboardInterrupt on
the second Ctrl-C, wherever the command is.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Final

SIGNALS: Final = (signal.SIGINT, signal.SIGTERM,
                  # A closed terminal (or ssh session): its default would end us at once,
                  # leaving no report and the embedded server's store directory behind.
                  *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))


class InterruptGuard:
    """Installs the handlers on :meth:`install`; :meth:`stopping` switches them to ``notice``;
    :meth:`remove` restores the defaults. Call them from the loop's thread, inside the task
    to cancel. Where the loop cannot handle signals (not the main thread, Windows) nothing is
    installed and the defaults stay."""

    def __init__(self, notice: Callable[[], None]) -> None:
        self._notice = notice
        self._task: asyncio.Task[object] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    def install(self) -> None:
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            if self._task is not None:
                # Explicit handlers: SIGINT may arrive ignored (a background job of a script),
                # and SIGTERM's default would kill us before the children are stopped.
                for sig in SIGNALS:
                    self._loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        if self._stopping:
            self._notice()
        elif self._task is not None:
            self._task.cancel()

    def stopping(self, *, handled: bool = False) -> None:
        """From now on a signal only calls ``notice``. ``handled``: the command caught the
        interrupt's cancellation and stops on its own, so the task's cancel count is cleared
        (the stop's awaits must not see it again)."""
        self._stopping = True
        if handled and self._task is not None:
            while self._task.cancelling():
                self._task.uncancel()

    def remove(self) -> None:
        if self._loop is None:
            return
        for sig in SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                self._loop.remove_signal_handler(sig)


__all__ = ["SIGNALS", "InterruptGuard"]
