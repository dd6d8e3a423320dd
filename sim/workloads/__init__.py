"""Workloads: one request record for every trace format and for the synthetic default.

Readers: :func:`read_mooncake` (Mooncake JSONL), :func:`read_azure` (Azure 2023 CSV),
:func:`read_leval` (L-Eval, Poisson arrivals), :func:`generate` (embedded synthetic default).
Transformations: :func:`scale_rate`, :func:`truncate`. Statistics: :func:`workload_stats`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shared.files import path_kind
from shared.ids import InvalidInput
from sim.workloads.azure import read_azure
from sim.workloads.errors import TraceFormatError
from sim.workloads.leval import read_leval
from sim.workloads.mooncake import read_mooncake
from sim.workloads.parsing import first_nonblank_line
from sim.workloads.stats import oracle_reuse, workload_stats
from sim.workloads.synthetic import Phase, SyntheticConfig, generate
from sim.workloads.workload import Request, Workload, scale_rate, truncate

TRACES_ENV = "VERTUMNUS_TRACES"


def default_traces_dir() -> Path:
    """Where the public traces live: ``$VERTUMNUS_TRACES`` if set, else ``../shared/data/traces``
    next to the repository (the layout of the development and CI machines). May not exist."""
    env = os.environ.get(TRACES_ENV)
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    return (repo / ".." / "shared" / "data" / "traces").resolve()


def load_workload(
    spec: str | Path,
    *,
    seed: int = 0,
    rate: float | None = None,
    **kwargs: Any,
) -> Workload:
    """Load a workload from a path, choosing the reader by content, or ``"synthetic"``.

    ``*.csv`` → Azure; JSONL whose first row has ``doc_sha1`` → L-Eval (needs ``rate``, req/s);
    other JSONL → Mooncake (two or more requests all at one instant are an error there; see
    :func:`read_mooncake`). ``rate`` for the other formats rescales arrivals to that mean
    rate (Mooncake/Azure) or sets the synthetic base rate. Extra keyword arguments go to the
    reader. Bad input (a missing file, a directory, a malformed or non-UTF-8 trace) is
    :class:`InvalidInput` (:class:`TraceFormatError` naming file:line where it has one).
    """
    if str(spec) == "synthetic":
        cfg = SyntheticConfig(rate=rate) if rate is not None else SyntheticConfig()
        return generate(cfg, seed=seed, **kwargs)
    path = Path(spec)
    kind = path_kind(path, "workload")
    if kind == "dir":
        raise InvalidInput(f"workload {spec!r} is a directory, not a trace file")
    if kind != "file":
        raise InvalidInput(f"workload {spec!r} is neither 'synthetic' nor an existing file")
    if path.suffix.lower() == ".csv":
        wl = read_azure(path, **kwargs)
    else:
        first = first_nonblank_line(path)  # bad UTF-8 here is a TraceFormatError, too
        if '"doc_sha1"' in first:
            if rate is None:
                raise InvalidInput(f"{path}: L-Eval has no arrival times; give a rate (req/s)")
            return read_leval(path, rate=rate, seed=seed, **kwargs)
        wl = read_mooncake(path, seed=seed, **kwargs)
    if rate is not None and wl.duration_s > 0:
        wl = scale_rate(wl, rate / (len(wl) / wl.duration_s))
    return wl


__all__ = [
    "TRACES_ENV",
    "Phase",
    "Request",
    "SyntheticConfig",
    "TraceFormatError",
    "Workload",
    "default_traces_dir",
    "first_nonblank_line",
    "generate",
    "load_workload",
    "oracle_reuse",
    "read_azure",
    "read_leval",
    "read_mooncake",
    "scale_rate",
    "truncate",
    "workload_stats",
]
