"""A Qwen3-architecture decoder (dense SwiGLU or top-k MoE MLP) and its single-process
reference forward.

Module and parameter names follow Hugging Face ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``
exactly (``model.layers.{i}.self_attn.q_proj.weight`` ...), so an HF checkpoint's state dict
loads without renaming (see ``checkpoint.py``).

Layers expose their two halves, :meth:`Qwen3DecoderLayer.attn_inputs` (norm, projections,
QK-norm, RoPE) and :meth:`Qwen3DecoderLayer.finish` (output projection, residuals, MLP), so the
CP forward (``cp_prefill.py``) can put its KV all-gather between them while reusing every
weight op; only attention differs between the two forwards.

Shapes: token ids (T,) int64; hidden (T, hidden_size); q (T, H, D); k, v (T, Hkv, D); all in
the model dtype (float32 or float64 in tests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.errors import SequenceTooLong, TokenOutOfVocab
from shared.ids import InvalidInput

KVLayers = list[tuple[Tensor, Tensor]]
"""Per layer (k, v), each (T, Hkv, D), post-RoPE, in the model dtype, natural token order."""


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · weight over the last dim.

    HF computes in float32; we compute in the wider of float32 and the input dtype so a
    float64 model stays float64 end to end (the float64 tests need it).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dt)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (T, head_dim) for absolute ``positions`` (T,), HF "rotate_half" layout.

    Computed in float64 then cast: positions up to ~1e6 keep full precision in the angle.
    """
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    )
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (T, H, D) by per-token cos/sin (T, D)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        hk = cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, hk, d
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hk * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hk * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)  # QK-norm: per head, before RoPE
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Post-RoPE q (T,H,D), k (T,Hkv,D) and v (T,Hkv,D) of normed hidden x at ``positions``."""
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


class Qwen3MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Top-k MoE (HF Qwen3-MoE): softmax router over experts, keep the top k per token,
    renormalise when ``norm_topk_prob``, sum the chosen experts' SwiGLU outputs.

    Per-token computation, so a token's output does not depend on which other tokens share
    the call (CP ranks and the reference group tokens differently).
    """

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Qwen3MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)
        )

    def forward(self, x: Tensor) -> Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.promote_types(x.dtype, torch.float32))
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            Qwen3MoeSparseMoeBlock(cfg)
            if cfg.is_moe_layer(layer_idx)
            else Qwen3MLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def attn_inputs(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.self_attn.qkv(self.input_layernorm(h), positions)

    def finish(self, h: Tensor, attn: Tensor) -> Tensor:
        """Residual stream after attention output ``attn`` (T, H, D) and the MLP."""
        h = h + self.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass(frozen=True)
class ForwardOutput:
    """Result of a forward over R new tokens.

    hidden: (R, hidden_size), final-normed (the lm_head input), natural order.
    logits: (vocab,) of the last new token. new_kv: per layer (R, Hkv, D), post-RoPE.
    """

    hidden: Tensor
    logits: Tensor
    new_kv: KVLayers

    @property
    def next_token(self) -> int:
        return int(torch.argmax(self.logits).item())


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float
) -> Tensor:
    """Plain softmax attention (no SDPA) with visibility k_pos <= q_pos (rule 3); GQA by head
    repetition. q (Tq,H,D), k/v (Tk,Hkv,D) -> (Tq,H,D). The oracle the CP kernels are held to.
    """
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


class Qwen3ForCausalLM(nn.Module):
    """The decoder plus lm_head (tied to the embedding when ``tie_word_embeddings``)."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # --- construction ------------------------------------------------------------------
    @classmethod
    def random(
        cls, cfg: Qwen3Config, seed: int = 0, dtype: torch.dtype = torch.float32
    ) -> Qwen3ForCausalLM:
        """Seeded random weights, identical in every process for the same (cfg, seed, dtype).

        Scales are chosen so activations and logits are O(1) (greedy tokens have clear
        margins), not to imitate a trained model. Norm weights are perturbed from 1 so the
        tests exercise them.
        """
        m = cls(cfg)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
                elif name.endswith("bias"):
                    p.copy_(0.02 * torch.randn(p.shape, generator=g, dtype=torch.float64))
                elif p.dim() == 2 and "embed_tokens" in name:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
                else:
                    std = 1.0 / math.sqrt(p.shape[-1])
                    p.copy_(std * torch.randn(p.shape, generator=g, dtype=torch.float64))
        return m.to(dtype).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # --- validation ----------------------------------------------------------------------
    def check_request(
        self, token_ids: Tensor | Sequence[int], prefix_len: int = 0
    ) -> Tensor:
        """Validate new-token ids (R,) against vocab and positions; returns them as int64.

        ``token_ids``: a tensor or a sequence of Python / NumPy ints. Raises
        :class:`InvalidInput` (R < 1, wrong shape, not integers), :class:`TokenOutOfVocab`
        (also for an id no int64 holds, e.g. >= 2**63: checked before the conversion, which
        would overflow), :class:`SequenceTooLong` -- never another exception for bad ids.
        Pure: callable on every rank before any collective.
        """
        if not isinstance(token_ids, Tensor):
            vocab = self.config.vocab_size
            # Python ints are unbounded: an id outside int64 makes torch.as_tensor raise
            # (Overflow), which a rank would report as a failure of the world, not of the
            # request. Range-check them first; the rest is checked on the tensor below.
            for t in token_ids if isinstance(token_ids, (list, tuple)) else ():
                if isinstance(t, int) and not isinstance(t, bool) and not 0 <= t < vocab:
                    raise TokenOutOfVocab(f"token id {t} outside the vocabulary [0, {vocab})")
            try:
                ids = torch.as_tensor(token_ids)
            except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
                raise InvalidInput(f"token ids are not a sequence of integers: {exc}") from exc
        else:
            ids = token_ids
        if ids.dim() != 1 or ids.numel() < 1:
            raise InvalidInput(
                f"token ids must be a non-empty 1-D sequence, got {tuple(ids.shape)}"
            )
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise InvalidInput(f"token ids must be integers, got {ids.dtype}")
        ids = ids.to(torch.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise TokenOutOfVocab(
                f"token id {bad} outside the vocabulary [0, {self.config.vocab_size})"
            )
        if prefix_len < 0:
            raise InvalidInput(f"prefix length must be >= 0, got {prefix_len}")
        total = prefix_len + ids.numel()
        if total > self.config.max_position_embeddings:
            raise SequenceTooLong(
                f"prefix {prefix_len} + new {ids.numel()} = {total} tokens exceeds "
                f"max_position_embeddings {self.config.max_position_embeddings}"
            )
        return ids

    # --- pieces shared by every forward -------------------------------------------------
    def embed(self, ids: Tensor) -> Tensor:
        return self.model.embed_tokens(ids.to(self.device))

    def final_hidden(self, h: Tensor) -> Tensor:
        return self.model.norm(h)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    # --- the oracle -------------------------------------------------------------------------
    @torch.no_grad()
    def reference_forward(
        self, token_ids: Tensor, prefix_kv: KVLayers | None = None
    ) -> ForwardOutput:
        """Single-process forward of R new tokens after a cached prefix (full causal attention
        over P + R, plain softmax attention). ``prefix_kv``: per layer (P, Hkv, D) post-RoPE,
        positions 0..P-1; None means P = 0.
        """
        p = 0 if not prefix_kv else int(prefix_kv[0][0].shape[0])
        ids = self.check_request(token_ids, p)
        r = ids.numel()
        pos = torch.arange(p, p + r, device=self.device)
        k_pos = torch.arange(0, p + r, device=self.device)
        h = self.embed(ids)
        new_kv: KVLayers = []
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.attn_inputs(h, pos)
            new_kv.append((k, v))
            if prefix_kv:
                k = torch.cat([prefix_kv[i][0], k])
                v = torch.cat([prefix_kv[i][1], v])
            attn = reference_attention(q, k, v, pos, k_pos, layer.self_attn.scale)
            h = layer.finish(h, attn)
        hidden = self.final_hidden(h)
        return ForwardOutput(hidden=hidden, logits=self.logits(hidden[-1]), new_kv=new_kv)

    @torch.no_grad()
    def greedy_generate(self, token_ids: Tensor, steps: int) -> list[int]:
        """Reference greedy decoding: ``steps`` tokens after ``token_ids`` (re-using KV)."""
        out = self.reference_forward(token_ids)
        kv = out.new_kv
        toks = [out.next_token]
        for _ in range(steps - 1):
            o = self.reference_forward(torch.tensor([toks[-1]]), kv)
            kv = [
                (torch.cat([a, b]), torch.cat([c, d]))
                for (a, c), (b, d) in zip(kv, o.new_kv, strict=True)
            ]
            toks.append(o.next_token)
        return toks
