"""rankd over the torch backend, a worker whose ranks are still in another geometry: its
first prefill switches them (a lazy merge, 1 + 1 → 2) before computing. The switch is queue
wait in the trace as in the FirstToken's breakdown: an ``epoch_switch`` span inside
``queue_wait`` lasting the engine's measured switch, and the ``prefill`` span starting where
it ends, lasting the measured step."""

from __future__ import annotations

import pytest
from engine_live_support import assignment
from nats.aio.client import Client
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service_support import service_running

from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from services.rankd.torch_backend import TINY_MODEL, TorchBackend
from services.rankd.torch_world import TorchWorld, WorldSpec
from shared.natsserver import EmbeddedNats
from shared.schemas import AssignmentAck, FirstToken, decode
from shared.service import call
from shared.subjects import Subjects

WAIT_S = 120.0  # hang guard only
CFG = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": 512}
TRACE, ROOT = "8bf92f3577b34da6a3ce929d0e0e4736", "30f067aa0ba902b7"


async def test_a_lazy_switch_is_queue_wait_and_the_prefill_span_starts_after_it(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    s = Subjects(uniq)
    spec = WorldSpec(world_size=2, degrees=(1, 2), initial_degrees=(1, 1), model_config=CFG,
                     seed=5, block_size=16, pages_per_rank=64)
    with TorchWorld(spec) as world:
        backend = TorchBackend(world, "w-cp2-g0")  # does not own the world
        settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq,
                                 worker_id="w-cp2-g0", epoch=1, drain_timeout_s=10)
        async with service_running(RankdService(settings, backend), timeout_s=WAIT_S):
            a = assignment("m-0", "w-cp2-g0", list(range(5, 40)), epoch=1)
            a = a.model_copy(update={"request": a.request.model_copy(
                update={"trace_context": {"traceparent": f"00-{TRACE}-{ROOT}-01"}})})
            sub = await nc.subscribe(s.result("m-0"))
            await call(nc, s.worker_assign("w-cp2-g0"), a, AssignmentAck, timeout_s=WAIT_S)
            ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
        assert ft.error is None and ft.stages is not None
        out = backend.outcomes["m-0"]
        assert len(out.switches) == 2 and out.switch_wall_s > 0  # both ranks merged here
        got = {x.name: x for x in spans.get_finished_spans()
               if format(x.context.trace_id, "032x") == TRACE}
        wait, switch, prefill = got["queue_wait"], got["epoch_switch"], got["prefill"]
        assert switch.parent is not None and switch.parent.span_id == wait.context.span_id
        assert switch.end_time == prefill.start_time == wait.end_time
        # Epoch seconds as floats carry ~0.2 µs: the spans' ends are that exact.
        assert (switch.end_time - switch.start_time) / 1e9 == pytest.approx(
            out.switch_wall_s, abs=1e-5)
        assert wait.attributes["vtm.epoch_switch_s"] == out.switch_wall_s
        assert (prefill.end_time - prefill.start_time) / 1e9 == pytest.approx(
            ft.stages.prefill_s, abs=1e-5)
        assert (wait.end_time - wait.start_time) / 1e9 == pytest.approx(
            ft.stages.queue_wait_s, abs=1e-5)
