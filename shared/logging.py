"""structlog configuration for every process, and per-message context binding.

* ``merge_contextvars`` runs first, so anything bound with :func:`bind_request` (request id,
  trace id) appears on every line logged while handling that message, from any module.
* JSON lines for services (machine-readable, one object per line); a console renderer when
  stderr is a terminal (``format="auto"``).
* Standard-library ``logging`` (nats-py, opentelemetry) is routed through the same renderer.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import structlog
from opentelemetry import trace

LogFormat = Literal["auto", "json", "console"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}  # fmt: skip


def configure_logging(
    format: LogFormat = "auto", level: str = "info", *, service: str | None = None
) -> None:
    """Configure structlog and stdlib logging for this process (idempotent; last call wins).

    ``service`` is bound as a global context field on every line.
    """
    if level not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}")
    use_console = format == "console" or (format == "auto" and sys.stderr.isatty())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor
    if use_console:
        renderer = structlog.dev.ConsoleRenderer()
    else:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])
    quiet_ssl_eof_warning()
    if service is not None:
        structlog.contextvars.bind_contextvars(service=service)


_SSL_EOF = "returning true from eof_received() has no effect when using ssl"


class _NoSslEofWarning(logging.Filter):
    """Drops asyncio's warning that ``eof_received`` returned True on a TLS transport: nats-py's
    protocol does so, and asyncio logs it each time a server closes a TLS connection (every
    drain at a stop). It tells an operator nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _SSL_EOF


def quiet_ssl_eof_warning() -> None:
    """Install :class:`_NoSslEofWarning` on the ``asyncio`` logger (idempotent)."""
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _NoSslEofWarning) for f in log.filters):
        log.addFilter(_NoSslEofWarning())


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    """A logger; ``initial`` values are bound on it."""
    return structlog.get_logger(name, **initial)  # type: ignore[no-any-return]


def current_trace_id() -> str | None:
    """Hex trace id of the current OpenTelemetry span, if any is recording or valid."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


@contextmanager
def bind_request(request_id: str, trace_id: str | None = None, **extra: Any) -> Iterator[None]:
    """Bind ``request_id`` and ``trace_id`` (default: the current span's) for this block.

    Context variables are per asyncio task, so concurrent handlers do not see each other's ids;
    the previous values are restored on exit.
    """
    fields: dict[str, Any] = {"request_id": request_id, **extra}
    tid = trace_id if trace_id is not None else current_trace_id()
    if tid is not None:
        fields["trace_id"] = tid
    with structlog.contextvars.bound_contextvars(**fields):
        yield
