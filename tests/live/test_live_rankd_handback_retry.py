"""rankd's hand-back to intake meeting errors other than a lost ack, on a real server: a
transient one (a JetStream 5xx, the connection down with its outbound buffer full) is tried
again until ``redirect_timeout_s``; an outcome that may have been stored is unknown (never
answered with an error); only a definite refusal fails the hand-back at once.

The intake stream is a stand-in subscriber on the intake subject (it answers each JetStream
publish as the stream would: a PubAck or an API error), except in the server-restart test,
which uses the real stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import structlog.testing
from nats.aio.client import Client
from nats.aio.msg import Msg

import shared.natsclient as natsclient
from services.rankd.backend import SimBackend
from services.rankd.core import (
    HANDED_BACK_CODE,
    INTAKE_MSG_HEADER,
    REDIRECTING_CODE,
    handback_msg_id,
)
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    EpochRecord,
    EpochWorker,
    FirstToken,
    IntakeRequest,
    decode,
    to_json,
)
from shared.service import RemoteError, call, ensure_intake_stream
from shared.subjects import Subjects
from shared.worker import Lifecycle

WID = "w-cp2-g2"
WAIT_S = 30.0  # bound for correctness waits only; nothing asserts on speed

UNAVAILABLE = {"code": 503, "err_code": 10008,
               "description": "JetStream system temporarily unavailable"}
STORE_FAILED = {"code": 503, "err_code": 10077, "description": "maximum messages exceeded"}
BAD_REQUEST = {"code": 400, "err_code": 10003, "description": "bad request"}


def assignment(rid: str, *, tokens: list[int] | None = None) -> Assignment:
    now = time.time()
    n = len(tokens) if tokens is not None else 1024
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=n, tokens=tokens,
                              block_hashes=[1, 2] if tokens is None else [],
                              arrival_s=now - 0.01),
        worker_id=WID, epoch=0, degree=2, prefix_tokens=min(512, n - 1),
        recompute_tokens=n - min(512, n - 1), predicted_s=0.2, dequeued_at_s=now - 0.005,
        assigned_at_s=now,
    )


class StandInIntake:
    """Answers each publish on the intake subject with the next of ``errors`` (a JetStream
    API error), then with ``then`` (an error, for ever) or a PubAck (``then`` None). Records
    the ``Nats-Msg-Id`` of every try."""

    def __init__(self, errors: list[dict], then: dict | None = None) -> None:
        self.errors = list(errors)
        self.then = then
        self.tries: list[str | None] = []

    async def answer(self, msg: Msg) -> None:
        self.tries.append((msg.headers or {}).get("Nats-Msg-Id"))
        error = self.errors.pop(0) if self.errors else self.then
        body = {"error": error} if error is not None else {"stream": "INTAKE",
                                                            "seq": len(self.tries)}
        await msg.respond(json.dumps(body).encode())


async def start_rankd(url: str, prefix: str, **kw: object) -> tuple[RankdService,
                                                                    asyncio.Task[None]]:
    """A rankd on the sim backend whose prefills take 30 s: the first request assigned runs
    for the whole test, the next ones stay queued (and are handed back by a drain)."""
    settings = RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=WID,
                             heartbeat_s=0.2, drain_timeout_s=0.5, **kw)  # type: ignore[arg-type]
    svc = RankdService(settings, SimBackend(prefill_time=lambda r, p, c, kind="cp": 30.0))
    task = asyncio.create_task(svc.run(handle_signals=False))
    await asyncio.wait_for(svc.started.wait(), timeout=WAIT_S)
    return svc, task


@pytest.fixture
async def stopper() -> AsyncIterator[list[tuple[RankdService, asyncio.Task[None]]]]:
    started: list[tuple[RankdService, asyncio.Task[None]]] = []
    yield started
    for svc, task in started:
        svc.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)


async def until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not cond():
            await asyncio.sleep(0.01)


async def drain_and_settle(nc: Client, s: Subjects, svc: RankdService) -> None:
    """Commit epoch 1 in which the worker drains; return once its hand-backs are settled and
    whatever it answered has reached ``nc``."""
    epochs = await nc.jetstream().key_value(s.epoch_bucket())
    await epochs.put(s.epoch_key(), to_json(EpochRecord(
        epoch=1, committed_at_s=time.time(),
        workers=[EpochWorker(worker_id=WID, first_gpu=2, degree=2,
                             lifecycle=Lifecycle.DRAINING)])))
    # The adoption hands back with no await after it: once DRAINING, the redirect is out.
    await until(lambda: svc.core.lifecycle is Lifecycle.DRAINING)
    await until(lambda: not svc.core.redirecting and not svc._redirects and not svc._handoffs)
    await svc.nc.flush()
    await nc.flush()


async def answers(nc: Client, subject: str) -> tuple[object, list[FirstToken]]:
    got: list[FirstToken] = []

    async def cb(msg: Msg) -> None:
        got.append(decode(FirstToken, msg.data, msg.headers))

    return await nc.subscribe(subject, cb=cb), got


async def test_a_transient_503_is_tried_again_and_the_hand_back_lands(
    nats_server: EmbeddedNats, nc: Client, uniq: str,
    stopper: list[tuple[RankdService, asyncio.Task[None]]],
) -> None:
    """Intake's JetStream answers the hand-back's first publish "temporarily unavailable"
    (503, 10008; a leader election): the hand-back is published again under the same
    ``Nats-Msg-Id``, lands, and nobody is answered an error. Before, the one 503 failed it at
    once and the client got "redirect failed" though 10 s were left (and, a 5xx possibly
    stored, could be answered twice)."""
    s = Subjects(uniq)
    intake = StandInIntake([UNAVAILABLE])
    await nc.subscribe(s.intake_requests(), cb=intake.answer)
    svc, task = await start_rankd(nats_server.url, uniq)
    stopper.append((svc, task))
    sub, results = await answers(nc, s.result("q-2"))
    for rid in ("q-1", "q-2"):
        await call(nc, s.worker_assign(WID), assignment(rid), AssignmentAck, timeout_s=WAIT_S)
    await drain_and_settle(nc, s, svc)
    assert results == []
    mid = handback_msg_id("q-2", None, WID, 1)
    assert intake.tries == [mid, mid]
    await sub.unsubscribe()


async def test_a_5xx_until_the_deadline_leaves_the_outcome_unknown(
    nats_server: EmbeddedNats, nc: Client, uniq: str,
    stopper: list[tuple[RankdService, asyncio.Task[None]]],
) -> None:
    """Intake answers 503 (10008) to every try until ``redirect_timeout_s``: the hand-back
    may have been stored (a 5xx in a cluster), so its outcome is unknown -- no error answer;
    the core remembers it, and a re-sent assignment of its source publishes it again (same
    id) and, intake acknowledging, is answered 410. Before, the first 503 answered the client
    "redirect failed" and the core forgot the hand-back (the re-sent assignment: 409)."""
    s = Subjects(uniq)
    intake = StandInIntake([], then=UNAVAILABLE)
    await nc.subscribe(s.intake_requests(), cb=intake.answer)
    svc, task = await start_rankd(nats_server.url, uniq, redirect_timeout_s=1.0)
    stopper.append((svc, task))
    sub, results = await answers(nc, s.result("q-2"))
    placed = {INTAKE_MSG_HEADER: "msg-q-2"}
    await call(nc, s.worker_assign(WID), assignment("q-1"), AssignmentAck, timeout_s=WAIT_S)
    second = assignment("q-2")
    await call(nc, s.worker_assign(WID), second, AssignmentAck, timeout_s=WAIT_S,
               headers=placed)
    await drain_and_settle(nc, s, svc)
    assert results == []
    mid = handback_msg_id("q-2", "msg-q-2", WID, 1)
    assert len(intake.tries) >= 2 and set(intake.tries) == {mid}
    tried = len(intake.tries)
    intake.then = None  # intake acknowledges from now on
    with pytest.raises(RemoteError) as err:
        await call(nc, s.worker_assign(WID), second, AssignmentAck, timeout_s=WAIT_S,
                   headers=placed)
    assert err.value.code == int(HANDED_BACK_CODE)
    assert intake.tries[tried:] == [mid]
    await svc.nc.flush()
    await nc.flush()
    assert results == []
    await sub.unsubscribe()


async def test_a_lasting_5xx_ends_the_hand_back_at_once_of_unknown_outcome(
    nats_server: EmbeddedNats, nc: Client, uniq: str,
    stopper: list[tuple[RankdService, asyncio.Task[None]]],
) -> None:
    """A store that failed (503, 10077: a retry within seconds gets the same answer, as the
    gateway classifies it) ends the hand-back after one try, but a 5xx may have been stored:
    unknown, not answered; a re-sent assignment of its source tries again (425 while intake
    still refuses). Before, the client was answered "redirect failed"."""
    s = Subjects(uniq)
    intake = StandInIntake([], then=STORE_FAILED)
    await nc.subscribe(s.intake_requests(), cb=intake.answer)
    svc, task = await start_rankd(nats_server.url, uniq)
    stopper.append((svc, task))
    sub, results = await answers(nc, s.result("q-2"))
    placed = {INTAKE_MSG_HEADER: "msg-q-2"}
    await call(nc, s.worker_assign(WID), assignment("q-1"), AssignmentAck, timeout_s=WAIT_S)
    second = assignment("q-2")
    await call(nc, s.worker_assign(WID), second, AssignmentAck, timeout_s=WAIT_S,
               headers=placed)
    await drain_and_settle(nc, s, svc)
    assert results == []
    assert len(intake.tries) == 1
    with pytest.raises(RemoteError) as err:
        await call(nc, s.worker_assign(WID), second, AssignmentAck, timeout_s=WAIT_S,
                   headers=placed)
    assert err.value.code == int(REDIRECTING_CODE)
    assert len(intake.tries) == 2
    await sub.unsubscribe()


async def test_a_refusal_below_500_fails_the_hand_back_at_once(
    nats_server: EmbeddedNats, nc: Client, uniq: str,
    stopper: list[tuple[RankdService, asyncio.Task[None]]],
) -> None:
    """A 400 answer (the stream refused the message on a check before storing): nothing was
    stored and a retry gets the same answer -- one try, and the client is answered once with
    "redirect failed"."""
    s = Subjects(uniq)
    intake = StandInIntake([], then=BAD_REQUEST)
    await nc.subscribe(s.intake_requests(), cb=intake.answer)
    svc, task = await start_rankd(nats_server.url, uniq)
    stopper.append((svc, task))
    sub, results = await answers(nc, s.result("q-2"))
    for rid in ("q-1", "q-2"):
        await call(nc, s.worker_assign(WID), assignment(rid), AssignmentAck, timeout_s=WAIT_S)
    await drain_and_settle(nc, s, svc)
    assert len(intake.tries) == 1
    assert [(r.token, "redirect failed" in (r.error or "")) for r in results] == [(None, True)]
    await sub.unsubscribe()


N_TOKEN_HEAVY = 8
TOKENS = 60_000  # ~420 KB of JSON each: four fill nats-py's 2 MiB reconnect buffer


async def test_hand_backs_beyond_the_reconnect_buffer_land_after_a_server_restart(
    tmp_path: Path, uniq: str
) -> None:
    """The server restarts (same port and store) while a stop hands back requests that carry
    their tokens: the publishes beyond nats-py's reconnect buffer raise
    OutboundBufferLimitError (nothing sent). They are tried again, and once the server is
    back every hand-back is in intake and nobody was answered an error. Before, each of them
    failed at once with "redirect failed"."""
    store = tmp_path / "jetstream"
    server = EmbeddedNats(store_dir=store).start()
    port = int(server.url.rsplit(":", 1)[1])
    try:
        nc = await natsclient.connect(server.url, max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.1)
        s = Subjects(uniq)
        await ensure_intake_stream(nc.jetstream(), s)
        svc, task = await start_rankd(server.url, uniq, redirect_timeout_s=WAIT_S / 2)
        try:
            for i in range(N_TOKEN_HEAVY):
                a = assignment(f"q-{i}", tokens=[1000 + i] * TOKENS)
                await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
            await until(lambda: svc.core.running is not None)  # q-0 runs, the rest queued
            server.stop()
            await until(lambda: not svc.nc.is_connected)
            with structlog.testing.capture_logs() as logs:
                svc.request_stop()  # hands back q-1..q-7 while the connection is down

                def refused() -> bool:
                    return any("OutboundBufferLimitError" in str(e.get("error", ""))
                               for e in list(logs))

                await until(refused)  # the buffer was full for some
                server = EmbeddedNats(store_dir=store, port=port).start()
                await asyncio.wait_for(task, timeout=WAIT_S)
        finally:
            svc.request_stop()
            await asyncio.wait_for(task, timeout=WAIT_S)
        failed = [e for e in logs if e["event"] in ("redirect failed", "redirect outcome unknown",
                                                    "redirect outcome unknown at stop")]
        assert failed == []
        await until(lambda: nc.is_connected)
        js = nc.jetstream()
        info = await js.stream_info(s.intake_stream())
        assert info.state.messages == N_TOKEN_HEAVY - 1
        stored = [decode(IntakeRequest, (await js.get_msg(s.intake_stream(), seq)).data)
                  for seq in range(info.state.first_seq, info.state.last_seq + 1)]
        assert sorted(r.request_id for r in stored) == [f"q-{i}" for i in range(1, N_TOKEN_HEAVY)]
        await nc.close()
    finally:
        server.stop()
