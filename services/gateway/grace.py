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
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final

from shared.tasks import cancel_and_wait

STOP_GRACE_S: Final[float] = 10.0
"""How long a stop lets requests being handled finish by default (``stop_grace_s``; well
below the service's whole stop bound, ``stop_timeout_s``)."""


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


__all__ = ["STOP_GRACE_S", "finish_within"]
