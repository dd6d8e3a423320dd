"""rankd's ``kv_transfer`` and ``first_decode`` spans on a real server (sim backend with its
KV handoff off the worker, ``vertumnus up``'s): they carry the stamps of the FirstToken that
went out -- a handoff timer firing late lengthens the first decode in both alike -- and a
first token that could not be made leaves a ``first_decode`` span with ERROR status."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from rankd_support import stage_spans
from service_support import service_running

from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import Assignment, AssignmentAck, FirstToken, IntakeRequest, decode
from shared.service import call
from shared.subjects import Subjects

WID = "w-cp2-g2"
WAIT_S = 20.0  # hang guard only; nothing asserts on speed
ROOT_SPAN = "10f067aa0ba902b7"
KV_S, DECODE_S = 0.3, 0.4  # the sim's handoff: the first token is due 0.7 s after the prefill
LATE_S = 0.25  # how much later than due the service's clock reads when the timer fires


def assignment(rid: str, trace_id: str) -> Assignment:
    now = time.time()
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=1024, block_hashes=[1, 2],
                              arrival_s=now - 0.01,
                              trace_context={"traceparent": f"00-{trace_id}-{ROOT_SPAN}-01"}),
        worker_id=WID, epoch=0, degree=2, prefix_tokens=0, recompute_tokens=1024,
        predicted_s=0.01, dequeued_at_s=now - 0.005, assigned_at_s=now,
    )


class Clock:
    """The service's clock: wall time plus ``skew``, which the test moves forward while a
    handoff's timer sleeps (its lateness made deterministic: the timer fires ``skew`` late
    by this clock, whatever the event loop adds)."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.time() + self.skew


class Spoiled(SimBackend):
    """The sim backend whose result makes no FirstToken (a token that is no integer)."""

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        return dataclasses.replace(await super().prefill(assignment), token="no-token")


def handoff_sim(cls: type[SimBackend] = SimBackend) -> SimBackend:
    return cls(prefill_time=lambda r, p, c, kind="cp": 0.01,
               handoff_time=lambda tokens, c: KV_S, first_decode_time=lambda tokens, c: DECODE_S,
               handoff_off_worker=True, time_scale=1.0)


def service(url: str, prefix: str, backend: SimBackend, clock: Clock) -> RankdService:
    return RankdService(RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=WID,
                                      heartbeat_s=0.2), backend, clock=clock)


async def late_first_token(svc: RankdService, clock: Clock, nc: Client, s: Subjects,
                           a: Assignment) -> FirstToken:
    """Assign ``a``; once its handoff's timer sleeps (the prefill done, the first token due),
    move the service's clock ``LATE_S`` ahead; the FirstToken that comes."""
    sub = await nc.subscribe(s.result(a.request.request_id))
    await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
    async with asyncio.timeout(WAIT_S):
        while not svc._handoffs:
            await asyncio.sleep(0.005)
    clock.skew = LATE_S
    ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
    await sub.unsubscribe()
    return ft



def seconds(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


async def test_a_late_handoff_timer_is_in_the_first_decode_span_as_in_the_breakdown(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """The first token is published by the handoff's timer, which fired ``LATE_S`` after it
    was due: the FirstToken's ``first_decode_s`` holds that lateness, and so does the
    ``first_decode`` span, which ends at the FirstToken's ``finished_at_s``; ``kv_transfer``
    is the breakdown's too. Before, both spans were recorded from the backend's result
    before the timer fired: ``first_decode`` lasted the modelled 0.4 s while the breakdown
    (and ``vtm.request.stage``) said 0.65 s or more."""
    s = Subjects(uniq)
    tid = f"{0x61:032x}"
    clock = Clock()
    svc = service(nats_server.url, uniq, handoff_sim(), clock)
    async with service_running(svc, timeout_s=WAIT_S):
        ft = await late_first_token(svc, clock, nc, s, assignment("late-1", tid))
    assert ft.error is None and ft.stages is not None
    assert ft.stages.first_decode_s >= DECODE_S + LATE_S
    got = await stage_spans(spans, tid, {"prefill", "kv_transfer", "first_decode"})
    prefill, kv, decode_span = got["prefill"], got["kv_transfer"], got["first_decode"]
    assert seconds(kv) == pytest.approx(ft.stages.kv_transfer_s, abs=1e-6)
    assert seconds(decode_span) == pytest.approx(ft.stages.first_decode_s, abs=1e-6)
    assert prefill.end_time == kv.start_time and kv.end_time == decode_span.start_time
    assert decode_span.end_time / 1e9 == pytest.approx(ft.finished_at_s, abs=1e-6)
    for span in (kv, decode_span):
        assert span.parent is not None and format(span.parent.span_id, "016x") == ROOT_SPAN
        assert span.status.status_code is StatusCode.UNSET
    assert decode_span.attributes["vtm.token"] == ft.token
    assert kv.attributes["vtm.modelled_handoff_s"] == pytest.approx(KV_S + DECODE_S)


async def test_a_first_token_never_sent_leaves_an_error_first_decode_span(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """The handoff ran but no FirstToken could be made of its result: the request gets an
    error answer, its ``kv_transfer`` span is recorded as for any handoff, and its
    ``first_decode`` span (with the timer's lateness, as the first token would have had it)
    has ERROR status saying the first token was not sent."""
    s = Subjects(uniq)
    tid = f"{0x62:032x}"
    clock = Clock()
    svc = service(nats_server.url, uniq, handoff_sim(Spoiled), clock)
    async with service_running(svc, timeout_s=WAIT_S):
        ft = await late_first_token(svc, clock, nc, s, assignment("late-bad", tid))
    assert ft.token is None and "first token not sent" in (ft.error or "")
    got = await stage_spans(spans, tid, {"prefill", "kv_transfer", "first_decode"})
    kv, decode_span = got["kv_transfer"], got["first_decode"]
    assert kv.status.status_code is StatusCode.UNSET
    assert seconds(kv) == pytest.approx(KV_S, abs=1e-6)
    assert decode_span.status.status_code is StatusCode.ERROR
    assert "first token not sent" in (decode_span.status.description or "")
    assert [e.name for e in decode_span.events] == ["exception"]
    assert seconds(decode_span) >= DECODE_S + LATE_S
    assert kv.end_time == decode_span.start_time
