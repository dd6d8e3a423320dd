"""Reader of the L-Eval long-context benchmark requests (OpenLMLab/LEval, derived files).

Two formats are accepted, told apart per file by their fields:

* lengths (``leval_requests.jsonl``): one (document, instruction) request per line with token
  counts (``llama3_tokens``, ``doc_llama3_tokens``, ``ref_output_llama3_tokens``, ...) and
  ``doc_sha1`` (equal ⇔ same document). Request text = document + "\\n\\n" + instruction, so
  the document's full blocks are a shared prefix: requests on the same document get the same
  chained ids for those blocks; the blocks from the document's end on are the request's own.
* Mooncake format (``leval_llama3_mooncake.jsonl``): real chained ``hash_ids`` computed from
  Llama-3 token ids, checked as the Mooncake reader checks them (64-bit, prefix-chained);
  its timestamps are all 0 and are ignored. A file in that form whose timestamps vary is a
  timed trace (Mooncake's): it is refused (:class:`TraceFormatError` naming the line) rather
  than read with its arrivals replaced by Poisson ones, silently.

L-Eval has no arrival times: arrivals are a Poisson process at ``rate`` req/s (seeded), in
file order (a document's questions one after another) or shuffled.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np

from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput
from sim.workloads.blocks import chain
from sim.workloads.errors import TraceFormatError
from sim.workloads.parsing import (
    MAX_TOKENS,
    PrefixChains,
    hash_ids_field,
    int_field,
    iter_jsonl,
)
from sim.workloads.workload import Request, Workload, truncate

Order = Literal["file", "shuffle"]


def poisson_arrivals(
    n: int, rate: float, rng: np.random.Generator, start_s: float = 0.0
) -> np.ndarray:
    """``n`` arrival times (s) of a Poisson process of ``rate`` req/s starting at ``start_s``."""
    if not (rate > 0 and math.isfinite(rate)):
        raise InvalidInput(f"arrival rate must be a finite number > 0 req/s, got {rate!r}")
    return start_s + np.cumsum(rng.exponential(1.0 / rate, size=n))


def _parse_lengths_row(
    row: dict[str, Any], path: Path, line: int, length_field: str, block_size: int
) -> tuple[int, int, tuple[int, ...]]:
    doc_field = f"doc_{length_field}"
    inp = int_field(row, length_field, path, line, 1)
    doc = int_field(row, doc_field, path, line, 0)
    if doc > inp:
        raise TraceFormatError(path, line, f"{doc_field} = {doc} exceeds {length_field} = {inp}")
    out_raw = row.get("ref_output_llama3_tokens", 0)
    if isinstance(out_raw, bool) or not isinstance(out_raw, int) or not \
            0 <= out_raw <= MAX_TOKENS:
        raise TraceFormatError(
            path, line,
            f"ref_output_llama3_tokens must be an int in [0, {MAX_TOKENS}], got {out_raw!r}"
        )
    sha = row.get("doc_sha1")
    if not isinstance(sha, str) or not sha:
        raise TraceFormatError(path, line, "field 'doc_sha1' must be a non-empty string")
    instr = row.get("instr_idx", line)
    doc_blocks = doc // block_size
    keys: list[Any] = [("leval-doc", sha, j) for j in range(doc_blocks)]
    keys += [("leval-req", sha, instr, line, j) for j in range(doc_blocks, inp // block_size)]
    return inp, out_raw, chain(keys)


def read_leval(
    path: str | Path,
    *,
    rate: float,
    seed: int = 0,
    order: Order = "file",
    name: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    length_field: str = "llama3_tokens",
    max_requests: int | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
) -> Workload:
    """Read L-Eval requests (either format) with Poisson arrivals at ``rate`` req/s.

    ``length_field`` selects the tokenizer's counts in the lengths format (``llama3_tokens``
    or ``llama2_tokens``; the document count is ``doc_<field>``). ``order="shuffle"`` permutes
    the requests (seeded) before assigning arrivals. Truncation as in :func:`truncate`.
    """
    path = Path(path)
    if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
        raise InvalidInput(f"arrival rate must be a finite number > 0 req/s, got {rate!r}")
    if order not in ("file", "shuffle"):
        raise InvalidInput(f"order must be 'file' or 'shuffle', got {order!r}")
    if block_size < 1:
        raise InvalidInput(f"block_size must be >= 1, got {block_size}")
    rng = np.random.default_rng(seed)
    name = name or path.stem
    rows: list[tuple[int, int, tuple[int, ...]]] = []
    fmt: str | None = None
    chains = PrefixChains(path)  # the Mooncake format's hash_ids
    first_stamp: Any = None
    timed: tuple[int, Any] | None = None  # the first row whose timestamp differs: (line, it)
    for line_no, row in iter_jsonl(path):
        # detect_format's rule: a timestamp that differs from the first row's makes the file
        # a timed trace, whose arrivals this reader would throw away (refused once every row
        # has been checked: a malformed row is named first, as every reader names it).
        if not rows:
            first_stamp = row.get("timestamp")
        elif timed is None and "timestamp" in row and row["timestamp"] != first_stamp:
            timed = (line_no, row["timestamp"])
        row_fmt = "mooncake" if "hash_ids" in row else "lengths"
        if fmt is None:
            fmt = row_fmt
        elif fmt != row_fmt:
            raise TraceFormatError(path, line_no, f"mixes {row_fmt} rows into a {fmt}-format file")
        if fmt == "mooncake":
            inp = int_field(row, "input_length", path, line_no, 1)
            out = int_field(row, "output_length", path, line_no, 0)
            hids = hash_ids_field(row, inp, block_size, path, line_no, chains)
            rows.append((inp, out, hids))
        else:
            rows.append(_parse_lengths_row(row, path, line_no, length_field, block_size))
    if timed is not None:
        raise TraceFormatError(
            path, timed[0],
            f"timestamp {timed[1]!r} differs from the first row's ({first_stamp!r}): this is a "
            "timed trace, and L-Eval's reader would replace its arrivals with Poisson ones; "
            "read it as a Mooncake trace (--format mooncake, or --format auto, which detects it)")
    idx = np.arange(len(rows))
    if order == "shuffle":
        idx = rng.permutation(len(rows))
    arrivals = poisson_arrivals(len(rows), rate, rng)
    reqs = [
        Request(f"{name}-{int(i)}", float(arrivals[k]), rows[i][0], rows[i][1], rows[i][2])
        for k, i in enumerate(idx)
    ]
    wl = Workload(
        name,
        tuple(reqs),
        block_size,
        {
            "source": str(path),
            "format": f"leval-{fmt or 'empty'}",
            "rate": rate,
            "seed": seed,
            "order": order,
        },
    )
    if max_requests is not None or start_s is not None or end_s is not None:
        wl = truncate(wl, max_requests=max_requests, start_s=start_s, end_s=end_s)
    return wl
