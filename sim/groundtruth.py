"""The simulator's ground truth: how long a prefill *really* takes on the simulated hardware.

This is a roofline model of Qwen3-30B-A3B prefill on H20-class GPUs (shared notes,
``ground-truth.md``), calibrated so that CP speedups match the paper's Figure 2. It stands in
for real hardware in the discrete-event simulator and in rankd's ``sim`` backend.

NOTE (honesty of evaluation): the scheduler, controller and cache manager must never import
this module. They only ever see a :class:`shared.costmodel.Profile` fitted from *measurements*
of this model (``sim.profiling``). A test enforces the import rule.

Units: seconds, tokens, bytes, FLOP, FLOP/s, bytes/s.

One request, batch 1, R new tokens, P cached prefix tokens, CP degree C (or TP degree T)::

    T(R,P,C) = d0 + [C>1]·d_cp + σ·R + Lyr·( max(t_gpu, t_cpu) + [C>1]·t_ag )

with the per-layer terms documented in :meth:`GroundTruth.layer_terms`. The slowest rank's
time is returned; zigzag gives every rank chunks k and 2C−1−k, whose indices sum to 2C−1, so
all ranks carry the same number of query-key pairs and rank 0 is a slowest rank.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np

from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput

Kind = Literal["cp", "tp"]
KIB: Final[int] = 1024


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Architecture facts of the served model (defaults: Qwen3-30B-A3B, BF16)."""

    name: str = "Qwen3-30B-A3B"
    layers: int = 48
    hidden: int = 2048
    q_heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    dense_params_per_layer: float = 19.14e6
    """Wd: q, k, v, o projections and router of one layer (parameters)."""
    expert_params: float = 4.72e6
    """We: one routed expert's parameters (gate, up, down at moe_intermediate 768)."""
    dtype_bytes: int = 2
    weight_bytes: float = 61e9
    """All weights in BF16; every CP rank holds all of them."""
    elementwise_bytes_per_token_layer: float = 98e3
    """HBM traffic of norms, residuals, activations, rope... per token per layer (98 KB)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "q_heads", "kv_heads", "head_dim", "experts", "top_k"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"ModelSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise InvalidInput(f"top_k {self.top_k} exceeds experts {self.experts}")

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer: 2·kv_heads·head_dim·dtype (2 KiB for Qwen3)."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV of one token over the whole model (96 KiB for Qwen3-30B-A3B)."""
        return self.layers * self.kv_bytes_per_token_layer

    @property
    def attn_flops_per_pair_layer(self) -> int:
        """4·H·D FLOP per (query, key) pair per layer: QKᵀ and PV, 2 FLOP per MAC."""
        return 4 * self.q_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator: dense BF16 peak, HBM size and bandwidth, NVLink bandwidth."""

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_bandwidth: float = 900e9
    """Bidirectional NVLink bandwidth (bytes/s)."""
    bandwidth_efficiency: float = 0.8
    """B = efficiency·hbm_bandwidth is the achievable HBM bandwidth used by the roofline."""

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.hbm_bytes, self.hbm_bandwidth, self.nvlink_bandwidth) <= 0:
            raise InvalidInput(f"GpuSpec {self.name!r}: all figures must be > 0")
        if not 0 < self.bandwidth_efficiency <= 1:
            raise InvalidInput(
                f"bandwidth_efficiency must be in (0, 1], got {self.bandwidth_efficiency}"
            )

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth_efficiency * self.hbm_bandwidth


H20: Final[GpuSpec] = GpuSpec("H20", peak_flops=148e12, hbm_bytes=96e9, hbm_bandwidth=4.0e12)
H20_3E: Final[GpuSpec] = GpuSpec("H20-3e", peak_flops=148e12, hbm_bytes=141e9, hbm_bandwidth=4.8e12)
# NOTE: on H200 CP gains shrink unless d_cp, σ, α_ag, β_ag are recalibrated (ground-truth.md).
H200: Final[GpuSpec] = GpuSpec("H200", peak_flops=989e12, hbm_bytes=141e9, hbm_bandwidth=4.8e12)
GPU_PRESETS: Final[dict[str, GpuSpec]] = {g.name: g for g in (H20, H20_3E, H200)}


@dataclass(frozen=True, slots=True)
class Efficiency:
    """η(x) = eta_max·x / (x + x_half): kernel efficiency as a function of the token count."""

    eta_max: float
    x_half: float

    def __call__(self, x: float) -> float:
        return self.eta_max * x / (x + self.x_half)


@dataclass(frozen=True, slots=True)
class Calibration:
    """Constants calibrated against the paper's Figure 2 speedups (ground-truth.md)."""

    d0: float = 4e-3
    """Per-request fixed cost: embedding, lm_head of the last token, sampling (s)."""
    d_cp: float = 32e-3
    """Extra per-request fixed cost when C > 1: metadata broadcast, barriers, gather (s)."""
    sigma: float = 40e-6
    """Serial, non-parallel work per new token at every degree (s/token)."""
    alpha_ag: float = 320e-6
    """All-gather latency incl. dispatch and reorder, per call; 2 calls per layer (s)."""
    beta_ag: float = 100e9
    """Effective all-gather bandwidth on NVLink (bytes/s)."""
    t_cpu: float = 150e-6
    """Per-layer dispatch floor (s): a layer never takes less than this."""
    eta_dense: Efficiency = field(default_factory=lambda: Efficiency(0.80, 256))
    eta_moe: Efficiency = field(default_factory=lambda: Efficiency(0.75, 1024))
    eta_attn: Efficiency = field(default_factory=lambda: Efficiency(0.80, 512))
    tp_allreduce_latency: float = 50e-6
    """TP baseline: latency per all-reduce (s). Assumed, not calibrated: prefill runs eagerly
    (no CUDA graph), so an NVLink all-reduce costs a launch plus a sync, ~tens of µs. It is far
    below α_ag, which also covers the zigzag reorder and KV gather bookkeeping of CP."""
    d_tp: float = 0.0
    """TP baseline: extra per-request fixed cost (s). The note gives TP no d_cp; kept as a knob."""
    tp_allreduce_bandwidth: float = 360e9
    """TP baseline: ring all-reduce bus bandwidth, 0.8 × 450 GB/s unidirectional NVLink."""


@dataclass(frozen=True, slots=True)
class Surroundings:
    """What happens around a prefill: KV handoff, first decode, capacities, transfers."""

    kv_handoff_bandwidth: float = 40e9
    """RDMA bandwidth per rank to the decode pool (bytes/s); ranks send in parallel."""
    first_decode_s: float = 0.030
    """One decode iteration producing the first token (s)."""
    kv_reserve_bytes: float = 10e9
    """Activation/workspace reserve per GPU, not available to the KV cache."""
    kv_capacity_blocks_per_gpu: int | None = None
    """Override of the KV-cache capacity per GPU in blocks (cache experiments use small ones)."""
    inter_node_bandwidth: float = 40e9
    """Replication between workers on different nodes: RDMA per link (bytes/s)."""
    intra_node_bandwidth: float = 100e9
    """Replication within a node: NVLink-class. We take the effective β_ag the all-gather
    achieves (100 GB/s) rather than NVLink's peak, as block-scattered KV copies are not
    bulk transfers."""
    transfer_latency_s: float = 0.0
    """Fixed setup cost per replication transfer (s)."""
    switch_min_s: float = 0.5
    switch_max_s: float = 1.0
    """Reconfiguration switch (§9.3): uniform in [min, max] seconds."""

    def __post_init__(self) -> None:
        if not 0 <= self.switch_min_s <= self.switch_max_s:
            raise InvalidInput(
                "need 0 <= switch_min_s <= switch_max_s, got "
                f"{self.switch_min_s}, {self.switch_max_s}"
            )
        if self.kv_capacity_blocks_per_gpu is not None and self.kv_capacity_blocks_per_gpu < 1:
            raise InvalidInput(
                f"kv_capacity_blocks_per_gpu must be >= 1, got {self.kv_capacity_blocks_per_gpu}"
            )
        for name in ("kv_handoff_bandwidth", "inter_node_bandwidth", "intra_node_bandwidth"):
            if getattr(self, name) <= 0:
                raise InvalidInput(f"{name} must be > 0")


def _check_request(r: int, p: int, degree: int, kind: str) -> None:
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
        raise InvalidInput(f"new tokens R must be an integer >= 1, got {r!r}")
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 0:
        raise InvalidInput(f"cached prefix P must be an integer >= 0, got {p!r}")
    if isinstance(degree, bool) or not isinstance(degree, (int, np.integer)) or degree < 1:
        raise InvalidInput(f"degree must be an integer >= 1, got {degree!r}")
    if kind not in ("cp", "tp"):
        raise InvalidInput(f"kind must be 'cp' or 'tp', got {kind!r}")


@dataclass(frozen=True, slots=True)
class GroundTruth:
    """Noise-free ground truth. ``gpu`` sets timing; ``memory_gpu`` sets KV capacity.

    The timing constants were calibrated with H20 figures (4.0 TB/s) while the paper's
    testbed is H20-3e (141 GB), so by default timing uses :data:`H20` and capacity
    :data:`H20_3E` (ground-truth.md).
    """

    model: ModelSpec = field(default_factory=ModelSpec)
    gpu: GpuSpec = H20
    memory_gpu: GpuSpec = H20_3E
    calibration: Calibration = field(default_factory=Calibration)
    surroundings: Surroundings = field(default_factory=Surroundings)

    # --- prefill -------------------------------------------------------------------------
    def layer_terms(self, r: int, p: int, degree: int, *, kind: Kind = "cp") -> dict[str, float]:
        """Per-layer times (s) of the slowest rank: dense, moe, attn, elem, gpu, comm.

        CP (degree C): R_pad = R if C = 1 else ceil(R/2C)·2C; n = R_pad/C local tokens;
        L = R_pad/2C tokens per zigzag chunk; the attention query length q_len is L for C > 1
        and R for C = 1 (one chunk sets the kernel's efficiency)::

            t_dense = max(2·n·Wd / (F·η_d(n)), 2·Wd / B)
            t_moe   = max(2·n·k·We / (F·η_m(n)), E·(1 − (1 − k/E)^n)·2·We / B)
            t_attn  = 4·H·D·pairs_rank / (F·η_a(q_len)) + (P + R_pad)·kv_layer / B
            t_elem  = n·98 KB / B
            comm    = 2·α_ag + (C − 1)·(n + P/C)·kv_layer / β_ag        (C > 1, else 0)

        pairs_rank = Σ over the rank's chunks c ∈ {0, 2C−1} of L·(P + c·L) + L(L+1)/2
        (for C = 1 it is W(R,P) = R·P + R(R+1)/2).

        TP (degree T), the vLLM-like baseline. Assumptions:

        * every rank sees all n = R tokens (no padding), so η uses R;
        * every matrix FLOP (dense and expert) and every weight read is divided by T
          (Megatron-style column/row split; experts split along moe_intermediate);
        * attention FLOPs are divided by T; KV reads by min(T, kv_heads) (KV heads sharded,
          replicated once T exceeds the 4 KV heads);
        * elementwise traffic (norms, residuals over the full hidden) is NOT divided —
          those activations are replicated in TP;
        * σ, d0 and the per-layer dispatch floor are unchanged; d_tp (default 0) replaces d_cp;
        * comm = two ring all-reduces of the activations (n·hidden·2 bytes) per layer at
          ``tp_allreduce_latency`` + 2·(T−1)/T·bytes / ``tp_allreduce_bandwidth``.
        """
        _check_request(r, p, degree, kind)
        m, g, cal = self.model, self.gpu, self.calibration
        f_peak, bw = g.peak_flops, g.effective_bandwidth
        kv_layer = m.kv_bytes_per_token_layer
        wd, we, e, k = m.dense_params_per_layer, m.expert_params, m.experts, m.top_k
        # Distinct experts touched by n tokens (each picks k of E uniformly): E·(1−(1−k/E)^n).
        if kind == "cp":
            c = degree
            r_pad = r if c == 1 else math.ceil(r / (2 * c)) * 2 * c
            n = r_pad / c
            if c == 1:
                q_len = float(r)
                pairs = r * p + r * (r + 1) / 2
            else:
                chunk = r_pad / (2 * c)
                q_len = chunk
                pairs = sum(
                    chunk * (p + idx * chunk) + chunk * (chunk + 1) / 2 for idx in (0, 2 * c - 1)
                )
            shard = 1
            elem_tokens = n
            kv_tokens = p + r_pad
        else:
            t = degree
            r_pad = r
            n = float(r)
            q_len = float(r)
            pairs = (r * p + r * (r + 1) / 2) / t
            shard = t
            elem_tokens = n
            # KV heads are sharded up to kv_heads ranks; beyond that each head is replicated.
            kv_tokens = (p + r) / min(t, m.kv_heads)
        touched = e * (1.0 - (1.0 - k / e) ** n)
        t_dense = max(2 * n * wd / (shard * f_peak * cal.eta_dense(n)), 2 * wd / (shard * bw))
        t_moe = max(
            2 * n * k * we / (shard * f_peak * cal.eta_moe(n)),
            touched * 2 * we / (shard * bw),
        )
        t_attn = m.attn_flops_per_pair_layer * pairs / (f_peak * cal.eta_attn(q_len)) + (
            kv_tokens * kv_layer / bw
        )
        t_elem = elem_tokens * m.elementwise_bytes_per_token_layer / bw
        t_gpu = t_dense + t_moe + t_attn + t_elem
        if kind == "cp":
            comm = 0.0
            if degree > 1:
                comm = 2 * cal.alpha_ag + (degree - 1) * (n + p / degree) * kv_layer / cal.beta_ag
        else:
            comm = 0.0
            if degree > 1:
                nbytes = n * m.hidden * m.dtype_bytes
                one = (
                    cal.tp_allreduce_latency
                    + 2 * (degree - 1) / degree * nbytes / cal.tp_allreduce_bandwidth
                )
                comm = 2 * one
        return {
            "dense": t_dense,
            "moe": t_moe,
            "attn": t_attn,
            "elem": t_elem,
            "gpu": t_gpu,
            "layer": max(t_gpu, cal.t_cpu),
            "comm": comm,
        }

    def prefill_time(self, r: int, p: int, degree: int, *, kind: Kind = "cp") -> float:
        """Noise-free prefill time (s) of R new tokens over P cached ones on a degree-C worker.

        Raises :class:`InvalidInput` on R < 1, P < 0, degree < 1 or an unknown kind.
        """
        if kind == "cp" and r.__class__ is int and p.__class__ is int \
                and degree.__class__ is int and r >= 1 and p >= 0 and degree >= 1:
            return self._prefill_time_cp(r, p, degree)
        terms = self.layer_terms(r, p, degree, kind=kind)
        cal = self.calibration
        fixed = cal.d0
        if degree > 1:
            fixed += cal.d_cp if kind == "cp" else cal.d_tp
        return fixed + cal.sigma * r + self.model.layers * (terms["layer"] + terms["comm"])

    def _prefill_time_cp(self, r: int, p: int, degree: int) -> float:
        """:meth:`prefill_time` for CP with valid plain-int inputs (speed: the simulator calls
        it once per request). The same float operations in the same order as
        :meth:`layer_terms` + :meth:`prefill_time` (bit-identical), without the validation
        and the dict, with the instance's constants looked up once (:func:`_cp_constants`);
        a test compares the two."""
        (f_peak, bw, kv_layer, wd, we, e, k, keep, ed_max, ed_half, em_max, em_half, ea_max,
         ea_half, attn_pair, elem, dense_floor, alpha2, beta_ag, t_cpu, d0, d_cp, sigma,
         layers) = _cp_constants(self)
        c = degree
        r_pad = r if c == 1 else math.ceil(r / (2 * c)) * 2 * c
        n = r_pad / c
        if c == 1:
            q_len = float(r)
            pairs = r * p + r * (r + 1) / 2
        else:
            chunk = r_pad / (2 * c)
            q_len = chunk
            last = 2 * c - 1
            # (layer_terms sums the two chunks' pairs with sum(); 0 + a + b == a + b)
            pairs = (chunk * (p + 0 * chunk) + chunk * (chunk + 1) / 2) \
                + (chunk * (p + last * chunk) + chunk * (chunk + 1) / 2)
        kv_tokens = p + r_pad
        touched = e * (1.0 - keep ** n)
        # shard = 1: 1 * f_peak and 1 * bw are f_peak and bw exactly.
        t_dense = max(2 * n * wd / (f_peak * (ed_max * n / (n + ed_half))), dense_floor)
        t_moe = max(
            2 * n * k * we / (f_peak * (em_max * n / (n + em_half))),
            touched * 2 * we / bw,
        )
        t_attn = attn_pair * pairs / (
            f_peak * (ea_max * q_len / (q_len + ea_half))) + (kv_tokens * kv_layer / bw)
        t_elem = n * elem / bw
        t_gpu = t_dense + t_moe + t_attn + t_elem
        comm = 0.0
        if degree > 1:
            comm = alpha2 + (degree - 1) * (n + p / degree) * kv_layer / beta_ag
        layer = max(t_gpu, t_cpu)
        fixed = d0
        if degree > 1:
            fixed += d_cp
        return fixed + sigma * r + layers * (layer + comm)

    # --- around the prefill --------------------------------------------------------------
    def kv_handoff_time(self, total_tokens: int, degree: int) -> float:
        """Time (s) to send (P+R)·96 KiB of KV to decode, each of ``degree`` ranks its share
        in parallel at ``kv_handoff_bandwidth`` (for TP, KV is sharded by head: same split)."""
        if total_tokens < 0 or degree < 1:
            raise InvalidInput(
                f"need total_tokens >= 0 and degree >= 1, got {total_tokens}, {degree}"
            )
        nbytes = total_tokens * self.model.kv_bytes_per_token
        return nbytes / (degree * self.surroundings.kv_handoff_bandwidth)

    def external_time(self, total_tokens: int, degree: int) -> float:
        """T_ext of §3.1 (s): KV handoff plus the first decode step; both belong to TTFT."""
        return self.kv_handoff_time(total_tokens, degree) + self.surroundings.first_decode_s

    def kv_capacity_tokens_per_gpu(self) -> int:
        """KV tokens one GPU can cache: (HBM − weights − reserve) / KV bytes per token."""
        s = self.surroundings
        if s.kv_capacity_blocks_per_gpu is not None:
            return s.kv_capacity_blocks_per_gpu * DEFAULT_BLOCK_SIZE
        free = self.memory_gpu.hbm_bytes - self.model.weight_bytes - s.kv_reserve_bytes
        if free <= 0:
            raise InvalidInput(
                f"{self.memory_gpu.name}: HBM {self.memory_gpu.hbm_bytes:.3g} B leaves no room "
                f"after weights {self.model.weight_bytes:.3g} B "
                f"and reserve {s.kv_reserve_bytes:.3g} B"
            )
        return int(free // self.model.kv_bytes_per_token)

    def kv_capacity_blocks(self, degree: int = 1, *, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
        """KV-cache capacity (blocks of ``block_size`` tokens) of a degree-C worker.

        A CP-C worker partitions its KV over its C ranks, so it caches C times one GPU's
        capacity; a TP-T worker shards KV by head and holds the same as a CP-T worker.
        """
        if degree < 1 or block_size < 1:
            raise InvalidInput(f"need degree >= 1 and block_size >= 1, got {degree}, {block_size}")
        s = self.surroundings
        if s.kv_capacity_blocks_per_gpu is not None and block_size == DEFAULT_BLOCK_SIZE:
            return degree * s.kv_capacity_blocks_per_gpu
        return degree * (self.kv_capacity_tokens_per_gpu() // block_size)

    def replication_time(
        self,
        n_blocks: int,
        *,
        same_node: bool,
        links: int = 1,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> float:
        """Seconds to copy ``n_blocks`` KV blocks between workers over ``links`` parallel links.

        Within a node NVLink-class bandwidth, across nodes RDMA (40 GB/s per link). A caller
        moving CP pages rank-to-rank may pass links = number of rank pairs in parallel.
        """
        if n_blocks < 0 or links < 1 or block_size < 1:
            raise InvalidInput(
                "need n_blocks >= 0, links >= 1, block_size >= 1; "
                f"got {n_blocks}, {links}, {block_size}"
            )
        if n_blocks == 0:
            return 0.0
        s = self.surroundings
        bw = s.intra_node_bandwidth if same_node else s.inter_node_bandwidth
        nbytes = n_blocks * block_size * self.model.kv_bytes_per_token
        return s.transfer_latency_s + nbytes / (bw * links)

    def switch_time(self, rng: random.Random | np.random.Generator) -> float:
        """Reconfiguration switch time (s), uniform in [switch_min_s, switch_max_s]."""
        s = self.surroundings
        u = rng.random()
        return s.switch_min_s + float(u) * (s.switch_max_s - s.switch_min_s)


DEFAULT_GROUND_TRUTH: Final[GroundTruth] = GroundTruth()

# id(truth) -> (truth, constants of GroundTruth._prefill_time_cp); the entry keeps the instance
# alive, so its id is not reused while cached (GroundTruth is frozen with slots: no room on it).
_CP_CONSTANTS: dict[int, tuple[GroundTruth, tuple[Any, ...]]] = {}


def _cp_constants(gt: GroundTruth) -> tuple[Any, ...]:
    """The per-instance terms of the CP fast path, each computed as layer_terms computes it."""
    ent = _CP_CONSTANTS.get(id(gt))
    if ent is not None and ent[0] is gt:
        return ent[1]
    m, g, cal = gt.model, gt.gpu, gt.calibration
    f_peak, bw = g.peak_flops, g.effective_bandwidth
    e, k = m.experts, m.top_k
    shard = 1
    consts = (
        f_peak, bw, m.kv_bytes_per_token_layer, m.dense_params_per_layer, m.expert_params,
        e, k, 1.0 - k / e,
        cal.eta_dense.eta_max, cal.eta_dense.x_half, cal.eta_moe.eta_max, cal.eta_moe.x_half,
        cal.eta_attn.eta_max, cal.eta_attn.x_half,
        m.attn_flops_per_pair_layer, m.elementwise_bytes_per_token_layer,
        2 * m.dense_params_per_layer / (shard * bw),  # the dense weight-read floor
        2 * cal.alpha_ag, cal.beta_ag, cal.t_cpu, cal.d0, cal.d_cp, cal.sigma, m.layers,
    )
    if len(_CP_CONSTANTS) >= 64:
        _CP_CONSTANTS.clear()
    _CP_CONSTANTS[id(gt)] = (gt, consts)
    return consts


def prefill_time(
    r: int, p: int, degree: int, *, kind: Kind = "cp", truth: GroundTruth = DEFAULT_GROUND_TRUTH
) -> float:
    """Noise-free prefill time (s) under the default (or given) ground truth."""
    return truth.prefill_time(r, p, degree, kind=kind)


_NOISE_BLOCK: Final[int] = 1024
"""Standard normals drawn per numpy call by :class:`NoisyGroundTruth` (speed only)."""


class NoisyGroundTruth:
    """The ground truth as measured: noise-free time × seeded mean-one lognormal noise.

    Noise factor = exp(σ·Z − σ²/2), Z ~ N(0, 1), so the mean time equals the noise-free one.
    Prefill noise and switch times come from independent streams spawned from ``seed``, so
    adding a reconfiguration does not shift the noise of later prefills. Deterministic for a
    seed and a call sequence.
    """

    def __init__(
        self,
        seed_or_truth: int | GroundTruth | None = None,
        sigma: float = 0.04,
        truth: GroundTruth | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        """``NoisyGroundTruth(seed, sigma=0.04)`` or ``NoisyGroundTruth(truth, seed=.., sigma=..)``.

        Without a truth the default (Qwen3-30B-A3B on H20) is used; without a seed, 0.
        """
        if isinstance(seed_or_truth, GroundTruth):
            if truth is not None:
                raise InvalidInput("ground truth given twice")
            truth = seed_or_truth
        elif seed_or_truth is not None:
            if seed is not None:
                raise InvalidInput("seed given twice")
            seed = seed_or_truth
        if seed is None:
            seed = 0
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InvalidInput(f"seed must be an integer >= 0, got {seed!r}")
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise InvalidInput(f"noise sigma must be finite and >= 0, got {sigma!r}")
        self.truth = truth if truth is not None else DEFAULT_GROUND_TRUTH
        self.seed = int(seed)
        self.sigma = float(sigma)
        noise_seq, switch_seq = np.random.SeedSequence(self.seed).spawn(2)
        self._noise = np.random.default_rng(noise_seq)
        self._switch = np.random.default_rng(switch_seq)
        # Speed: the noise stream is drawn in blocks (one numpy call per _NOISE_BLOCK prefills
        # instead of one each). A block of standard normals is the same sequence as that many
        # single draws from the same generator, so every factor is unchanged; nothing else
        # draws from this stream.
        self._z: list[float] = []
        self._zi = 0
        self._half_var = 0.5 * self.sigma**2

    def noise_free(self, r: int, p: int, degree: int, *, kind: Kind = "cp") -> float:
        return self.truth.prefill_time(r, p, degree, kind=kind)

    def prefill_time(self, r: int, p: int, degree: int, *, kind: Kind = "cp") -> float:
        """One measured prefill (s): noise-free time times a fresh lognormal factor."""
        base = self.truth.prefill_time(r, p, degree, kind=kind)
        if self.sigma == 0:
            return base
        i = self._zi
        if i == len(self._z):
            self._z = self._noise.standard_normal(_NOISE_BLOCK).tolist()
            i = 0
        self._zi = i + 1
        return base * math.exp(self.sigma * self._z[i] - self._half_var)

    def external_time(self, total_tokens: int, degree: int) -> float:
        """KV handoff + first decode (s); not noisy (network and decode are not modelled)."""
        return self.truth.external_time(total_tokens, degree)

    def switch_time(self) -> float:
        """One reconfiguration switch time (s) from the switch stream."""
        return self.truth.switch_time(self._switch)
