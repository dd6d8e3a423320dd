"""rankd's pull hold and a cache command it refuses, on a real server (sim backend): a
replicate command of the held request's blocks that the worker refuses (a newer epoch's, or
another worker's) brings nothing, so the hold must not count it as a copy of its blocks --
neither link to its ``cache-cmd`` span (``cache_pull_wait``'s links, ``vtm.pull_copies``) nor
link that span to the request's root.

Before, a copy was registered as arriving (and linked to the held request both ways) before
the worker checked it: a refused command changed the held request's trace as a copy that
brought its prefix would."""

from __future__ import annotations

import time

import pytest
from nats.aio.client import Client
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rankd_support import stage_spans, until
from service_support import service_running

from services.rankd.backend import SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    CacheCommandResult,
    FirstToken,
    IntakeRequest,
    ReplicateCommand,
    decode,
)
from shared.service import RemoteError, call
from shared.subjects import Subjects

WID = "w-cp2-g2"
WAIT_S = 20.0  # hang guard only; nothing asserts on speed
ROOT_SPAN = "10f067aa0ba902b7"
TRACE = f"{0x61:032x}"


def held(rid: str) -> Assignment:
    """Two full blocks ([1, 2], blocks of 512) priced with P = 512 counting on a copy whose
    hold is capped far off (it waits for the copy), traced under :data:`TRACE`."""
    now = time.time()
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=1024, block_hashes=[1, 2],
                              arrival_s=now - 0.01,
                              trace_context={"traceparent": f"00-{TRACE}-{ROOT_SPAN}-01"}),
        worker_id=WID, epoch=0, degree=2, prefix_tokens=512, recompute_tokens=512,
        predicted_s=0.01, assigned_at_s=now, pull_copy_s=60.0,
    )


@pytest.mark.parametrize("refused", [
    ReplicateCommand(command_id="c-new", worker_id=WID, epoch=5, blocks=[1],
                     source_worker="w-cp2-g0"),
    ReplicateCommand(command_id="c-other", worker_id="w-cp2-g0", epoch=0, blocks=[1],
                     source_worker="w-cp2-g4"),
], ids=["newer-epoch", "another-worker"])
async def test_a_refused_copy_is_not_linked_to_the_held_request(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter,
    refused: ReplicateCommand,
) -> None:
    s = Subjects(uniq)
    svc = RankdService(RankdSettings(nats_url=nats_server.url, subject_prefix=uniq,
                                     worker_id=WID, heartbeat_s=0.2), SimBackend())
    async with service_running(svc, timeout_s=WAIT_S):
        sub = await nc.subscribe(s.result("held"))
        await call(nc, s.worker_assign(WID), held("held"), AssignmentAck, timeout_s=WAIT_S)
        await until(lambda: svc._holding is not None, "the request held for its pull")
        with pytest.raises(RemoteError):
            await call(nc, s.cache_cmd(WID), refused, CacheCommandResult, timeout_s=WAIT_S)
        good = ReplicateCommand(command_id="c-good", worker_id=WID, epoch=0, blocks=[1],
                                source_worker="w-cp2-g0")
        assert (await call(nc, s.cache_cmd(WID), good, CacheCommandResult,
                           timeout_s=WAIT_S)).ok
        ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
    assert ft.error is None and ft.prefix_tokens == 512
    got = await stage_spans(spans, TRACE, {"queue_wait", "cache_pull_wait", "prefill"})
    cmds = {x.attributes["vtm.command_id"]: x for x in spans.get_finished_spans()
            if x.name.endswith(".cache-cmd")}
    assert set(cmds) == {refused.command_id, "c-good"}
    pull = got["cache_pull_wait"]
    assert [x.context.span_id for x in pull.links] == [cmds["c-good"].context.span_id]
    assert pull.attributes["vtm.pull_copies"] == 1
    assert list(cmds[refused.command_id].links) == []
