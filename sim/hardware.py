"""The simulated hardware as a configuration file: the ground truth's model, GPUs, calibration
and surroundings (``ground-truth.md``), for ``vertumnus simulate --hardware`` and ``vertumnus
profile --backend sim --hardware``.

A JSON or TOML file (by its suffix: ``.json``, ``.toml``) whose top-level keys are any of
``model``, ``gpu``, ``memory_gpu``, ``calibration`` and ``surroundings``. Each is a table of the
fields of :class:`~sim.groundtruth.ModelSpec`, :class:`~sim.groundtruth.GpuSpec`,
:class:`~sim.groundtruth.Calibration` or :class:`~sim.groundtruth.Surroundings`; a field left
out keeps its default (the Qwen3-30B-A3B / H20 model the rest of the project is calibrated on).
``gpu`` and ``memory_gpu`` may also name a preset (:data:`~sim.groundtruth.GPU_PRESETS`: H20,
H20-3e, H200), and a GPU table may start from one with ``preset``. ``gpu`` sets the timing,
``memory_gpu`` the KV-cache capacity; a file that gives ``gpu`` and not ``memory_gpu`` gets
the same GPU for both (the default pair, timing on H20 and capacity of H20-3e, is the note's
and only holds while neither is given). The calibration's kernel efficiencies (``eta_dense``,
``eta_moe``, ``eta_attn``) are tables of ``eta_max`` and ``x_half``. Example::

    gpu = "H200"

    [model]
    name = "Qwen3-30B-A3B"

    [surroundings]
    first_decode_s = 0.025

Every value is checked (a number where a number belongs, finite, positive unless the field may
be 0, and at most a bound far beyond any real model or GPU: :data:`MAXIMA`) and the result
must be usable: a model whose weights leave no room for one KV block in the memory GPU is an
error, so is one whose heads do not fit grouped-query attention (``q_heads`` a multiple of
``kv_heads``), and so is hardware on which a 128K-token prefill on one GPU would take more than
:data:`MAX_PREFILL_S` (a value far too small, such as a peak of 1 FLOP/s, which no per-field
bound catches). Errors are :class:`~shared.ids.InvalidInput` naming the file and the key.

The simulator's policies never see this file: they get the profile fitted on the ground truth
it describes (``sim.profiling``), as with the default hardware.

Pure apart from :func:`load_ground_truth`, which reads the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any, Final, get_type_hints

from shared.files import read_config_file
from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput
from shared.schemas import MAX_TOKENS
from sim.groundtruth import (
    DEFAULT_GROUND_TRUTH,
    GPU_PRESETS,
    Calibration,
    Efficiency,
    GpuSpec,
    GroundTruth,
    ModelSpec,
    Surroundings,
)

SECTIONS: Final[tuple[str, ...]] = ("model", "gpu", "memory_gpu", "calibration", "surroundings")
ZERO_ALLOWED: Final[frozenset[str]] = frozenset({
    # Fixed costs, latencies and reserves that a model of some hardware may leave out; every
    # other number is a size, a rate or a divisor and must be > 0.
    "d0", "d_cp", "sigma", "alpha_ag", "t_cpu", "tp_allreduce_latency", "d_tp",
    "elementwise_bytes_per_token_layer", "first_decode_s", "kv_reserve_bytes",
    "transfer_latency_s", "switch_min_s", "switch_max_s", "x_half",
})


_BANDWIDTH_MAX: Final[float] = 1e17
_LATENCY_MAX: Final[float] = 1.0
_FIXED_COST_MAX: Final[float] = 60.0

MAXIMA: Final[Mapping[str, float]] = {
    # model (ModelSpec)
    "layers": 4096,
    "hidden": 1 << 20,
    "q_heads": 1 << 14,
    "kv_heads": 1 << 14,
    "head_dim": 1 << 14,
    "experts": 1 << 20,
    "top_k": 1 << 20,
    "dense_params_per_layer": 1e12,
    "expert_params": 1e12,
    "dtype_bytes": 8,
    "weight_bytes": 1e14,
    "elementwise_bytes_per_token_layer": 1e9,
    # GPU (GpuSpec; bandwidth_efficiency and the efficiencies' eta_max are at most 1 anyway)
    "peak_flops": 1e19,
    "hbm_bytes": 1e14,
    "hbm_bandwidth": _BANDWIDTH_MAX,
    "nvlink_bandwidth": _BANDWIDTH_MAX,
    # calibration (Calibration, Efficiency)
    "d0": _FIXED_COST_MAX,
    "d_cp": _FIXED_COST_MAX,
    "d_tp": _FIXED_COST_MAX,
    "sigma": 1.0,
    "alpha_ag": _LATENCY_MAX,
    "t_cpu": _LATENCY_MAX,
    "tp_allreduce_latency": _LATENCY_MAX,
    "beta_ag": _BANDWIDTH_MAX,
    "tp_allreduce_bandwidth": _BANDWIDTH_MAX,
    "x_half": MAX_TOKENS,
    # surroundings (Surroundings)
    "kv_handoff_bandwidth": _BANDWIDTH_MAX,
    "inter_node_bandwidth": _BANDWIDTH_MAX,
    "intra_node_bandwidth": _BANDWIDTH_MAX,
    "first_decode_s": _FIXED_COST_MAX,
    "transfer_latency_s": _FIXED_COST_MAX,
    "switch_min_s": 3600.0,
    "switch_max_s": 3600.0,
    "kv_reserve_bytes": 1e14,
    "kv_capacity_blocks_per_gpu": 1e9,
}
"""The largest value each number of a hardware file may take (its field name: the names are
unique across the sections). Every bound is far above every real model and GPU, so that
only a mistyped or corrupt value is refused, here, naming its key, rather than passed on to
fail later in the profile or a run (10^9 layers gave 0 KV blocks, a κ of 10^-6 and a
simulation that never ends). The shipped presets (H20, H20-3e, H200) and the default model
(Qwen3-30B-A3B) are orders of magnitude inside every bound. Why each:

* ``layers`` 4,096: served LLMs have at most ~130 (Llama 3.1 405B: 126; DeepSeek-V3: 61),
  the deepest transformer trained (DeepNet) 1,000.
* ``hidden`` 2^20: the widest models have ~25,600 (Megatron's 1T); 40× that.
* ``q_heads``, ``kv_heads``, ``head_dim`` 2^14: real models have at most 128 query heads and
  head dimensions of 64-256 (MLA's latent KV: 576); at 2^14 heads of 64 the model is 2^20
  wide, ``hidden``'s bound.
* ``experts``, ``top_k`` 2^20: routed MoE models have at most a few hundred experts (Kimi
  K2: 384), the largest published expert layer (PEER) 2^20; ``top_k`` <= ``experts`` too.
* ``dense_params_per_layer``, ``expert_params`` 10^12: a 405B dense model's layer holds ~3.3e9
  parameters (here its MLP may count as the dense part or one always-routed expert); 300×.
* ``dtype_bytes`` 8: FP64, the widest number format an accelerator computes in.
* ``weight_bytes`` 10^14 (100 TB), ``hbm_bytes``'s bound (the memory GPU must hold the weights
  and one KV block besides): the largest published models hold ~2×10^12 parameters, 4 TB in
  BF16; 25×.
* ``elementwise_bytes_per_token_layer`` 10^9: 98 KB at hidden 2,048; it grows with ``hidden``,
  to ~5×10^7 at that field's bound.
* ``peak_flops`` 10^19 FLOP/s: dense BF16 of one GPU is ~10^15 (H200 989 TFLOP/s, B200
  2.25 PFLOP/s); a wafer-scale chip (Cerebras WSE-3) claims 1.25×10^17.
* ``hbm_bytes``, ``kv_reserve_bytes`` 10^14 (100 TB): a GPU has 96-288 GB, the largest
  announced ~1 TB.
* Bandwidths (``hbm_bandwidth``, ``nvlink_bandwidth``, ``beta_ag``, ``tp_allreduce_bandwidth``,
  ``kv_handoff_bandwidth``, ``inter_node_bandwidth``, ``intra_node_bandwidth``) 10^17 B/s
  (100 PB/s): HBM gives 4-8 TB/s, NVLink 0.9-1.8 TB/s; a wafer-scale chip's on-chip SRAM
  2.1×10^16.
* Per-call and per-layer latencies (``alpha_ag``, ``t_cpu``, ``tp_allreduce_latency``) 1 s:
  tens to hundreds of µs calibrated; a second is thousands of times that (and is paid
  layers × 2 times per prefill).
* Per-request fixed costs (``d0``, ``d_cp``, ``d_tp``, ``first_decode_s``,
  ``transfer_latency_s``) 60 s: milliseconds to tens of milliseconds calibrated.
* ``sigma`` 1 s per token: 40 µs calibrated.
* ``switch_min_s``, ``switch_max_s`` 3,600 s: a reconfiguration takes 0.5-1 s (§9.3); one that
  reloads weights from disk, minutes.
* ``x_half`` :data:`~shared.schemas.MAX_TOKENS` (2^24) tokens: the token count at which a
  kernel reaches half its peak efficiency (256-1,024 calibrated); no request is longer, so a
  larger one would mean kernels that never become efficient.
* ``kv_capacity_blocks_per_gpu`` 10^9 blocks: the default GPU holds 1,390 blocks of 512
  tokens; 10^9 are 5×10^11 tokens of KV, beyond any GPU at any real model's KV size.
"""

MAX_PREFILL_S: Final[float] = 86_400.0
"""Longest a 131,072-token prefill (no cached prefix) may take on one GPU of a hardware file:
a day. The slowest real pairing that fits one GPU (a ~60B dense model on an H20) takes
minutes, the default 69 s. A longer time comes from a value far too small (a peak of
1 FLOP/s) or bounds combined past sense, which would make the profile's κ ramp measure
nothing (κ at its floor) and a simulation run for ever."""


def _shown(v: int | float) -> str:
    """A number for a message: as written, or its magnitude when it is a huge integer."""
    if isinstance(v, int) and abs(v) >= 10**16:
        return f"an integer of {len(str(abs(v)))} digits"
    return repr(v)


def _number(where: str, name: str, v: Any, kind: type) -> int | float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InvalidInput(f"{where}: must be a number, got {v!r}")
    if kind is int:
        if isinstance(v, float) and not v.is_integer():
            raise InvalidInput(f"{where}: must be an integer, got {v!r}")
        v = int(v)
    else:
        v = float(v)
        if not math.isfinite(v):
            raise InvalidInput(f"{where}: must be finite, got {v!r}")
    if v < 0 or (v == 0 and name not in ZERO_ALLOWED):
        raise InvalidInput(f"{where}: must be {'>= 0' if name in ZERO_ALLOWED else '> 0'}, "
                           f"got {_shown(v)}")
    top = MAXIMA.get(name)
    if top is not None and v > top:
        bound = f"{int(top):,}" if top < 1e15 and float(top).is_integer() else f"{top:g}"
        raise InvalidInput(f"{where}: must be at most {bound}, far beyond any real model or "
                           f"GPU (sim/hardware.py MAXIMA), got {_shown(v)}")
    return v


def _table(where: str, data: Any) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise InvalidInput(f"{where}: must be a table of fields, got {data!r}")
    return data


def _build(cls: type, where: str, data: Any, base: Any | None = None) -> Any:
    """An instance of the dataclass ``cls`` from ``data``: ``base`` (or the defaults) with the
    fields ``data`` gives, each checked against its annotated type."""
    data = _table(where, data)
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InvalidInput(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                           f"known: {', '.join(sorted(names))}")
    values: dict[str, Any] = {}
    for name, v in data.items():
        hint, at = hints[name], f"{where}.{name}"
        if hint is Efficiency:
            eff = values[name] = _build(Efficiency, at, v)
            if eff.eta_max > 1:
                raise InvalidInput(f"{at}.eta_max: an efficiency is at most 1, got "
                                   f"{eff.eta_max!r}")
        elif hint is str:
            if not isinstance(v, str) or not v:
                raise InvalidInput(f"{at}: must be a non-empty string, got {v!r}")
            values[name] = v
        elif hint in (int, float):
            values[name] = _number(at, name, v, hint)
        elif hint == int | None:
            values[name] = None if v is None else _number(at, name, v, int)
        else:  # a field type this loader does not know: a new field needs a rule here
            raise InvalidInput(f"{at}: cannot be set from a file")
    try:
        return replace(base, **values) if base is not None else cls(**values)
    except InvalidInput as exc:  # the dataclass's own checks
        raise InvalidInput(f"{where}: {exc}") from None


def _gpu(where: str, data: Any) -> GpuSpec:
    """A GPU from a preset name, or a table (optionally starting from ``preset``)."""
    if isinstance(data, str):
        if data not in GPU_PRESETS:
            raise InvalidInput(f"{where}: unknown GPU preset {data!r}; "
                               f"known: {', '.join(GPU_PRESETS)}")
        return GPU_PRESETS[data]
    table = dict(_table(where, data))
    preset = table.pop("preset", None)
    if preset is None:
        missing = [f.name for f in fields(GpuSpec)
                   if f.default is MISSING and f.default_factory is MISSING
                   and f.name not in table]
        if missing:
            raise InvalidInput(f"{where}: missing field(s) {', '.join(missing)} (or start "
                               f"from a preset: preset = one of {', '.join(GPU_PRESETS)})")
        return _build(GpuSpec, where, table)
    base = _gpu(f"{where}.preset", preset)
    return _build(GpuSpec, where, table, base)


def _check_heads(where: str, model: ModelSpec) -> None:
    """Grouped-query attention: each KV head serves the same whole number of query heads, so
    ``kv_heads`` <= ``q_heads`` and ``q_heads`` is a multiple of ``kv_heads`` (the ground
    truth's KV sizes and TP sharding assume it; ``ModelSpec`` itself only checks >= 1)."""
    if model.kv_heads > model.q_heads:
        raise InvalidInput(f"{where}.kv_heads: {model.kv_heads} KV heads exceed the "
                           f"{model.q_heads} query heads (q_heads); a model has at most one KV "
                           f"head per query head")
    if model.q_heads % model.kv_heads:
        raise InvalidInput(f"{where}.q_heads: {model.q_heads} query heads are not a multiple "
                           f"of the {model.kv_heads} KV heads (kv_heads); grouped-query "
                           f"attention gives every KV head the same number of query heads")


def ground_truth_from_mapping(data: Any, *, source: str = "hardware") -> GroundTruth:
    """The ground truth a hardware mapping describes (module docstring); ``source`` names it
    in errors. Raises :class:`InvalidInput` naming the key of the first bad value."""
    data = _table(source, data)
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise InvalidInput(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                           f"known: {', '.join(SECTIONS)}")
    base = GroundTruth()
    gpu = _gpu(f"{source}: gpu", data["gpu"]) if "gpu" in data else base.gpu
    if "memory_gpu" in data:
        memory_gpu = _gpu(f"{source}: memory_gpu", data["memory_gpu"])
    else:
        memory_gpu = gpu if "gpu" in data else base.memory_gpu
    model = _build(ModelSpec, f"{source}: model", data.get("model", {}))
    _check_heads(f"{source}: model", model)
    truth = GroundTruth(
        model=model,
        gpu=gpu,
        memory_gpu=memory_gpu,
        calibration=_build(Calibration, f"{source}: calibration", data.get("calibration", {})),
        surroundings=_build(Surroundings, f"{source}: surroundings",
                            data.get("surroundings", {})),
    )
    try:
        # Usable: room for one KV block per GPU (none: a worker could cache nothing, and a
        # live rank daemon refuses a capacity of 0), and a finite, positive prefill time at
        # the smallest and a large request on one GPU and on a CP group, a large one's at
        # most MAX_PREFILL_S.
        if truth.kv_capacity_blocks(1) < 1:
            raise InvalidInput(
                f"{truth.memory_gpu.name} holds no KV block of {DEFAULT_BLOCK_SIZE} tokens: "
                f"each token's KV takes {truth.model.kv_bytes_per_token:.3g} B (model.layers "
                f"× 2 × kv_heads × head_dim × dtype_bytes) and "
                f"{_free_bytes(truth):.3g} B are free after weights and reserve")
        for r, c in ((1, 1), (131_072, 1), (131_072, 8)):
            t = truth.prefill_time(r, 0, c)
            if not (math.isfinite(t) and t > 0):
                raise InvalidInput(f"a prefill of {r} tokens at degree {c} takes {t!r} s")
            if (r, c) == (131_072, 1) and t > MAX_PREFILL_S:
                raise InvalidInput(
                    f"a prefill of {r:,} tokens on one GPU would take {t:.3g} s, more than "
                    f"{MAX_PREFILL_S:,.0f} s (a day; the default hardware: "
                    f"{DEFAULT_GROUND_TRUTH.prefill_time(r, 0, 1):.0f} s): some rate or "
                    f"size is far from any real GPU's")
    except (InvalidInput, ArithmeticError) as exc:
        raise InvalidInput(f"{source}: not a usable ground truth: {exc}") from None
    return truth


def _free_bytes(truth: GroundTruth) -> float:
    """HBM of the memory GPU left for KV after the weights and the reserve."""
    return (truth.memory_gpu.hbm_bytes - truth.model.weight_bytes
            - truth.surroundings.kv_reserve_bytes)


def load_ground_truth(path: str | Path) -> GroundTruth:
    """Read a hardware file (``.json`` or ``.toml``, UTF-8); see the module docstring.

    Raises :class:`InvalidInput` naming the file: missing, a directory, another suffix, not
    UTF-8 (with the line), not valid JSON/TOML (:func:`~shared.files.read_config_file`), or a
    bad value (with the key).
    """
    data = read_config_file(path, "hardware file")
    return ground_truth_from_mapping(data, source=str(Path(path)))


def ground_truth_to_mapping(truth: GroundTruth) -> dict[str, Any]:
    """Every field of ``truth`` as a hardware mapping (what a run records in its meta.json;
    :func:`ground_truth_from_mapping` reads it back to an equal ground truth)."""
    def table(obj: Any) -> dict[str, Any]:
        return {f.name: (table(v) if isinstance(v := getattr(obj, f.name), Efficiency) else v)
                for f in fields(obj)}

    return {name: table(getattr(truth, name)) for name in SECTIONS}


__all__ = [
    "MAXIMA",
    "MAX_PREFILL_S",
    "SECTIONS",
    "ground_truth_from_mapping",
    "ground_truth_to_mapping",
    "load_ground_truth",
]
