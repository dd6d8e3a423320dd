"""What a lazy reconcile copy's trigger gives its span (services/cachemgr/tracing.py): a link
to the request and one to the reconcile that left its pages pending, and whether the span is
kept whatever the sampling ratio -- only when the reconcile's trace is sampled (a
reconfiguration's always is; a record written outside one is a root the ratio may drop, and
its copies keep to the ratio too)."""

from __future__ import annotations

from services.cachemgr.tracing import LINK_REASON, ReconcileOrigin, RequestTrigger

REQUEST = "00-7bf92f3577b34da6a3ce929d0e0e4736-20f067aa0ba902b7-01"
EPOCH_TRACE, EPOCH_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def test_a_reconcile_copy_links_to_the_request_and_to_its_reconcile() -> None:
    origin = ReconcileOrigin.from_carrier({"traceparent": f"00-{EPOCH_TRACE}-{EPOCH_SPAN}-01"}, 3)
    assert origin is not None
    trigger = RequestTrigger("r1", RequestTrigger.from_headers("r1", {"traceparent": REQUEST})
                             .context, origin)
    links = trigger.links()
    assert [dict(x.attributes or {}) for x in links] == [
        {LINK_REASON: "triggered_by", "vtm.request_id": "r1"},
        {LINK_REASON: "reconciles", "vtm.epoch": 3}]
    assert format(links[1].context.trace_id, "032x") == EPOCH_TRACE
    assert format(links[1].context.span_id, "016x") == EPOCH_SPAN
    assert trigger.always_sample


def test_an_unsampled_reconcile_keeps_its_copies_to_the_ratio() -> None:
    origin = ReconcileOrigin.from_carrier({"traceparent": f"00-{EPOCH_TRACE}-{EPOCH_SPAN}-00"}, 1)
    assert origin is not None
    trigger = RequestTrigger("r1", None, origin)
    assert [x.attributes[LINK_REASON] for x in trigger.links() if x.attributes] == ["reconciles"]
    assert not trigger.always_sample


def test_no_reconcile_context_no_link_and_no_always() -> None:
    assert ReconcileOrigin.from_carrier(None, 1) is None
    assert ReconcileOrigin.from_carrier({"traceparent": "garbage"}, 1) is None
    trigger = RequestTrigger.from_headers("r1", {"traceparent": REQUEST})
    assert [x.attributes[LINK_REASON] for x in trigger.links() if x.attributes] == [
        "triggered_by"]
    assert not trigger.always_sample
