"""Decode role and KV hand-off serialisation (single process)."""

from __future__ import annotations

import threading

import pytest
import torch

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.cp_prefill import cp_prefill
from services.rankd.engine.decode import (
    MAX_CHUNK_BYTES,
    ChunkedBytesTransport,
    ChunkReassembler,
    InProcessTransport,
    decode_kv_chunks,
    decode_step,
    encode_kv_chunks,
    parse_chunk,
)
from services.rankd.engine.errors import KVFormatError, SequenceTooLong
from services.rankd.engine.groups import local_group
from services.rankd.engine.model import Qwen3ForCausalLM
from shared.ids import InvalidInput

CFG = Qwen3Config(max_position_embeddings=40)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_prefill_then_decode_equals_greedy(dtype) -> None:
    m = Qwen3ForCausalLM.random(CFG, seed=9, dtype=dtype)
    ids = torch.randint(0, CFG.vocab_size, (15,), generator=torch.Generator().manual_seed(1))
    pre = cp_prefill(m, local_group(), ids)
    toks = [pre.next_token]
    kv = pre.full_kv()
    for _ in range(3):
        d = decode_step(m, kv, toks[-1])
        kv = d.kv
        toks.append(d.next_token)
    assert toks == m.greedy_generate(ids, 4)
    assert kv[0][0].shape[0] == 15 + 3


def test_decode_rejects_bad_input() -> None:
    m = Qwen3ForCausalLM.random(CFG)
    out = m.reference_forward(torch.arange(40))
    with pytest.raises(SequenceTooLong):
        decode_step(m, out.new_kv, 1)  # position 40 == max_position_embeddings
    with pytest.raises(InvalidInput):
        decode_step(m, out.new_kv[:1], 1)
    assert decode_step(m, [(k[:5], v[:5]) for k, v in out.new_kv], 3).logits.isfinite().all()


def _kv(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(t, 8, 128, generator=g), torch.randn(t, 8, 128, generator=g)) for _ in range(3)
    ]


def test_chunks_are_bounded_and_round_trip_in_any_order() -> None:
    kv = _kv(200)  # 3 layers x 2 x 200 x 8 x 128 x 4 B ≈ 4.9 MB
    chunks = encode_kv_chunks("req-42", kv, {"token": 7, "P": 12})
    assert len(chunks) > 8 and max(len(c) for c in chunks) <= MAX_CHUNK_BYTES
    rid, kv2, meta = decode_kv_chunks(list(reversed(chunks)) + chunks[:2])
    assert rid == "req-42" and meta == {"token": 7, "P": 12}
    assert all(
        torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(kv, kv2, strict=True)
    )


def test_reassembler_interleaves_requests_and_rejects_garbage() -> None:
    sent = {"a": (_kv(3, 1), {"token": 7}), "b": (_kv(3, 2), {})}
    a = encode_kv_chunks("a", *sent["a"], max_chunk=2000)
    b = encode_kv_chunks("b", *sent["b"], max_chunk=2000)
    assert len(a) > 1 and len(b) > 1  # several chunks each: they do interleave
    asm = ChunkReassembler()
    done = [r for pair in zip(a, b, strict=True) for c in pair if (r := asm.add(c)) is not None]
    done += [r for c in a[len(b) :] + b[len(a) :] if (r := asm.add(c)) is not None]
    assert sorted(d[0] for d in done) == ["a", "b"]
    for rid, kv, meta in done:  # each request gets back exactly what was sent for it
        want, want_meta = sent[rid]
        assert meta == want_meta
        assert len(kv) == len(want)
        for (k, v), (wk, wv) in zip(kv, want, strict=True):
            assert torch.equal(k, wk) and torch.equal(v, wv), rid
    with pytest.raises(KVFormatError):
        parse_chunk(b"xx")
    with pytest.raises(KVFormatError):
        parse_chunk(a[0][:-1])
    with pytest.raises(KVFormatError):
        decode_kv_chunks(a[:-1])
    one = encode_kv_chunks("c", _kv(1), {}, max_chunk=10_000)[0]
    _, _, _, payload = parse_chunk(one)
    garbage = one[: len(one) - len(payload)] + b"\xff" * len(payload)  # valid header, bad body
    with pytest.raises(KVFormatError):
        decode_kv_chunks([garbage])


def test_transports() -> None:
    kv = _kv(4)
    t = InProcessTransport()
    threading.Timer(0.01, t.send, args=("r", kv, {"token": 1})).start()
    got, meta = t.recv("r", timeout=30)
    assert got is kv and meta == {"token": 1}
    with pytest.raises(TimeoutError):
        t.recv("missing", timeout=0.01)
    c = ChunkedBytesTransport(max_chunk=5000)
    c.send("r", kv, {"token": 2})
    got, meta = c.recv("r", timeout=1)
    assert meta == {"token": 2} and c.largest_chunk <= 5000 and c.chunks_sent > 1
    assert torch.equal(got[2][1], kv[2][1])
