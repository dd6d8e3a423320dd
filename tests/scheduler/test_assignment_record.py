"""AssignmentRecord as read back from the KV bucket: what a replica will NAK must be an ack
subject (a corrupt record cannot make it publish anywhere else)."""

from __future__ import annotations

import json

import pytest

from services.scheduler.service import AssignmentRecord
from shared.schemas import SCHEMA_VERSION, SchemaError, from_json

BASE = {
    "schema_version": SCHEMA_VERSION, "request_id": "r1", "stream_seq": 7, "msg_id": "r1",
    "worker_id": "w-cp2-g0", "epoch": 0, "degree": 2, "predicted_s": 0.5,
    "state": "dispatched", "scheduler": "sched-a", "assigned_at_s": 1.0e9,
}


def record(**kw: object) -> AssignmentRecord:
    return from_json(AssignmentRecord, json.dumps({**BASE, **kw}))


def test_holder_and_ack_subject_default_to_empty() -> None:
    rec = record()
    assert rec.holder == "" and rec.ack_subject == ""  # records of the previous version


def test_an_ack_subject_is_kept() -> None:
    subject = "$JS.ACK.VTM_INTAKE.sched.1.42.42.1796030235811709937.3"
    assert record(ack_subject=subject, holder="sched-b").ack_subject == subject


@pytest.mark.parametrize("bad", ["vtm.intake.requests", "$JS.API.STREAM.DELETE.X",
                                 "$JS.ACK.S C", "$JS.ACK." + "x" * 600])
def test_anything_else_is_refused(bad: str) -> None:
    with pytest.raises(SchemaError):
        record(ack_subject=bad)
