"""Following the worker-state bucket (:func:`shared.service.worker_state_kv`): what its
watch's entries mean, read once for every service that keeps the workers' last states.

Every rank host puts its worker's :class:`~shared.schemas.WorkerState` under the worker's id
and the bucket's TTL removes it once the heartbeats stop. A watch of the bucket
(:class:`shared.service.KvWatch`) yields the stored entries, a None once they have all come,
then every change; a deleted or purged key, or an empty value, means the worker's state is
gone.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, MutableMapping
from typing import Any

from shared.schemas import SchemaError, WorkerState, decode


async def worker_state_changes(
    watcher: AsyncIterable[Any], log: Any, counters: MutableMapping[str, int],
) -> AsyncIterator[tuple[str, WorkerState | None]]:
    """Each change that ``watcher`` (a watch of the worker-state bucket) yields, as ``(key,
    state)``: ``state`` is None where the key was deleted or purged or holds an empty value
    (the worker's state is gone), else the value decoded.

    Passed over: the None that ends the initial values, and a value that is no WorkerState
    or whose ``worker_id`` is not its key -- counted in ``counters["malformed"]`` and logged
    by ``log`` (warning ``bad worker state ignored``, with the key and the error). A yielded
    state's ``worker_id`` is thus its key: the callers keep a state under its worker_id and
    drop it by key, and one kept under another key would never be dropped."""
    async for entry in watcher:
        if entry is None:
            continue
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            yield entry.key, None
            continue
        try:
            state = decode(WorkerState, entry.value)
            if state.worker_id != entry.key:
                raise SchemaError("WorkerState", "worker_id",
                                  f"{state.worker_id!r} stored under key {entry.key!r}")
        except SchemaError as exc:
            counters["malformed"] += 1
            log.warning("bad worker state ignored", key=entry.key, error=str(exc))
            continue
        yield entry.key, state


__all__ = ["worker_state_changes"]
