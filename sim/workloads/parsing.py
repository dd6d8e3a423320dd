"""Line-level parsing helpers shared by the trace readers; every failure names file:line."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from shared.files import NotJson, parse_json, path_kind
from shared.ids import InvalidInput
from shared.schemas import MAX_TOKENS as SCHEMA_MAX_TOKENS
from sim.workloads.errors import TraceFormatError

_BOM = "\ufeff"

MAX_TOKENS = SCHEMA_MAX_TOKENS
"""Largest token count a trace field may hold (16,777,216: beyond any model's context); a
larger one is a corrupt field, and would overflow the statistics or stall the block chaining.
The messages' bound (``shared.schemas.MAX_TOKENS``), so every replayable request is valid."""
MAX_HASH_ID = (1 << 64) - 1
"""Largest block id a trace may hold. Ids travel as msgpack's 64-bit integers
(``shared.schemas.HashInt``) and seed the generator of a request's synthesised tokens, which
folds an id into 64 bits (``services/rankd/torch_backend.py``): a wider or a negative id would
alias another one there, so it is refused as corrupt. Mooncake ids are unsigned (the real
traces' largest is 182,789)."""
MAX_SPAN_S = 366 * 86400.0
"""Longest span of arrivals (s) a trace may have, as read or once its rate is scaled: the
simulator steps its controller through every window of it, idle or not (a year of 20 s windows
takes about a minute), so a longer span is a corrupt timestamp or a mistyped rate."""


# Leading bytes of files that are not text traces, for a message that says what the file is.
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "a gzip-compressed file; decompress it first"),
    (b"PK\x03\x04", "a zip archive; extract the trace first"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file; decompress it first"),
    (b"BZh", "a bzip2-compressed file; decompress it first"),
    (b"\xfd7zXZ\x00", "an xz-compressed file; decompress it first"),
    (b"\xff\xfe", "UTF-16 text; save it as UTF-8"),
    (b"\xfe\xff", "UTF-16 text; save it as UTF-8"),
)
_SNIFF_BYTES = 8192


def open_trace(path: Path) -> io.BufferedReader:
    """``path`` opened for binary reading, after a look at its first bytes.

    Raises :class:`InvalidInput` (never a raw ``OSError``) when it is a directory or cannot be
    opened, and :class:`TraceFormatError` naming the file when it is plainly not text: a
    compressed file or archive, UTF-16, or binary data (a NUL byte, which text never has).
    """
    if path_kind(path, "trace") == "dir":
        raise InvalidInput(f"{path} is a directory, not a trace file")
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise InvalidInput(f"cannot open trace {path}: {exc}") from exc
    try:
        head = fh.peek(_SNIFF_BYTES)[:_SNIFF_BYTES]
    except OSError as exc:
        fh.close()
        raise InvalidInput(f"cannot read trace {path}: {exc}") from exc
    problem = next((what for magic, what in _SIGNATURES if head.startswith(magic)), None)
    if problem is None and b"\0" in head:
        problem = "binary data (it has NUL bytes)"
    if problem is not None:
        fh.close()
        raise TraceFormatError(path, None, f"not a text trace: {problem}")
    return fh


def decode_line(raw: bytes, path: Path, line_no: int) -> str:
    """One line of a trace as text, or a :class:`TraceFormatError` naming ``path:line_no``.

    Traces are UTF-8. A NUL byte never occurs in a text trace (binary data has them), so it
    gets its own message rather than a decoding error. A UTF-8 byte-order mark on line 1 is
    dropped (spreadsheet exports write one).
    """
    if b"\0" in raw:
        raise TraceFormatError(path, line_no, "has a NUL byte: binary data, not UTF-8 text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            path, line_no,
            f"not valid UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start} of the line)",
        ) from None
    if line_no == 1 and text.startswith(_BOM):
        text = text[len(_BOM):]
    return text


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, text with its line ending) for every line of ``path``.

    Lines are read as bytes and decoded one by one (:func:`decode_line`) so that a bad byte is
    reported with its line, which a text-mode file object cannot do. Lines end at ``\\n``
    (``\\r\\n`` keeps its ``\\r``, which the JSON and CSV parsers accept).
    """
    with open_trace(path) as fh:
        for line_no, raw in enumerate(fh, start=1):
            yield line_no, decode_line(raw, path, line_no)


def first_nonblank_line(path: Path) -> str:
    """The first line of ``path`` with something on it ("" for an empty file), for telling
    formats apart; bad bytes up to that line are :class:`TraceFormatError` as in
    :func:`iter_lines`."""
    for _, text in iter_lines(path):
        if text.strip():
            return text
    return ""


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (1-based line number, object) for each non-blank line; bad JSON (a truncated
    last line included) or bad UTF-8 is a :class:`TraceFormatError` naming the line."""
    for line_no, text in iter_lines(path):
        if not text.strip():
            continue
        try:
            row = parse_json(text)
        except NotJson as exc:
            raise TraceFormatError(path, line_no, f"not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise TraceFormatError(path, line_no, "a line must be a JSON object")
        yield line_no, row


def check_arrivals_vary(path: Path, fmt: str, *, requests: int, varied: bool, shown: str) -> None:
    """Reject a trace whose two or more requests all arrive at the same instant.

    Such a file has no arrival process to replay (every request would be queued at once,
    which measures nothing the trace stands for). The usual cause is a benchmark file without
    arrival times read as a timed trace, e.g. an L-Eval file (timestamps all 0) read with
    ``--format mooncake``. A single request, or a burst inside a trace that also has other
    times, is fine. ``requests``: how many records the file has (as far as it was read);
    ``varied``: whether any of their times differs from the first; ``fmt``: the format it was
    read as; ``shown``: the shared time as the file writes it (``"timestamp 0 ms"``).
    """
    if varied or requests < 2:
        return
    raise TraceFormatError(
        path, None,
        f"all {requests} requests have the same arrival time ({shown}) when read as {fmt}, "
        f"so there is no arrival process to replay; for a file without arrival times (such "
        f"as L-Eval) use --format leval, which draws Poisson arrivals at --rate",
    )


def int_field(row: dict[str, Any], key: str, path: Path, line: int, minimum: int,
              maximum: int = MAX_TOKENS) -> int:
    """``row[key]`` as an int in [``minimum``, ``maximum``] (bools are not ints here)."""
    if key not in row:
        raise TraceFormatError(path, line, f"missing field {key!r}")
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceFormatError(path, line, f"field {key!r} must be an integer, got "
                               f"{shown_value(v)}")
    if v < minimum:
        raise TraceFormatError(path, line, f"field {key!r} must be >= {minimum}, got "
                               f"{shown_value(v)}")
    if v > maximum:
        raise TraceFormatError(path, line, f"field {key!r} must be <= {maximum}, got "
                               f"{shown_value(v)}")
    return v


SHOWN_CHARS = 80
"""Longest value a message quotes as the file wrote it (:func:`shown_value`)."""


def shown_value(v: Any) -> str:
    """``v`` for a message: its repr, an integer too long to read by its size in bits (a
    4,000-digit count made a 4,000-character message), another long value cut short."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"an integer of {v.bit_length()} bits"
    text = repr(v)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} chars)"


def _place(parent: int | None) -> str:
    """Where a block stands in its chain, for messages."""
    return "is a first block" if parent is None else f"follows {parent}"


class PrefixChains:
    """The predecessor of every block id one trace has listed so far (None: a first block).

    Mooncake ``hash_ids`` are prefix-chained: an id stands for its block *and every block
    before it*, which is how the cache manager's trie keys it (by its hash, under its parent).
    A file in which one id follows two different predecessors, or is a first block in one
    request and a later block in another, is therefore not a prefix trace: replaying it would
    merge different prefixes into one cache entry and silently corrupt the cache state. One
    instance checks one file, a request at a time in file order (:meth:`add`); after an error
    it is spent (the reader stops there).
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._parent: dict[int, int | None] = {}
        # The line of each request that listed new ids, keyed by the first of them (see add).
        self._run_line: dict[int, int] = {}

    def add(self, ids: Sequence[Any], line: int) -> None:
        """Check one request's ``hash_ids`` and record them: every id an int (not a bool) in
        [0, :data:`MAX_HASH_ID`], none repeated within the request, and each after the same
        predecessor as wherever it occurred before. Otherwise :class:`TraceFormatError`
        naming ``line`` (and, for a conflict, the id and the earlier line that fixed its
        predecessor). Cost: one dict lookup per block, one insertion per request."""
        parent, top = self._parent, MAX_HASH_ID  # locals: this loop runs once per block
        known = len(parent)
        prev: int | None = None
        for h in ids:
            # type(), not isinstance(): a JSON true is a bool, and bool is a subclass of int.
            if type(h) is not int or not 0 <= h <= top:
                raise self._bad_id(h, line)
            if parent.setdefault(h, prev) != prev:
                raise self._conflict(ids, h, prev, line)
            prev = h
        new = len(parent) - known
        if new:
            # Where ids are chained, a known id's predecessor is known too, so a request's
            # new ids are its last ones: where that run starts is all a message needs to
            # find the line of any of them (_first_line), at no cost per block.
            self._run_line[ids[len(ids) - new]] = line

    def _first_line(self, h: int) -> int | None:
        """The line that listed the recorded id ``h`` first (so fixed its predecessor): that of
        the run of new ids it belongs to, whose first id is found by walking up from ``h``."""
        node: int | None = h
        while node is not None and node not in self._run_line:
            node = self._parent.get(node)
        return None if node is None else self._run_line[node]

    def _bad_id(self, h: Any, line: int) -> TraceFormatError:
        if type(h) is not int:
            return TraceFormatError(self._path, line,
                                    f"field 'hash_ids' must hold only integers, got {h!r}")
        shown = str(h) if h.bit_length() <= 128 else f"of {h.bit_length()} bits"
        return TraceFormatError(
            self._path, line, f"field 'hash_ids' holds id {shown}, outside [0, 2**64 - 1]: "
            "block ids are unsigned 64-bit integers")

    def _conflict(self, ids: Sequence[Any], h: int, prev: int | None,
                  line: int) -> TraceFormatError:
        # Error path only: find the offending occurrence (the first one of h after prev).
        j = next(k for k, x in enumerate(ids) if x == h and (ids[k - 1] if k else None) == prev)
        if h in ids[:j]:
            return TraceFormatError(
                self._path, line, f"hash_ids repeat id {h} (blocks {list(ids).index(h)} and "
                f"{j}): an id stands for its whole prefix, so a request cannot hold it twice")
        return TraceFormatError(
            self._path, line, f"hash id {h} {_place(prev)} here but {_place(self._parent[h])} "
            f"on line {self._first_line(h)}: ids must be prefix-chained (an id stands for "
            "its whole prefix, so it has one predecessor)")


def hash_ids_field(
    row: dict[str, Any], input_len: int, block_size: int, path: Path, line: int,
    chains: PrefixChains,
) -> tuple[int, ...]:
    """The full blocks' ids of a Mooncake ``hash_ids`` list: ceil(L/B) ids expected, checked
    and recorded by ``chains`` (the file's :class:`PrefixChains`)."""
    hids = row.get("hash_ids")
    if not isinstance(hids, list):
        raise TraceFormatError(path, line, "field 'hash_ids' must be a list of integers")
    chains.add(hids, line)
    expected = -(-input_len // block_size)
    if len(hids) != expected:
        raise TraceFormatError(
            path,
            line,
            f"{len(hids)} hash_ids for input_length {input_len}; expected "
            f"ceil({input_len}/{block_size}) = {expected} (is the block size {block_size}?)",
        )
    return tuple(hids[: input_len // block_size])
