"""The live rankd with ``backend=torch`` in host mode: a RankdHost over GPUs 0-1 whose workers
are TorchBackends on one persistent gloo world, following epoch records through a real
nats-server: assignments in over the micro endpoint, FirstTokens out, KV to the decode role
over ``{prefix}.kv.{rid}``; split 2 → 1 + 1 and merge back with the same rank processes."""

from __future__ import annotations

import asyncio
import json

import torch
from engine_live_support import assignment, first_token, host_settings, record, until_workers
from nats.aio.client import Client
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service_support import service_running

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from services.rankd.torch_backend import (
    TINY_MODEL,
    TorchSettings,
    single_worker_backend,
    start_torch_host,
)
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    AssignmentAck,
    FirstToken,
    WorkerState,
    decode,
    from_json,
)
from shared.service import call
from shared.subjects import Subjects
from shared.telemetry import Stage

WAIT_S = 120.0  # hang guard only
# The project's tiny random Qwen3 (TINY_MODEL), with a smaller vocabulary and context.
CFG = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": 512}
SEED = 3


async def test_rankd_host_torch_split_merge(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    settings = host_settings(nats_server.url, uniq, "w-cp2-g0")
    ts = TorchSettings(
        model_json=json.dumps(CFG),
        seed=SEED,
        block_size=16,
        pages_per_rank=64,
        degrees="1,2",
        decode_timeout_s=WAIT_S,
    )
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(CFG), seed=SEED)
    host, pool = await start_torch_host(settings, ts, nc=nc)
    task = asyncio.create_task(host.run(nc, handle_signals=False))
    pids = pool.world.pids

    async def run(rid: str, wid: str, epoch: int, tokens: list[int]) -> FirstToken:
        return await first_token(nc, s, assignment(rid, wid, tokens, epoch=epoch), WAIT_S)

    def ids(seed: int, n: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist()

    def expect(tokens: list[int]) -> int:
        return model.reference_forward(torch.tensor(tokens)).next_token

    try:
        await until_workers(host, {"w-cp2-g0"}, WAIT_S)
        t = ids(1, 41)
        first = await run("a-0", "w-cp2-g0", 0, t)
        assert first.error is None and first.token == expect(t)
        assert first.stages is not None and first.stages.prefill_s > 0

        bad = await run("a-bad", "w-cp2-g0", 0, [1, 2, 999, 3])
        assert bad.token is None and "outside the vocabulary" in (bad.error or "")

        epochs = await nc.jetstream().key_value(s.epoch_bucket())
        await epochs.put(s.epoch_key(), record(1, "w-cp1-g0", "w-cp1-g1"))
        await until_workers(host, {"w-cp1-g0", "w-cp1-g1"}, WAIT_S)
        for rid, wid, seed in (("b-0", "w-cp1-g0", 2), ("b-1", "w-cp1-g1", 3)):
            t = ids(seed, 33)
            ft = await run(rid, wid, 1, t)
            assert ft.error is None and ft.token == expect(t), (rid, ft)

        await epochs.put(s.epoch_key(), record(2, "w-cp2-g0"))
        await until_workers(host, {"w-cp2-g0"}, WAIT_S)
        t = ids(4, 57)
        ft = await run("c-0", "w-cp2-g0", 2, t)
        assert ft.error is None and ft.token == expect(t)
        assert pool.world.pids == pids and all(pool.world.alive())
        assert [pool.world.geometry(r) for r in (0, 1)] == [(2, 2), (2, 2)]
        assert pool.decode_role is not None and pool.decode_role.served == 4
    finally:
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
        await pool.close()
    assert not any(pool.world.alive())


async def test_rankd_single_worker_torch(nats_server: EmbeddedNats, nc: Client, uniq: str,
                                        spans: InMemorySpanExporter) -> None:
    """``backend=torch`` for one worker (no host mode): the backend owns its world and its
    decode role; closing the service stops the rank processes. Each rank's ``prefill_rank``
    span lasts that rank's measured compute (the engine's time on that rank)."""
    s = Subjects(uniq)
    settings = RankdSettings(
        nats_url=nats_server.url, subject_prefix=uniq, worker_id="w-cp2-g0", drain_timeout_s=10
    )
    ts = TorchSettings(
        model_json=json.dumps(CFG), seed=SEED, degrees="1,2", decode_timeout_s=WAIT_S
    )
    backend = await asyncio.to_thread(single_worker_backend, settings, ts)
    world = backend.world
    svc = RankdService(settings, backend)
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(CFG), seed=SEED)
    async with service_running(svc, nc, timeout_s=WAIT_S):
        tokens = list(range(5, 70))
        sub = await nc.subscribe(s.result("s-0"))
        await call(
            nc,
            s.worker_assign("w-cp2-g0"),
            assignment("s-0", "w-cp2-g0", tokens),
            AssignmentAck,
            timeout_s=WAIT_S,
        )
        ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
        assert ft.error is None
        assert ft.token == model.reference_forward(torch.tensor(tokens)).next_token
        # The worker-state bucket tells the scheduler its prompt limit: the model's positions
        # less the one the hand-off's first decoded token takes.
        kv = await nc.jetstream().key_value(s.worker_state_bucket())
        state = from_json(WorkerState, (await kv.get("w-cp2-g0")).value)
        assert state.max_seq_len == CFG["max_position_embeddings"] - 1
        out = backend.outcomes["s-0"]
        assert out.handoff is not None and out.handoff.via == "nats"
        assert out.decode_token == model.greedy_generate(torch.tensor(tokens), 2)[1]
        finished = spans.get_finished_spans()
        prefill = next(x for x in finished if x.name == str(Stage.PREFILL)
                       and x.attributes.get("vtm.request_id") == "s-0")
        ranks = sorted((x for x in finished if x.name == str(Stage.PREFILL_RANK)
                        and x.attributes.get("vtm.request_id") == "s-0"),
                       key=lambda x: x.attributes["vtm.rank"])
        assert [x.attributes["vtm.rank_compute_s"] for x in ranks] == list(out.engine_s)
        for x in ranks:
            assert x.attributes["vtm.rank_measured"] is True
            assert x.parent.span_id == prefill.context.span_id
            # Epoch seconds as floats carry ~0.2 µs: the span's ends are that exact.
            compute_ns = x.attributes["vtm.rank_compute_s"] * 1e9
            assert x.end_time - x.start_time <= compute_ns + 1000
            assert x.end_time <= prefill.end_time
    assert not any(world.alive())
