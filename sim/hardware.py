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
be 0) and the result must be usable: a model whose weights leave no room for KV in the memory
GPU is an error, and so is one whose heads do not fit grouped-query attention (``q_heads`` a
multiple of ``kv_heads``). Errors are :class:`~shared.ids.InvalidInput` naming the file and
the key.

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
from shared.ids import InvalidInput
from sim.groundtruth import (
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
                           f"got {v!r}")
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
        # Usable: room for KV, and a finite, positive prefill time at the smallest and a
        # large request on one GPU and on a CP group.
        truth.kv_capacity_blocks(1)
        for r, c in ((1, 1), (131_072, 1), (131_072, 8)):
            t = truth.prefill_time(r, 0, c)
            if not (math.isfinite(t) and t > 0):
                raise InvalidInput(f"a prefill of {r} tokens at degree {c} takes {t!r} s")
    except (InvalidInput, ArithmeticError) as exc:
        raise InvalidInput(f"{source}: not a usable ground truth: {exc}") from None
    return truth


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
    "SECTIONS",
    "ground_truth_from_mapping",
    "ground_truth_to_mapping",
    "load_ground_truth",
]
