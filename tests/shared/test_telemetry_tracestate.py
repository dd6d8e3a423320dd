"""A malformed ``tracestate`` is dropped silently by ``extract``: OpenTelemetry's TraceState
parser would log a warning for each one, so a client could flood the logs one request at a time.
The ``traceparent`` is still extracted, a well-formed ``tracestate`` still round-trips through
``inject``, and the resulting span context is always the one OpenTelemetry's own propagator
builds (only without its warnings).

What OpenTelemetry 1.45 (``opentelemetry/trace/span.py``, ``tracecontext.py``) calls malformed,
each with a warning: a header over 8192 characters, a non-empty member (``,``-separated, blanks
stripped) that is not ``key=value`` with a W3C key (lowercase, digits, ``_-*/``, optional
``@vendor``) and a printable-ASCII value without ``,``/``=``, or more than 32 members. A duplicate
key makes it discard the header too, silently."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.telemetry import extract, inject

T = "4bf92f3577b34da6a3ce929d0e0e4736"
S = "00f067aa0ba902b7"
TP = f"00-{T}-{S}-01"
OTEL = TraceContextTextMapPropagator()

MALFORMED: list[tuple[str, str]] = [
    ("uppercase key", "A=1"),
    ("no value", "a"),
    ("empty value", "a="),
    ("blank value", "a= "),
    ("two equals", "a=1=2"),
    ("comma-less pair list", "a=1 b=2"),
    ("DEL in value", "a=\x7f"),
    ("non-ASCII value", "a=é"),
    ("control char in value", "a=1\x01"),
    ("one bad member among good", "a=1,B=2,c=3"),
    ("key too long", "k" * 257 + "=1"),
    ("value too long", "a=" + "v" * 257),
    ("vendor part too long", "t@" + "v" * 15 + "=1"),
    ("33 members", ",".join(f"k{i}=v" for i in range(33))),
    ("over 8192 chars, 32 members", ",".join(f"k{i}=" + "v" * 256 for i in range(32))[:8193]),
    ("duplicate key", "a=1,a=2"),
]

WELL_FORMED: list[tuple[str, str, str]] = [  # name, header, what inject writes back
    ("one member", "a=1", "a=1"),
    ("two members", "a=1,b=2", "a=1,b=2"),
    ("vendor key", "t0@vendor=x", "t0@vendor=x"),
    ("key chars", "a_b-c*d/e=1", "a_b-c*d/e=1"),
    ("inner blanks in value", "a=1 x", "a=1 x"),
    ("leading blank in value", "a= 1", "a= 1"),
    ("blanks and empty members", " a=1 ,\t, b=2 ,", "a=1,b=2"),
    ("longest key and value", "k" * 256 + "=" + "v" * 256, "k" * 256 + "=" + "v" * 256),
    ("32 members", ",".join(f"k{i}=v" for i in range(32)), ",".join(f"k{i}=v" for i in range(32))),
]


def span_context(ctx: object) -> trace.SpanContext:
    return trace.get_current_span(ctx).get_span_context()  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["tracestate", "Tracestate"])
@pytest.mark.parametrize("header", [h for _, h in MALFORMED], ids=[n for n, _ in MALFORMED])
def test_malformed_tracestate_is_dropped_silently(
    header: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        ctx = extract({"traceparent": TP, key: header})
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    sc = span_context(ctx)
    assert sc.is_valid and format_trace_id(sc.trace_id) == T
    assert len(sc.trace_state) == 0
    assert inject({}, context=ctx) == {"traceparent": TP}  # nothing of it travels on


@pytest.mark.parametrize(("header", "written"), [(h, w) for _, h, w in WELL_FORMED],
                         ids=[n for n, _, _ in WELL_FORMED])
def test_well_formed_tracestate_round_trips(header: str, written: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        ctx = extract({"Traceparent": TP, "Tracestate": header})
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert inject({}, context=ctx) == {"traceparent": TP, "tracestate": written}
    # a child span (of a provider of its own: the process's global one is left alone) carries
    # the parent's tracestate on, as every hop of a request does
    child = TracerProvider().get_tracer("t").start_span("child", context=ctx)
    out = inject({}, context=trace.set_span_in_context(child))
    assert out["tracestate"] == written and out["traceparent"][3:35] == T


def test_empty_tracestate_writes_none() -> None:
    assert inject({}, context=extract({"traceparent": TP, "tracestate": ""})) == {"traceparent": TP}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def otel_log() -> Iterator[list[logging.LogRecord]]:
    """What the ``opentelemetry`` loggers emit (a handler on that logger itself: caplog is a
    function-scoped fixture, which hypothesis does not reset between examples)."""
    handler, log = _Records(), logging.getLogger("opentelemetry")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


_KEY_CHARS = "abz09_-*/@A ="
_VALUE_CHARS = "a1 !~=,\x7f\té"
_MEMBER = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.text(_KEY_CHARS, min_size=1, max_size=5),
              st.text(_VALUE_CHARS, max_size=5)),
    st.text(_KEY_CHARS + _VALUE_CHARS, max_size=6),
    st.sampled_from(["a=1", "b=2", "t@v=x", ""]),
)
_TRACESTATE = st.one_of(
    st.lists(_MEMBER, max_size=6).map(",".join),
    st.lists(st.sampled_from(["a=1", "b=2", "k=v"]), min_size=30, max_size=34).map(
        lambda ms: ",".join(f"{m[0]}{i}{m[1:]}" for i, m in enumerate(ms))),
    st.text(max_size=20),
)
_TRACEPARENT = st.sampled_from([TP, f"01-{T}-{S}-00-x", f"00-{T}-{S}-01-x", "garbage",
                                f"01-{T}-{S}-01-" + "x" * 500])


@settings(max_examples=300, deadline=None)
@given(_TRACEPARENT, _TRACESTATE)
def test_property_extract_is_otel_extract_without_warnings(traceparent: str, tracestate: str
                                                           ) -> None:
    carrier = {"traceparent": traceparent, "tracestate": tracestate}
    with otel_log() as records:
        ours = span_context(extract(carrier))
    assert [r for r in records if r.levelno >= logging.WARNING] == []
    theirs = span_context(OTEL.extract(carrier))
    assert ours == theirs  # same ids, flags and tracestate entries
    assert list(ours.trace_state.items()) == list(theirs.trace_state.items())
