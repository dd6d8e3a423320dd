"""What a path names, asked once and safely: the first check of every file the project reads
or writes at a boundary (CLI options, settings, trace, profile and hardware files).

``Path.exists()`` / ``is_dir()`` / ``is_file()`` raise ``PermissionError`` on Python 3.11 when
a parent directory cannot be searched (they return False only for "not found"), so a check
written with them turns a user's unreadable path into a traceback. :func:`path_kind` does one
``stat`` and turns every such failure into :class:`~shared.ids.InvalidInput` naming the path.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tomllib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from shared.ids import InvalidInput

PathKind = Literal["missing", "dir", "file", "other"]


def path_kind(path: str | Path, what: str = "path") -> PathKind:
    """``"missing"`` (nothing there, or a parent that is a file), ``"dir"``, ``"file"`` (a
    regular file) or ``"other"`` (a device, pipe or socket). Raises :class:`InvalidInput`
    "cannot access {what} {path} (reason)" when the path cannot be looked at (permission
    denied on a parent, a name too long, a loop of links)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as exc:
        raise InvalidInput(f"cannot access {what} {p} ({exc.strerror or exc})") from None
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


class NotJson(ValueError):
    """Text that is no JSON. ``str()`` says why in full; ``msg`` without the position of a
    syntax error (for a caller that names the line itself)."""

    def __init__(self, message: str, msg: str | None = None) -> None:
        super().__init__(message)
        self.msg = msg or message


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file beside it, then
    renamed over it (``os.replace``, atomic on POSIX). A run interrupted while writing leaves
    the old file (or none), never a truncated one that a later run would take for a damaged
    input. Raises ``OSError`` as ``Path.write_text`` does; the temporary file is removed."""
    p = Path(path)
    tmp = p.parent / f".{p.name}.{uuid.uuid4().hex[:12]}.tmp"
    # Mode 0666 less the umask, as write_text creates a file (mkstemp's would be 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def parse_json(text: str | bytes) -> Any:
    """``json.loads(text)``, with every way the text is not JSON one :class:`NotJson`: a syntax
    error, nesting deeper than the parser goes ("[[[[..."), an integer of more digits than
    Python converts (a ValueError json.loads raises as such, not a JSONDecodeError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotJson(str(exc), exc.msg) from None
    except RecursionError:
        raise NotJson("nested too deep") from None
    except ValueError as exc:
        raise NotJson(str(exc)) from None


CONFIG_SUFFIXES: tuple[str, ...] = (".json", ".toml")
"""The suffixes of a configuration file (:func:`read_config_file`): the suffix picks the parser."""


def read_config_file(path: str | Path, what: str) -> Any:
    """The parsed contents of a JSON or TOML configuration file (``.json`` / ``.toml``, by its
    suffix; UTF-8, a byte-order mark allowed), e.g. a hardware or a synthetic workload file.

    Raises :class:`InvalidInput` naming the file as ``what`` (e.g. "hardware file"): missing,
    a directory or not a regular file, another suffix, unreadable, not UTF-8 (with the line),
    or not valid JSON/TOML. What the contents mean is the caller's to check.
    """
    p = Path(path)
    kind = path_kind(p, what)
    if kind == "dir":
        raise InvalidInput(f"{what} {p} is a directory, not a file")
    if kind == "missing":
        raise InvalidInput(f"{what} not found: {p}")
    if kind != "file":
        raise InvalidInput(f"{what} {p} is not a regular file")
    suffix = p.suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        # Checked before reading: the suffix decides the parser, so say what it is rather
        # than report a parse error in a format the file never claimed.
        has = f"the suffix {p.suffix!r}" if suffix else "no suffix"
        raise InvalidInput(f"{p}: a {what} is .json or .toml; this one has {has}")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (some editors write one) is fine
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise InvalidInput(f"{p}:{line}: not valid UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                           f"a {what} is UTF-8 {suffix[1:].upper()}") from None
    try:
        if suffix == ".json":
            return parse_json(text)
        return tomllib.loads(text)
    except (NotJson, tomllib.TOMLDecodeError, RecursionError) as exc:  # RecursionError: "[[[[..."
        raise InvalidInput(f"{p}: not valid {suffix[1:].upper()}: {exc}") from None


def config_number(at: str, v: Any, *, integer: bool, also: str = "") -> int | float:
    """A number of a configuration file (a synthetic workload or a controller file): an
    ``int`` when ``integer`` (an integral float such as ``3.0`` counts), else a ``float``.
    Raises :class:`InvalidInput` "``{at}``: must be a number / an integer / finite, got ..."
    (``also`` is added after what it must be, e.g. " (or false)"); a bool is no number."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InvalidInput(f"{at}: must be {'an integer' if integer else 'a number'}{also}, "
                           f"got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise InvalidInput(f"{at}: must be finite, got {v!r}")
    if integer:
        if isinstance(v, float) and not v.is_integer():
            raise InvalidInput(f"{at}: must be an integer{also}, got {v!r}")
        return int(v)
    return float(v)


def toml_value(v: Any) -> str:
    """``v`` (a number, a bool, or a table of them) as a TOML value: Python's ``repr`` of an int
    or a finite float is valid TOML; a mapping is an inline table."""
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)
