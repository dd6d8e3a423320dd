"""Typed errors of the workload readers."""

from __future__ import annotations

from pathlib import Path

from shared.ids import InvalidInput


class TraceFormatError(InvalidInput):
    """A trace file is malformed; the message names ``file:line`` and the problem."""

    def __init__(self, path: str | Path, line: int | None, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}")
