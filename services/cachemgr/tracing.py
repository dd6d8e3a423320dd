"""What the spans of a cache command say of it, alike on both ends: the cache manager's
client span per command it sends (services/cachemgr/service.py) and the worker's
``vtm-rankd.cache-cmd`` server span that executes it (services/rankd/service.py), a child of
the first through the W3C context in the command's headers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext

from shared.schemas import (
    DemoteCommand,
    ReclaimCommand,
    ReconcileCommand,
    ReplicateCommand,
)
from shared.telemetry import extract, traceparent_of

COMMAND_SPAN_PREFIX: Final[str] = "cache_"
"""The cache manager's span of one command it sends (kind CLIENT) is named
``cache_{label}``: ``cache_pull`` for a route-time pull (a replicate of kind ``route``), else
``cache_`` + the command's op (``cache_replicate``, ``cache_reconcile``, ``cache_reclaim``,
``cache_demote``; :func:`command_span_name`). It carries the command's attributes
(:func:`command_attributes`), the action's (``vtm.copy_kind``: route / inter / intra /
reconcile; ``vtm.copy_blocks``: the blocks a copy moves), the request that triggered it
(``vtm.request_id`` and a link, :class:`RequestTrigger`) and the outcome (``vtm.cache_ok``,
``vtm.blocks_done``, ``vtm.cache_error``)."""

LINK_REASON: Final[str] = "vtm.link"
"""Attribute of a span link that says why two traces are linked: ``triggered_by`` (a copy the
placement of a request triggered, to that request's root), ``pull_hold`` (a worker's copy, to
the root of the request it held for it; and back, from the request's ``cache_pull_wait``)."""

Command = ReplicateCommand | ReclaimCommand | ReconcileCommand | DemoteCommand


def command_attributes(cmd: Command) -> dict[str, Any]:
    """A command's span attributes: its op, id, epoch, the worker that executes it, the worker
    a copy comes from (when it names one) and how many blocks it names (a copy's whole
    root-to-node path; a reclaim's or demote's exact blocks)."""
    attrs: dict[str, Any] = {"vtm.cache_op": cmd.op, "vtm.command_id": cmd.command_id,
                             "vtm.worker_id": cmd.worker_id, "vtm.epoch": cmd.epoch,
                             "vtm.blocks": len(cmd.blocks)}
    source = getattr(cmd, "source_worker", None)
    if source is not None:
        attrs["vtm.source_worker"] = source
    return attrs


def command_span_name(op: str, copy_kind: str | None = None) -> str:
    """The name of the cache manager's span of a command (:data:`COMMAND_SPAN_PREFIX`)."""
    return COMMAND_SPAN_PREFIX + ("pull" if copy_kind == "route" else op)


@dataclass(frozen=True, slots=True)
class RequestTrigger:
    """The request whose placement (its RequestStats) made the cache manager send a command
    (a route-time pull, a lazy reconcile copy): its id, and the trace context the stats'
    headers carried (None: they carried none). The command's span names the request
    (``vtm.request_id``) and links to that context; it is not the span's parent: a copy is
    work of the pool's, which outlives the request and often serves later ones."""

    request_id: str
    context: SpanContext | None = None

    @classmethod
    def from_headers(cls, request_id: str, headers: Mapping[str, str] | None) -> RequestTrigger:
        ctx = None
        if traceparent_of(headers) is not None:
            ctx = trace.get_current_span(extract(headers)).get_span_context()
        return cls(request_id, ctx if ctx is not None and ctx.is_valid else None)

    def links(self) -> list[Link]:
        if self.context is None:
            return []
        return [Link(self.context, {LINK_REASON: "triggered_by",
                                    "vtm.request_id": self.request_id})]
