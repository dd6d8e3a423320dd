"""``shared.service.publish_result`` against a real nats-server: a result counts as sent only
once the results stream stored it; a missing stream is waited for (sent again), within a bound.
Workers' first tokens and the scheduler's "not scheduled" answers both go this way."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from shared.schemas import FirstToken, SchemaError, TtftStages, encode
from shared.service import (
    RESULTS_KEPT_PER_REQUEST,
    ensure_results_stream,
    first_token_of,
    latest_result,
    publish_result,
)
from shared.subjects import Subjects


def first_token(rid: str, token: int = 7) -> FirstToken:
    return FirstToken(request_id=rid, token=token, stages=TtftStages(
        intake_wait_s=0, schedule_s=0, queue_wait_s=0, prefill_s=0, kv_transfer_s=0,
        first_decode_s=0, total_s=0), finished_at_s=1.0)


class Kept:
    """A message as a reader gets it: ``.data`` and ``.headers``."""

    def __init__(self, ft: FirstToken | bytes) -> None:
        self.data, self.headers = (ft, None) if isinstance(ft, bytes) else encode(ft)


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
    sent = nc.stats["out_msgs"]

    async def later() -> None:
        # The stream is made once a second try went out (so the first one failed), not after
        # a fixed pause: a try that came only after the pause would pass without a retry.
        # (No subscriber watches the subject: one would turn "no responders" into timeouts.)
        async with asyncio.timeout(30):
            while nc.stats["out_msgs"] < sent + 2:
                await asyncio.sleep(0.01)
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


def test_first_token_of_takes_only_a_result_of_that_request() -> None:
    assert first_token_of("a", Kept(first_token("a"))).token == 7
    with pytest.raises(SchemaError) as other:
        first_token_of("a", Kept(first_token("b")))
    assert other.value.field == "request_id" and "'b'" in other.value.reason
    with pytest.raises(SchemaError) as junk:
        first_token_of("a", Kept(b"\x00 no message"))
    assert junk.value.field == "<payload>"


async def test_latest_result_passes_over_what_is_no_result_of_that_request(
        nc: Client, uniq: str) -> None:
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_results_stream(js, s)
    with pytest.raises(NotFoundError):  # nothing kept for it
        await latest_result(js, s, "a")
    answer, stray = encode(first_token("a", 11)), encode(first_token("b"))
    await js.publish(s.result("a"), answer[0], headers=answer[1])
    await js.publish(s.result("a"), stray[0], headers=stray[1])
    await js.publish(s.result("a"), b"junk")
    bad: list[SchemaError] = []
    kept = await latest_result(js, s, "a", on_bad=bad.append)
    assert kept is not None and kept[0].token == 11 and kept[1] == 1
    assert [e.field for e in bad] == ["<payload>"]  # the latest only, once

    # More strays than the stream keeps per request: the answer is gone, none is found.
    for _ in range(RESULTS_KEPT_PER_REQUEST):
        await js.publish(s.result("a"), b"junk")
    assert await latest_result(js, s, "a") is None
