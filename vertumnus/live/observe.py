"""What the orchestrator watches on NATS: service discovery, epoch records, results.

* :func:`ping` — ``$SRV.PING[.name]`` and collect every answer for a short window (nats-py's
  ``request`` returns only the first), keeping services of this deployment (metadata
  ``prefix``).
* :class:`Observer` — watches the epoch record (composition changes) and taps
  ``{prefix}.result.*`` for each request's reused prefix tokens (P), which the HTTP answer
  does not carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError, NotFoundError

from shared.schemas import EpochRecord, FirstToken, SchemaError, decode
from shared.service import KvWatch, epoch_kv, every_answer
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait
from vertumnus.live.report import CompositionChange


async def ping(nc: Client, name: str | None = None, *, prefix: str | None = None,
               window_s: float = 0.5) -> list[dict[str, Any]]:
    """Every ``$SRV.PING`` answer (optionally of micro service ``name``) within ``window_s``."""
    return await every_answer(nc, "$SRV.PING" + (f".{name}" if name else ""), prefix=prefix,
                              window_s=window_s)


async def service_stats(nc: Client, name: str, *, prefix: str | None = None,
                        window_s: float = 0.5) -> list[dict[str, Any]]:
    """Every replica's ``$SRV.STATS`` answer for micro service ``name`` within ``window_s``
    (each endpoint's ``data`` holds the service's own counters, ``MicroService.stats_data``)."""
    return await every_answer(nc, f"$SRV.STATS.{name}", prefix=prefix, window_s=window_s)


class _Quiet:
    """A logger that says nothing (KvWatch's re-watch notes, inside a command's output)."""

    def info(self, *args: Any, **kw: Any) -> None:
        return None

    def warning(self, *args: Any, **kw: Any) -> None:
        return None


class Observer:
    """Epoch records and first-token results of one deployment, as they happen."""

    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.changes: list[CompositionChange] = []
        self.prefix_tokens: dict[str, int] = {}
        self.results = 0
        self.cache_commands: dict[str, int] = {}
        self.t0 = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []
        self._watcher: Any = None

    def mark_start(self) -> None:
        """Reset the clock that stamps composition changes (call when the replay starts)."""
        shift = time.monotonic() - self.t0
        self.t0 += shift
        self.changes = [CompositionChange(c.epoch, c.at_s - shift, c.workers, c.reason)
                        for c in self.changes]

    async def start(self) -> None:
        self._subs.append(await self.nc.subscribe(self.subjects.result_all(), cb=self._on_result))
        cmd_all = self.subjects.cache_cmd("x").rsplit(".", 1)[0] + ".*"
        self._subs.append(await self.nc.subscribe(cmd_all, cb=self._on_cache_cmd))
        self._tasks.append(asyncio.create_task(self._follow_epochs(), name="observe-epochs"))

    async def _on_result(self, msg: Msg) -> None:
        self.results += 1
        with contextlib.suppress(SchemaError):
            ft = decode(FirstToken, msg.data, msg.headers)
            if ft.prefix_tokens is not None:
                self.prefix_tokens[ft.request_id] = ft.prefix_tokens

    async def _on_cache_cmd(self, msg: Msg) -> None:
        # Count the cache manager's commands by op (replicate / reclaim / reconcile / demote).
        with contextlib.suppress(ValueError, AttributeError):
            op = str(json.loads(msg.data).get("op", "?"))
            self.cache_commands[op] = self.cache_commands.get(op, 0) + 1

    async def _follow_epochs(self) -> None:
        js = self.nc.jetstream()
        kv = None
        while kv is None:  # the bucket appears when the controller / rankd create it
            try:
                kv = await epoch_kv(js, self.subjects)
            except (BucketNotFoundError, NotFoundError, TimeoutError):
                await asyncio.sleep(0.5)
        # Made again after a server restart (replay --nats may watch a long-lived server).
        # Quietly: the command's own output (a table) is no place for a service log line.
        self._watcher = await KvWatch(self.nc, kv, self.subjects.epoch_key(),
                                      logger=_Quiet()).start()
        async for entry in self._watcher:
            if entry is None or not entry.value:
                continue
            with contextlib.suppress(SchemaError):
                self.add_record(decode(EpochRecord, entry.value))

    def add_record(self, rec: EpochRecord) -> None:
        if self.changes and rec.epoch <= self.changes[-1].epoch:
            return
        self.changes.append(CompositionChange(
            rec.epoch, time.monotonic() - self.t0,
            tuple(sorted(w.worker_id for w in rec.workers)), rec.reason,
        ))

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
        await cancel_and_wait(self._tasks)  # bounded even if a cancel is swallowed (3.11)

    def summary_counts(self) -> Mapping[str, Any]:
        return {"results_seen": self.results, "epochs_seen": len(self.changes),
                "cache_commands": dict(sorted(self.cache_commands.items()))}


__all__ = ["Observer", "ping", "service_stats"]
