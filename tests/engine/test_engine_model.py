"""Single-process checks of the model, checkpoint IO, zigzag plan, kernels and block hashes."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rankd.engine.attention import masked_attention, zigzag_attention
from services.rankd.engine.checkpoint import load_model, load_tokenizer, save_model
from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.errors import CheckpointError, SequenceTooLong, TokenOutOfVocab
from services.rankd.engine.model import Qwen3ForCausalLM, reference_attention
from services.rankd.engine.zigzag import ZigzagPlan
from shared.blockhash import HASH_MASK, chain_hashes
from shared.ids import InvalidInput

CFG = Qwen3Config(max_position_embeddings=64)
MOE = Qwen3Config(
    num_experts=4, num_experts_per_tok=2, mlp_only_layers=(0,), max_position_embeddings=64
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_prefix_cached_forward_equals_full_forward(cfg: Qwen3Config) -> None:
    m = Qwen3ForCausalLM.random(cfg, seed=3, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(0))
    full = m.reference_forward(ids)
    for p in (1, 8, 11):
        a = m.reference_forward(ids[:p])
        b = m.reference_forward(ids[p:], a.new_kv)
        assert rel(b.hidden, full.hidden[p:]) < 1e-12
        assert b.next_token == full.next_token
        for (k1, v1), (k2, v2) in zip(b.new_kv, full.new_kv, strict=True):
            assert rel(k1, k2[p:]) < 1e-12 and rel(v1, v2[p:]) < 1e-12


def test_moe_layers_follow_hf_rule() -> None:
    m = Qwen3ForCausalLM(MOE)
    assert type(m.model.layers[0].mlp).__name__ == "Qwen3MLP"
    assert type(m.model.layers[1].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in m.state_dict()
    assert "model.layers.1.mlp.gate.weight" in m.state_dict()


def test_greedy_generate_matches_full_recompute() -> None:
    m = Qwen3ForCausalLM.random(CFG, seed=1, dtype=torch.float64)
    ids = torch.arange(3, 12)
    toks = m.greedy_generate(ids, 3)
    assert len(toks) == 3  # the loop below checks each of them
    seq = ids.tolist()
    for t in toks:
        assert m.reference_forward(torch.tensor(seq)).next_token == t
        seq.append(t)


def test_bad_inputs_raise_typed_errors() -> None:
    m = Qwen3ForCausalLM.random(CFG, dtype=torch.float32)
    with pytest.raises(TokenOutOfVocab):
        m.reference_forward(torch.tensor([1, CFG.vocab_size]))
    with pytest.raises(TokenOutOfVocab):
        m.reference_forward(torch.tensor([-1, 2]))
    with pytest.raises(SequenceTooLong):
        m.reference_forward(torch.zeros(65, dtype=torch.int64))
    with pytest.raises(InvalidInput):
        m.reference_forward(torch.zeros(0, dtype=torch.int64))
    with pytest.raises(InvalidInput):
        m.reference_forward(torch.zeros(3))
    assert m.reference_forward(torch.tensor([1, 2])).logits.isfinite().all()


@pytest.mark.parametrize("tie", [False, True])
def test_checkpoint_round_trip(tmp_path, tie: bool) -> None:
    cfg = Qwen3Config(tie_word_embeddings=tie, num_experts=2, num_experts_per_tok=1)
    m = Qwen3ForCausalLM.random(cfg, seed=2)
    save_model(m, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"
    m2 = load_model(tmp_path)
    ids = torch.arange(7)
    assert torch.equal(m.reference_forward(ids).logits, m2.reference_forward(ids).logits)
    assert load_model(tmp_path, dtype=torch.float64).dtype == torch.float64


def test_malformed_checkpoint_dirs(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type"):
        load_model(tmp_path)
    bad = CFG.to_dict() | {"num_key_value_heads": 3}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="multiple"):
        load_model(tmp_path)
    # What the engine does not implement is refused, not ignored (other logits than HF's).
    for extra, needle in (({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
                          ({"use_sliding_window": True}, "use_sliding_window")):
        (tmp_path / "config.json").write_text(json.dumps(CFG.to_dict() | extra))
        with pytest.raises(CheckpointError, match=needle):
            load_model(tmp_path)
    # As Qwen3's own config.json states them: off.
    plain = Qwen3Config.from_dict(CFG.to_dict() | {"rope_scaling": None,
                                                   "use_sliding_window": False})
    assert plain == CFG
    save_model(Qwen3ForCausalLM.random(CFG), tmp_path)
    st_file = tmp_path / "model.safetensors"
    sd = load_file(str(st_file))
    good = dict(sd)
    sd.pop("model.layers.1.self_attn.k_norm.weight")
    save_file(sd, str(st_file))
    with pytest.raises(CheckpointError, match="missing tensors.*k_norm"):
        load_model(tmp_path)
    sd = dict(good)
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, str(st_file))
    with pytest.raises(CheckpointError, match="q_proj.weight has shape"):
        load_model(tmp_path)
    sd = dict(good) | {"model.extra.weight": torch.zeros(1)}
    save_file(sd, str(st_file))
    with pytest.raises(CheckpointError, match="unexpected"):
        load_model(tmp_path)
    st_file.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_model(tmp_path)
    st_file.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_tokenizer_json_is_loaded_when_present(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert load_tokenizer(tmp_path) is None
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("hello world").ids == [1, 2]
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError):
        load_tokenizer(tmp_path)


@settings(max_examples=60, deadline=None)
@given(r=st.integers(1, 40), c=st.sampled_from([1, 2, 4, 8]))
def test_zigzag_plan_is_a_balanced_permutation(r: int, c: int) -> None:
    plan = ZigzagPlan(r, c)
    assert plan.r_pad % (2 * c) == 0 and plan.r_pad - r < 2 * c
    g = plan.gather_offsets()
    assert sorted(g.tolist()) == list(range(plan.r_pad))
    assert torch.equal(g[plan.restore_index()], torch.arange(plan.r_pad))
    for k in range(c):
        a, b = plan.chunks(k)
        assert a + b == 2 * c - 1
        assert plan.offsets(k).numel() == 2 * plan.chunk


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("p,r,c", [(0, 9, 2), (5, 7, 2), (3, 2, 4), (13, 17, 4), (6, 5, 1)])
def test_zigzag_attention_equals_plain_attention(dtype, tol, p, r, c) -> None:
    g = torch.Generator().manual_seed(p * 100 + r)
    plan = ZigzagPlan(r, c)
    q = torch.randn(plan.r_pad, 4, 8, generator=g, dtype=dtype)
    k = torch.randn(p + plan.r_pad, 2, 8, generator=g, dtype=dtype)
    v = torch.randn(p + plan.r_pad, 2, 8, generator=g, dtype=dtype)
    q_pos = torch.arange(p, p + plan.r_pad)
    ref = reference_attention(q, k, v, q_pos, torch.arange(p + plan.r_pad), 0.3)
    for rank in range(c):
        off = plan.offsets(rank)
        out = zigzag_attention(q[off], k[:p], v[:p], k[p:], v[p:], plan, rank, p, 0.3)
        assert rel(out, ref[off]) < tol


def test_sdpa_is_causal_would_be_wrong_with_a_prefix() -> None:
    # Rule 6: is_causal=True aligns top-left; our mask aligns bottom-right.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(7, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(7, 2, 8, generator=g, dtype=torch.float64)
    ours = masked_attention(q, k, v, torch.arange(4, 7), torch.arange(7), 0.3)
    ref = reference_attention(q, k, v, torch.arange(4, 7), torch.arange(7), 0.3)
    top_left = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.3
    ).transpose(0, 1)
    assert rel(ours, ref) < 1e-12
    assert rel(top_left, ref) > 1e-3


def test_chain_hashes_contract() -> None:
    toks = list(range(100, 123))
    h = chain_hashes(toks, 4)
    assert len(h) == 5 and all(0 <= x <= HASH_MASK for x in h)
    assert chain_hashes(toks[:8], 4) == h[:2]  # a prefix's hashes are a prefix
    assert chain_hashes(toks[8:20], 4, parent=h[1]) == h[2:5]  # suffix chained on its parent
    other = toks.copy()
    other[1] += 1
    assert all(
        a != b for a, b in zip(chain_hashes(other, 4), h, strict=True)
    )  # chained: all differ
    # Golden value pins the byte layout shared with the gateway: blake2b-64 over the parent's
    # 8 LE bytes (zeros at the root) + int32 LE tokens, top bit cleared.
    assert chain_hashes([1, 2, 3, 4], 4) == [658132497017838498]
    # The chaining, from hashlib directly (an independent oracle of the layout above).
    parent, want = 0, []
    for i in range(0, 20, 4):
        digest = hashlib.blake2b(struct.pack("<Q", parent) + struct.pack("<4i", *toks[i:i + 4]),
                                 digest_size=8).digest()
        parent = int.from_bytes(digest, "little") & ((1 << 63) - 1)
        want.append(parent)
    assert h == want
    assert chain_hashes([1, 2, 3], 4) == []
    with pytest.raises(InvalidInput):
        chain_hashes(toks, 0)
