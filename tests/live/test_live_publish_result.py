"""``shared.service.publish_result`` against a real nats-server: a result counts as sent only
once the results stream stored it; a missing stream is waited for (sent again), within a bound.
Workers' first tokens and the scheduler's "not scheduled" answers both go this way."""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.client import Client

from shared.service import ensure_results_stream, publish_result
from shared.subjects import Subjects


class Notes:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.warnings.append((event, kw))


async def test_stored_when_the_stream_is_there(nc: Client, uniq: str) -> None:
    s = Subjects(uniq)
    await ensure_results_stream(nc.jetstream(), s)
    assert await publish_result(nc, s.result("r1"), b"one", {})
    kept = await nc.jetstream().get_last_msg(s.results_stream(), s.result("r1"))
    assert kept.data == b"one"


async def test_sent_again_until_the_stream_is_back(nc: Client, uniq: str) -> None:
    s = Subjects(uniq)
    js = nc.jetstream()

    async def later() -> None:
        await asyncio.sleep(0.5)
        await ensure_results_stream(js, s)

    maker = asyncio.create_task(later())
    assert await publish_result(nc, s.result("r2"), b"two", {}, timeout_s=0.2, within_s=30.0)
    await maker
    kept = await js.get_last_msg(s.results_stream(), s.result("r2"))
    assert kept.data == b"two"


async def test_gives_up_after_its_bound_and_says_so(nc: Client, uniq: str) -> None:
    s = Subjects(uniq)
    notes = Notes()
    assert not await publish_result(nc, s.result("r3"), b"three", {}, timeout_s=0.1,
                                    within_s=0.3, log=notes)
    assert [e for e, _ in notes.warnings] == ["result not stored by the results stream"]
    assert notes.warnings[0][1]["subject"] == s.result("r3")
