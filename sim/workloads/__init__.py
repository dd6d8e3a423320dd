"""Workloads: one request record for every trace format and for the synthetic default.

Readers: :func:`read_mooncake` (Mooncake JSONL), :func:`read_azure` (Azure 2023 CSV),
:func:`read_leval` (L-Eval, Poisson arrivals), :func:`generate` (embedded synthetic default).
Transformations: :func:`scale_rate`, :func:`scale_to_rate`, :func:`truncate`. Statistics:
:func:`workload_stats`.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from shared.files import NotJson, parse_json, path_kind
from shared.ids import InvalidInput
from sim.workloads.azure import read_azure
from sim.workloads.errors import TraceFormatError
from sim.workloads.leval import read_leval
from sim.workloads.mooncake import read_mooncake
from sim.workloads.parsing import first_nonblank_line, iter_jsonl
from sim.workloads.stats import oracle_reuse, workload_stats
from sim.workloads.synthetic import Phase, SyntheticConfig, generate
from sim.workloads.synthetic_file import load_synthetic_config
from sim.workloads.workload import Request, Workload, scale_rate, scale_to_rate, truncate

TRACES_ENV = "VERTUMNUS_TRACES"

TraceFormat = Literal["mooncake", "azure", "leval", "synthetic"]
LEVAL_KEYS: tuple[str, ...] = ("doc_sha1", "doc_id")
"""Top-level keys that make a JSON-lines file L-Eval (:func:`detect_format`): both L-Eval
formats carry ``doc_sha1`` (the lengths format ``doc_id`` too); Mooncake traces have neither."""


def default_traces_dir() -> Path:
    """Where the public traces live: ``$VERTUMNUS_TRACES`` if set, else ``../shared/data/traces``
    next to the repository (the layout of the development and CI machines). May not exist."""
    env = os.environ.get(TRACES_ENV)
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    return (repo / ".." / "shared" / "data" / "traces").resolve()


def public_trace(rel: str, *, needed_by: str = "this run") -> Path:
    """The public trace ``rel`` (a path under the traces directory, e.g.
    ``mooncake/conversation_trace.jsonl``) in :func:`default_traces_dir`. Raises
    :class:`InvalidInput` when it is not a file there, naming ``$VERTUMNUS_TRACES``, the file
    name it expects under it and where it looked -- in a checkout not next to ``../shared``
    the default directory does not exist, and a bare "not found" of that path would not say
    how to point at the traces. ``needed_by``: what needs the file, for the message."""
    base = default_traces_dir()
    path = base / rel
    if path.is_file():
        return path
    where = (f"${TRACES_ENV} is {os.environ[TRACES_ENV]!r}" if os.environ.get(TRACES_ENV)
             else f"${TRACES_ENV} is not set, so {base} was looked in (../shared/data/traces "
             "next to the repository)")
    raise InvalidInput(f"{needed_by} needs the public trace {rel} under the traces directory, "
                       f"but {path} is not a file ({where}); set {TRACES_ENV} to the directory "
                       f"that holds {rel}")


def detect_format(path: str | Path) -> TraceFormat:
    """The reader a trace file needs: the one definition :func:`load_workload` and
    ``vertumnus simulate --format auto`` (``sim.runner.load_trace``) share.

    ``*.csv`` (any case) → ``"azure"``; ``*.toml`` → ``"synthetic"`` (the generator's
    parameters, :mod:`sim.workloads.synthetic_file`; no trace format is TOML; a ``.json``
    parameter file is named with ``--format synthetic``). Any other file by its first
    non-blank line: a JSON
    object with a key of :data:`LEVAL_KEYS` at its top level → ``"leval"``; anything else,
    unreadable JSON included (that reader then names the line) → ``"mooncake"``. The suffix
    of a JSON file does not matter, and a key is looked up in the parsed object rather than
    as text, so a value or a nested key spelled like one does not count. Bad bytes up to that
    line are a :class:`TraceFormatError` naming it (:func:`first_nonblank_line`).

    One exception: a file whose first row has L-Eval's key *and* a ``timestamp``, and a
    later row with another timestamp, is a timed trace that carries a document key →
    ``"mooncake"`` (L-Eval's Mooncake-form file has every timestamp 0; reading a timed trace
    as L-Eval would replace its arrivals with Poisson ones, silently).
    """
    path = Path(path)
    if path.suffix.lower() == ".csv":
        return "azure"
    if path.suffix.lower() == ".toml":
        return "synthetic"
    try:
        row = parse_json(first_nonblank_line(path))
    except NotJson:
        return "mooncake"
    if isinstance(row, dict) and any(k in row for k in LEVAL_KEYS):
        return "mooncake" if "timestamp" in row and _timestamps_vary(path) else "leval"
    return "mooncake"


def _looks_like_csv(path: Path) -> bool:
    """Whether the first non-blank line of ``path`` reads as a CSV header or row: commas,
    and no JSON object or array."""
    try:
        line = first_nonblank_line(path).strip()
    except TraceFormatError:
        return False
    return "," in line and not line.startswith(("{", "["))


def _timestamps_vary(path: Path) -> bool:
    """Whether a later row of JSON-lines ``path`` has another ``timestamp`` than the first
    row. Reads until one does (a timed trace: a tick or so) or to the end; a line that is not
    a JSON object ends the scan (False: the reader chosen then names that line)."""
    first: Any = None
    try:
        for i, (_, row) in enumerate(iter_jsonl(path)):
            if i == 0:
                first = row.get("timestamp")
            elif row.get("timestamp") != first:
                return True
    except TraceFormatError:
        pass
    return False


def load_workload(
    spec: str | Path,
    *,
    seed: int = 0,
    rate: float | None = None,
    **kwargs: Any,
) -> Workload:
    """Load a workload from a path, choosing the reader by content, or ``"synthetic"``.

    The format is :func:`detect_format`'s: ``*.csv`` → Azure; ``*.toml`` → the synthetic
    generator with that file's parameters (:func:`generate_from_file`); JSON lines whose
    first row has ``doc_sha1`` or ``doc_id`` → L-Eval (needs ``rate``, req/s); other JSON
    lines → Mooncake (two or more requests all at one instant are an error there; see
    :func:`read_mooncake`). ``rate`` for the other formats rescales arrivals to that mean
    rate (Mooncake/Azure: a mean inter-arrival gap of 1/``rate`` over the whole trace,
    :func:`scale_to_rate`) or sets the synthetic base rate (a parameter file's too). Extra
    keyword arguments go to the reader. Bad input (a missing file, a directory, a malformed
    or non-UTF-8 trace) is :class:`InvalidInput` (:class:`TraceFormatError` naming file:line
    where it has one).
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
    fmt = detect_format(path)  # bad UTF-8 on the first line is a TraceFormatError, too
    if fmt == "synthetic":
        return generate_from_file(path, seed=seed, rate=rate)
    if fmt == "azure":
        wl = read_azure(path, **kwargs)
    elif fmt == "leval":
        if rate is None:
            raise InvalidInput(f"{path}: L-Eval has no arrival times; give a rate (req/s)")
        return read_leval(path, rate=rate, seed=seed, **kwargs)
    else:
        try:
            wl = read_mooncake(path, seed=seed, **kwargs)
        except TraceFormatError as exc:
            if not exc.problem.startswith("not valid JSON") or not _looks_like_csv(path):
                raise
            raise TraceFormatError(path, exc.line, f"{exc.problem} (read as a Mooncake trace; it "
                                   "looks like CSV: an Azure trace is read from a file named "
                                   "*.csv, or with --format azure)") from None
    if rate is not None:
        wl = scale_to_rate(wl, rate)
    return wl


def generate_from_file(path: str | Path, *, seed: int = 0, rate: float | None = None
                       ) -> Workload:
    """The synthetic workload a parameter file describes (``.toml`` / ``.json``,
    :func:`~sim.workloads.synthetic_file.load_synthetic_config`), named after the file's stem;
    ``rate`` (req/s) replaces the file's base rate. Raises :class:`InvalidInput` naming the
    file and the key of a bad value."""
    path = Path(path)
    cfg = load_synthetic_config(path)
    if rate is not None:
        try:
            cfg = replace(cfg, rate=rate)
        except InvalidInput as exc:
            raise InvalidInput(f"{path} at rate {rate:g}: "
                               f"{str(exc).removeprefix('SyntheticConfig: ')}") from None
    return generate(cfg, seed=seed, name=path.stem or "synthetic")


__all__ = [
    "LEVAL_KEYS",
    "TRACES_ENV",
    "Phase",
    "Request",
    "SyntheticConfig",
    "TraceFormat",
    "TraceFormatError",
    "Workload",
    "default_traces_dir",
    "detect_format",
    "generate_from_file",
    "first_nonblank_line",
    "generate",
    "load_workload",
    "oracle_reuse",
    "public_trace",
    "read_azure",
    "read_leval",
    "read_mooncake",
    "scale_rate",
    "scale_to_rate",
    "truncate",
    "workload_stats",
]
