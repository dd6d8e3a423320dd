"""A stop's grace for the requests in flight: let them finish for a while, then cancel the rest.

The gateway's one rule for both of its entries (:meth:`services.gateway.httpserver.HttpServer.
close` for HTTP requests, the stop of :class:`services.gateway.adapter.GatewayService` for NATS
completions): once a stop takes no new request, each request still being handled gets up to
the grace (``stop_grace_s``, :data:`STOP_GRACE_S` by default) to be answered with its own
result; those still unfinished then are cancelled, and each answers 503 "stopping" on its way
out (the HTTP server's connection task, the NATS completion's task), so no caller is left to
wait out its own timeout.

Why one grace for both: a stop is bounded as a whole (``stop_timeout_s``); the entries wait
side by side (the gateway starts both at once), so the grace costs the stop its length once.

A grace never outlasts the process's own stop deadline (:func:`affordable_grace`): past that
deadline the process exits at once (status 70, shared/stopping.py), the 503s unsent -- a
gateway ``vertumnus up`` starts has about 2.3 s of it by default, well below the 10 s grace.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final

from shared.tasks import cancel_and_wait

STOP_GRACE_S: Final[float] = 10.0
"""How long a stop lets requests being handled finish by default (``stop_grace_s``; well
below the service's whole stop bound, ``stop_timeout_s``)."""
GRACE_SHARE: Final[float] = 0.5
"""The most of the stop time left (to the process's stop deadline) that the grace takes; the
rest is the stop's after it: the 503s of the requests it ran out on, the drains."""


def affordable_grace(grace_s: float, time_left_s: float | None) -> float:
    """The grace a stop gives its requests in flight: ``grace_s``, but at most
    :data:`GRACE_SHARE` of ``time_left_s`` -- the seconds left to the process's stop
    deadline (:func:`shared.stopping.stop_time_left`; None: no deadline, as for a service run
    inside another program: ``grace_s`` whole) -- and 0 once that has passed.

    Why: the deadline ends the process where it is (exit status 70): a grace that outlasted
    it left every request in flight unanswered, its caller waiting out its own timeout,
    where the grace's end would have answered it 503."""
    if time_left_s is None:
        return grace_s
    return max(0.0, min(grace_s, GRACE_SHARE * time_left_s))


async def finish_within(tasks: Iterable[asyncio.Task[Any]], grace_s: float,
                        log: Any = None) -> set[asyncio.Task[Any]]:
    """Let ``tasks`` run for up to ``grace_s`` seconds (0: not at all), then cancel those still
    running and wait for them to end (:func:`~shared.tasks.cancel_and_wait`, bounded).

    Returns the tasks the grace ran out on (cancelled: each answers its caller as it ends);
    empty when every task finished within it. Never raises but CancelledError; the tasks'
    own results and errors are theirs (not raised here). Tasks made after the call are not
    waited for: the caller stops taking new requests first."""
    pending = {t for t in tasks if not t.done()}
    if pending and grace_s > 0:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    if pending:
        await cancel_and_wait(pending, log)
    return pending


__all__ = ["GRACE_SHARE", "STOP_GRACE_S", "affordable_grace", "finish_within"]
