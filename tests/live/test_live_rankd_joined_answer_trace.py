"""The answer of a later attempt that joined a job, on a real nats-server with a real
RankdService (sim backend held by a gate): the copy of the job's first token sent to that
attempt carries the attempt's own trace context in its headers, as the job's answer carries
the job's (``_request_context``: whoever waits on a result links to its request's trace --
the controller's drain span does), and so does the copy of an error answer.

Before, the copies were stamped under whatever context was current where the answer was made
-- the executor's, no request's: a joined attempt's answer carried no trace context at all."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from gated_backend import GatedBackend
from nats.aio.client import Client
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rankd_support import WAIT_S, plain_assignment, until
from service_support import service_running

from services.rankd.backend import PrefillResult
from services.rankd.core import INTAKE_MSG_HEADER
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import Assignment, AssignmentAck, FirstToken, decode
from shared.service import call
from shared.subjects import Subjects

WID = "w-cp2-g2"
FIRST_TRACE, LATER_TRACE = "1" * 32, "2" * 32


def traced(a: Assignment, trace_id: str, arrival_after: float = 0.0) -> Assignment:
    req = a.request.model_copy(update={
        "arrival_s": a.request.arrival_s + arrival_after,
        "trace_context": {"traceparent": f"00-{trace_id}-{'a' * 16}-01"}})
    return a.model_copy(update={"request": req})


class FailingGated(GatedBackend):
    """Held by the gate, then every prefill fails (the request's fault)."""

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        await self.gate.wait()
        raise RuntimeError("no prefill here")


@pytest.fixture(params=["token", "error"])
async def worker(request: pytest.FixtureRequest, nats_server: EmbeddedNats,
                 uniq: str) -> AsyncIterator[tuple[RankdService, GatedBackend, str]]:
    backend = GatedBackend() if request.param == "token" else FailingGated()
    svc = RankdService(RankdSettings(nats_url=nats_server.url, subject_prefix=uniq,
                                     worker_id=WID, heartbeat_s=0.2), backend)
    try:
        async with service_running(svc, timeout_s=WAIT_S):
            yield svc, backend, request.param
    finally:
        backend.gate.set()


async def test_a_joined_attempts_answer_carries_its_own_trace_context(
    worker: tuple[RankdService, GatedBackend, str], nc: Client, uniq: str,
    spans: InMemorySpanExporter,
) -> None:
    svc, backend, outcome = worker
    s = Subjects(uniq)
    sub = await nc.subscribe(s.result("x"))
    first = traced(plain_assignment("x", WID), FIRST_TRACE)
    later = traced(first, LATER_TRACE, 1.0)
    for a in (first, later):
        await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S,
                   headers={INTAKE_MSG_HEADER: "x"})
        await until(lambda: svc.core.running is not None, "x running")
    backend.gate.set()
    got: dict[float, str | None] = {}
    for _ in range(2):
        msg = await sub.next_msg(timeout=WAIT_S)
        ft = decode(FirstToken, msg.data, msg.headers)
        assert (ft.error is None) == (outcome == "token")
        got[ft.arrival_s] = ((msg.headers or {}).get("traceparent") or "-").split("-")[1]
    assert got == {first.request.arrival_s: FIRST_TRACE, later.request.arrival_s: LATER_TRACE}
