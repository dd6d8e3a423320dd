"""Line-level parsing helpers shared by the JSONL readers; every failure names file:line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shared.ids import InvalidInput
from sim.workloads.errors import TraceFormatError


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (1-based line number, object) for each non-blank line; bad JSON (a truncated
    last line included) is a :class:`TraceFormatError` naming the line."""
    try:
        fh = path.open(encoding="utf-8")
    except OSError as exc:
        raise InvalidInput(f"cannot open trace {path}: {exc}") from exc
    with fh:
        for line_no, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(path, line_no, f"not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise TraceFormatError(path, line_no, "a line must be a JSON object")
            yield line_no, row


def int_field(row: dict[str, Any], key: str, path: Path, line: int, minimum: int) -> int:
    """``row[key]`` as an int >= ``minimum`` (bools are not ints here)."""
    if key not in row:
        raise TraceFormatError(path, line, f"missing field {key!r}")
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceFormatError(path, line, f"field {key!r} must be an integer, got {v!r}")
    if v < minimum:
        raise TraceFormatError(path, line, f"field {key!r} must be >= {minimum}, got {v}")
    return v


def hash_ids_field(
    row: dict[str, Any], input_len: int, block_size: int, path: Path, line: int
) -> tuple[int, ...]:
    """The full blocks' ids of a Mooncake ``hash_ids`` list (ceil(L/B) ids expected)."""
    hids = row.get("hash_ids")
    if not isinstance(hids, list):
        raise TraceFormatError(path, line, "field 'hash_ids' must be a list of integers")
    if any(isinstance(h, bool) or not isinstance(h, int) for h in hids):
        raise TraceFormatError(path, line, "field 'hash_ids' must hold only integers")
    expected = -(-input_len // block_size)
    if len(hids) != expected:
        raise TraceFormatError(
            path,
            line,
            f"{len(hids)} hash_ids for input_length {input_len}; expected "
            f"ceil({input_len}/{block_size}) = {expected} (is the block size {block_size}?)",
        )
    return tuple(hids[: input_len // block_size])
