"""What the spans of a cache command say of it, alike on both ends: the cache manager's
client span per command it sends (services/cachemgr/service.py) and the worker's
``vtm-rankd.cache-cmd`` server span that executes it (services/rankd/service.py), a child of
the first through the W3C context in the command's headers.

And the spans of the cache manager's part in a reconfiguration (:data:`DRAIN_SPAN`,
:data:`EPOCH_SPAN`): children of the controller's phase span whose context the DrainNotice's
headers or the epoch record's ``traceparent`` carry (:func:`carried_parent`), so that the
commands sent from them, and the rank daemons' server spans of those, are in the
reconfiguration's trace -- which is always sampled (services/controller/tracing.py), so they
are recorded at any sampling ratio. Before, the drain notice's context was ignored and the
record's unread: each re-homing command was a root of its own, sampled by the ratio.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext

from shared.schemas import (
    DemoteCommand,
    DrainNotice,
    EpochRecord,
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
placement of a request triggered, to that request's root), ``reconciles`` (a lazy reconcile
copy, to the ``cachemgr_epoch`` span whose reconcile of a split or merge left the pages it
copies pending: in the reconfiguration's trace), ``pull_hold`` (a worker's copy, to the root
of the request it held for it; and back, from the request's ``cache_pull_wait``)."""

DRAIN_SPAN: Final[str] = "cachemgr_drain"
"""The cache manager's handling of a DrainNotice (kind CONSUMER): a split's re-homing
(``vtm.rehome_copies``, ``vtm.rehome_demotes``: what it sends; the commands' spans are its
children, sent from tasks that start under it), with the notice's reconfiguration, kind,
sources, targets and drain epoch (:func:`drain_attributes`). A child of the context in the
notice's headers: the controller's ``drain`` phase span."""

EPOCH_SPAN: Final[str] = "cachemgr_epoch"
"""The cache manager's handling of a newer epoch record (kind CONSUMER): the trie's
reconcile of the splits and merges it shows (``vtm.splits``: the parents split;
``vtm.merges``: the workers merged into), a merge's re-homing (``vtm.rehome_copies``) and the
snapshots it asks of the workers the record made or brings back -- the commands and requests
sent from it are its descendants. A child of the record's ``traceparent`` (the controller's
phase span that wrote it: ``drain``, ``epoch_commit`` or ``expose``); a root, sampled by the
ratio, for a record written outside a reconfiguration."""

Command = ReplicateCommand | ReclaimCommand | ReconcileCommand | DemoteCommand


@dataclass(frozen=True, slots=True)
class CarriedParent:
    """The parent a message's trace context gives the span of the work it starts.

    ``context``: the carried one when its ``traceparent`` is well formed (W3C,
    :func:`shared.telemetry.traceparent_of`), else an empty context -- the span is then a root
    and the work goes on as it would untraced. ``malformed``: the carried ``traceparent``
    (at most 80 characters) when there was one and it was refused, for the caller's warning;
    None when it was accepted or there was none."""

    context: otel_context.Context
    malformed: str | None = None


def carried_parent(carrier: Mapping[str, Any] | None) -> CarriedParent:
    """The :class:`CarriedParent` of ``carrier`` (NATS headers, or :func:`record_carrier`);
    never raises, whatever the carrier holds. The key is matched case-insensitively, as
    ``traceparent_of`` matches it (nats-py header keys are case-sensitive)."""
    if traceparent_of(carrier) is not None:
        return CarriedParent(extract(carrier))
    for key, value in (carrier or {}).items():
        if isinstance(key, str) and key.lower() == "traceparent":
            return CarriedParent(otel_context.Context(), str(value)[:80])
    return CarriedParent(otel_context.Context())


def record_carrier(record: EpochRecord) -> dict[str, str] | None:
    """The carrier of ``record``'s ``traceparent`` (a KV value has no headers: the writer puts
    its span's context in the record); None when it has none."""
    return {"traceparent": record.traceparent} if record.traceparent else None


def drain_attributes(notice: DrainNotice) -> dict[str, Any]:
    """The :data:`DRAIN_SPAN` attributes a notice gives, named as the controller's root span
    names them (services/controller/tracing.py ``plan_attributes``)."""
    return {"vtm.reconfiguration.id": notice.reconfiguration,
            "vtm.reconfiguration.kind": notice.kind,
            "vtm.reconfiguration.sources": list(notice.sources),
            "vtm.reconfiguration.targets": list(notice.targets),
            "vtm.epoch": notice.epoch}


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
    reconcile: ReconcileOrigin | None = None
    """For a lazy reconcile copy: the reconcile whose pending pages it copies (None: not one,
    or the manager keeps no context of it)."""

    @classmethod
    def from_headers(cls, request_id: str, headers: Mapping[str, str] | None) -> RequestTrigger:
        return cls(request_id, span_context_of(headers))

    def links(self) -> list[Link]:
        out: list[Link] = []
        if self.context is not None:
            out.append(Link(self.context, {LINK_REASON: "triggered_by",
                                           "vtm.request_id": self.request_id}))
        if self.reconcile is not None:
            out.append(Link(self.reconcile.context, {LINK_REASON: "reconciles",
                                                     "vtm.epoch": self.reconcile.epoch}))
        return out

    @property
    def always_sample(self) -> bool:
        """Whether the command's span (a root: the pool's work) is kept whatever the ratio
        (:data:`shared.telemetry.ALWAYS_SAMPLE`): a lazy reconcile copy whose reconcile's
        trace is sampled -- a reconfiguration's always is. Else the link to that trace would
        be on a span the ratio mostly drops (99 of 100 at 0.01), and the reconfiguration's
        trace would not find the copies that finish its reconcile. Bounded: one copy per
        pending page a request reuses, and a reconfiguration is rare."""
        return self.reconcile is not None and self.reconcile.context.trace_flags.sampled


@dataclass(frozen=True, slots=True)
class ReconcileOrigin:
    """The ``cachemgr_epoch`` span whose reconcile (of the split or merge of ``epoch``) left
    pages pending that a lazy reconcile copy brings: its context, linked from the copy's span
    (``vtm.link`` = ``reconciles``)."""

    context: SpanContext
    epoch: int

    @classmethod
    def from_carrier(cls, carrier: Mapping[str, str] | None,
                     epoch: int) -> ReconcileOrigin | None:
        """From the W3C ``carrier`` the manager keeps of that span (None: none, or not a
        valid context)."""
        ctx = span_context_of(carrier)
        return None if ctx is None else cls(ctx, epoch)


def span_context_of(carrier: Mapping[str, str] | None) -> SpanContext | None:
    """The remote span context a W3C ``carrier`` holds, None when it holds no valid one."""
    if traceparent_of(carrier) is None:
        return None
    ctx = trace.get_current_span(extract(carrier)).get_span_context()
    return ctx if ctx.is_valid else None
