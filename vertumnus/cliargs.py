"""Option parsing shared by the CLI's commands: one error line, exit status 2."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, TypeVar

import typer

if TYPE_CHECKING:
    from shared.slo import SloTable

T = TypeVar("T", int, float)


def fail(msg: str, code: int = 2) -> NoReturn:
    """Print ``error: msg`` on stderr and exit with ``code`` (2: a usage error)."""
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def comma_list(text: str, name: str, conv: Callable[[str], T], kind: str, *,
               valid: Callable[[T], bool] | None = None, need: str = "at least one value"
               ) -> tuple[T, ...]:
    """``--name``'s comma-separated values converted by ``conv``; refuses a value that does
    not convert (naming ``kind``), no value at all, or one that ``valid`` rejects (saying
    what it ``need``s)."""
    try:
        vals = tuple(conv(x) for x in text.split(",") if x.strip())
    except ValueError:
        fail(f"--{name} must be comma-separated {kind}, got {text!r}")
    if not vals or (valid is not None and not all(valid(v) for v in vals)):
        fail(f"--{name} needs {need}, got {text!r}")
    return vals


SLO_HELP = ("TTFT deadlines by prompt length: a table name (qwen3-30b-a3b, deepseek-v4-flash: "
            "paper Table 2) or BOUND:SECONDS pairs, e.g. 8192:1,32768:5,inf:10 (under 8,192 "
            "tokens 1 s, …)")


def slo_table(text: str) -> SloTable:
    """``--slo``'s table (:func:`sim.metrics.parse_slo`); a bad one exits 2 naming why."""
    from shared.ids import InvalidInput
    from shared.slo import parse_slo

    try:
        return parse_slo(text)
    except InvalidInput as exc:
        fail(f"--slo: {exc}")
