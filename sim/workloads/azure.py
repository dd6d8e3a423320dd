"""Reader of the Azure LLM inference trace 2023 (Azure/AzurePublicDataset, CSV).

Header ``TIMESTAMP,ContextTokens,GeneratedTokens``; TIMESTAMP is a wall-clock string with up
to 7 fractional digits (``2023-11-16 18:17:03.9799600``). Arrivals are seconds since the first
row. The trace has no prefix or session information, so every request gets unique block
hashes (it is treated as uncached; oracle reuse is 0). Rows must be in time order.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from contextlib import closing
from datetime import datetime
from pathlib import Path

from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput
from sim.workloads.blocks import chain
from sim.workloads.errors import TraceFormatError
from sim.workloads.parsing import MAX_SPAN_S, MAX_TOKENS, check_arrivals_vary, iter_lines
from sim.workloads.workload import Request, Workload, truncate

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


# The stamp as the Azure files write it, in ASCII digits only ([0-9]: \d, and strptime's own
# patterns, match any script's digits, which int() then converts). A fraction, when there is
# a dot, has at least one digit: "18:15:46." is a cut-off cell, not 46 s.
_STAMP = re.compile(r"([0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2})(?:\.([0-9]+))?")


def parse_timestamp(text: str) -> float:
    """POSIX seconds (naive, as UTC) of ``YYYY-MM-DD HH:MM:SS[.fffffff]``; ValueError if bad.

    Every digit is an ASCII one, each field has its width (two digits for month to second),
    and a dot is followed by at least one digit (any number of them: the files write 7).
    Blanks around the stamp are ignored. ``datetime`` takes at most 6 fractional digits; the
    rest (the 7th is 100 ns) is added separately.
    """
    m = _STAMP.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a YYYY-MM-DD HH:MM:SS[.fffffff] stamp in ASCII digits: {text!r}")
    base, frac = m.group(1), m.group(2) or ""
    dt = datetime.strptime(base, "%Y-%m-%d %H:%M:%S")
    seconds = (dt - datetime(1970, 1, 1)).total_seconds()
    return seconds + (int(frac) / 10 ** len(frac) if frac else 0.0)


_PLAIN_INT = re.compile(r"-?[0-9]+")  # [0-9]: \d matches any script's digits


def _int_cell(value: str | None, column: str, path: Path, line: int, minimum: int) -> int:
    """A count cell as an int in [``minimum``, MAX_TOKENS]; else TraceFormatError naming the
    line and the column.

    Only plain ASCII decimal integers are counts here (the real traces write nothing else, not
    even spaces around them). ``int()`` alone would also take ``1_000``, ``+5``, ``" 12 "`` and
    non-ASCII digits such as ``١٢``, so a cell some tool mangled would read as a number. A
    minus sign is let through to the range check, whose message says more than "not an
    integer".
    """
    if value is None or not _PLAIN_INT.fullmatch(value):
        raise TraceFormatError(
            path, line,
            f"column {column} must be a plain decimal integer (ASCII digits only), got {value!r}"
        )
    try:
        v = int(value)
    except ValueError:  # more digits than int() converts (thousands): far out of range
        bound = f">= {minimum}" if value.startswith("-") else f"<= {MAX_TOKENS}"
        raise TraceFormatError(
            path, line, f"column {column} must be {bound}, got {len(value)} characters"
        ) from None
    if v < minimum:
        raise TraceFormatError(path, line, f"column {column} must be >= {minimum}, got {v}")
    if v > MAX_TOKENS:
        raise TraceFormatError(path, line, f"column {column} must be <= {MAX_TOKENS}, got {v}")
    return v


def _csv_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of each CSV record of ``path``, the header included.

    Lines are decoded one by one (:func:`~sim.workloads.parsing.iter_lines`) so that bad UTF-8
    is a :class:`TraceFormatError` naming its line; the csv reader counts the lines it pulls,
    so ``line_num`` stays the file's line number. A record may not span lines: the trace's
    cells are numbers and timestamps, so that is an unmatched quote, which would swallow
    every later line into one record; it is an error naming the line where it starts (the
    line it ended on, the file's last, pointed nowhere near it).
    """
    with closing(iter_lines(path)) as numbered:
        reader = csv.reader(text for _, text in numbered)
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:  # e.g. a bare carriage return inside an unquoted field
                raise TraceFormatError(path, reader.line_num, f"not valid CSV ({exc})") from None
            if reader.line_num > start:
                raise TraceFormatError(path, start, f"a quoted field runs on to line "
                                       f"{reader.line_num} (an unmatched '\"'?)")
            yield reader.line_num, row


def read_azure(
    path: str | Path,
    *,
    name: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_requests: int | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
) -> Workload:
    """Read an Azure 2023 CSV trace. Request ids ``{name}-{row index}``; unique block hashes.

    Rows with ContextTokens = 0 are rejected (a prefill needs at least one token), and so is
    a file whose two or more rows all have one TIMESTAMP (no arrival process to replay,
    :func:`~sim.workloads.parsing.check_arrivals_vary`). Errors are
    :class:`TraceFormatError` naming file:line (bad UTF-8 included).
    """
    path = Path(path)
    if block_size < 1:
        raise InvalidInput(f"block_size must be >= 1, got {block_size}")
    name = name or path.stem
    reqs: list[Request] = []
    t0: float | None = None
    first_stamp = ""
    prev = float("-inf")
    read_all = start_s is None and end_s is None
    seen = 0  # data rows read, including those only scanned past max_requests
    varied = False  # some TIMESTAMP differs from the first one
    with closing(_csv_rows(path)) as records:
        first = next(records, None)
        if first is None:
            raise TraceFormatError(path, 1, "empty file (expected a header)")
        header = [h.strip() for h in first[1]]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise TraceFormatError(
                path, first[0], f"header lacks column(s) {missing}; got {header}"
            )
        col = {c: header.index(c) for c in COLUMNS}
        for line, row in records:
            if not row or all(not cell.strip() for cell in row):
                continue
            scanning = read_all and max_requests is not None and len(reqs) >= max_requests
            if scanning and (varied or t0 is None):
                break
            if len(row) != len(header):
                raise TraceFormatError(path, line, f"expected {len(header)} fields, got {len(row)}")
            stamp = row[col["TIMESTAMP"]]
            try:
                t = parse_timestamp(stamp)
            except ValueError:
                shown = stamp if len(stamp) <= 40 else stamp[:40] + "..."
                raise TraceFormatError(
                    path, line, f"bad TIMESTAMP {shown!r}: expected a real date and time as "
                    "YYYY-MM-DD HH:MM:SS[.fffffff] in ASCII digits (a dot needs digits "
                    "after it)"
                ) from None
            if t < prev:
                raise TraceFormatError(
                    path, line, "TIMESTAMP goes backwards (rows must be in time order)"
                )
            prev = t
            seen += 1
            if t0 is None:
                t0, first_stamp = t, row[col["TIMESTAMP"]].strip()
            if t - t0 > MAX_SPAN_S:
                raise TraceFormatError(
                    path, line, f"TIMESTAMP is {(t - t0) / 86400:.0f} days after the first "
                    f"row's; a trace may span at most {MAX_SPAN_S / 86400:.0f} days")
            varied = varied or t != t0
            if scanning:
                # Past max_requests: read on (timestamps only) until one differs, so that
                # stopping early neither hides a file of one instant nor rejects a burst.
                continue
            inp = _int_cell(row[col["ContextTokens"]], "ContextTokens", path, line, 1)
            out = _int_cell(row[col["GeneratedTokens"]], "GeneratedTokens", path, line, 0)
            rid = f"{name}-{len(reqs)}"
            hashes = chain(("azure", rid, j) for j in range(inp // block_size))
            reqs.append(Request(rid, t - t0, inp, out, hashes))
    check_arrivals_vary(path, "azure", requests=seen, varied=varied,
                        shown=f"TIMESTAMP {first_stamp}")
    wl = Workload.from_requests(
        name,
        reqs,
        block_size=block_size,
        metadata={"source": str(path), "format": "azure", "prefix_info": False},
    )
    if max_requests is not None or start_s is not None or end_s is not None:
        wl = truncate(wl, max_requests=max_requests, start_s=start_s, end_s=end_s)
    return wl
