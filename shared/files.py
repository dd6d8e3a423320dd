"""What a path names, asked once and safely: the first check of every file the project reads
or writes at a boundary (CLI options, settings, trace, profile and hardware files).

``Path.exists()`` / ``is_dir()`` / ``is_file()`` raise ``PermissionError`` on Python 3.11 when
a parent directory cannot be searched (they return False only for "not found"), so a check
written with them turns a user's unreadable path into a traceback. :func:`path_kind` does one
``stat`` and turns every such failure into :class:`~shared.ids.InvalidInput` naming the path.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Literal

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
