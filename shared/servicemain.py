"""The common ``main`` of the service processes (gateway, scheduler, controller, cache manager).

Each ``services/<name>/main.py`` keeps its own flags, help text and ``serve`` coroutine and
calls :func:`parse_flags` (environment, then flags that win over it) and :func:`run_service`
(logging, tracing, ``asyncio.run`` until SIGINT/SIGTERM, tracing flushed at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from shared.ids import InvalidInput
from shared.logging import configure_logging
from shared.metrics import setup_metrics, shutdown_metrics
from shared.settings import ServiceSettings
from shared.telemetry import setup_tracing, shutdown_tracing

S = TypeVar("S", bound=ServiceSettings)


def parse_flags(
    settings_cls: type[S],
    flags: Iterable[tuple[str, str, Any]],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
) -> S:
    """``settings_cls`` from the environment, overridden by the flags given in ``argv``.

    ``flags`` are ``(flag, settings field, argparse type)``; a flag not given leaves the field
    to the environment (or its default).
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for flag, dest, typ in flags:
        parser.add_argument(flag, dest=dest, type=typ, default=None)
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return settings_cls(**overrides)
    except ValidationError as exc:
        parser.exit(2, f"{prog}: invalid settings:\n{settings_errors(exc, settings_cls)}\n")


def settings_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line per problem: the setting (its ``VTM_*`` name) and what is wrong with it, with
    the value given -- except for a secret of ``model`` (a ``SecretStr`` field: a token, a
    password, API keys), whose value no error message may show."""
    lines = []
    for e in exc.errors():
        loc = "__".join(str(x) for x in e["loc"])
        where = f"VTM_{loc.upper()}" if loc else "settings"
        if not loc:
            lines.append(f"  {where}: {e['msg']}")
        elif _secret(model, e["loc"]):
            lines.append(f"  {where}: {e['msg']} (value not shown: a secret)")
        else:
            lines.append(f"  {where}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _secret(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> bool:
    """Whether the top-level field at ``loc`` of ``model`` holds a secret (None: any field
    could, so say yes)."""
    if model is None:
        return True
    field = model.model_fields.get(str(loc[0]))
    return field is not None and "SecretStr" in str(field.annotation)


def load_settings(settings_cls: type[S], prog: str) -> S:
    """``settings_cls()`` from the environment; a bad value exits 2 naming it (no traceback)."""
    try:
        return settings_cls()
    except ValidationError as exc:
        print(f"{prog}: invalid settings:\n{settings_errors(exc, settings_cls)}",
              file=sys.stderr)
        raise SystemExit(2) from None


def degree_list(text: str) -> list[int]:
    """A ``--degrees`` flag: comma-separated integers (``"2,4"``). A non-integer raises
    ValueError, which argparse reports as an invalid value of the flag."""
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def run_service(settings: S, serve: Callable[[S], Coroutine[Any, Any, None]]) -> None:
    """Configure logging, tracing and metrics from ``settings``, run ``serve(settings)``, flush
    tracing and metrics."""
    configure_logging(settings.log.format, settings.log.level, service=settings.service_name)
    setup_tracing(settings.service_name, settings.telemetry)
    setup_metrics(settings.service_name, settings.telemetry)
    try:
        asyncio.run(serve(settings))
    except InvalidInput as exc:
        # Settings valid one by one but not together (a GPU count the degrees cannot tile,
        # an unknown policy): the service cannot start. One line, not a traceback.
        print(f"{settings.service_name}: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        shutdown_tracing()
        shutdown_metrics()
