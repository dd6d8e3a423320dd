"""A cache manager's snapshot request that fails with an exception the fetch does not expect
(real nats-server, the cache manager on a real nats-py client, a worker the test plays).

The manager asks each worker it starts tracking for its cache index. The fetch handled no
answer, a micro error (asked again by housekeeping) and a malformed reply, but anything else --
here nats-py's ``OutboundBufferLimitError``, what a publish raises that the client can neither
send nor buffer (reconnecting with a full pending buffer) -- ended the fetch's task with the
exception unretrieved, and the worker was never asked again: not stale, not in the retry set,
its cached prefixes stayed unknown to the scans and the reconcile until an event gap. The
scheduler's fetch had the same defect, fixed in session 57
(tests/live_sched/test_live_snapshot_failure.py); the cache manager's kept it. Now such a
failure is counted, logged and asked again like an unanswered one.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import nats.errors
from live_ctl_support import eventually
from nats.aio.client import Client
from nats.aio.msg import Msg
from test_live_cachemgr import B, inspect, reply, settings, state

from services.cachemgr.service import CacheMgrService
from shared.schemas import CacheSnapshot, to_json
from shared.service import worker_state_kv
from shared.subjects import Subjects


class FirstPublishFails(Client):
    """A real nats-py client whose first publish on ``subject`` raises what the client raises
    for a publish it can neither send nor buffer (third-party behaviour played, not the cache
    manager's: every other call is the client's own)."""

    def __init__(self, subject: str) -> None:
        super().__init__()
        self.failing_subject = subject
        self.failures_left = 1

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        if subject == self.failing_subject and self.failures_left > 0:
            self.failures_left -= 1
            raise nats.errors.OutboundBufferLimitError
        await super().publish(subject, payload, reply=reply, headers=headers)


async def test_a_snapshot_that_fails_unexpectedly_is_asked_again(
        nc: Client, nats_server: Any, uniq: str) -> None:
    s = Subjects(uniq)
    asked: list[Msg] = []

    async def b_snapshot(msg: Msg) -> None:
        asked.append(msg)
        await reply(nc, msg, CacheSnapshot(worker=B, last_event_id=0,
                                           blocks=[(31, None), (32, 31)]))

    await nc.subscribe(s.cache_snapshot(B), cb=b_snapshot)
    await nc.flush()
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put(B, to_json(state(B, [2, 3])))
    async with AsyncExitStack() as stack:
        client = FirstPublishFails(s.cache_snapshot(B))
        await client.connect(nats_server.url, connect_timeout=5)
        stack.push_async_callback(client.close)  # after the manager stops
        svc = CacheMgrService(settings(nats_server.url, uniq))
        await svc.start(stack, client)

        async def failed() -> bool | None:
            return True if client.failures_left == 0 and B not in svc._snapshotting else None

        await eventually(failed, what="the first snapshot request failed and its task ended")
        # Housekeeping (every 0.1 s here) asks a worker whose snapshot is owed: the worker
        # answers (the failed request never reached it), and its blocks are learnt without
        # any cache event.

        async def learnt() -> dict[str, Any] | None:
            body = await inspect(nc, uniq, match=[31, 32])
            return body if body["counters"]["snapshots_applied"] else None

        body = await eventually(learnt, what="the failed snapshot asked again and applied",
                               timeout=10)
        assert body["workers"][B]["blocks"] == 2 and body["match"]["held"] == {B: 2}
        assert body["counters"]["snapshots_failed"] == 1, body["counters"]
        assert len(asked) == 1
