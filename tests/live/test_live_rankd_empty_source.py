"""An assignment whose intake message id header (``Vtm-Intake-Msg-Id``) is present but empty,
on a real nats-server with a real RankdService (sim backend held by a gate): it is an
assignment without a source, as the scheduler itself takes an empty ``Nats-Msg-Id`` for none
(it sends the request id then). So when the worker hands such requests back, each goes to
intake under an id of its own (``{request}-r{epoch}-{worker}``) and intake stores every one.

Before, the empty string was kept as the source: every such request's hand-back had the one
id ``>{worker}`` (``handback_msg_id``), so intake stored the first and dropped the others as
duplicates -- which the worker took for acknowledgements: requests lost, and nobody told."""

from __future__ import annotations

import time

from gated_backend import GatedBackend
from nats.aio.client import Client
from rankd_support import WAIT_S, handed_back, plain_assignment, until
from service_support import service_running

from services.rankd.core import INTAKE_MSG_HEADER
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import AssignmentAck, EpochRecord, EpochWorker, to_json
from shared.service import call, ensure_intake_stream
from shared.subjects import Subjects
from shared.worker import GpuGroup, Lifecycle

WID = "w-cp2-g2"


async def test_requests_with_an_empty_intake_message_id_are_all_handed_back(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    backend = GatedBackend()
    svc = RankdService(RankdSettings(nats_url=nats_server.url, subject_prefix=uniq,
                                     worker_id=WID, heartbeat_s=0.2), backend)
    try:
        async with service_running(svc, timeout_s=WAIT_S):
            for rid in ("q-1", "a", "b"):
                await call(nc, s.worker_assign(WID), plain_assignment(rid, WID), AssignmentAck,
                           timeout_s=WAIT_S, headers={INTAKE_MSG_HEADER: ""})
                await until(lambda: svc.core.running is not None, "q-1 running")
            g = GpuGroup.from_worker_id(WID)
            epochs = await js.key_value(s.epoch_bucket())
            await epochs.put(s.epoch_key(), to_json(EpochRecord(
                epoch=1, committed_at_s=time.time(), workers=[EpochWorker(
                    worker_id=WID, first_gpu=g.first_gpu, degree=g.degree,
                    lifecycle=Lifecycle.DRAINING)])))
            got = await handed_back(js, s, 2)
            backend.gate.set()
    finally:
        backend.gate.set()
    assert got == {"a": f"a-r1-{WID}", "b": f"b-r1-{WID}"}
