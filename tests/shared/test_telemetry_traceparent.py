"""``traceparent_of`` (and ``is_sampled``, ``trace_id_of``, ``extract``) accept exactly the
``traceparent`` headers that OpenTelemetry's ``TraceContextTextMapPropagator.extract`` turns into
a valid span context: the cheap check and the full extract must never disagree.

The table pins the W3C Trace Context rules as OTel 1.45 applies them (version 00 is exactly 55
characters, only a higher version may carry more ``-`` fields, ``ff`` is invalid, lowercase hex
only, no all-zero id, at most 512 characters, optional blanks around the value); the property
test checks the agreement on headers built from well-formed and malformed parts."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.trace import format_span_id, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.telemetry import extract, is_sampled, trace_id_of, traceparent_of

T = "4bf92f3577b34da6a3ce929d0e0e4736"
S = "00f067aa0ba902b7"
OTEL = TraceContextTextMapPropagator()


def otel_span_context(carrier: dict[str, str]) -> trace.SpanContext:
    """The span context OpenTelemetry's own propagator extracts (default getter: exact keys)."""
    return trace.get_current_span(OTEL.extract(carrier)).get_span_context()


def ours_span_context(carrier: dict[str, str]) -> trace.SpanContext:
    return trace.get_current_span(extract(carrier)).get_span_context()


CASES: list[tuple[str, str, bool]] = [
    ("v00", f"00-{T}-{S}-01", True),
    ("v00 unsampled", f"00-{T}-{S}-00", True),
    ("v00 other flags", f"00-{T}-{S}-ff", True),
    ("future version, 55 chars", f"01-{T}-{S}-01", True),
    ("future version, extra field", f"01-{T}-{S}-01-extra", True),
    ("future version, extra fields", f"cc-{T}-{S}-01-what-the-future-holds", True),
    ("future version, empty extra field", f"fe-{T}-{S}-09-", True),
    ("leading blanks", f" \t00-{T}-{S}-01", True),
    ("trailing blanks", f"00-{T}-{S}-01 \t", True),
    ("trailing newline (OTel's regex `$`)", f"00-{T}-{S}-01\n", True),
    ("future version, 512 chars", f"01-{T}-{S}-01-" + "x" * (512 - 56), True),
    ("v00 with extra field", f"00-{T}-{S}-01-extra", False),
    ("v00 with empty extra field", f"00-{T}-{S}-01-", False),
    ("v00, junk after flags", f"00-{T}-{S}-01extra", False),
    ("future version, junk after flags", f"01-{T}-{S}-01extra", False),
    ("future version, 513 chars", f"01-{T}-{S}-01-" + "x" * (513 - 56), False),
    ("version ff", f"ff-{T}-{S}-01", False),
    ("version ff, extra field", f"ff-{T}-{S}-01-extra", False),
    ("uppercase version", f"0A-{T}-{S}-01", False),
    ("uppercase trace id", f"00-{T.upper()}-{S}-01", False),
    ("uppercase span id", f"00-{T}-{S.upper()}-01", False),
    ("uppercase flags", f"00-{T}-{S}-0A", False),
    ("zero trace id", f"00-{'0' * 32}-{S}-01", False),
    ("zero span id", f"00-{T}-{'0' * 16}-01", False),
    ("short trace id", f"00-{T[:-1]}-{S}-01", False),
    ("long span id", f"00-{T}-{S}0-01", False),
    ("one-digit version", f"0-{T}-{S}-01", False),
    ("wrong separator", f"00_{T}-{S}-01", False),
    ("non-hex", f"00-{T[:-1]}g-{S}-01", False),
    ("leading newline", f"\n00-{T}-{S}-01", False),
    ("two trailing newlines", f"00-{T}-{S}-01\n\n", False),
    ("newline inside extra field", f"01-{T}-{S}-01-x\ny", False),
    ("empty", "", False),
    ("garbage", "garbage", False),
]


@pytest.mark.parametrize(("header", "valid"), [(h, v) for _, h, v in CASES],
                         ids=[name for name, _, _ in CASES])
def test_traceparent_of_agrees_with_otel_extract(header: str, valid: bool) -> None:
    carrier = {"traceparent": header}
    assert otel_span_context(carrier).is_valid is valid  # the table states OTel's behaviour
    assert (traceparent_of(carrier) is not None) is valid
    assert ours_span_context(carrier).is_valid is valid
    # nats-py header keys are case-sensitive: the other spelling must read the same
    assert (traceparent_of({"Traceparent": header}) is not None) is valid
    assert ours_span_context({"Traceparent": header}).is_valid is valid


@pytest.mark.parametrize("header", [h for _, h, v in CASES if v],
                         ids=[name for name, _, v in CASES if v])
def test_trace_id_and_sampled_flag_match_otel(header: str) -> None:
    carrier = {"traceparent": header}
    sc = otel_span_context(carrier)
    assert trace_id_of(carrier) == format_trace_id(sc.trace_id)
    assert is_sampled(carrier) is sc.trace_flags.sampled
    tp = traceparent_of(carrier)
    assert tp is not None and tp[36:52] == format_span_id(sc.span_id)


def test_non_string_traceparent_is_not_valid() -> None:
    carrier: dict[str, object] = {"traceparent": f"00-{T}-{S}-01".encode()}
    assert traceparent_of(carrier) is None  # type: ignore[arg-type]
    assert not ours_span_context(carrier).is_valid  # type: ignore[arg-type]


def _hex(n: int) -> st.SearchStrategy[str]:
    return st.text("0123456789abcdef", min_size=n, max_size=n)


# A field is mostly well formed, sometimes broken in one of the ways a sender breaks it.
_VERSION = st.one_of(_hex(2), st.sampled_from(["00", "01", "fe", "ff", "0A", "F0", "0", "000"]))
_TRACE_ID = st.one_of(
    _hex(32), st.sampled_from(["0" * 32, T.upper(), T[:-1], T + "0", T[:-1] + "z"]))
_SPAN_ID = st.one_of(
    _hex(16), st.sampled_from(["0" * 16, S.upper(), S[:-1], S + "0", S[:-1] + " "]))
_FLAGS = st.one_of(_hex(2), st.sampled_from(["0A", "f", "001", "-1"]))
_SEP = st.sampled_from(["-", "-", "-", "-", "_", "", "--"])
_BLANKS = st.text(" \t", max_size=2)
_TAIL = st.one_of(
    st.just(""),
    st.sampled_from(["-", "-extra", "extra", "\n", " \n", "\n\n", "-x\n", "-x\ny", "-x-y"]),
    st.builds(lambda n: "-" + "x" * n, st.integers(440, 470)),  # around the 512-char limit
    st.text(max_size=8).map(lambda s: "-" + s),
)


@st.composite
def traceparents(draw: st.DrawFn) -> str:
    return (draw(_BLANKS) + draw(_VERSION) + draw(_SEP) + draw(_TRACE_ID) + draw(_SEP)
            + draw(_SPAN_ID) + draw(_SEP) + draw(_FLAGS) + draw(_TAIL) + draw(_BLANKS))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(traceparents(), st.text(max_size=80)))
def test_property_traceparent_of_iff_otel_extract_is_valid(header: str) -> None:
    carrier = {"traceparent": header}
    sc = otel_span_context(carrier)
    assert (traceparent_of(carrier) is not None) is sc.is_valid
    assert ours_span_context(carrier) == sc
    if sc.is_valid:
        assert trace_id_of(carrier) == format_trace_id(sc.trace_id)
        assert is_sampled(carrier) is sc.trace_flags.sampled
