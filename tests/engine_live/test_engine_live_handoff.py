"""The KV hand-off over a real nats-server with more than one decode role in the queue group
(each torch rank-daemon process embeds one): a transfer of many chunks is served whole by one
role, whichever first chunk reached it."""

from __future__ import annotations

import torch
from nats.aio.client import Client

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.decode import decode_step, kv_to_bytes
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.settings import RankdSettings
from services.rankd.torch_backend import (
    TINY_MODEL,
    KVDecodeRole,
    NatsKVHandoff,
    service_connect_options,
)
from shared.natsserver import EmbeddedNats
from shared.subjects import Subjects

T = 8192  # tokens of KV: ~4 MiB in float32, so 9 chunks of at most 512 KiB
CFG = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": T + 8}
WAIT_S = 60.0  # a correctness bound (a lost transfer never answers), not a speed figure


async def test_a_multi_chunk_transfer_is_served_by_one_of_several_decode_roles(
    nc: Client, uniq: str
) -> None:
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(CFG), seed=3)
    subjects = Subjects(uniq)
    roles = [KVDecodeRole(model, subjects) for _ in range(3)]
    for role in roles:
        await role.start(nc)
    handoff = NatsKVHandoff(nc, subjects, timeout_s=WAIT_S)
    g = torch.Generator().manual_seed(0)
    shape = (T, CFG["num_key_value_heads"], CFG["head_dim"])
    kv = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
          for _ in range(CFG["num_hidden_layers"])]
    try:
        for i in range(3):
            blob = kv_to_bytes(kv, {"request_id": f"r{i}", "token": 5, "length": T})
            out = await handoff.transfer(f"r{i}", blob)
            assert out.chunks > 4 and out.via == "nats"
            assert out.token == decode_step(model, kv, 5).next_token
        assert sum(r.served for r in roles) == 3
        assert all(r._asm.blobs.pending == 0 for r in roles)  # no half transfer left behind
    finally:
        for role in roles:
            await role.stop()


async def test_the_pools_own_connections_reconnect_for_ever_and_ping(
    nats_server: EmbeddedNats, uniq: str
) -> None:
    """The KV hand-off's own connection (and the embedded decode role's, made from the same
    options: start_torch_host, single_worker_backend) is a service's: it reconnects for ever
    and pings every VTM_PING_INTERVAL_S. Before, it took only the credentials, so nats-py's
    defaults closed it for good after two minutes of a lost broker (every hand-off failing
    until the process restarted) and noticed a silent broker only after six."""
    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq,
                             ping_interval_s=3.0, max_outstanding_pings=4)
    handoff = NatsKVHandoff(None, Subjects(uniq), servers=[nats_server.url],
                            connect_options=service_connect_options(settings))
    conn = await handoff._conn()
    try:
        assert conn.is_connected
        assert (conn.options["ping_interval"], conn.options["max_outstanding_pings"],
                conn.options["max_reconnect_attempts"]) == (3.0, 4, -1)
    finally:
        await conn.close()
