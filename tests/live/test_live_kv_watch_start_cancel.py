"""A :class:`~shared.service.KvWatch` whose start is cancelled inside nats-py's ``kv.watch``
leaves nothing on its connection, on a real nats-server.

nats-py makes a watch in steps: the ordered consumer, its subscription and two tasks
(heartbeat and flow-control checks), then a consumer-info request. The server is frozen
(SIGSTOP) once the subscription is made, so that the request waits for its answer, and the
start is cancelled there -- as a service's stop during its start-up does. Before, the cancel
went through nats-py's watch, which undoes what it made only for an error: the subscription
and both tasks stayed on the connection, with no watcher left to stop them. Now the making
runs to its end (the request answered once the server resumes, or timed out while it stays
frozen), what it made is stopped, and the cancel is raised.
"""

from __future__ import annotations

import asyncio

import pytest
from frozen import freeze, resume
from nats.aio.client import Client

from shared.natsclient import connect
from shared.natsserver import EmbeddedNats
from shared.service import KvWatch, drain_or_close, ensure_key_value

WAIT_S = 30.0  # a liveness bound, not a speed check
JS_TIMEOUT_S = 1.0  # the consumer-info request a frozen server leaves unanswered times out


def watch_leftovers(nc: Client) -> list[str]:
    """The ordered-consumer subscriptions of ``nc`` and the tasks of such consumers still
    running (nats-py keeps both private: ``_subs``, a subscription's ``_jsi``)."""
    subs = [f"sub {sid}" for sid, sub in nc._subs.items() if getattr(sub, "_jsi", None)]
    tasks = [t.get_coro().__qualname__ for t in asyncio.all_tasks()
             if not t.done() and "_JSI." in getattr(t.get_coro(), "__qualname__", "")]
    return subs + sorted(tasks)


async def until(cond: object, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("server", ["resumed", "frozen"])
async def test_a_start_cancelled_inside_the_watch_leaves_nothing_behind(
        own_nats_server: EmbeddedNats, uniq: str, server: str) -> None:
    """``resumed``: the server answers once the cancel has landed (the watch is made whole,
    then stopped); ``frozen``: it never answers (the making times out, nats-py undoes it).
    Either way the start ends cancelled and the connection keeps no subscription or task of
    the watch."""
    nc = await connect(own_nats_server.url, connect_timeout=5)
    frozen = False
    try:
        kv = await ensure_key_value(nc.jetstream(timeout=JS_TIMEOUT_S), f"{uniq}-b")
        await kv.put("k", b"v")
        task = asyncio.create_task(KvWatch(nc, kv, "k").start())
        # Every loop step: the subscription is seen before its consumer-info request can
        # have been answered (that takes a round trip), and the freeze blocks the loop.
        async with asyncio.timeout(WAIT_S):
            while not watch_leftovers(nc):
                await asyncio.sleep(0)
        freeze(own_nats_server)
        frozen = True
        task.cancel()
        await asyncio.sleep(0.05)  # the cancel lands (held, or through nats-py's watch)
        if server == "resumed":
            resume(own_nats_server)
            frozen = False
        await asyncio.wait({task}, timeout=WAIT_S)
        assert task.cancelled()
        # nats-py's own undoing (the request timed out) cancels its tasks without awaiting
        # them: they end within a loop step or two.
        await until(lambda: not watch_leftovers(nc), "nothing of the watch left")
    finally:
        if frozen:
            resume(own_nats_server)
        await drain_or_close(nc, 2.0)
    assert watch_leftovers(nc) == []
