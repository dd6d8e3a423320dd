"""What a path names, asked once and safely: the first check of every file the project reads
or writes at a boundary (CLI options, settings, trace, profile and hardware files).

``Path.exists()`` / ``is_dir()`` / ``is_file()`` raise ``PermissionError`` on Python 3.11 when
a parent directory cannot be searched (they return False only for "not found"), so a check
written with them turns a user's unreadable path into a traceback. :func:`path_kind` does one
``stat`` and turns every such failure into :class:`~shared.ids.InvalidInput` naming the path.
"""

from __future__ import annotations

import json
import stat
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
