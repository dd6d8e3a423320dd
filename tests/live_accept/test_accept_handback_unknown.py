"""A hand-back whose publish outcome is unknown is remembered and settled (real nats-server,
rankd in-process).

W admits y (intake message ``y``) behind a long request and is drained: it hands y back to
intake, but every publish attempt of the hand-back times out — either after intake stored it
(the ack was lost) or before (the message never arrived). Whether intake holds y is unknown.
Before the fix W forgot y; a scheduler re-sending y's assignment (after a crash, or after
its own dispatch timed out) was answered 409 "not ACTIVE", deleted its record and placed y
afresh — beside the stored hand-back when the ack had only been lost: y ran twice.

Now W remembers the hand-back. A re-sent assignment of the same source makes W publish the
hand-back again under its own id (``y>W``), which intake stores at most once: while that
fails W answers 425 (the scheduler keeps its record and retries), once intake acknowledges
it 410 (the scheduler acks its old message) — and intake holds exactly one message for y.
The publish failures are injected by a wrapper around W's JetStream context; everything
else is the real rankd and server.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import nats
import pytest
from live_accept_support import ActingController, InProcess, wait_until

from services.rankd.backend import SimBackend
from services.rankd.core import HANDED_BACK_CODE, INTAKE_MSG_HEADER, REDIRECTING_CODE
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import Assignment, AssignmentAck, IntakeRequest
from shared.service import RemoteError, call, ensure_intake_stream, epoch_kv
from shared.worker import Lifecycle

W = "w-cp2-g0"
BLOCKER_LEN = 4000


class FlakyJetStream:
    """W's JetStream context with injected publish outcomes: ``lose_ack`` (stored, then a
    timeout), ``drop`` (a timeout, nothing stored) or ``pass``."""

    def __init__(self, js: Any, mode: str) -> None:
        self.js, self.mode = js, mode
        self.msg_ids: list[str] = []

    async def publish(self, subject: str, payload: bytes, **kw: Any) -> Any:
        self.msg_ids.append((kw.get("headers") or {}).get("Nats-Msg-Id", ""))
        if self.mode == "drop":
            await asyncio.sleep(0.01)  # a timeout takes time (and yields to the loop)
            raise nats.errors.TimeoutError
        ack = await self.js.publish(subject, payload, **kw)
        if self.mode == "lose_ack":
            raise nats.errors.TimeoutError
        return ack

    def __getattr__(self, name: str) -> Any:
        return getattr(self.js, name)


def assignment(rid: str, length: int) -> Assignment:
    req = IntakeRequest(request_id=rid, input_len=length, block_size=16, arrival_s=time.time())
    return Assignment(request=req, worker_id=W, epoch=0, degree=2, prefix_tokens=0,
                      recompute_tokens=length, predicted_s=0.1, assigned_at_s=time.time())


async def resend_code(nc: Any, live: InProcess, y: Assignment) -> int:
    """What W answers a re-send of y's assignment ``y`` (its request, so its arrival stamp, as
    intake message ``y`` carries it) from that message."""
    with pytest.raises(RemoteError) as err:
        await call(nc, live.subjects.worker_assign(W), y, AssignmentAck,
                   timeout_s=10.0, headers={INTAKE_MSG_HEADER: "y"})
    return err.value.code


@pytest.mark.parametrize("failure", ["lose_ack", "drop"])
async def test_unknown_handback_is_settled_by_publishing_it_again(
        nats_server: EmbeddedNats, failure: str) -> None:
    live = InProcess(nats_server.url, "t" + os.urandom(5).hex())
    nc = await nats.connect(nats_server.url, connect_timeout=5)
    js = nc.jetstream()
    try:
        await ensure_intake_stream(js, live.subjects)
        settings = RankdSettings(nats_url=live.url, subject_prefix=live.prefix, worker_id=W,
                                 heartbeat_s=0.2, drain_timeout_s=0.5, redirect_timeout_s=0.3)
        backend = SimBackend(prefill_time=lambda r, p, c, kind="cp": 120.0 if r >= BLOCKER_LEN
                             else 0.02, handoff_time=lambda n, c: 0.001)
        w = await live.run(RankdService(settings, backend))
        await live.until_served(live.subjects.worker_assign(W))
        await call(nc, live.subjects.worker_assign(W), assignment("blocker", BLOCKER_LEN),
                   AssignmentAck, timeout_s=10.0)
        y = assignment("y", 40)
        await call(nc, live.subjects.worker_assign(W), y, AssignmentAck,
                   timeout_s=10.0, headers={INTAKE_MSG_HEADER: "y"})
        assert [j.request_id for j in w.core.queued] == ["y"]
        flaky = FlakyJetStream(w._js, failure)
        w._js = flaky

        kv = await epoch_kv(js, live.subjects)
        rec = ActingController._make(1, {W: Lifecycle.DRAINING}, "drain W")
        await kv.put(live.subjects.epoch_key(), rec.model_dump_json().encode())
        await wait_until(lambda: w.core.lifecycle is Lifecycle.DRAINING, "W draining")
        await wait_until(lambda: not w.core.redirecting, "y's hand-back given up")
        assert flaky.msg_ids and set(flaky.msg_ids) == {f"y>{W}"}
        stored = (await js.stream_info(live.subjects.intake_stream())).state.messages
        assert stored == (1 if failure == "lose_ack" else 0)

        # While publishing still fails: 425, the scheduler keeps its record and retries.
        assert await resend_code(nc, live, y) == int(REDIRECTING_CODE)
        # Intake works again: the hand-back is published once more and acknowledged → 410.
        flaky.mode = "pass"
        assert await resend_code(nc, live, y) == int(HANDED_BACK_CODE)
        published = len(flaky.msg_ids)
        assert await resend_code(nc, live, y) == int(HANDED_BACK_CODE)  # now remembered as such
        assert len(flaky.msg_ids) == published  # settled: no further publish
        # Intake holds y exactly once, under the hand-back's id, whatever happened before.
        info = await js.stream_info(live.subjects.intake_stream())
        assert info.state.messages == 1
        msg = await js.get_msg(live.subjects.intake_stream(), info.state.last_seq)
        assert (msg.headers or {}).get("Nats-Msg-Id") == f"y>{W}"
        assert len(w.core) == 1  # only the blocker: the refusals changed nothing
    finally:
        await live.close()
        await nc.drain()
