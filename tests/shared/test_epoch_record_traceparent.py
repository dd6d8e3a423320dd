"""EpochRecord's optional ``traceparent`` (the context of the span that wrote the record, so
that a rank's adoption joins its trace): old records without it still parse, one with it
round-trips, and a malformed one still parses (the reader checks it and goes on without it:
a bad context must never make a record unreadable, which would stop every adoption)."""

from __future__ import annotations

import json

from shared.schemas import EpochRecord, EpochWorker, from_json, from_msgpack, to_json, to_msgpack
from shared.worker import Lifecycle

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def rec(**kw: object) -> EpochRecord:
    return EpochRecord(epoch=2, committed_at_s=1_700_000_000.0, reason="commit reconfiguration 1",
                       workers=[EpochWorker(worker_id="w-cp4-g0", first_gpu=0, degree=4,
                                            lifecycle=Lifecycle.ACTIVE)], **kw)


def test_a_record_written_before_the_field_existed_parses_without_a_context() -> None:
    """A guard, not a change: what a controller of before wrote (every field but it)."""
    old = {"schema_version": 1, "epoch": 2, "committed_at_s": 1_700_000_000.0,
           "reason": "commit reconfiguration 1",
           "workers": [{"worker_id": "w-cp4-g0", "first_gpu": 0, "degree": 4,
                        "lifecycle": "active"}]}
    parsed = from_json(EpochRecord, json.dumps(old))
    assert parsed.traceparent == "" and parsed == rec()


def test_a_record_with_a_context_round_trips() -> None:
    r = rec(traceparent=TP)
    assert from_json(EpochRecord, to_json(r)) == r
    assert from_msgpack(EpochRecord, to_msgpack(r)) == r


def test_a_malformed_context_does_not_make_the_record_unreadable() -> None:
    r = rec(traceparent="not-a-traceparent")
    assert from_json(EpochRecord, to_json(r)).traceparent == "not-a-traceparent"
