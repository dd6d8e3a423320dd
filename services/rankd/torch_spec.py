"""The torch pool's world from its settings: every ``VTM_TORCH_*`` value checked and turned
into the :class:`~services.rankd.torch_world.WorldSpec` the rank processes are spawned with.

One definition for the two places that read those values: :meth:`TorchPool.start
<services.rankd.torch_backend.TorchPool.start>` builds its spec here (:func:`world_spec`), and
rankd's entry point (:func:`services.rankd.main.run_rankd`) asks :func:`torch_problems`
before it starts anything, so a value the pool would refuse -- or that would fail only inside
every spawned rank, a child's traceback reported as a broken world -- ends the daemon with
status 2 and a line naming the variable, the value and what it may be. The checks are the
ranks' own parsing run in the parent: the dtype's name as :func:`torch_dtype` maps it (what
a rank and the decode role build with), the model config through ``Qwen3Config.from_dict`` and
the model's constructor on the meta device (no memory), a checkpoint through the loader's
own checks on the files' headers (``checkpoint.check_checkpoint``), the seed through the
generator a random model is drawn from, the device through ``engine.device.check_device``.

Importing this module imports no torch; the checks that need it import it when they run (a
daemon on the ``torch`` backend has it, or is told it needs the 'engine' extra).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from services.rankd.torch_settings import InvalidTorchSettings, TorchSettings, read_torch_settings
from services.rankd.torch_world import WorldSpec
from shared.ids import InvalidInput
from shared.worker import GpuGroup, WorkerKind

if TYPE_CHECKING:
    import torch

    from services.rankd.settings import RankdSettings

DTYPES: Final[tuple[str, ...]] = ("float32", "float64", "bfloat16", "float16")
"""The engine's dtypes (``VTM_TORCH_DTYPE``), by the names torch gives them."""
SEED_RANGE: Final[range] = range(-(2**63), 2**64)
"""Seeds torch's generator takes (what ``Qwen3ForCausalLM.random`` seeds it with)."""


def check_dtype(value: object, source: str = "VTM_TORCH_DTYPE") -> str:
    """``value`` when it is one of :data:`DTYPES`, else :class:`InvalidInput` naming
    ``source`` (the variable or option it came from), the value and the allowed names."""
    if value not in DTYPES:
        raise InvalidInput(f"{source} must be one of {', '.join(DTYPES)}, got {value!r}")
    return str(value)


def torch_dtype(name: str, source: str = "VTM_TORCH_DTYPE") -> torch.dtype:
    """The torch dtype a rank process and the decode role build the model in
    (:func:`check_dtype` first: ``getattr(torch, name)`` alone took ``int8`` or ``nn``)."""
    import torch

    dtype = getattr(torch, check_dtype(name, source))
    assert isinstance(dtype, torch.dtype)
    return dtype


def lattice_degrees(text: str, world_size: int, source: str = "VTM_TORCH_DEGREES",
                    ) -> tuple[int, ...]:
    """The lattice degrees of a world of ``world_size`` ranks from ``text`` (comma-separated
    powers of two, ``"1,2,4,8"``; empty: degree 1 alone): those dividing ``world_size``, and
    1, ascending. An entry that is no power of two >= 1 raises :class:`InvalidInput` naming
    ``source``, the value and what it takes (before, ``x`` was a ValueError traceback, ``0`` a
    ZeroDivisionError, ``3`` an InvalidInput of the world's spec)."""
    entries = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in entries if not x.isdecimal() or int(x) < 1 or int(x) & (int(x) - 1)]
    if bad:
        raise InvalidInput(f"{source} must be comma-separated powers of two >= 1 (e.g. "
                           f"'1,2,4,8'), got {text!r} ({', '.join(map(repr, bad))})")
    return tuple(sorted({d for d in map(int, entries) if world_size % d == 0} | {1}))


def initial_degrees(gpus: range, initial_workers: Sequence[str]) -> list[int]:
    """Each rank's degree at start-up (rank i runs GPU ``gpus.start + i``): its initial
    worker's, else 1. Raises :class:`~shared.ids.InvalidInput` naming the worker and the GPU
    range when a worker's GPUs are not all in ``gpus`` (before, one past the end was an
    IndexError and one before the start a negative index: a world in the wrong degrees)."""
    initial = [1] * len(gpus)
    for wid in initial_workers:
        g = GpuGroup.from_worker_id(wid)
        if g.gpus.start < gpus.start or g.gpus.stop > gpus.stop:
            raise InvalidInput(
                f"initial worker {wid} (GPUs {g.gpus.start}-{g.gpus.stop - 1}) is outside "
                f"this host's GPUs {gpus.start}-{gpus.stop - 1}"
            )
        for gpu in g.gpus:
            initial[gpu - gpus.start] = g.degree
    return initial


def check_seed(seed: int, source: str = "VTM_TORCH_SEED") -> int:
    """``seed`` when torch's generator takes it (:data:`SEED_RANGE`), else
    :class:`InvalidInput` naming ``source``: each rank seeded with it failed."""
    if seed not in SEED_RANGE:
        raise InvalidInput(f"{source} must be an integer in [{SEED_RANGE.start}, "
                           f"{SEED_RANGE.stop - 1}] (a torch generator's seed), got {seed}")
    return seed


def random_model_config(model_json: str, source: str = "VTM_TORCH_MODEL_JSON",
                        ) -> dict[str, Any]:
    """The Qwen3 config (a JSON object) of the random model, checked as the ranks use it:
    read by ``Qwen3Config.from_dict`` and built on the meta device (the constructor's own
    checks, no memory: a negative ``intermediate_size``, a ``decoder_sparse_step`` of 0).
    A problem raises :class:`InvalidInput` naming ``source``."""
    try:
        data = json.loads(model_json)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{source} must be a JSON object (a Qwen3 config), got "
                           f"{type(data).__name__}")
    from services.rankd.engine.checkpoint import expected_tensors
    from services.rankd.engine.config import Qwen3Config

    try:
        cfg = Qwen3Config.from_dict(data)
    except InvalidInput as exc:
        raise InvalidInput(f"{source}: {exc}") from None
    try:
        expected_tensors(cfg)  # the model's constructor on the meta device
    except Exception as exc:  # whatever the constructor raises, each rank would raise too
        raise InvalidInput(f"{source}: the model cannot be built from this config: "
                           f"{type(exc).__name__}: {exc}") from None
    return data


def check_model_path(path: str, source: str = "VTM_TORCH_MODEL_PATH") -> str:
    """``path`` when it is a checkpoint every rank can load: the loader's checks on its
    config and its safetensors files' headers (``checkpoint.check_checkpoint``, no weight
    read), else :class:`InvalidInput` naming ``source`` and the path."""
    from services.rankd.engine.checkpoint import check_checkpoint

    try:
        check_checkpoint(path)
    except InvalidInput as exc:
        raise InvalidInput(f"{source} {path}: {exc} (a local HF-format Qwen3 checkpoint "
                           "directory)") from None
    return path


def world_spec(ts: TorchSettings, gpus: range, initial_workers: Sequence[str] = ()) -> WorldSpec:
    """The spec of a torch world over ``gpus`` (rank i on GPU ``gpus.start + i``) whose
    ranks not covered by ``initial_workers`` start at degree 1, from ``ts``.

    Every value is checked first, the way the ranks use it (module docstring); the problems
    are raised together as :class:`~services.rankd.torch_settings.InvalidTorchSettings` (an
    InvalidInput), each naming its variable and value. ``model_json`` and ``seed`` are used
    (and checked) only without a ``model_path``, which wins over them."""
    from services.rankd.engine.device import check_device

    problems: list[str] = []

    def checked(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except InvalidInput as exc:
            problems.append(str(exc))
            return None

    n = len(gpus)
    degrees = checked(lattice_degrees, ts.degrees, n)
    initial = checked(initial_degrees, gpus, initial_workers)
    if degrees is not None and initial is not None:
        for wid in initial_workers:
            d = GpuGroup.from_worker_id(wid).degree
            if d not in degrees:
                problems.append(
                    f"VTM_TORCH_DEGREES={ts.degrees!r} lacks degree {d} of the initial worker "
                    f"{wid} (the degrees of a world of {n} GPUs: {', '.join(map(str, degrees))})")
    checked(check_dtype, ts.dtype)
    checked(check_device, ts.device, "VTM_TORCH_DEVICE", gpus)
    config: dict[str, Any] | None = None
    if ts.model_path:
        checked(check_model_path, ts.model_path)
    else:
        checked(check_seed, ts.seed)
        config = checked(random_model_config, ts.model_json)
    if problems:
        raise InvalidTorchSettings(problems)
    assert degrees is not None and initial is not None
    return WorldSpec(
        world_size=n,
        degrees=degrees,
        initial_degrees=tuple(initial),
        model_config=config,
        model_path=ts.model_path or None,
        seed=ts.seed,
        dtype=ts.dtype,
        block_size=ts.block_size,
        pages_per_rank=ts.pages_per_rank,
        gpu_offset=gpus.start,
        device=ts.device,
        threads=ts.threads,
    )


def torch_problems(settings: RankdSettings, overrides: Mapping[str, str] | None = None,
                   ) -> list[str]:
    """What keeps a rank daemon of ``settings`` from starting its torch pool, one line per
    problem naming the variable and the value ([]: nothing, or not the ``torch`` backend).

    The pool's GPUs and initial workers are the daemon's (the host's range and
    ``VTM_INITIAL_WORKERS``, or one worker's GPUs); the ``VTM_TORCH_*`` values are read from
    the environment as the pool reads them, ``overrides`` (``VTM_TORCH_*`` variables: a
    child's environment over this process's) winning (:func:`~services.rankd.torch_settings.
    read_torch_settings`: a value pydantic refuses is named, the other fields checked still)
    and checked by :func:`world_spec`. Also refused: ``VTM_KIND=tp`` for a single worker, or
    a host with initial workers (each starts in ``VTM_KIND``; the engine runs CP workers only:
    the pool had started, ranks and all, before it said so) and a missing 'engine' extra
    (torch not importable)."""
    if settings.backend != "torch":
        return []
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        return [f"VTM_BACKEND=torch needs the 'engine' extra (pip install "
                f"'vertumnus[engine]'): {exc}"]
    ts, problems = read_torch_settings(overrides)
    gpus = settings.host_range
    if gpus is None:
        gpus = GpuGroup.from_worker_id(settings.worker_id).gpus
        workers = [settings.worker_id]
    else:
        workers = settings.initial_worker_ids
    # The kind the worker (a host: each initial worker) starts in; a host's workers from the
    # epoch record start in the record's kinds, not this one.
    if workers and settings.kind != WorkerKind.CP:
        problems.append(f"VTM_KIND={settings.kind.value!r}: the torch backend runs CP "
                        "workers only (tp is a sim baseline)")
    try:
        world_spec(ts, gpus, workers)
    except InvalidTorchSettings as exc:
        problems.extend(exc.problems)
    except InvalidInput as exc:  # the spec's own checks: nothing above should leave one
        problems.append(str(exc))
    return problems


__all__ = ["DTYPES", "SEED_RANGE", "check_dtype", "check_model_path", "check_seed",
           "initial_degrees", "lattice_degrees", "random_model_config", "torch_dtype",
           "torch_problems", "world_spec"]
