"""Attention kernels with bottom-right causal semantics over [cached prefix, new tokens]
(cp-attention.md rules 3-7).

Visibility is defined by absolute positions: a query at position q sees a key at position k iff
k <= q (rule 3). On CPU we call SDPA with an explicit boolean mask built from positions
(``is_causal=True`` is top-left aligned and wrong whenever Tq != Tk, rule 6). On CUDA we use
``flash_attn_varlen_func`` when importable (``causal=True`` is bottom-right aligned for
seqlen_q < seqlen_k, rule 5), else SDPA with the mask. torch's ``varlen_attn`` with
``window_size=(-1, 0)`` (rule 7) is implemented but opt-in (``Backend.TORCH_VARLEN`` or
``VTM_TORCH_VARLEN=1``) until ``cuda_check.py`` has verified its alignment on a GPU.

Shapes: q (Tq, H, D); k, v (Tk, Hkv, D) with H % Hkv == 0 (GQA); output (Tq, H, D).
"""

from __future__ import annotations

import os
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from services.rankd.engine.zigzag import ZigzagPlan

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func as _flash_varlen  # type: ignore[import-not-found]
except Exception:  # ImportError, or a CUDA-less build failing at import
    _flash_varlen = None


class Backend(StrEnum):
    SDPA_MASK = "sdpa_mask"  # any device: SDPA with an explicit boolean mask
    FLASH_VARLEN = "flash_varlen"  # CUDA + flash-attn installed
    TORCH_VARLEN = "torch_varlen"  # CUDA, torch.nn.attention.varlen.varlen_attn


def _torch_varlen() -> Any | None:
    try:
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn
    except ImportError:
        return None


def default_backend(device: torch.device, dtype: torch.dtype) -> Backend:
    """Best verified kernel for ``device``/``dtype`` (varlen kernels need CUDA and fp16/bf16)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if _flash_varlen is not None:
            return Backend.FLASH_VARLEN
        # NOTE: opt-in until its bottom-right alignment is verified on a GPU (rule 7).
        if os.environ.get("VTM_TORCH_VARLEN") == "1" and _torch_varlen() is not None:
            return Backend.TORCH_VARLEN
    return Backend.SDPA_MASK


def masked_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float
) -> Tensor:
    """SDPA with mask[i, j] = k_pos[j] <= q_pos[i]. Every query must see >= 1 key (a fully
    masked row is NaN in SDPA's math path); with keys starting at position 0 that holds.
    """
    mask = k_pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def zigzag_attention(
    q: Tensor,
    prefix_k: Tensor | None,
    prefix_v: Tensor | None,
    new_k: Tensor,
    new_v: Tensor,
    plan: ZigzagPlan,
    rank: int,
    prefix_len: int,
    scale: float,
    backend: Backend = Backend.SDPA_MASK,
) -> Tensor:
    """Attention of one rank's 2L queries (its chunks k and 2C−1−k, in that row order).

    prefix_k/v: (P, Hkv, D), natural order (any order would do, rule 4); new_k/v: (R_pad, Hkv,
    D) of the whole group, natural order. For chunk c the keys are [prefix, new[:(c+1)L]] and
    the mask is causal aligned bottom-right (rule 4). Returns (2L, H, D).
    """
    ell = plan.chunk
    p = prefix_len
    dev = q.device
    chunks = plan.chunks(rank)
    keys = []
    for c in chunks:
        kk, vv = new_k[: (c + 1) * ell], new_v[: (c + 1) * ell]
        if p:
            assert prefix_k is not None and prefix_v is not None
            kk, vv = torch.cat([prefix_k, kk]), torch.cat([prefix_v, vv])
        keys.append((kk, vv))

    if backend is Backend.SDPA_MASK:
        outs = []
        for i, c in enumerate(chunks):
            kk, vv = keys[i]
            q_pos = torch.arange(p + c * ell, p + (c + 1) * ell, device=dev)
            k_pos = torch.arange(0, p + (c + 1) * ell, device=dev)
            outs.append(masked_attention(q[i * ell : (i + 1) * ell], kk, vv, q_pos, k_pos, scale))
        return torch.cat(outs)

    # One varlen call for both chunks (rule 5): cu_q = [0, L, 2L], cu_k = [0, Tk0, Tk0+Tk1].
    k_all = torch.cat([keys[0][0], keys[1][0]])
    v_all = torch.cat([keys[0][1], keys[1][1]])
    tk0, tk1 = keys[0][0].shape[0], keys[1][0].shape[0]
    cu_q = torch.tensor([0, ell, 2 * ell], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, tk0, tk0 + tk1], dtype=torch.int32, device=dev)
    if backend is Backend.FLASH_VARLEN:
        assert _flash_varlen is not None
        return _flash_varlen(
            q, k_all, v_all, cu_q, cu_k, ell, max(tk0, tk1), softmax_scale=scale, causal=True
        )
    varlen = _torch_varlen()
    assert varlen is not None
    return varlen(
        q,
        k_all,
        v_all,
        cu_q,
        cu_k,
        ell,
        max(tk0, tk1),
        scale=scale,
        window_size=(-1, 0),
        enable_gqa=q.shape[1] != k_all.shape[1],
    )
