"""Helpers of the live tests that drive one rank daemon's worker service as the scheduler does
and watch what it answers, hands back and publishes (its faults, its dying tasks): a plain
assignment, assigning it, the results on the bus, the requests handed back to intake, the
worker's last state, a bounded wait and a bounded stop. Every wait is bounded by
``timeout_s`` (correctness, never speed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.rankd.core import INTAKE_MSG_HEADER
from services.rankd.service import RankdService
from shared.schemas import (
    Assignment,
    AssignmentAck,
    FirstToken,
    IntakeRequest,
    WorkerState,
    decode,
    from_json,
)
from shared.service import call
from shared.subjects import Subjects
from shared.worker import GpuGroup

WAIT_S = 20.0


def plain_assignment(rid: str, wid: str) -> Assignment:
    """A 100-token request for ``wid`` under epoch 0, nothing cached, assigned now."""
    now = time.time()
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=100, arrival_s=now - 0.01),
        worker_id=wid,
        epoch=0,
        degree=GpuGroup.from_worker_id(wid).degree,
        prefix_tokens=0,
        recompute_tokens=100,
        predicted_s=0.01,
        assigned_at_s=now,
    )


async def assign(nc: Client, s: Subjects, rid: str, wid: str, *,
                 timeout_s: float = WAIT_S) -> AssignmentAck:
    """Assign ``rid`` to ``wid`` as the scheduler does (intake message id ``m-{rid}``), once
    the worker's endpoint is up (a host's worker shows up just before its endpoints
    subscribe)."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                return await call(nc, s.worker_assign(wid), plain_assignment(rid, wid),
                                  AssignmentAck, timeout_s=timeout_s,
                                  headers={INTAKE_MSG_HEADER: f"m-{rid}"})
            except NoRespondersError:
                await asyncio.sleep(0.05)


async def results_of(nc: Client, s: Subjects) -> tuple[list[FirstToken], object]:
    """Every FirstToken published from now on (the list fills in), and the subscription."""
    got: list[FirstToken] = []

    async def cb(msg: Msg) -> None:
        got.append(decode(FirstToken, msg.data, msg.headers))

    return got, await nc.subscribe(s.result_all(), cb=cb)


async def handed_back(js: JetStreamContext, s: Subjects, n: int, *,
                      timeout_s: float = WAIT_S) -> dict[str, str]:
    """The next ``n`` requests in intake: request id → Nats-Msg-Id."""
    consumer = await js.pull_subscribe(s.intake_requests(), durable="sched")
    got: dict[str, str] = {}
    async with asyncio.timeout(timeout_s):
        while len(got) < n:
            for m in await consumer.fetch(n - len(got), timeout=timeout_s):
                got[decode(IntakeRequest, m.data, m.headers).request_id] = (
                    (m.headers or {}).get("Nats-Msg-Id", ""))
                await m.ack()
    return got


async def last_state(js: JetStreamContext, s: Subjects, wid: str) -> WorkerState:
    """``wid``'s WorkerState as the state bucket holds it now."""
    kv = await js.key_value(s.worker_state_bucket())
    return from_json(WorkerState, (await kv.get(wid)).value)


async def until(cond: Callable[[], bool], what: str, *, timeout_s: float = WAIT_S) -> None:
    """Wait until ``cond()`` holds; fail naming ``what`` if it does not within the bound."""
    try:
        async with asyncio.timeout(timeout_s):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"not within {timeout_s} s: {what}")


async def stopped(svc: RankdService, task: asyncio.Task[None], *,
                  timeout_s: float = WAIT_S) -> None:
    """Stop ``svc`` if it still runs (bounded), so a failing test leaves nothing behind."""
    if not task.done():
        svc.request_stop()
        await asyncio.wait({task}, timeout=timeout_s)


async def stage_spans(spans: InMemorySpanExporter, trace_id: str, names: set[str], *,
                      timeout_s: float = WAIT_S) -> dict[str, ReadableSpan]:
    """The finished spans of ``trace_id`` (32 hex digits) by name, once every one of
    ``names`` has ended."""
    async with asyncio.timeout(timeout_s):
        while True:
            got = {x.name: x for x in spans.get_finished_spans()
                   if format(x.context.trace_id, "032x") == trace_id}
            if names <= set(got):
                return got
            await asyncio.sleep(0.01)
