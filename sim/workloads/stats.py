"""Summary statistics of a workload (the same definitions as the traces' ``stats.json``).

Percentiles use numpy's linear interpolation. The oracle prefix-reuse potential is the
token-level hit rate of a global prefix cache with unlimited capacity that keeps every full
block seen, in arrival order (paper footnote 3): for each request, k = the leading run of its
block hashes already seen (block ids are prefix-chained, so a flat set equals a trie walk), and
it reuses min(k·B, L − 1) tokens — a request always recomputes its last token (design.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.workloads.workload import Workload, history_hit_blocks

LONG_THRESHOLD = 32_768
"""Requests with input_len > this count as long (stats.json's ">32K")."""


def oracle_reuse(workload: Workload) -> dict[str, float]:
    """Oracle prefix-reuse potential.

    ``oracle_reuse``: Σ min(k·B, L−1) / Σ L, the token-level hit rate an infinite cache of
    full blocks achieves. ``oracle_reuse_full_blocks``: Σ k·B / Σ ⌊L/B⌋·B, reuse over full
    blocks only — stats.json's ``token_reuse_fullblock_only``, reproduced exactly.
    """
    bsz = workload.block_size
    reused = total = fb_num = fb_den = 0
    for r, k in zip(workload.requests, history_hit_blocks(workload), strict=True):
        reused += min(k * bsz, r.input_len - 1)
        total += r.input_len
        fb_num += k * bsz
        fb_den += len(r.block_hashes) * bsz
    return {
        "oracle_reuse": reused / total if total else 0.0,
        "oracle_reuse_full_blocks": fb_num / fb_den if fb_den else 0.0,
    }


def workload_stats(workload: Workload, *, long_threshold: int = LONG_THRESHOLD) -> dict[str, Any]:
    """Counts, lengths (tokens), rate (req/s), long share and oracle reuse of a workload.

    ``rate_req_per_s`` is requests / ``duration_s`` (first to last arrival), stats.json's
    ``mean_rate_req_per_s``. A trace rescaled to R req/s
    (:func:`~sim.workloads.workload.scale_to_rate`: a mean gap of 1/R) shows R·n/(n − 1)
    here: R itself for thousands of requests."""
    n = len(workload)
    out: dict[str, Any] = {"name": workload.name, "requests": n, "block_size": workload.block_size}
    if n == 0:
        return out
    inp = np.array([r.input_len for r in workload.requests], dtype=np.int64)
    outp = np.array([r.output_len for r in workload.requests], dtype=np.int64)
    long_mask = inp > long_threshold
    dur = workload.duration_s
    out.update(
        {
            "duration_s": dur,
            "rate_req_per_s": n / dur if dur > 0 else None,
            "input_mean": float(inp.mean()),
            "input_p50": float(np.percentile(inp, 50)),
            "input_p90": float(np.percentile(inp, 90)),
            "input_p99": float(np.percentile(inp, 99)),
            "input_max": int(inp.max()),
            "input_total_tokens": int(inp.sum()),
            "output_mean": float(outp.mean()),
            "long_threshold": long_threshold,
            "long_share": float(long_mask.mean()),
            "long_token_share": float(inp[long_mask].sum() / inp.sum()),
            "sessions": len({r.session_id for r in workload.requests if r.session_id is not None}),
        }
    )
    out.update(oracle_reuse(workload))
    return out
