"""The decode role's device: ``VTM_TORCH_DEVICE`` checked once at start-up (naming the setting),
the role's model put on the configured device, and KV received on another device (the hand-off
delivers CPU tensors) moved to the model's before use.

No GPU here: the CUDA checks run with ``torch.cuda``'s answers replaced, and the moving logic
with a model on ``meta`` (shapes and devices, no data); the CPU path runs end to end over a
real nats-server."""

from __future__ import annotations

import json

import pytest
import torch
from nats.aio.client import Client

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.cp_prefill import cp_prefill
from services.rankd.engine.decode import decode_logits, decode_step, kv_to_bytes, kv_to_device
from services.rankd.engine.device import check_device, decode_device
from services.rankd.engine.groups import local_group
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.torch_backend import (
    TINY_MODEL,
    NatsKVHandoff,
    TorchPool,
    TorchSettings,
    _decode_model,
)
from shared.ids import InvalidInput
from shared.subjects import Subjects

CFG = Qwen3Config(max_position_embeddings=40)
WAIT_S = 60.0  # a correctness bound (a lost transfer never answers), not a speed figure


# -- the setting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["tpu", "gpu", "CUDA", "cuda:0", "", None])
def test_a_device_that_is_neither_cpu_nor_cuda_is_refused_naming_the_setting(value) -> None:
    with pytest.raises(InvalidInput, match="VTM_TORCH_DEVICE must be 'cpu' or 'cuda'") as info:
        decode_device(value, range(0, 1))
    assert repr(value) in str(info.value)


def test_cuda_without_a_cuda_device_is_refused_naming_the_setting(cuda) -> None:
    with pytest.raises(InvalidInput, match="VTM_TORCH_DEVICE is cuda.*no CUDA device"):
        decode_device("cuda", range(0, 1))
    with pytest.raises(InvalidInput, match="--device is cuda"):
        check_device("cuda", "--device")


def test_cuda_needs_every_gpu_of_the_range(cuda) -> None:
    cuda[0] = 2
    with pytest.raises(InvalidInput, match=r"VTM_TORCH_DEVICE is cuda, but GPUs 2-3 .*is 2\)"):
        decode_device("cuda", range(2, 4))
    with pytest.raises(InvalidInput, match="GPUs 1-2"):
        decode_device("cuda", range(1, 3))


def test_the_decode_device_is_the_first_gpu_of_the_range_or_the_cpu(cuda) -> None:
    cuda[0] = 4
    assert decode_device("cuda", range(2, 4)) == torch.device("cuda", 2)
    assert decode_device("cuda", range(0, 4)) == torch.device("cuda", 0)
    assert decode_device("cpu", range(2, 4)) == torch.device("cpu")
    cuda[0] = 0
    assert decode_device("cpu", range(0, 1)) == torch.device("cpu")  # no CUDA needed


# -- moving the KV -------------------------------------------------------------------------------


def _kv(t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(t)
    shape = (t, CFG.num_key_value_heads, CFG.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
            for _ in range(CFG.num_hidden_layers)]


def test_kv_is_moved_to_another_device_and_kept_where_it_already_is() -> None:
    kv = _kv(5)
    moved = kv_to_device(kv, "meta")
    assert [(k.device.type, v.device.type) for k, v in moved] == [("meta", "meta")] * len(kv)
    assert [(k.shape, v.dtype) for k, v in moved] == [(k.shape, v.dtype) for k, v in kv]
    same = kv_to_device(kv, torch.device("cpu"))
    assert all(a is k and b is v for (a, b), (k, v) in zip(same, kv, strict=True))  # no copy


def test_decode_moves_cpu_kv_to_the_models_device() -> None:
    """The decode role's case: the hand-off's KV is on the CPU, the model on its device (a
    GPU; ``meta`` here). Before, the step concatenated the two and torch refused it."""
    model = Qwen3ForCausalLM.random(CFG, seed=2).to("meta")
    kv = _kv(7)
    logits, out = decode_logits(model, kv, 3)
    assert logits.device.type == "meta" and tuple(logits.shape) == (CFG.vocab_size,)
    assert all(k.device.type == v.device.type == "meta" for k, v in out)
    grown = (8, CFG.num_key_value_heads, CFG.head_dim)  # T + 1 rows
    assert [tuple(k.shape) for k, _ in out] == [grown] * len(kv)


def test_decode_on_the_cpu_is_unchanged_by_the_move() -> None:
    m = Qwen3ForCausalLM.random(CFG, seed=4)
    ids = torch.randint(0, CFG.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    pre = cp_prefill(m, local_group(), ids)
    d = decode_step(m, pre.full_kv(), pre.next_token)
    assert [pre.next_token, d.next_token] == m.greedy_generate(ids, 2)


# -- the embedded decode role --------------------------------------------------------------------


class _NoWorld:
    """The decode role needs no rank process: a pool whose world is never used."""

    def close(self) -> None:
        return None


def test_the_decode_model_is_built_on_the_given_device() -> None:
    ts = TorchSettings(model_json=json.dumps(CFG.to_dict()))
    assert _decode_model(ts).device.type == "cpu"
    assert _decode_model(ts, "meta").device.type == "meta"


async def test_the_embedded_role_puts_its_model_on_the_pools_decode_device(
    nc: Client, uniq: str
) -> None:
    pool = TorchPool(world=_NoWorld(), subjects=Subjects(uniq),  # type: ignore[arg-type]
                     settings=TorchSettings(handoff="nats"), decode_device="meta")
    role = await pool.start_decode_role(nc)
    try:
        assert role.model.device.type == "meta"
    finally:
        await pool.close()


async def test_prefill_kv_through_the_embedded_cpu_decode_role_over_nats(
    nc: Client, uniq: str
) -> None:
    """The CPU path end to end: the pool's role (its model built from the settings, on the
    checked device) decodes KV handed over in chunks on a real nats-server, and answers the
    token the reference model generates."""
    ts = TorchSettings(handoff="nats", model_json=json.dumps(TINY_MODEL), seed=5)
    on = str(decode_device(ts.device, range(0, 1)))
    pool = TorchPool(world=_NoWorld(), subjects=Subjects(uniq),  # type: ignore[arg-type]
                     settings=ts, decode_device=on)
    role = await pool.start_decode_role(nc)
    handoff = NatsKVHandoff(nc, Subjects(uniq), timeout_s=WAIT_S)
    ref = Qwen3ForCausalLM.random(Qwen3Config.from_dict(TINY_MODEL), seed=5)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (600,),
                        generator=torch.Generator().manual_seed(6))
    try:
        assert on == "cpu" and role.model.device.type == "cpu"
        pre = cp_prefill(ref, local_group(), ids)
        blob = kv_to_bytes(pre.full_kv(), {"token": pre.next_token, "length": len(ids)})
        out = await handoff.transfer("r1", blob)
        assert out.via == "nats" and out.chunks >= 1
        assert [pre.next_token, out.token] == ref.greedy_generate(ids, 2)
        assert role.served == 1
    finally:
        await pool.close()
