"""The gateway's HTTP server stops even if a connection's handler swallows a cancel.

On Python 3.11 ``asyncio.wait_for`` (inside every nats-py request the gateway's handler
makes) drops a cancel that lands in the loop step in which the reply arrives; the handler
then carries on. ``close()`` used to cancel each connection once and gather them, so it waited
for whatever the handler did next (here: an hour). It now uses ``shared.tasks.
cancel_and_wait``, which cancels again a task that ignored the first cancel. The swallow is
reproduced deterministically by a handler that catches the first CancelledError.
"""

from __future__ import annotations

import asyncio

from services.gateway.httpserver import HttpRequest, HttpResponse, HttpServer
from vertumnus.live.http import HttpError, request

WAIT_S = 60.0  # a liveness bound (a hang would be ~an hour), never a speed check


async def test_close_returns_although_a_handler_swallowed_the_first_cancel() -> None:
    entered = asyncio.Event()
    cancels = 0

    async def handler(req: HttpRequest) -> HttpResponse:
        nonlocal cancels
        entered.set()
        for _ in range(2):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels == 2:
                    raise
                # the first cancel is "swallowed", as wait_for does on 3.11
        return HttpResponse.json(200, {})

    server = HttpServer(handler)
    await server.start()
    client = asyncio.create_task(request(server.url + "/x", "POST", b"{}", timeout_s=WAIT_S))
    try:
        await asyncio.wait_for(entered.wait(), WAIT_S)
        # No grace: the handler is cancelled at once (the grace is test_live_http_server's).
        await asyncio.wait_for(server.close(grace_s=0.0), WAIT_S)
        assert cancels == 2  # cancelled again after ignoring the first
    finally:
        client.cancel()
        await asyncio.gather(client, return_exceptions=True)
    assert client.done()
    exc = client.exception() if not client.cancelled() else None
    assert exc is None or isinstance(exc, (HttpError, TimeoutError))
