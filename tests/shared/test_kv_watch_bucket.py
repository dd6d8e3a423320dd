"""KvWatch follows its bucket when the bucket is deleted and created again while the connection
stays up (no reconnect): nats-py's watch is an ordered consumer of the bucket's stream, which
goes with the stream, and the watch then stayed silent for ever. A real nats-server; bounds
(``WAIT_S``) are liveness bounds, never speed checks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from shared.service import KvWatch, ensure_key_value

WAIT_S = 20.0
CHECK_S = 0.1
RETRIES = 20
"""Retries of a gone bucket's watch a test waits for (each ``CHECK_S`` apart)."""


class Said:
    """A structlog-like logger that keeps what it was told: (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append(("info", event, kw))

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append(("warning", event, kw))

    def at(self, level: str) -> list[str]:
        return [event for lvl, event, _ in self.lines if lvl == level]


class Followed:
    """What a KvWatch yields, followed by a task: (key, value) per entry, None per marker."""

    def __init__(self, watch: KvWatch) -> None:
        self.watch = watch
        self.got: list[tuple[str, bytes] | None] = []
        self.task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        async for entry in self.watch:
            self.got.append(None if entry is None else (entry.key, entry.value or b""))

    async def until(self, what: tuple[str, bytes] | None, *, after: int = 0) -> None:
        """Wait until ``what`` is among the entries from index ``after`` on (the task must
        not end on the way: an exception out of ``__anext__`` fails here)."""
        async with asyncio.timeout(WAIT_S):
            while what not in self.got[after:]:
                if self.task.done():
                    raise AssertionError(f"the watch ended: {self.task!r}")
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        await self.watch.stop()
        await asyncio.wait_for(self.task, WAIT_S)  # stop ends the iteration


class ApiTap:
    """The JetStream API requests about one stream, seen at the server's API subjects (the
    watch's requests echo back to this connection): a count of what the watch did, so a test
    waits for checks that happened instead of sleeping for the time a check takes."""

    def __init__(self, nc: Client, stream: str) -> None:
        self.nc, self.stream = nc, stream
        self.subjects: list[str] = []

    async def start(self) -> ApiTap:
        async def on_api(msg: Msg) -> None:
            if msg.subject.endswith(f".{self.stream}") or f".{self.stream}." in msg.subject:
                self.subjects.append(msg.subject)

        self.sub = await self.nc.subscribe("$JS.API.>", cb=on_api)
        await self.nc.flush()
        return self

    def infos(self) -> int:
        """Stream-info requests so far: one per check of the bucket (and one per remake)."""
        return sum(".STREAM.INFO." in s for s in self.subjects)

    async def until(self, what: str, done: Callable[[], bool], watch: Followed) -> None:
        """Wait until ``done()``: a liveness bound (``WAIT_S``); the watch must go on."""
        try:
            async with asyncio.timeout(WAIT_S):
                while not done():
                    if watch.task.done():
                        raise AssertionError(f"the watch ended: {watch.task!r}")
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}: {self.subjects}") from None

    async def stop(self) -> None:
        await self.sub.unsubscribe()


async def _bucket_with(nc: Client, bucket: str, keys: int) -> KeyValue:
    kv = await ensure_key_value(nc.jetstream(), bucket)
    for i in range(keys):
        await kv.put(f"k{i}", b"old")
    return kv


async def test_a_watch_follows_its_bucket_deleted_and_created_again(nc: Client,
                                                                    uniq: str) -> None:
    """The bucket's stream is deleted and created again, the connection up all along: the
    watch is made again (counted in ``remade``, logged) and yields what the new bucket holds
    and what is written to it after. Before: nothing ever came (nats-py resumed its ordered
    consumer, if at all, at the old stream's next sequence)."""
    js = nc.jetstream()
    bucket = f"B{uniq}"
    # More entries before than after: a consumer resumed at the old stream's next sequence
    # would skip every entry the new bucket gets here.
    kv = await _bucket_with(nc, bucket, keys=3)
    said = Said()
    watch = await KvWatch(nc, kv, check_s=CHECK_S, logger=said).start()
    seen = Followed(watch)
    try:
        await seen.until(None)
        assert seen.got == [("k0", b"old"), ("k1", b"old"), ("k2", b"old"), None]
        await js.delete_key_value(bucket)
        again = await ensure_key_value(js, bucket)
        await again.put("new", b"1")
        await seen.until(("new", b"1"))
        assert watch.remade == 1
        assert any("re-created" in event or "created again" in event
                   for event in said.at("info")), said.lines
        # The new watch follows what is written after it was made.
        mark = len(seen.got)
        await again.put("later", b"2")
        await seen.until(("later", b"2"), after=mark)
        assert watch.remade == 1
    finally:
        await seen.close()
        with contextlib.suppress(NotFoundError):  # (not created again: a failed test)
            await js.delete_key_value(bucket)


async def test_a_deleted_bucket_is_waited_for_without_spinning_or_raising(
        nc: Client, uniq: str) -> None:
    """Deleted and not created again for a while: the watch keeps trying every ``check_s``
    (a handful of JetStream API requests a second at most, counted at the server's API
    subjects), says so once, and raises nothing out of ``__anext__``; once the bucket is back
    it is watched again."""
    js = nc.jetstream()
    bucket = f"B{uniq}"
    kv = await _bucket_with(nc, bucket, keys=1)
    tap = await ApiTap(nc, f"KV_{bucket}").start()
    said = Said()
    watch = await KvWatch(nc, kv, check_s=CHECK_S, logger=said).start()
    seen = Followed(watch)
    loop = asyncio.get_running_loop()
    try:
        await seen.until(None)
        await js.delete_key_value(bucket)
        async with asyncio.timeout(WAIT_S):  # noticed (a warning), the watch still iterating
            while not said.at("warning"):
                assert not seen.task.done(), seen.task
                await asyncio.sleep(0.02)
        await nc.flush()
        start, before, requests_before = loop.time(), tap.infos(), len(tap.subjects)
        # RETRIES tries to watch the gone bucket again (each asks for its stream first), the
        # bucket still gone: the warning must not come again at any of them.
        await tap.until(f"{RETRIES} retries", lambda: tap.infos() >= before + RETRIES, seen)
        await nc.flush()
        elapsed, requests = loop.time() - start, len(tap.subjects) - requests_before
        assert not seen.task.done(), seen.task
        # One retry per check_s (a stream info, and a consumer create when it exists): a
        # spinning loop makes its RETRIES at once, far above this. Slowness only lowers it.
        assert requests <= 2 * (elapsed / CHECK_S + 2), (requests, elapsed)
        # Said once (the warning), not at every retry, at no level.
        assert [level for level, _, _ in said.lines] == ["warning"], said.lines
        assert watch.remade == 0
        again = await ensure_key_value(js, bucket)
        await again.put("back", b"1")
        await seen.until(("back", b"1"))
        assert watch.remade == 1
    finally:
        await seen.close()
        await tap.stop()
        with contextlib.suppress(NotFoundError):  # (not created again: a failed test)
            await js.delete_key_value(bucket)


async def test_a_watch_of_an_untouched_bucket_is_not_made_again(nc: Client, uniq: str) -> None:
    """The check that notices a re-created bucket finds nothing wrong with a bucket left alone
    (quiet or written to): no re-watch, no log line. The checks are counted as they happen
    (stream-info requests at the server's API subjects), so that the test cannot pass with
    none having run."""
    bucket = f"B{uniq}"
    kv = await _bucket_with(nc, bucket, keys=2)
    tap = await ApiTap(nc, f"KV_{bucket}").start()
    said = Said()
    watch = await KvWatch(nc, kv, check_s=CHECK_S, logger=said).start()
    seen = Followed(watch)
    try:
        await seen.until(None)
        made = tap.infos()  # the start's own stream info
        await tap.until("checks of the quiet bucket", lambda: tap.infos() >= made + 3, seen)
        for i in range(5):
            mark = len(seen.got)
            await kv.put("k0", b"v%d" % i)
            await seen.until(("k0", b"v%d" % i), after=mark)
            # A check with the write yielded (the revision the checks compare against raised)
            # before the next write.
            checked = tap.infos()
            await tap.until("a check between the writes",
                            lambda c=checked: tap.infos() > c, seen)
        assert watch.remade == 0 and said.lines == []
    finally:
        await seen.close()
        await tap.stop()
        await nc.jetstream().delete_key_value(bucket)
