"""rankd never finishes a request without answering it, on a real server: whatever fails in
a job's bookkeeping outside the backend's prefill (its span, the making of its FirstToken)
answers the request -- and the later attempts that joined it -- with an error FirstToken, as
a failed prefill does. And a token id no message can carry is refused at the boundary (400)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Callable

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import ValidationError
from service_support import service_running

from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.service import RankdService, request_content
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    MAX_TOKEN_ID,
    Assignment,
    AssignmentAck,
    CompletionRequest,
    FirstToken,
    IntakeRequest,
    decode,
)
from shared.service import RemoteError, call
from shared.subjects import Subjects

WID = "w-cp2-g2"
WAIT_S = 20.0  # bound for correctness waits only; nothing asserts on speed


def assignment(rid: str, *, arrival: float | None = None) -> Assignment:
    now = time.time()
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=1024, block_hashes=[1, 2],
                              arrival_s=arrival if arrival is not None else now - 0.01),
        worker_id=WID, epoch=0, degree=2, prefix_tokens=512, recompute_tokens=512,
        predicted_s=0.2, dequeued_at_s=now - 0.005, assigned_at_s=now,
    )


def reattempt(a: Assignment, arrival: float) -> Assignment:
    """A later attempt of ``a``'s request (same id, same content), arrived at ``arrival``."""
    return a.model_copy(update={"request": a.request.model_copy(update={"arrival_s": arrival})})


class BadResults(SimBackend):
    """The sim backend whose result for a request named ``bad-*`` is spoiled by ``spoil``
    (a broken engine's result: a token that is no integer, a NaN duration); each prefill
    waits for ``release`` (set by default)."""

    def __init__(self, spoil: Callable[[PrefillResult], PrefillResult], **kw: object) -> None:
        super().__init__(prefill_time=lambda r, p, c, kind="cp": 0.01, time_scale=1.0,
                         **kw)  # type: ignore[arg-type]
        self.spoil = spoil
        self.release = asyncio.Event()
        self.release.set()

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        await self.release.wait()
        result = await super().prefill(assignment)
        if assignment.request.request_id.startswith("bad-"):
            return self.spoil(result)
        return result


@contextlib.asynccontextmanager
async def running_rankd(url: str, prefix: str, backend: SimBackend) -> AsyncIterator[RankdService]:
    settings = RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=WID,
                             heartbeat_s=0.2)
    svc = RankdService(settings, backend)
    async with service_running(svc, timeout_s=WAIT_S):
        yield svc


async def answers(nc: Client, subject: str) -> tuple[object, list[FirstToken]]:
    got: list[FirstToken] = []

    async def cb(msg: Msg) -> None:
        got.append(decode(FirstToken, msg.data, msg.headers))

    return await nc.subscribe(subject, cb=cb), got


async def until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not cond():
            await asyncio.sleep(0.01)


async def all_sent(svc: RankdService, nc: Client) -> None:
    """Every answer ``svc`` sends has gone out and reached ``nc``'s client."""
    await until(lambda: not svc._handoffs and svc.core.running is None)
    await svc.nc.flush()
    await nc.flush()


SPOILS: dict[str, tuple[Callable[[PrefillResult], PrefillResult], str]] = {
    # After the core finished the job: the FirstToken cannot be made.
    "token-no-integer": (lambda r: dataclasses.replace(r, token=1.5),  # type: ignore[arg-type]
                         "request bookkeeping failed"),
    # Before it: the backend's times are refused (check_result_times), as no stage, span or
    # metric can hold them -- the prefill failed.
    "nan-prefill": (lambda r: dataclasses.replace(r, prefill_s=math.nan),
                    "prefill_s=nan, not a finite number"),
    "inf-handoff": (lambda r: dataclasses.replace(r, kv_transfer_s=math.inf),
                    "kv_transfer_s=inf, not a finite number"),
    "str-prefill": (lambda r: dataclasses.replace(r, prefill_s="0.1"),  # type: ignore[arg-type]
                    "prefill_s='0.1', not a finite number"),
}


@pytest.mark.parametrize("spoil", sorted(SPOILS))
async def test_a_job_whose_bookkeeping_fails_is_answered_with_an_error(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spoil: str
) -> None:
    """The backend's result for x makes no FirstToken (or has times no stage can hold): x
    and the later attempt that joined x's job are each answered once with an error, stamped
    for it; the worker serves on (the next request gets its token). Before, the job was
    finished with nobody answered ("request bookkeeping failed" logged), and a re-sent
    assignment was acked as done and never ran."""
    spoiled, why = SPOILS[spoil]
    backend = BadResults(spoiled)
    backend.release.clear()  # x waits in its prefill until its later attempt joined it
    s = Subjects(uniq)
    async with running_rankd(nats_server.url, uniq, backend) as svc:
        sub, results = await answers(nc, s.result("bad-x"))
        first = assignment("bad-x", arrival=time.time() - 1.0)
        later = reattempt(first, first.request.arrival_s + 0.5)
        for a in (first, later):
            await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
        backend.release.set()
        await until(lambda: len(results) >= 2)
        await all_sent(svc, nc)
        assert sorted((r.arrival_s, r.token) for r in results) == [
            (first.request.arrival_s, None), (later.request.arrival_s, None)]
        assert all(why in (r.error or "") for r in results)
        _, fine = await answers(nc, s.result("ok-y"))
        await call(nc, s.worker_assign(WID), assignment("ok-y"), AssignmentAck,
                   timeout_s=WAIT_S)
        await until(lambda: len(fine) >= 1)
        assert fine[0].error is None and fine[0].token is not None
        await all_sent(svc, nc)
        assert len(results) == 2
        await sub.unsubscribe()


async def test_a_first_token_that_cannot_be_made_after_the_handoff_is_answered_with_an_error(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """The KV handoff runs off the worker (its first token is sent by a task of its own once
    the handoff is over): a result that makes no FirstToken is answered with an error there.
    Before, that task logged "first token publish failed" and answered nobody."""
    backend = BadResults(SPOILS["token-no-integer"][0], handoff_time=lambda tokens, c: 0.2,
                         handoff_off_worker=True)
    s = Subjects(uniq)
    async with running_rankd(nats_server.url, uniq, backend) as svc:
        sub, results = await answers(nc, s.result("bad-h"))
        await call(nc, s.worker_assign(WID), assignment("bad-h"), AssignmentAck,
                   timeout_s=WAIT_S)
        await until(lambda: svc.core.answered("bad-h"))
        await until(lambda: len(results) >= 1)
        await all_sent(svc, nc)
        assert [(r.token, "first token not sent" in (r.error or "")) for r in results] == [
            (None, True)]
        await sub.unsubscribe()


def test_token_ids_are_bounded_to_32_bits() -> None:
    """A token id is an unsigned 32-bit id: 2**32 - 1 passes, 2**32 and more (2**64 used to
    pass, and failed msgpack after the request had run) are refused by the schema, in the
    intake's request and in the client's."""
    assert MAX_TOKEN_ID == 2**32 - 1
    IntakeRequest(request_id="r", input_len=2, tokens=[0, MAX_TOKEN_ID], arrival_s=1.0)
    CompletionRequest(prompt_tokens=[0, MAX_TOKEN_ID])
    for bad in (2**32, 2**64):
        with pytest.raises(ValidationError, match="tokens"):
            IntakeRequest(request_id="r", input_len=2, tokens=[1, bad], arrival_s=1.0)
        with pytest.raises(ValidationError, match="prompt_tokens"):
            CompletionRequest(prompt_tokens=[1, bad])


def test_the_content_digest_never_raises() -> None:
    """What a worker digests of a prompt takes any schema-valid request: ``max_tokens`` and
    ``block_size`` have no upper bound, and one beyond msgpack's integers is digested all the
    same (equal for equal content, different for other content)."""
    def req(max_tokens: int) -> IntakeRequest:
        return IntakeRequest(request_id="r", input_len=4, arrival_s=1.0, max_tokens=max_tokens)

    assert request_content(req(2**64)) == request_content(req(2**64))
    assert request_content(req(2**64)) != request_content(req(2**64 + 1))
    assert request_content(req(2**64)) != request_content(req(1))


async def test_an_assignment_with_a_token_id_beyond_32_bits_is_refused_400(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """An assignment whose prompt has a token id of 2**64 (sent as JSON, as any client may)
    is refused 400 and admits nothing. Before, it was admitted, ran, and its answer's making
    failed (OverflowError): nobody answered."""
    s = Subjects(uniq)
    async with running_rankd(nats_server.url, uniq, BadResults(lambda r: r)) as svc:
        body = assignment("big-tok").model_dump(mode="json")
        body["request"]["tokens"] = [7] * 1023 + [2**64]
        body["request"]["block_hashes"] = []
        with pytest.raises(RemoteError) as err:
            await call(nc, s.worker_assign(WID), json.dumps(body).encode(), AssignmentAck,
                       timeout_s=WAIT_S)
        assert err.value.code == 400
        assert "tokens" in err.value.description
        assert len(svc.core) == 0 and not svc.core.answered("big-tok")
