"""The common ``main`` of the service processes (gateway, scheduler, controller, cache manager).

Each ``services/<name>/main.py`` keeps its own flags, help text and ``serve`` coroutine and
calls :func:`parse_flags` (environment, then flags that win over it) and :func:`run_service`
(logging, tracing, ``asyncio.run`` until SIGINT/SIGTERM, then tracing and metrics flushed
within what is left of the stop deadline: :func:`flush_telemetry`).

Exit status of a service process: 0 after SIGINT/SIGTERM (during its start-up too); 2 for
settings it cannot work with (below); :data:`RESTART_EXIT` after a start-up that lost its NATS
server (:class:`shared.service.StartUpLost`: one error logged, what had started stopped), which
asks its supervisor to start it again -- docker compose's ``restart: unless-stopped`` and
``vertumnus up``'s supervision restart a child that exited, whatever its status, and a rank
daemon exits with the same status after a worker fault (services/rankd/main.py);
:data:`shared.stopping.STOP_TIMEOUT_EXIT` for a stop that overran its deadline; 1 (a
traceback) for anything else.

Everything a process can tell is wrong from its arguments and settings alone ends it before it
connects anywhere (a service waiting for NATS would otherwise retry forever on a typo):
``--help`` prints the usage and exits 0, an unknown argument exits 2 naming it, and a setting
that is valid by type but unusable (a NATS URL with no scheme, a negative seed, a composition
that does not parse: :func:`check_nats_url` and each service's own checks, raising
:class:`SettingProblem`) exits 2 naming its ``VTM_*`` variable and its flag. So does a ``VTM_*``
variable that no vertumnus process reads, a misspelt name (:func:`check_environment`); one that
another process reads is left alone (one environment may serve several services).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import structlog
from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from shared.envcheck import unknown_variables
from shared.ids import InvalidInput
from shared.logging import configure_logging
from shared.metrics import setup_metrics, shutdown_metrics
from shared.service import StartUpLost
from shared.settings import NESTED, ServiceSettings
from shared.stopping import bound_stops, stop_time_left, watch_parent
from shared.telemetry import setup_tracing, shutdown_tracing

S = TypeVar("S", bound=ServiceSettings)

NATS_SCHEMES: Final[tuple[str, ...]] = ("nats", "tls", "ws", "wss")
"""URL schemes a NATS server URL may have (what nats-py connects with)."""
RESTART_EXIT: Final[int] = 75
"""Exit status of a service process that should be started again: EX_TEMPFAIL (sysexits.h, "try
again later"), after a start-up that lost its NATS server (:func:`run_service`); a rank daemon
exits with it after a worker fault too (services/rankd/main.py)."""
TELEMETRY_FLUSH_MIN_S: Final[float] = 2.0
"""The least time the telemetry flush at exit gets, however little is left of the stop
deadline: a reachable collector takes the last spans and metrics in far less. Below
:data:`shared.stopping.HARD_GRACE_S`, so that a flush given it at the deadline still ends
before the fault handler ends the process."""

log = structlog.get_logger("vertumnus.servicemain")


class SettingProblem(ValueError):
    """A setting (or several that do not fit together) valid by type but unusable; raised by
    a process's checks, reported by :func:`parse_flags` naming each field's ``VTM_*`` variable
    (and flag) -- never its value, which the message gives only where it is no secret."""

    def __init__(self, fields: str | Sequence[str], problem: str) -> None:
        super().__init__(problem)
        self.fields: tuple[str, ...] = (fields,) if isinstance(fields, str) else tuple(fields)
        self.problem = problem


SettingsCheck = Callable[[S], None]
"""A process's own check of its settings: returns, or raises :class:`SettingProblem`."""


def shown_url(url: str) -> str:
    """``url`` fit for a message: everything before its last ``@`` (user and password,
    ``nats://u:p@host``, even a password holding ``/`` or ``@``) replaced by ***."""
    return re.sub(r"^([A-Za-z][\w+.-]*://)?.*@", r"\1***@", url)


def _as_nats_uri(url: str) -> str:
    """``url`` as nats-py reads a server entry: without a scheme (``host``, ``host:port``) it
    is ``nats://`` that address, so those forms are checked as what they will connect to."""
    return url if "://" in url else f"nats://{url}"


def check_nats_url(settings: ServiceSettings) -> None:
    """``nats_url``: one or more comma-separated server URLs, each with a scheme of
    :data:`NATS_SCHEMES`, a host and a valid port, not mixing websocket (ws, wss) with plain
    (nats, tls) servers. An entry without a scheme (``nats:4222``, ``localhost``) is
    ``nats://`` that address, as nats-py takes it (compose's ``nats`` host is one); a wrong
    scheme (``http://``), a bad port or no host exits at start instead of retrying forever."""
    servers = [_as_nats_uri(u) for u in settings.nats_servers]
    if not servers:
        raise SettingProblem("nats_url", "no server URL given (e.g. nats://127.0.0.1:4222)")
    for url in servers:
        parts = urlsplit(url)
        try:
            parts.port  # noqa: B018 - parsing the port is the check
        except ValueError:
            raise SettingProblem("nats_url", f"{shown_url(url)!r} has no valid port "
                                 "(1..65535)") from None
        if parts.scheme.lower() not in NATS_SCHEMES or not parts.hostname:
            raise SettingProblem(
                "nats_url", f"{shown_url(url)!r} is not a NATS server URL: it needs a scheme "
                f"({', '.join(s + '://' for s in NATS_SCHEMES)}) and a host, e.g. "
                "nats://127.0.0.1:4222")
    web = {urlsplit(u).scheme.lower() in ("ws", "wss") for u in servers}
    if len(web) > 1:
        raise SettingProblem("nats_url", "mixes websocket (ws://, wss://) and plain (nats://, "
                             "tls://) server URLs")


def seed_check(field: str) -> SettingsCheck[Any]:
    """A check that the integer setting ``field`` (a random seed) is >= 0."""

    def check(settings: ServiceSettings) -> None:
        value = getattr(settings, field)
        if value < 0:
            raise SettingProblem(field, f"must be an integer >= 0 (a random seed), got {value}")

    return check


def check_settings(settings: S, checks: Iterable[SettingsCheck[S]], *, prog: str,
                   flag_of: Mapping[str, str] | None = None) -> S:
    """``settings`` once :func:`check_nats_url` and each of ``checks`` passed; else prints
    ``{prog}: invalid settings:`` and a line naming the variables (``VTM_FIELD (--flag)``,
    from ``flag_of``: field -> flag) and the problem on stderr, and exits 2."""
    try:
        check_nats_url(settings)
        for check in checks:
            check(settings)
    except SettingProblem as exc:
        names = ", ".join(f"VTM_{f.upper()}" + (f" ({flag_of[f]})" if flag_of and f in flag_of
                                                else "") for f in exc.fields)
        print(f"{prog}: invalid settings:\n  {names}: {exc.problem}", file=sys.stderr)
        raise SystemExit(2) from None
    return settings


def _help_width() -> int:
    """Columns a ``--help`` text's own lines fill: the terminal's (``COLUMNS``), less the 2
    argparse keeps free, within [60, 100]."""
    return max(60, min(100, shutil.get_terminal_size().columns - 2))


def _fill_long_lines(text: str, width: int) -> str:
    """``text`` with each line over ``width`` wrapped to it (shorter lines, and so any line
    breaks the text was written with, kept: argparse prints a raw description as it is)."""
    return "\n".join(textwrap.fill(ln, width) if len(ln) > width else ln
                     for ln in text.splitlines())


def settings_epilog(settings_cls: type[ServiceSettings], *, flags: bool = True) -> str:
    """The ``VTM_*`` variables of ``settings_cls`` for a ``--help`` text, one a line with the
    first sentence of its description (nested groups as ``VTM_GROUP__*``), wrapped to the
    terminal (:func:`_help_width`: readable at 80 columns); ``flags``: the process has flags,
    which win over their variables."""
    width = _help_width()
    lines = ["settings (environment variables" + ("; a flag above wins over its variable):"
                                                  if flags else "):")]
    for name, field in settings_cls.model_fields.items():
        nested = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        var = f"VTM_{name.upper()}" + ("__*" if nested else "")
        # The first sentence: up to a full stop before a capital ("e.g. 8192" goes on).
        doc = re.split(r"\.\s+(?=[A-Z])", field.description or "")[0].rstrip(".")
        lines.append(textwrap.fill(doc, width=width, initial_indent=f"  {var:<28} ",
                                   subsequent_indent=" " * 31) if doc else f"  {var}")
    return "\n".join(lines)


def parse_flags(
    settings_cls: type[S],
    flags: Iterable[tuple[str, str, Any]],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    checks: Iterable[SettingsCheck[S]] = (),
) -> S:
    """``settings_cls`` from the environment, overridden by the flags given in ``argv``
    (None: ``sys.argv[1:]``), then checked (:func:`check_settings`: the NATS URL and each of
    ``checks``) -- all before the process connects anywhere.

    ``flags`` are ``(flag, settings field, argparse type)``; a flag not given leaves the field
    to the environment (or its default). ``--help`` prints the flags and every ``VTM_*``
    variable and exits 0; an argument that is no flag of this process, a flag's value that
    does not convert, an invalid setting, a ``VTM_*`` variable no vertumnus process reads
    (:func:`check_environment`) or a failed check exits 2 naming it (no traceback).
    """
    flags = tuple(flags)
    parser = argparse.ArgumentParser(prog=prog,
                                     description=_fill_long_lines(description, _help_width()),
                                     epilog=settings_epilog(settings_cls, flags=bool(flags)),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, dest, typ in flags:
        parser.add_argument(flag, dest=dest, type=_flag_type(typ), default=None,
                            help=f"VTM_{dest.upper()}")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    try:
        settings = settings_from(settings_cls, **overrides)
    except (ValidationError, SettingsError) as exc:
        parser.exit(2, f"{prog}: invalid settings:\n{settings_errors(exc, settings_cls)}\n")
    check_environment(settings_cls, prog)
    return check_settings(settings, checks, prog=prog,
                          flag_of={dest: flag for flag, dest, _ in flags})


def _flag_type(typ: Callable[[str], Any]) -> Callable[[str], Any]:
    """``typ`` as a flag's argparse type: argparse turns its ValueError into an exit 2 naming
    the flag but lets a RecursionError (a JSON flag nested deeper than the parser goes:
    ``--policy-params '[[[[...'``) through as a traceback, so that one is said too."""
    def convert(text: str) -> Any:
        try:
            return typ(text)
        except RecursionError:
            raise argparse.ArgumentTypeError("JSON nested too deeply to read") from None

    convert.__name__ = getattr(typ, "__name__", repr(typ))  # argparse's "invalid <name> value"
    return convert


def settings_from(settings_cls: type[S], **overrides: Any) -> S:
    """``settings_cls(**overrides)`` (the environment, overridden by ``overrides``), raising
    what it raises for a value that cannot be used -- a ValidationError, a SettingsError --
    and a SettingsError naming the variable for a JSON value nested deeper than Python's
    parser goes (``VTM_LOG='[[[[...'``): pydantic-settings catches only a ValueError of the
    parser and lets that RecursionError through, naming nothing."""
    try:
        return settings_cls(**overrides)
    except RecursionError as exc:
        field = _too_deep_field(settings_cls)
        if field is None:  # not a value of the environment: nothing to name
            raise
        raise SettingsError(
            f'error parsing value for field "{field}" from source "EnvSettingsSource"') from exc


def _too_deep_field(settings_cls: type[BaseModel]) -> str | None:
    """The field of ``settings_cls`` whose ``VTM_*`` variable (the whole group's or one of its
    ``__`` parts) holds JSON nested deeper than the parser goes, or None."""
    for name, value in os.environ.items():
        low = name.lower()
        if not low.startswith("vtm_"):
            continue
        field = low[len("vtm_"):].split(NESTED)[0]
        if field not in settings_cls.model_fields:
            continue
        try:
            json.loads(value)
        except RecursionError:
            return field
        except ValueError:
            continue
    return None


def settings_errors(exc: ValidationError | SettingsError,
                    model: type[BaseModel] | None = None) -> str:
    """One line per problem: the setting (its ``VTM_*`` name) and what is wrong with it, with
    the value given -- except for a secret of ``model`` (a ``SecretStr`` field: a token, a
    password, API keys), whose value no error message may show.

    A :class:`SettingsError` (pydantic-settings could not read a variable at all: a nested
    group such as ``VTM_LOG`` or a list such as ``VTM_DEGREES`` whose value is no JSON) is one
    line naming the variable and why (:func:`source_error`)."""
    if isinstance(exc, SettingsError):
        return source_error(exc, model)
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


def source_error(exc: SettingsError, model: type[BaseModel] | None = None) -> str:
    """The line of :func:`settings_errors` for a variable pydantic-settings could not read: a
    field that takes JSON (a nested group, a list, a mapping) given a value that is no JSON.
    It names the variable, says what the JSON parser found (its message: a position, never
    the value) and, for a nested group, that its fields can be set one by one
    (``VTM_LOG__FORMAT``)."""
    m = re.search(r'field "([^"]+)"', str(exc))
    if m is None:  # not about one field: say what pydantic-settings said
        return f"  settings: {exc}"
    name = m.group(1)
    var = f"VTM_{name.upper()}"
    cause = exc.__cause__
    if isinstance(cause, json.JSONDecodeError):
        why = f"not JSON ({cause.msg} at character {cause.pos + 1})"
    elif isinstance(cause, RecursionError):  # from settings_from
        why = "JSON nested too deeply to read"
    elif cause is not None:
        why = f"cannot be read ({type(cause).__name__})"
    else:
        why = "cannot be read"
    field = model.model_fields.get(name) if model is not None else None
    group = getattr(field, "annotation", None)
    if isinstance(group, type) and issubclass(group, BaseModel) and group.model_fields:
        first = next(iter(group.model_fields)).upper()
        hint = (f"; a group of settings: set each as {var}__<FIELD> (e.g. {var}__{first}), "
                "or the whole group as a JSON object")
    else:
        kind = str(group).replace("typing.", "")
        hint = ("; it takes a JSON list (e.g. [2, 4])" if kind.startswith("list")
                else "; it takes a JSON object" if kind.startswith("dict")
                else "; it takes a JSON value")
    return f"  {var}: {why}{hint}"


def _secret(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> bool:
    """Whether the top-level field at ``loc`` of ``model`` holds a secret (None: any field
    could, so say yes)."""
    if model is None:
        return True
    field = model.model_fields.get(str(loc[0]))
    return field is not None and "SecretStr" in str(field.annotation)


def load_settings(settings_cls: type[S], prog: str,
                  checks: Iterable[SettingsCheck[S]] = ()) -> S:
    """``settings_cls()`` from the environment, checked as :func:`check_settings` does; a bad
    value exits 2 naming it (no traceback), and so does a ``VTM_*`` variable no vertumnus
    process reads (:func:`check_environment`). It reads no argument: a process with a command
    line parses it with :func:`parse_flags` (which handles ``--help`` and refuses unknown
    arguments)."""
    try:
        settings = settings_from(settings_cls)
    except (ValidationError, SettingsError) as exc:
        print(f"{prog}: invalid settings:\n{settings_errors(exc, settings_cls)}",
              file=sys.stderr)
        raise SystemExit(2) from None
    check_environment(settings_cls, prog)
    return check_settings(settings, checks, prog=prog)


def check_environment(settings_cls: type[ServiceSettings], prog: str,
                      environ: Mapping[str, str] | None = None) -> None:
    """Exit 2 when ``environ`` (None: this process's environment) has a ``VTM_*`` variable
    that neither ``settings_cls`` nor any other vertumnus process reads -- a misspelt name,
    which pydantic-settings would ignore, leaving the setting at its default. It prints
    ``{prog}: invalid settings:`` and a line per variable, with the known name closest to it
    (:func:`shared.envcheck.unknown_variables`). A variable another process reads is no
    error: one environment may serve several services (docker-compose's shared variables)."""
    problems = unknown_variables(os.environ if environ is None else environ, settings_cls)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        print(f"{prog}: invalid settings:\n{lines}", file=sys.stderr)
        raise SystemExit(2)


def degree_list(text: str) -> list[int]:
    """A ``--degrees`` flag: comma-separated integers (``"2,4"``). A non-integer raises
    ValueError, which argparse reports as an invalid value of the flag."""
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def telemetry_flush_s(stop_timeout_s: float, time_left_s: float | None) -> float:
    """How long the telemetry flush at exit may take: what is left of the stop deadline
    (``time_left_s``, :func:`shared.stopping.stop_time_left`; None: no stop signal armed it,
    ``serve`` returned by itself, and the flush gets a whole ``stop_timeout_s``), never less
    than :data:`TELEMETRY_FLUSH_MIN_S`."""
    budget = stop_timeout_s if time_left_s is None else time_left_s
    return max(TELEMETRY_FLUSH_MIN_S, budget)


def flush_telemetry(timeout_s: float) -> bool:
    """Export the spans and metrics still held and stop their exporters, both at once, within
    about ``timeout_s`` seconds (>= 0) in all (:func:`shared.telemetry.shutdown_tracing`,
    :func:`shared.metrics.shutdown_metrics`). Returns whether both finished in that time;
    when not, logs a warning naming which were cut short -- what they had not exported by
    then (a collector that refuses or does not answer) is lost."""
    deadline = time.monotonic() + timeout_s
    metrics_done: list[bool] = []
    # At once, not one after the other: each gets the whole bound, and a trace collector that
    # does not answer (compose: jaeger) does not cost the metrics (prometheus) their last
    # export.
    metrics_flush = threading.Thread(
        target=lambda: metrics_done.append(shutdown_metrics(timeout_s)),
        name="vtm-metrics-flush", daemon=True)
    metrics_flush.start()
    cut_short = [] if shutdown_tracing(timeout_s) else ["tracing"]
    # shutdown_metrics bounds itself; the join only guards against it not doing so.
    metrics_flush.join(max(0.0, deadline - time.monotonic()) + 0.5)
    if not (metrics_done and metrics_done[0]):
        cut_short.append("metrics")
    if cut_short:
        log.warning("telemetry flush cut short at its deadline; spans or metrics not yet "
                    "exported are lost", cut_short=cut_short, flush_timeout_s=round(timeout_s, 3))
    return not cut_short


def quiet_cancelled_leftovers(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's exception handler in a service process: asyncio's own, except for a
    future dropped with a *cancellation* as its never-retrieved exception, logged at debug.

    Why: nats-py's drain waits for its subscriptions' drains through ``asyncio.gather``; when
    that wait is cancelled (a stop whose server was lost meanwhile: ``drain_or_close`` gives
    the drain up) the gathering future is left holding a ``CancelledError`` that nothing
    retrieves, and asyncio logged it with a traceback at the process's exit -- a cancelled
    operation, not an error, reported as one in a clean stop. Any other exception a future
    or task drops is still logged by asyncio's handler."""
    exc = context.get("exception")
    if isinstance(exc, asyncio.CancelledError) \
            and "never retrieved" in str(context.get("message", "")):
        log.debug("a cancelled future was never awaited",
                  future=repr(context.get("future") or context.get("task"))[:200])
        return
    loop.default_exception_handler(context)


async def _serve_in(settings: S, serve: Callable[[S], Coroutine[Any, Any, None]]) -> None:
    asyncio.get_running_loop().set_exception_handler(quiet_cancelled_leftovers)
    await serve(settings)


def run_service(settings: S, serve: Callable[[S], Coroutine[Any, Any, None]]) -> None:
    """Configure logging, tracing and metrics from ``settings``, run ``serve(settings)``, flush
    tracing and metrics. The process's graceful stop is bounded by ``stop_timeout_s``, and it
    stops when ``parent_pid`` (if set) is no longer its parent (shared/stopping.py).

    The flush is part of the stop: it ends by the stop deadline armed by the stop signal
    (:func:`telemetry_flush_s`: what is left of it, at least :data:`TELEMETRY_FLUSH_MIN_S`;
    ``stop_timeout_s`` when ``serve`` returned without a signal), so an unreachable collector
    neither delays the exit past ``stop_timeout_s`` (+ the minimum) nor gets the process
    killed mid-flush -- by the fault handler, ``HARD_GRACE_S`` after the deadline, or by
    compose's ``stop_grace_period``. What the flush could not export by then is lost, and a
    warning says so (:func:`flush_telemetry`).

    A start-up that lost its NATS server (:class:`~shared.service.StartUpLost`, logged where
    it was met) ends the process with :data:`RESTART_EXIT`, not a traceback. The loop's
    exception handler is :func:`quiet_cancelled_leftovers`."""
    configure_logging(settings.log.format, settings.log.level, service=settings.service_name)
    bound_stops(settings.stop_timeout_s)
    if settings.parent_pid is not None:
        watch_parent(settings.parent_pid)
    setup_tracing(settings.service_name, settings.telemetry, instance_id=settings.instance_id)
    setup_metrics(settings.service_name, settings.telemetry, instance_id=settings.instance_id)
    try:
        asyncio.run(_serve_in(settings, serve))
    except InvalidInput as exc:
        # Settings valid one by one but not together (a GPU count the degrees cannot tile,
        # an unknown policy): the service cannot start. One line, not a traceback.
        print(f"{settings.service_name}: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except StartUpLost:
        # The cause was logged as an error when it was met; no traceback on top of it.
        log.info("exiting for a restart", exit_status=RESTART_EXIT)
        raise SystemExit(RESTART_EXIT) from None
    finally:
        flush_telemetry(telemetry_flush_s(settings.stop_timeout_s, stop_time_left()))
