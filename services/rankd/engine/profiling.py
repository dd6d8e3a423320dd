"""``vertumnus profile --backend torch``: measure the real CP engine, fit Ê_C, write the profile.

1. **Measure**: a world of max(degrees) rank processes (gloo on CPU, NCCL on GPU;
   :class:`~services.rankd.torch_world.TorchWorld`, every lattice group created once) runs a
   model (a small random Qwen3 in float32 by default, or a checkpoint; the CLI measures the
   engine rankd's ``VTM_TORCH_*`` settings name, :func:`rankd_engine`). For each degree C the
   ranks switch to C (``RankEngine.switch``, no restart) and the first degree-C worker (ranks
   [0, C)) prefills every (R, P) point of the grid: the P-token prefix is prefilled first (so
   it is cached as whole blocks), then the full P + R request, whose engine step (lookup of the
   cached prefix, zigzag CP prefill of R tokens, storing new blocks) is timed on every member;
   the sample is the slowest member's time, and the median (or ``min``) over ``repeats``
   fresh requests (new random ids, so nothing else is reused) is fitted. Per degree, one
   untimed pass over the whole grid (``warmup``) runs first, so that no timed request is the
   first of its shape; the repeats are interleaved over the grid (slow drifts of a shared
   machine's load hit every point alike), and their spread is reported as the noise floor.
2. **Fit** Eq. 2 with :func:`shared.costmodel.fit_profile` twice: one coefficient set for all
   degrees, and one set per degree (``per_degree=True``). Both MAPEs against the measurements
   are reported; the profile stores the per-degree fit only if its MAPE is lower (the report
   says which was stored).
3. **Write** ``profile.json`` (loadable by ``Profile.load``), ``profile_report.json``
   (coefficients, ``mape_vs_measured``, both fits' MAPE overall and per degree, every sample),
   ``profile_samples.csv`` and ``profile_fit.png`` (predicted vs measured, log-log, Agg).

κ_C is not measured on the torch engine (a load ramp of a real engine is an experiment of its
own); the profile has none, so the controller falls back to ``Profile.kappa_for``'s default.
On a CPU box the world is capped at ``max_world`` ranks (default 4): larger degrees (e.g. 8
from the CLI's default list) are dropped with a note in the report.
"""

from __future__ import annotations

import csv
import json
import math
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from services.rankd.torch_settings import TINY_MODEL
from services.rankd.torch_spec import DTYPES as DTYPES  # the engine's dtypes, re-exported
from shared.costmodel import Profile, Sample, fit_profile

PROFILE_MODEL: Final[dict[str, Any]] = dict(TINY_MODEL)
"""The default profiled model: the random model rankd runs when ``VTM_TORCH_*`` names none
(``TorchSettings``' default, :data:`~services.rankd.torch_settings.TINY_MODEL`); small enough
for a CPU world of 4 on 2 cores. ``vertumnus profile --backend torch`` profiles whatever
rankd's settings name (:func:`rankd_engine`)."""

DEFAULT_LENGTHS: Final[tuple[int, ...]] = (16, 32, 64, 128, 256, 512)
DEFAULT_PREFIXES: Final[tuple[int, ...]] = (0, 128, 512)
DEFAULT_REPEATS: Final[int] = 5
CPU_MAX_WORLD: Final[int] = 4

PROFILE_FILE: Final[str] = "profile.json"
REPORT_FILE: Final[str] = "profile_report.json"
PLOT_FILE: Final[str] = "profile_fit.png"
SAMPLES_FILE: Final[str] = "profile_samples.csv"


def _degrees(degrees: Sequence[int], max_world: int) -> tuple[tuple[int, ...], list[str]]:
    from shared.ids import InvalidInput

    degs = sorted({int(d) for d in degrees})
    if not degs or any(d < 1 or d & (d - 1) for d in degs):
        raise InvalidInput(f"degrees must be powers of two >= 1, got {list(degrees)!r}")
    notes = []
    dropped = [d for d in degs if d > max_world]
    if dropped:
        notes.append(
            f"degrees {dropped} ignored: this machine's world is capped at {max_world} ranks"
        )
    kept = tuple(d for d in degs if d <= max_world)
    if not kept:
        raise InvalidInput(f"no degree <= {max_world} among {degs}")
    return kept, notes


def measure(
    degrees: Sequence[int],
    lengths: Sequence[int],
    prefixes: Sequence[int],
    repeats: int,
    *,
    seed: int = 0,
    model_config: dict[str, Any] | None = None,
    model_path: str | None = None,
    block_size: int = 16,
    device: str = "cpu",
    dtype: str = "float32",
    warmup: int = 1,
    threads: int = 1,
) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """Raw measurements (one dict per request timed) and each degree's switch time (s).

    ``warmup``: untimed passes over the whole (R, P) grid per degree before the timed ones
    (0: a single warm-up request per degree), so that no timed request is the first of its
    shape (allocator growth, kernel selection). ``threads``: torch intra-op threads per rank
    (``VTM_TORCH_THREADS``)."""
    from services.rankd.torch_world import TorchWorld, WorldSpec
    from shared.ids import InvalidInput

    if repeats < 1:
        raise InvalidInput(f"repeats must be >= 1, got {repeats}")
    bad = [p for p in prefixes if p % block_size]
    if bad:
        raise InvalidInput(f"prefixes {bad} are not multiples of the block size {block_size}")
    if any(r < 1 for r in lengths) or any(p < 0 for p in prefixes):
        raise InvalidInput("lengths must be >= 1 and prefixes >= 0")
    cfg = dict(model_config or PROFILE_MODEL)
    need = max(prefixes) + max(lengths)
    if model_path is None and cfg.get("max_position_embeddings", 0) < need:
        cfg["max_position_embeddings"] = need
    world_size = max(degrees)
    # Enough pages for one request at a time of the longest point on every rank, and more.
    pages = 4 * (-(-need // block_size)) + 64
    spec = WorldSpec(
        world_size=world_size,
        degrees=tuple(degrees),
        initial_degrees=(world_size,),
        model_config=None if model_path else cfg,
        model_path=model_path,
        seed=seed,
        dtype=dtype,
        block_size=block_size,
        pages_per_rank=pages,
        device=device,
        threads=threads,
    )
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    switch_s: dict[int, float] = {}
    with TorchWorld(spec) as world:
        vocab = world.vocab_size
        all_ranks = list(range(world_size))
        for epoch, c in enumerate(sorted(degrees, reverse=True), start=1):
            t0 = time.perf_counter()
            world.switch(all_ranks, epoch, c)
            switch_s[c] = time.perf_counter() - t0
            members = list(range(c))
            warm = rng.integers(0, vocab, min(lengths) + block_size).tolist()
            world.prefill(members, warm)
            for _ in range(warmup):
                for p in prefixes:
                    for r in lengths:
                        ids = rng.integers(0, vocab, p + r).tolist()
                        if p:
                            world.prefill(members, ids[:p])
                        world.prefill(members, ids)
            for rep in range(repeats):
                for p in prefixes:
                    for r in lengths:
                        ids = rng.integers(0, vocab, p + r).tolist()
                        if p:
                            world.prefill(members, ids[:p])
                        replies = world.prefill(members, ids)
                        rows.append(
                            {
                                "degree": c,
                                "r": r,
                                "p": p,
                                "repeat": rep,
                                "prefix_reused": replies[0].prefix_len,
                                "seconds": max(x.seconds for x in replies),
                                "per_rank_s": [x.seconds for x in replies],
                            }
                        )
    return rows, switch_s


ESTIMATORS: Final[dict[str, Any]] = {"median": statistics.median, "min": min}
"""How the repeats of one (R, P, C) point become the fitted sample."""


def _medians(rows: Sequence[dict[str, Any]], estimator: str = "median") -> list[Sample]:
    est = ESTIMATORS[estimator]
    groups: dict[tuple[int, int, int], list[float]] = {}
    for row in rows:
        groups.setdefault((row["r"], row["p"], row["degree"]), []).append(row["seconds"])
    return [Sample(r, p, c, float(est(v))) for (r, p, c), v in sorted(groups.items())]


def spread(rows: Sequence[dict[str, Any]]) -> float:
    """Measurement noise: the median over points of (max − min) / median of the repeats."""
    groups: dict[tuple[int, int, int], list[float]] = {}
    for row in rows:
        groups.setdefault((row["r"], row["p"], row["degree"]), []).append(row["seconds"])
    rel = [(max(v) - min(v)) / statistics.median(v) for v in groups.values() if len(v) > 1]
    return float(statistics.median(rel)) if rel else 0.0


def plot_fits(
    fits: Sequence[tuple[str, Profile]], samples: Sequence[Sample], path: str | Path
) -> Path:
    """Predicted vs measured prefill time, log-log, one panel per fit, one colour per degree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, len(fits), figsize=(5.0 * len(fits), 4.5), dpi=110, squeeze=False)
    for ax, (label, prof) in zip(axes[0], fits, strict=True):
        lo, hi = math.inf, 0.0
        for c in sorted({s.degree for s in samples}):
            meas = np.array([s.seconds for s in samples if s.degree == c])
            pred = np.array([prof.predict(s.r, s.p, s.degree) for s in samples if s.degree == c])
            pred = np.maximum(pred, 1e-9)
            ax.scatter(meas, pred, s=14, alpha=0.8, label=f"C={c}")
            lo, hi = min(lo, meas.min(), pred.min()), max(hi, meas.max(), pred.max())
        line = np.array([lo * 0.8, hi * 1.25])
        ax.plot(line, line, "k-", lw=0.8, label="y = x")
        ax.plot(line, line * 1.15, "k:", lw=0.6, label="±15%")
        ax.plot(line, line / 1.15, "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # decade labels only: no overlap
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("Measured prefill time (s)")
        ax.set_ylabel("Predicted prefill time (s)")
        ax.set_title(f"{label}: MAPE {100 * (prof.fit_mape or math.nan):.1f}%", fontsize=9)
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
        ax.legend(fontsize=7)
    fig.suptitle("Ê_C on the torch CP engine", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


def default_prefixes(block_size: int) -> tuple[int, ...]:
    """:data:`DEFAULT_PREFIXES` in whole blocks of ``block_size`` tokens (a cached prefix is
    whole blocks): each rounded down to a multiple, and one block added when that leaves
    P = 0 alone (the fit needs two prefix lengths). 16-token blocks: the defaults as they are;
    512 (the stack's default block, ``VTM_TORCH_BLOCK_SIZE=512``): (0, 512)."""
    ps = sorted({p - p % block_size for p in DEFAULT_PREFIXES})
    if len(ps) < 2:
        ps.append(ps[0] + block_size)
    return tuple(ps)


def rankd_engine(
    settings: Any = None,
    *,
    model_path: str | Path | None = None,
    block_size: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """The engine rankd runs, as :func:`torch_profile_command`'s keywords (``model_config``,
    ``model_path``, ``block_size``, ``device``, ``dtype``, ``threads``): those of ``settings``
    (a ``TorchSettings``; None: read from the environment, ``VTM_TORCH_*``, as rankd reads
    it), each overridden by the keyword given here (the CLI's ``--model-path``,
    ``--block-size``, ``--device``, ``--dtype``). A model path, from either, wins over the
    settings' ``model_json`` as it does in rankd.

    Checked before anything starts; raises :class:`~shared.ids.InvalidInput` naming the
    option (``--model-path``) or the variable (``VTM_TORCH_MODEL_PATH``) the bad value came
    from: a model path that is no checkpoint directory (its ``config.json`` is read), a
    ``model_json`` that is not JSON or no Qwen3 config the model can be built from, a device
    other than cpu / cuda, cuda without a CUDA device, a dtype not in :data:`DTYPES`, a block
    size < 1 -- the checks of rankd's start (services/rankd/torch_spec.py) but for the
    checkpoint's tensors."""
    from services.rankd.engine.checkpoint import load_config
    from services.rankd.engine.device import check_device
    from services.rankd.torch_settings import torch_settings_from_env
    from services.rankd.torch_spec import check_dtype, random_model_config
    from shared.ids import InvalidInput

    ts = torch_settings_from_env() if settings is None else settings

    def pick(name: str, given: Any) -> tuple[Any, str]:
        if given is not None:
            return given, "--" + name.replace("_", "-")
        return getattr(ts, name), f"VTM_TORCH_{name.upper()}"

    path, path_src = pick("model_path", None if model_path is None else str(model_path))
    bs, bs_src = pick("block_size", block_size)
    dev, dev_src = pick("device", device)
    dt, dt_src = pick("dtype", dtype)
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise InvalidInput(f"{bs_src} must be an integer >= 1 (tokens per cache block), "
                           f"got {bs!r}")
    # The checks rankd runs on the same values before it spawns its ranks (torch_spec).
    check_device(dev, dev_src)
    check_dtype(dt, dt_src)
    cfg: dict[str, Any] | None = None
    if path:
        try:  # its config alone (rankd reads the safetensors headers too: torch_spec)
            load_config(path)
        except InvalidInput as exc:
            raise InvalidInput(f"{path_src} {path}: {exc} (a local HF-format Qwen3 "
                               "checkpoint directory)") from None
    else:
        cfg = random_model_config(ts.model_json)
    return {"model_config": cfg, "model_path": path or None, "block_size": bs,
            "device": dev, "dtype": dt, "threads": ts.threads}


def torch_profile_command(
    out_dir: str | Path,
    degrees: Sequence[int] = (1, 2, 4),
    seed: int = 0,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    prefixes: Sequence[int] | None = None,
    repeats: int = DEFAULT_REPEATS,
    *,
    model_config: dict[str, Any] | None = None,
    model_path: str | None = None,
    block_size: int = 16,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = 1,
    max_world: int | None = None,
    warmup: int = 1,
    estimator: str = "median",
) -> Path:
    """Profile the real engine (module docstring); returns the path of ``profile.json``.

    The engine: ``model_config`` (a random model; None: :data:`PROFILE_MODEL`) or
    ``model_path``, its ``block_size``, ``device``, ``dtype`` and ``threads`` per rank;
    :func:`rankd_engine` gives those of the engine rankd runs. ``prefixes`` None:
    :func:`default_prefixes` of the block size. ``warmup``: untimed passes over the grid per
    degree (:func:`measure`); ``estimator``: ``median`` (default: the typical time, what a
    scheduler faces) or ``min`` (the interference-free time; lower fit error on a shared
    machine, but biased low against typical times) of the repeats of each point."""
    from shared.ids import InvalidInput

    if estimator not in ESTIMATORS:
        raise InvalidInput(f"estimator must be one of {sorted(ESTIMATORS)}, got {estimator!r}")
    if prefixes is None:
        prefixes = default_prefixes(block_size)
    if max_world is None:
        if device == "cuda":
            import torch

            max_world = max(1, torch.cuda.device_count())
        else:
            max_world = CPU_MAX_WORLD
    degs, notes = _degrees(degrees, max_world)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows, switch_s = measure(
        degs,
        lengths,
        prefixes,
        repeats,
        seed=seed,
        model_config=model_config,
        model_path=model_path,
        block_size=block_size,
        device=device,
        dtype=dtype,
        warmup=warmup,
        threads=threads,
    )
    wall = time.perf_counter() - t0
    reused_wrong = [r for r in rows if r["prefix_reused"] != r["p"]]
    if reused_wrong:
        notes.append(f"{len(reused_wrong)} requests reused a prefix other than the planned P")
    samples = _medians(rows, estimator)
    cfg = model_config or PROFILE_MODEL
    name = model_path or (
        f"qwen3-random(seed={seed}, layers={cfg['num_hidden_layers']}, "
        f"hidden={cfg['hidden_size']}, heads={cfg['num_attention_heads']}/"
        f"{cfg['num_key_value_heads']})"
    )
    comm = "nccl" if device == "cuda" else "gloo"
    per_rank = "1 thread/rank" if threads == 1 else f"{threads} threads/rank"
    hardware = f"{device}:{platform.machine()} world={max(degs)} ({comm}, {per_rank})"
    base = Profile(block_size=block_size, model=name, hardware=hardware)
    single = fit_profile(samples, base=base)
    per = fit_profile(samples, per_degree=True, base=base)
    use_per = (per.fit_mape or math.inf) < (single.fit_mape or math.inf) and bool(per.per_degree)
    chosen = per if use_per else single
    chosen.save(out / PROFILE_FILE)
    plot_fits([("one coefficient set", single), ("per-degree sets", per)], samples, out / PLOT_FILE)
    with (out / SAMPLES_FILE).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["degree", "r", "p", "repeat", "prefix_reused", "seconds"])
        for row in rows:
            w.writerow([row[k] for k in ("degree", "r", "p", "repeat", "prefix_reused", "seconds")])
    report = {
        "backend": "torch",
        "model": name,
        "model_config": None if model_path else cfg,
        "hardware": hardware,
        "degrees": list(degs),
        "grid": {"lengths": list(lengths), "prefixes": list(prefixes), "repeats": repeats},
        "warmup_passes": warmup,
        "estimator": estimator,
        # Noise floor: median over points of (max − min) / median of their repeats.
        "repeat_spread": spread(rows),
        "block_size": block_size,
        "dtype": dtype,
        "threads": threads,
        "seed": seed,
        "stored": "per_degree" if use_per else "single",
        "coefficients": chosen.coefficients.as_dict(),
        "per_degree_coefficients": {str(c): co.as_dict() for c, co in chosen.per_degree.items()},
        "mape_vs_measured": chosen.fit_mape,
        "mape_vs_measured_per_degree": {str(c): m for c, m in chosen.fit_mape_per_degree.items()},
        "single_set": {
            "coefficients": single.coefficients.as_dict(),
            "mape": single.fit_mape,
            "mape_per_degree": {str(c): m for c, m in single.fit_mape_per_degree.items()},
        },
        "per_degree_fit": {
            "coefficients": {str(c): co.as_dict() for c, co in per.per_degree.items()},
            "mape": per.fit_mape,
            "mape_per_degree": {str(c): m for c, m in per.fit_mape_per_degree.items()},
        },
        "switch_s": {str(c): s for c, s in switch_s.items()},
        "kappa": None,
        "notes": notes
        + ["κ_C is not measured on the torch engine; the controller uses its default"],
        "wall_s": wall,
        "samples": [
            {"r": s.r, "p": s.p, "degree": s.degree, "seconds": s.seconds} for s in samples
        ],
        "raw": rows,
        "files": {
            "profile": PROFILE_FILE,
            "plot": PLOT_FILE,
            "samples": SAMPLES_FILE,
            "report": REPORT_FILE,
        },
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return out / PROFILE_FILE
