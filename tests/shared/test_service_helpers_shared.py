"""The helpers the services' adapters share: reading the worker-state watch, stopping what a
setup started, tracked tasks, optional request bodies, dict settings given as JSON text, and
a worker's snapshot reply. No NATS server: fakes stand for the watch, the subscriptions and
the request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel

from services.cachemgr.events import MalformedEvent, Snapshot, Stored, snapshot_reply
from shared.schemas import WorkerState
from shared.service import MicroService, optional_request_model
from shared.settings import ServiceSettings, json_object_text
from shared.tasks import spawn_once, spawn_tracked
from shared.worker import Lifecycle
from shared.workerstates import worker_state_changes


@dataclass
class Entry:
    key: str
    value: bytes | None
    operation: str | None = None


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.warnings.append((event, kw))


async def _entries(*items: Entry | None) -> AsyncIterator[Entry | None]:
    for item in items:
        yield item


def _state(worker: str) -> bytes:
    return WorkerState(worker_id=worker, degree=2, gpus=[0, 1], epoch=0,
                       lifecycle=Lifecycle.ACTIVE, queue_len=0, outstanding_s=0.0,
                       kv_free_blocks=0, kv_total_blocks=0, heartbeat_s=1.0
                       ).model_dump_json().encode()


async def test_worker_state_changes_decode_remove_and_pass_over() -> None:
    log, counters = Log(), {"malformed": 0}
    changes = [c async for c in worker_state_changes(_entries(
        Entry("w-cp2-g0", _state("w-cp2-g0")),
        None,  # end of the initial values
        Entry("w-cp2-g2", b"not json"),
        Entry("w-cp2-g0", b"", "DEL"),
        Entry("w-cp2-g4", None, "PURGE"),
        Entry("w-cp2-g6", b""),
    ), log, counters)]
    assert [(k, None if s is None else s.worker_id) for k, s in changes] == [
        ("w-cp2-g0", "w-cp2-g0"), ("w-cp2-g0", None), ("w-cp2-g4", None), ("w-cp2-g6", None)]
    assert counters["malformed"] == 1
    assert [(e, kw["key"]) for e, kw in log.warnings] == [("bad worker state ignored",
                                                          "w-cp2-g2")]


class Closable:
    """Stands for a watch (``stop``) or a subscription (``unsubscribe``); ``fail``: closing it
    raises, as on a connection that is gone."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.closed = fail, False

    async def _close(self) -> None:
        self.closed = True
        if self.fail:
            raise RuntimeError("connection closed")

    stop = unsubscribe = _close


async def test_stop_listening_cancels_then_stops_everything_despite_failures() -> None:
    svc = MicroService(ServiceSettings(), name="vtm-test", version="1.0.0", group="vtm.test")
    task = asyncio.create_task(asyncio.sleep(60), name="sleeper")
    watches = [Closable(True), Closable(False)]
    subs = [Closable(True), None, Closable(False)]
    await svc.stop_listening([task], watches, subs)  # type: ignore[arg-type]
    assert task.cancelled()
    assert all(c.closed for c in [*watches, *subs] if c is not None)


async def test_spawn_tracked_leaves_the_list_when_done() -> None:
    tasks: list[asyncio.Task[Any]] = []
    gate = asyncio.Event()
    task = spawn_tracked(tasks, gate.wait(), "waiter")
    assert tasks == [task] and task.get_name() == "waiter"
    gate.set()
    await task
    await asyncio.sleep(0)  # done callbacks run on the next loop iteration
    assert tasks == []


class Query(BaseModel):
    n: int = 20


@dataclass
class FakeRequest:
    data: bytes
    headers: dict[str, str] | None = None


@pytest.mark.parametrize("body", [b"", b"  \n"])
def test_optional_request_model_blank_body_is_the_defaults(body: bytes) -> None:
    assert optional_request_model(FakeRequest(body), Query) == Query()  # type: ignore[arg-type]


def test_optional_request_model_decodes_a_body() -> None:
    got = optional_request_model(FakeRequest(b'{"n": 3}'), Query)  # type: ignore[arg-type]
    assert got == Query(n=3)


def test_json_object_text() -> None:
    assert json_object_text('{"2": 8.0}') == {"2": 8.0}
    assert json_object_text("  ") == {}
    assert json_object_text({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError):
        json_object_text("{not json")


def test_snapshot_reply_checks_kind_and_worker() -> None:
    snap = Snapshot("w-cp2-g0", 3, ())
    assert snapshot_reply("w-cp2-g0", json.dumps(snap.to_wire()).encode()) == snap
    with pytest.raises(MalformedEvent, match="is not its snapshot"):
        snapshot_reply("w-cp2-g2", json.dumps(snap.to_wire()).encode())
    stored = Stored("w-cp2-g0", 1, None, (5,))
    with pytest.raises(MalformedEvent, match="is not its snapshot"):
        snapshot_reply("w-cp2-g0", json.dumps(stored.to_wire()).encode())
    with pytest.raises(MalformedEvent):
        snapshot_reply("w-cp2-g0", b"nope")


async def test_spawn_once_runs_one_task_per_key_and_frees_the_key() -> None:
    tasks: list[asyncio.Task[Any]] = []
    running: set[str] = set()
    gate = asyncio.Event()
    calls: list[str] = []

    async def work(key: str) -> None:
        calls.append(key)
        await gate.wait()
        raise RuntimeError("failed")  # the key is freed however the task ends

    assert spawn_once(tasks, running, "a", lambda: work("a"), "work-a")
    assert not spawn_once(tasks, running, "a", lambda: work("a"), "work-a")
    assert spawn_once(tasks, running, "b", lambda: work("b"), "work-b")
    assert running == {"a", "b"} and len(tasks) == 2
    gate.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0)
    assert calls == ["a", "b"] and running == set() and tasks == []


async def test_spawn_once_frees_the_key_of_a_task_cancelled_before_it_ran() -> None:
    """A teardown right after the spawn cancels the task before its first step: its body
    never runs, and the key is freed all the same (before, it stayed taken for good, and the
    work was never asked for again)."""
    tasks: list[asyncio.Task[Any]] = []
    running: set[str] = set()
    ran: list[str] = []

    async def work() -> None:
        ran.append("a")

    assert spawn_once(tasks, running, "a", work, "work-a")
    task = tasks[0]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # the done callbacks
    assert ran == [] and running == set() and tasks == []
    assert spawn_once(tasks, running, "a", work, "work-a")  # asked again: runs
    await asyncio.gather(*tasks)
    assert ran == ["a"]


def test_spawn_once_takes_no_key_when_the_work_cannot_be_made() -> None:
    """``start()`` raising (no event loop needed: nothing is spawned) leaves the key free."""
    running: set[str] = set()

    def broken() -> Any:
        raise TypeError("bad arguments")

    with pytest.raises(TypeError):
        spawn_once([], running, "a", broken, "work-a")
    assert running == set()


async def test_worker_state_changes_refuse_a_state_stored_under_another_key() -> None:
    # The callers store a state under its worker_id and drop it by key: one under another
    # key would never be dropped.
    log, counters = Log(), {"malformed": 0}
    changes = [c async for c in worker_state_changes(_entries(
        Entry("w-cp2-g4", _state("w-cp2-g0")),
        Entry("w-cp2-g2", _state("w-cp2-g2")),
    ), log, counters)]
    assert [(k, None if s is None else s.worker_id) for k, s in changes] == [
        ("w-cp2-g2", "w-cp2-g2")]
    assert counters["malformed"] == 1
    assert [(e, kw["key"]) for e, kw in log.warnings] == [("bad worker state ignored",
                                                          "w-cp2-g4")]
    assert "w-cp2-g0" in log.warnings[0][1]["error"]
