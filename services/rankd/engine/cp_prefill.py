"""Zigzag context-parallel prefill of R new tokens after a cached prefix of P tokens
(paper §2.1; cp-attention.md rules 1-10).

Per rank k of a degree-C group:
  1. validate (before any collective, identically on every rank: a bad request raises on all
     ranks and leaves them usable);
  2. pad R to R_pad = ceil(R/2C)·2C, take the rows of chunks k and 2C−1−k, positions P + j;
  3. all-gather the cached prefix: page p (``page_size`` tokens) lives on rank p mod C, so each
     rank's shard length follows from (P, page_size, C) and needs no metadata exchange; shards
     are padded to the longest (gloo needs equal shapes) and scattered back to natural order;
  4. per layer: local q/k/v (post-RoPE), all-gather the new-token KV, restore natural order,
     attention with bottom-right causal semantics over [prefix, new[:(c+1)L]] per chunk;
  5. all-gather the final hidden rows, restore order, keep the first R; the last row's logits
     give the greedy token (every rank computes the same token).
Returns the new KV (R real rows per layer; padded rows never leave this function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.rankd.engine.attention import Backend, default_backend, zigzag_attention
from services.rankd.engine.groups import CPGroup
from services.rankd.engine.model import KVLayers, Qwen3ForCausalLM
from services.rankd.engine.zigzag import ZigzagPlan
from shared.ids import InvalidInput

PAD_TOKEN = 0  # any in-vocab id: padded rows are never visible to real queries nor cached


def page_positions(prefix_len: int, page_size: int, degree: int, rank: int) -> Tensor:
    """Prefix positions (int64) held by ``rank``: pages p ≡ rank (mod degree), ascending, the
    last page possibly partial."""
    n_pages = -(-prefix_len // page_size)
    parts = [
        torch.arange(p * page_size, min((p + 1) * page_size, prefix_len))
        for p in range(rank, n_pages, degree)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def shard_prefix(full: Tensor, page_size: int, degree: int, rank: int) -> Tensor:
    """``rank``'s shard of a natural-order prefix stack (layers, 2, P, Hkv, D)."""
    return full[:, :, page_positions(full.shape[2], page_size, degree, rank)]


def stack_kv(kv: KVLayers) -> Tensor:
    """Per-layer (k, v) of (T, Hkv, D) -> one (layers, 2, T, Hkv, D) tensor."""
    return torch.stack([torch.stack([k, v]) for k, v in kv])


def unstack_kv(t: Tensor) -> KVLayers:
    return [(t[i, 0], t[i, 1]) for i in range(t.shape[0])]


def gather_prefix(group: CPGroup, local: Tensor, prefix_len: int, page_size: int) -> Tensor:
    """All-gather the page-sharded prefix: (layers, 2, T_local, Hkv, D) -> (layers, 2, P, Hkv, D)
    in natural order (rules 10, 11)."""
    if group.degree == 1:
        return local
    c = group.degree
    pos = [page_positions(prefix_len, page_size, c, r) for r in range(c)]
    t_max = max(p.numel() for p in pos)
    pad = t_max - local.shape[2]
    if pad:
        local = torch.cat([local, local.new_zeros(*local.shape[:2], pad, *local.shape[3:])], 2)
    parts = group.all_gather(local)
    full = local.new_empty(*local.shape[:2], prefix_len, *local.shape[3:])
    for r in range(c):
        full[:, :, pos[r]] = parts[r][:, :, : pos[r].numel()]
    return full


@dataclass(frozen=True)
class PrefillResult:
    """Output of one CP prefill (identical on every rank of the group).

    hidden: (R, hidden_size) final-normed, natural order; logits: (vocab,) of the last token;
    next_token: greedy token; new_kv: per layer (R, Hkv, D) post-RoPE (to be cached);
    prefix_kv: the gathered prefix (layers, 2, P, Hkv, D) or None when P = 0 (for the decode
    hand-off, which needs prefix + new).
    """

    hidden: Tensor
    logits: Tensor
    next_token: int
    new_kv: KVLayers
    prefix_kv: Tensor | None

    def full_kv(self) -> KVLayers:
        """Per layer (P + R, Hkv, D): the KV of the whole sequence, for the decode role."""
        if self.prefix_kv is None:
            return self.new_kv
        return [
            (torch.cat([self.prefix_kv[i, 0], k]), torch.cat([self.prefix_kv[i, 1], v]))
            for i, (k, v) in enumerate(self.new_kv)
        ]


def check_prefix_shard(
    model: Qwen3ForCausalLM,
    group: CPGroup,
    local: Tensor | None,
    prefix_len: int,
    page_size: int,
) -> None:
    if prefix_len == 0:
        return
    if page_size < 1:
        raise InvalidInput(f"page_size must be >= 1, got {page_size}")
    cfg = model.config
    want = (
        cfg.num_hidden_layers,
        2,
        page_positions(prefix_len, page_size, group.degree, group.rank).numel(),
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    if local is None or tuple(local.shape) != want:
        got = None if local is None else tuple(local.shape)
        raise InvalidInput(f"prefix shard has shape {got}, expected {want} for P={prefix_len}")


@torch.no_grad()
def cp_prefill(
    model: Qwen3ForCausalLM,
    group: CPGroup,
    token_ids: Tensor,
    prefix_local: Tensor | None = None,
    prefix_len: int = 0,
    page_size: int = 1,
    backend: Backend | None = None,
) -> PrefillResult:
    """Prefill ``token_ids`` (R,) after a P-token prefix on this rank of ``group``.

    Collective over ``group``: every member calls it with the same ids, P and page_size, and
    its own prefix shard ``prefix_local`` (layers, 2, T_local, Hkv, D) holding pages
    p ≡ group.rank (mod C) of ``page_size`` tokens. Raises InvalidInput subclasses before any
    collective.
    """
    ids = model.check_request(token_ids, prefix_len)
    check_prefix_shard(model, group, prefix_local, prefix_len, page_size)
    dev = model.device
    backend = backend or default_backend(dev, model.dtype)
    r, p = ids.numel(), prefix_len
    plan = ZigzagPlan(r, group.degree)
    off = plan.offsets(group.rank)
    padded = torch.full((plan.r_pad,), PAD_TOKEN, dtype=torch.int64)
    padded[:r] = ids
    pos = (p + off).to(dev)
    restore = plan.restore_index().to(dev)

    prefix = None
    if p:
        assert prefix_local is not None
        prefix = gather_prefix(group, prefix_local.to(dev), p, page_size)

    h = model.embed(padded[off])
    new_kv: KVLayers = []
    for i, layer in enumerate(model.model.layers):
        q, k, v = layer.attn_inputs(h, pos)
        kv_all = torch.cat(group.all_gather(torch.stack([k, v])), dim=1)[:, restore]
        attn = zigzag_attention(
            q,
            None if prefix is None else prefix[i, 0],
            None if prefix is None else prefix[i, 1],
            kv_all[0],
            kv_all[1],
            plan,
            group.rank,
            p,
            layer.self_attn.scale,
            backend,
        )
        h = layer.finish(h, attn)
        new_kv.append((kv_all[0, :r], kv_all[1, :r]))  # padded rows dropped (rule 2)
    hidden = torch.cat(group.all_gather(model.final_hidden(h)))[restore][:r]
    logits = model.logits(hidden[-1])
    return PrefillResult(hidden, logits, int(torch.argmax(logits).item()), new_kv, prefix)
