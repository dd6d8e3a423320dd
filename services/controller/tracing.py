"""One trace per reconfiguration (a split or a merge), as the controller sees it.

Span tree of one operation (conventions.md "Tracing"; names are :class:`ReconfStage`)::

    reconfiguration                 root: kind, sources and targets with their degrees, the
    |                               record epochs (before the plan, drain, commit, exposure),
    |                               the planner rule that fired and its reason, the outcome
    +- queue_query                  step 1: the sources' queues asked (rankd's ``queue``
    |                               endpoint joins the trace: the request carries its context)
    +- drain                        drain record written .. the sources' last in-flight request
    |                               done (events: a source stopped admitting, a request done)
    +- epoch_commit                 the commit record (sources gone, targets switching)
    +- switch                       the targets' ranks acknowledging the commit (an event each)
    +- expose                       the exposure record (targets schedulable)

The phases follow one another: a phase span ends where the next starts. A reconfiguration
that does not reach its exposure -- aborted (drain timeout, a source's lease), undone (its drain
record not written), forgotten (the core rebuilt from another controller's record), or left
when the controller stops -- ends its open phase span and its root with status ERROR and the
reason as the status description.

The context handed to what runs on a reconfiguration's behalf (:meth:`ReconfTraces.current`)
is its open phase span's: NATS requests made there carry it (:func:`shared.service.call`
injects the current context), so rank daemons' handlers join the trace; log lines written
there carry its trace id (:meth:`ReconfTraces.bound`).

Links: a request the drain waited on is linked from the ``drain`` span when its result
(FirstToken) carries the request's W3C trace context in its headers. Neither the drain-state
messages (QueueReport: ids and arrival stamps; WorkerState: counts) nor rankd's results carry
it today, so no link is made until rankd sends it (see the controller's report).

Sampling: every reconfiguration's trace is kept, whatever the sampling ratio. Its root is
created with :data:`shared.telemetry.ALWAYS_SAMPLE`, which the installed sampler
(:func:`shared.telemetry.sampler`) always samples; every other span of the trace follows its
parent (parent-based), here and in the rank daemons that the context reaches (NATS headers,
and the ``traceparent`` of the epoch records written for it). Before, the root was sampled by
the ratio like a request's: at 0.01, 99 of 100 reconfigurations left no trace. (Without the
SDK's provider -- tests that install none -- the spans are no-ops and no context travels.)

Epoch records: the drain, commit and exposure records of an operation carry the context of
the phase span that writes them (:meth:`ReconfTrace.traceparent`, the record's
``traceparent``), so that each rank daemon's adoption of the record (its ``epoch_adopt``
span) is a child of that phase: KV writes carry no headers. Its drain-timeout abort record
carries the root's (written after the trace ended) and a re-announcement awaiting its
targets' acks its switch phase's. The cache manager's handling of these records and of the
DrainNotice joins the trace the same way (services/cachemgr/tracing.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from services.controller.planner import Plan
from shared.telemetry import ALWAYS_SAMPLE, extract, inject, traceparent_of, tracer

MAX_EVENTS_PER_PHASE: Final[int] = 64
"""Events (a request done, a rank's ack) recorded on one phase span at most: a source with
hundreds of requests in flight must not fill the span (the SDK keeps 128 and drops the
oldest silently); past it, ``vtm.events_dropped`` counts them."""


class ReconfStage(StrEnum):
    """Span names of a reconfiguration's trace (the module doc's tree)."""

    RECONFIGURATION = "reconfiguration"  # root
    QUEUE_QUERY = "queue_query"
    DRAIN = "drain"
    EPOCH_COMMIT = "epoch_commit"
    SWITCH = "switch"
    EXPOSE = "expose"


@dataclass
class ReconfTrace:
    """The spans of one operation: its root and the phase span open now (or None)."""

    root: Span
    phase: Span | None = None
    phase_name: ReconfStage | None = None
    events: int = 0
    dropped: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def trace_id(self) -> str | None:
        ctx = self.root.get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else None

    def context(self) -> otel_context.Context:
        """The open phase span's context (the root's between phases)."""
        return trace.set_span_in_context(self.phase if self.phase is not None else self.root)

    def traceparent(self) -> str:
        """The W3C ``traceparent`` of :meth:`context` (what an epoch record written in this
        phase carries); empty when its span has no valid context (no SDK provider)."""
        return inject({}, self.context()).get("traceparent", "")


def plan_attributes(plan: Plan, *, rule: str | None, epoch_before: int | None,
                    instance: str) -> dict[str, Any]:
    """The root span's attributes known before the operation starts. Pure."""
    attrs: dict[str, Any] = {
        "vtm.reconfiguration.kind": plan.kind.value,
        "vtm.reconfiguration.sources": [str(w) for w in plan.source_ids],
        "vtm.reconfiguration.source_degrees": [g.degree for g in plan.sources],
        "vtm.reconfiguration.targets": [str(w) for w in plan.target_ids],
        "vtm.reconfiguration.target_degrees": [g.degree for g in plan.targets],
        "vtm.planner.rule": rule or "none",
        "vtm.planner.reason": plan.reason,
        "vtm.planner.predicted_drain_s": plan.predicted_drain_s,
        "vtm.controller.instance": instance,
    }
    if epoch_before is not None:
        attrs["vtm.epoch.before"] = epoch_before
    return attrs


class ReconfTraces:
    """The open traces of one controller's reconfigurations, by reconfiguration id.

    Adapter state (it holds OTel spans); every method is synchronous and never raises for a
    reconfiguration it does not know (a trace must never fail the work it describes)."""

    def __init__(self) -> None:
        self._open: dict[int, ReconfTrace] = {}

    def __contains__(self, rid: int) -> bool:
        return rid in self._open

    def get(self, rid: int) -> ReconfTrace | None:
        return self._open.get(rid)

    # -- lifecycle ---------------------------------------------------------------------------

    @staticmethod
    def begin(attributes: Mapping[str, Any]) -> ReconfTrace:
        """A new root span (a new trace: no parent, whatever is current) for an operation
        about to be carried out, its ``queue_query`` phase open. Always sampled (the module
        doc's "Sampling"): the marker is given at creation, where the sampler sees it."""
        root = tracer().start_span(
            str(ReconfStage.RECONFIGURATION),
            context=otel_context.Context(),
            attributes={**attributes, ALWAYS_SAMPLE: True},
        )
        t = ReconfTrace(root=root, attributes=dict(attributes))
        _open_phase(t, ReconfStage.QUEUE_QUERY)
        return t

    def started(self, t: ReconfTrace, rid: int, attributes: Mapping[str, Any]) -> None:
        """The operation started as reconfiguration ``rid``: its drain begins."""
        t.root.set_attribute("vtm.reconfiguration.id", rid)
        for k, v in attributes.items():
            t.root.set_attribute(k, v)
        self._open[rid] = t
        _open_phase(t, ReconfStage.DRAIN)

    def phase(self, rid: int, stage: ReconfStage, **attributes: Any) -> None:
        """Reconfiguration ``rid`` entered ``stage``: the open phase span ends, ``stage``'s
        begins (the same stage again: the open span gets an event ``retried``)."""
        t = self._open.get(rid)
        if t is None:
            return
        if t.phase_name is stage and t.phase is not None:
            t.phase.add_event("retried", attributes=_clean(attributes))
            return
        _open_phase(t, stage, attributes)

    def set(self, rid: int, **attributes: Any) -> None:
        """Attributes of ``rid``'s root span."""
        t = self._open.get(rid)
        if t is not None:
            for k, v in _clean(attributes).items():
                t.root.set_attribute(k, v)

    def event(self, rid: int, name: str, **attributes: Any) -> None:
        """An event on ``rid``'s open phase span (bounded: :data:`MAX_EVENTS_PER_PHASE`)."""
        t = self._open.get(rid)
        if t is None:
            return
        span = t.phase if t.phase is not None else t.root
        if t.events >= MAX_EVENTS_PER_PHASE:
            t.dropped += 1
            span.set_attribute("vtm.events_dropped", t.dropped)
            return
        t.events += 1
        span.add_event(name, attributes=_clean(attributes))

    def link(self, rid: int, carrier: Mapping[str, str] | None, **attributes: Any) -> bool:
        """Link ``rid``'s drain span to the span context in ``carrier`` (a request's W3C
        headers); False when there is nothing valid to link or no drain is open."""
        t = self._open.get(rid)
        if t is None or t.phase is None or t.phase_name is not ReconfStage.DRAIN:
            return False
        if traceparent_of(carrier) is None:
            return False
        ctx = trace.get_current_span(extract(carrier)).get_span_context()
        if not ctx.is_valid:
            return False
        t.phase.add_link(ctx, attributes=_clean(attributes))
        return True

    def ended(self, rid: int, **attributes: Any) -> None:
        """``rid`` was exposed: its spans end, status OK."""
        t = self._open.pop(rid, None)
        if t is None:
            return
        self.set_on(t, attributes, outcome="exposed")
        _close_phase(t)
        t.root.set_status(Status(StatusCode.OK))
        t.root.end()

    def failed(self, rid: int, reason: str, *, outcome: str = "aborted",
               error: BaseException | None = None, **attributes: Any) -> None:
        """``rid`` did not reach its exposure (``reason``): its open phase span and its root
        end with status ERROR and ``reason`` as the description."""
        t = self._open.pop(rid, None)
        if t is not None:
            self.failed_trace(t, reason, outcome=outcome, error=error, **attributes)

    def failed_trace(self, t: ReconfTrace, reason: str, *, outcome: str = "aborted",
                     error: BaseException | None = None, **attributes: Any) -> None:
        """:meth:`failed` for a trace that has no reconfiguration id (it never started)."""
        self.set_on(t, attributes, outcome=outcome)
        if t.phase is not None:
            t.phase.set_status(Status(StatusCode.ERROR, reason))
            _close_phase(t)
        if error is not None:
            t.root.record_exception(error)
        t.root.set_status(Status(StatusCode.ERROR, reason))
        t.root.end()

    def fail_all(self, reason: str, *, outcome: str) -> None:
        """Every open reconfiguration fails (the core was rebuilt, the controller stops)."""
        for rid in list(self._open):
            self.failed(rid, reason, outcome=outcome)

    @staticmethod
    def set_on(t: ReconfTrace, attributes: Mapping[str, Any], *, outcome: str) -> None:
        t.root.set_attribute("vtm.reconfiguration.outcome", outcome)
        for k, v in _clean(attributes).items():
            t.root.set_attribute(k, v)

    # -- context -----------------------------------------------------------------------------

    def current(self, rid: int) -> contextlib.AbstractContextManager[Any]:
        """:meth:`bound` for ``rid`` (nothing for a reconfiguration without a trace)."""
        t = self._open.get(rid)
        return bound(t, rid) if t is not None else contextlib.nullcontext()


@contextlib.contextmanager
def bound(t: ReconfTrace, rid: int | None = None) -> Iterator[None]:
    """For this block: ``t``'s open phase span is the current span (NATS requests made here
    carry it) and log lines carry its trace id and the reconfiguration id, as a request's
    handler binds its ids (shared/logging.py)."""
    fields: dict[str, Any] = {}
    tid = t.trace_id
    if tid is not None:
        fields["trace_id"] = tid
    if rid is not None:
        fields["reconfiguration"] = rid
    token = otel_context.attach(t.context())
    try:
        with structlog.contextvars.bound_contextvars(**fields):
            yield
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def bound_all(traces: Sequence[ReconfTrace]) -> Iterator[None]:
    """:func:`bound` for a step shared by several operations of one plan: the first one's
    span is current and its trace id bound; ``trace_ids`` lists every one's."""
    if not traces:
        yield
        return
    ids = [tid for t in traces if (tid := t.trace_id) is not None]
    with bound(traces[0]), structlog.contextvars.bound_contextvars(trace_ids=ids):
        yield


def _open_phase(t: ReconfTrace, stage: ReconfStage,
                attributes: Mapping[str, Any] | None = None) -> None:
    _close_phase(t)
    t.phase = tracer().start_span(
        str(stage),
        context=trace.set_span_in_context(t.root),
        attributes=_clean(attributes or {}) or None,
    )
    t.phase_name = stage
    t.events = t.dropped = 0


def _close_phase(t: ReconfTrace) -> None:
    if t.phase is not None:
        t.phase.end()
    t.phase, t.phase_name = None, None


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes OTel takes: None values left out, sequences as lists of str/int/float."""
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if v is None:
            continue
        if isinstance(v, (str, bool, int, float)):
            out[k] = v
        elif isinstance(v, (list, tuple, set, frozenset)):
            items = sorted(v, key=str) if isinstance(v, (set, frozenset)) else list(v)
            out[k] = [x if isinstance(x, (str, bool, int, float)) else str(x) for x in items]
        else:
            out[k] = str(v)
    return out
