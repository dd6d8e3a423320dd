"""Every wire message round-trips through JSON and msgpack; bad payloads give SchemaError."""

from __future__ import annotations

import contextlib
import json

import msgpack
import pytest
from pydantic import BaseModel, ValidationError

from shared.ids import InvalidInput
from shared.schemas import (
    CONTENT_TYPE,
    JSON,
    MAX_TOKENS,
    MSGPACK,
    WINDOW_REPORT_VERSION,
    Assignment,
    AssignmentAck,
    CacheCleared,
    CacheCommand,
    CacheCommandResult,
    CacheEvent,
    CacheRemoved,
    CacheSnapshot,
    CacheStored,
    CompletionRequest,
    DemoteCommand,
    EpochAck,
    EpochRecord,
    EpochWorker,
    FirstToken,
    IntakeRequest,
    KvChunk,
    PlacementTerms,
    ReclaimCommand,
    ReconcileCommand,
    ReplicateCommand,
    RequestStats,
    SchemaError,
    TtftStages,
    WindowReport,
    WorkerState,
    decode,
    encode,
    from_json,
    from_msgpack,
    to_json,
    to_msgpack,
)
from shared.worker import Lifecycle, WorkerKind

INTAKE = IntakeRequest(
    request_id="r-1",
    input_len=1100,
    block_hashes=[11, 22, -(2**63)],
    arrival_s=1_700_000_000.5,
    trace_context={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
)

SAMPLES: list[tuple[object, BaseModel]] = [
    (CompletionRequest, CompletionRequest(prompt_tokens=[1, 2, 3], max_tokens=4)),
    (CompletionRequest, CompletionRequest(prompt="hello", stream=True, request_id="abc")),
    (IntakeRequest, INTAKE),
    (IntakeRequest, IntakeRequest(request_id="r-2", input_len=3, tokens=[5, 6, 7], arrival_s=1.0)),
    (
        Assignment,
        Assignment(
            request=INTAKE,
            worker_id="w-cp4-g8",
            epoch=3,
            degree=4,
            prefix_tokens=1024,
            recompute_tokens=76,
            predicted_s=0.25,
            assigned_at_s=1_700_000_000.6,
            terms=PlacementTerms(
                policy="vertumnus",
                q_s=0.1,
                s_s=0.25,
                gpu_cost_s=-0.01,
                beta=1.5,
                lam=0.5,
                j=0.5,
                candidates=5,
            ),
        ),
    ),
    (
        AssignmentAck,
        AssignmentAck(request_id="r-1", worker_id="w-cp4-g8", epoch=3, queue_position=0),
    ),
    (
        WorkerState,
        WorkerState(
            worker_id="w-cp4-g8",
            degree=4,
            gpus=[8, 9, 10, 11],
            epoch=3,
            lifecycle=Lifecycle.ACTIVE,
            queue_len=2,
            outstanding_s=0.7,
            kv_free_blocks=10,
            kv_total_blocks=100,
            hit_tokens=512,
            input_tokens=4096,
            heartbeat_s=5.0,
        ),
    ),
    (
        EpochRecord,
        EpochRecord(
            epoch=4,
            workers=[
                EpochWorker(
                    worker_id="w-cp4-g0", first_gpu=0, degree=4, lifecycle=Lifecycle.ACTIVE
                ),
                EpochWorker(
                    worker_id="w-cp2-g4", first_gpu=4, degree=2, lifecycle=Lifecycle.SWITCHING
                ),
                EpochWorker(
                    worker_id="w-tp2-g6",
                    kind=WorkerKind.TP,
                    first_gpu=6,
                    degree=2,
                    lifecycle=Lifecycle.DRAINING,
                ),
            ],
            committed_at_s=2.0,
            reason="split",
        ),
    ),
    (EpochAck, EpochAck(gpu=5, epoch=4, degree=2, worker_id="w-cp2-g4", adopted_at_s=3.0)),
    (
        CacheEvent,
        CacheStored(worker="w-cp2-g0", event_id=1, parent_hash=None, block_hashes=[1, 2**64 - 1]),
    ),
    (CacheEvent, CacheStored(worker="w-cp2-g0", event_id=2, parent_hash=2, block_hashes=[3])),
    (CacheEvent, CacheRemoved(worker="w-cp2-g0", event_id=3, block_hashes=[3])),
    (CacheEvent, CacheCleared(worker="w-cp2-g0", event_id=4)),
    (CacheEvent, CacheSnapshot(worker="w-cp2-g0", last_event_id=4, blocks=[(1, None), (2, 1)])),
    (
        CacheCommand,
        ReplicateCommand(
            command_id="c1", worker_id="w-cp2-g2", epoch=1, blocks=[1, 2], source_worker="w-cp2-g0"
        ),
    ),
    (CacheCommand, ReclaimCommand(command_id="c2", worker_id="w-cp2-g2", epoch=1, blocks=[2])),
    (CacheCommand, ReconcileCommand(command_id="c3", worker_id="w-cp4-g0", epoch=2, blocks=[1])),
    (CacheCommand, DemoteCommand(command_id="c4", worker_id="w-cp2-g0", epoch=2, blocks=[1, 2])),
    (
        CacheCommandResult,
        CacheCommandResult(command_id="c1", worker_id="w-cp2-g2", ok=True, blocks_done=2),
    ),
    (
        WindowReport,
        WindowReport(
            reporter="s-0",
            window_index=7,
            window_start_s=140.0,
            window_s=20.0,
            epoch=2,
            demand_s=33.5,
            requests=40,
            long_requests=3,
            demand_by_degree={2: 10.0, 4: 23.5},
        ),
    ),
    (
        FirstToken,
        FirstToken(
            request_id="r-1",
            token=42,
            worker_id="w-cp4-g8",
            epoch=3,
            predicted_prefill_s=0.25,
            stages=TtftStages(
                intake_wait_s=0.01,
                schedule_s=0.001,
                queue_wait_s=0.2,
                prefill_s=0.3,
                kv_transfer_s=0.01,
                first_decode_s=0.02,
                total_s=0.55,
            ),
            finished_at_s=10.0,
        ),
    ),
    (
        FirstToken,
        FirstToken(
            request_id="r-9",
            token=None,
            error="worker lost",
            stages=TtftStages(),
            finished_at_s=1.0,
        ),
    ),
    (
        KvChunk,
        KvChunk(
            request_id="r-1",
            index=1,
            count=3,
            rank=2,
            layer=0,
            dtype="bfloat16",
            shape=[2, 8, 64],
            data=bytes(range(256)),
        ),
    ),
]


@pytest.mark.parametrize(("target", "msg"), SAMPLES, ids=lambda x: type(x).__name__)
def test_json_and_msgpack_round_trip(target: object, msg: BaseModel) -> None:
    assert from_json(target, to_json(msg)) == msg
    assert from_msgpack(target, to_msgpack(msg)) == msg
    for ctype in (JSON, MSGPACK):
        data, headers = encode(msg, ctype)
        assert headers == {CONTENT_TYPE: ctype}
        assert decode(target, data, headers) == msg
    # Every message is at schema version 1 but WindowReport (2: the preferred-degree
    # breakdown; its version-1 form still decodes, tests/live_ctl/test_ctl_adapter_helpers.py).
    assert msg.schema_version == (WINDOW_REPORT_VERSION if isinstance(msg, WindowReport) else 1)


def test_messages_are_frozen() -> None:
    with pytest.raises(ValidationError):
        INTAKE.input_len = 5  # type: ignore[misc]


def test_missing_content_type_means_json_and_header_case_is_ignored() -> None:
    assert decode(IntakeRequest, to_json(INTAKE)) == INTAKE
    assert decode(IntakeRequest, to_msgpack(INTAKE), {"content-type": MSGPACK}) == INTAKE


def _raw(msg: BaseModel, **changes: object) -> dict:
    d = json.loads(to_json(msg))
    d.update(changes)
    return d


REJECTS: list[tuple[object, bytes, str, str]] = [
    (IntakeRequest, b"{not json", "IntakeRequest", ""),
    (IntakeRequest, json.dumps(_raw(INTAKE, surprise=1)).encode(), "IntakeRequest", "surprise"),
    (
        IntakeRequest,
        json.dumps(_raw(INTAKE, schema_version=2)).encode(),
        "IntakeRequest",
        "schema_version",
    ),
    (IntakeRequest, json.dumps(_raw(INTAKE, input_len=0)).encode(), "IntakeRequest", "input_len"),
    (
        IntakeRequest,
        json.dumps(_raw(INTAKE, request_id="Bad Id")).encode(),
        "IntakeRequest",
        "request_id",
    ),
    (IntakeRequest, json.dumps(_raw(INTAKE, input_len=10)).encode(), "IntakeRequest", "<model>"),
    (
        IntakeRequest,
        json.dumps(_raw(INTAKE, block_hashes=[2**64])).encode(),
        "IntakeRequest",
        "block_hashes.0",
    ),
    (CompletionRequest, b'{"prompt":"a","prompt_tokens":[1]}', "CompletionRequest", "<model>"),
    (
        CacheEvent,
        b'{"type":"stored","worker":"w","event_id":1,"block_hashes":[]}',
        "CacheEvent",
        "stored.block_hashes",
    ),
    (CacheEvent, b'{"type":"bogus","worker":"w","event_id":1}', "CacheEvent", "type"),
    (
        CacheEvent,
        b'{"type":"removed","worker":"w","event_id":0,"block_hashes":[1]}',
        "CacheEvent",
        "removed.event_id",
    ),
    (
        CacheCommand,
        b'{"op":"replicate","command_id":"c","worker_id":"w","epoch":0,'
        b'"blocks":[1],"source_worker":"w"}',
        "CacheCommand",
        "replicate",
    ),
    (
        CacheCommand,
        b'{"op":"demote","command_id":"c","worker_id":"w","epoch":0,"blocks":["x"]}',
        "CacheCommand",
        "demote.blocks.0",
    ),
    (
        EpochAck,
        b'{"gpu":9,"epoch":1,"degree":2,"worker_id":"w-cp2-g4","adopted_at_s":1}',
        "EpochAck",
        "<model>",
    ),
    (
        WindowReport,
        b'{"reporter":"s","window_index":0,"window_start_s":0,"window_s":20,'
        b'"epoch":0,"demand_s":1,"requests":1,"long_requests":2}',
        "WindowReport",
        "<model>",
    ),
    # A trace context is copied into NATS headers downstream: only the W3C keys, printable.
    (
        IntakeRequest,
        b'{"request_id":"r","input_len":5,"arrival_s":1,"trace_context":{"bad key":"x"}}',
        "IntakeRequest",
        "trace_context",
    ),
    (
        IntakeRequest,
        b'{"request_id":"r","input_len":5,"arrival_s":1,'
        b'"trace_context":{"Content-Type":"application/msgpack"}}',
        "IntakeRequest",
        "trace_context",
    ),
    (
        IntakeRequest,
        b'{"request_id":"r","input_len":5,"arrival_s":1,'
        b'"trace_context":{"tracestate":"a\\r\\nb"}}',
        "IntakeRequest",
        "trace_context",
    ),
]


@pytest.mark.parametrize(("target", "data", "model", "field"), REJECTS)
def test_json_rejections_are_typed(target: object, data: bytes, model: str, field: str) -> None:
    with pytest.raises(SchemaError) as err:
        from_json(target, data)
    assert err.value.model == model
    assert field in err.value.field
    assert isinstance(err.value, InvalidInput)


def test_a_demote_command_decodes_as_one_and_refuses_what_it_does_not_carry() -> None:
    """The ``demote`` op selects DemoteCommand from the union; it has no ``source_worker``
    (the executing worker is the pull's source itself) and its blocks are hashes, so a
    non-int block is refused naming the model, the op and the block's position."""
    cmd = DemoteCommand(command_id="c", worker_id="w-cp2-g0", epoch=0, blocks=[5, 6])
    assert type(from_json(CacheCommand, to_json(cmd))) is DemoteCommand
    raw = json.loads(to_json(cmd))
    for change, field in (({"blocks": [5, "x"]}, "demote.blocks.1"),
                          ({"blocks": []}, "demote.blocks"),
                          ({"source_worker": "w-cp2-g2"}, "demote.source_worker")):
        with pytest.raises(SchemaError) as err:
            from_json(CacheCommand, json.dumps({**raw, **change}))
        assert (err.value.model, err.value.field) == ("CacheCommand", field)
        assert str(err.value).startswith(f"CacheCommand: field {field!r}: ")


def test_assignment_lengths_must_add_up() -> None:
    raw = json.loads(to_json(SAMPLES[4][1]))
    raw["recompute_tokens"] = 1
    with pytest.raises(SchemaError, match="P \\+ R"):
        from_json(Assignment, json.dumps(raw))
    raw["recompute_tokens"] = 0
    raw["prefix_tokens"] = 1100
    with pytest.raises(SchemaError) as err:
        from_json(Assignment, json.dumps(raw))
    assert err.value.field == "recompute_tokens"


def test_worker_state_consistency() -> None:
    raw = json.loads(to_json(SAMPLES[6][1]))
    for change in (
        {"gpus": [8, 9, 10]},
        {"gpus": [8, 10, 11, 12]},
        {"kv_free_blocks": 101},
        {"hit_tokens": 5000},
    ):
        with pytest.raises(SchemaError):
            from_json(WorkerState, json.dumps({**raw, **change}))


def test_worker_state_max_seq_len() -> None:
    """A worker's own prompt limit: optional (a state without it, e.g. from an older rank
    daemon, is valid and means "not known"), a positive token count up to MAX_TOKENS, and
    carried through both codecs."""
    raw = json.loads(to_json(SAMPLES[6][1]))
    assert "max_seq_len" in raw  # the sample is a WorkerState
    del raw["max_seq_len"]
    assert from_json(WorkerState, json.dumps(raw)).max_seq_len is None
    for limit in (1, 40_960, MAX_TOKENS):
        st = from_json(WorkerState, json.dumps({**raw, "max_seq_len": limit}))
        assert st.max_seq_len == limit
        for ctype in (JSON, MSGPACK):
            data, headers = encode(st, ctype)
            assert decode(WorkerState, data, headers) == st
    for bad in (0, -1, MAX_TOKENS + 1, 1.5, "abc", [512]):
        with pytest.raises(SchemaError) as err:
            from_json(WorkerState, json.dumps({**raw, "max_seq_len": bad}))
        assert err.value.field == "max_seq_len", bad


def test_epoch_record_rejects_overlap_and_misaligned_groups() -> None:
    good = json.loads(to_json(SAMPLES[7][1]))
    overlap = {
        **good,
        "workers": good["workers"]
        + [{"worker_id": "w-cp2-g2", "first_gpu": 2, "degree": 2, "lifecycle": "active"}],
    }
    with pytest.raises(SchemaError, match="overlaps"):
        from_json(EpochRecord, json.dumps(overlap))
    misaligned = {
        **good,
        "workers": [{"worker_id": "w-cp4-g2", "first_gpu": 2, "degree": 4, "lifecycle": "active"}],
    }
    with pytest.raises(SchemaError, match="multiple"):
        from_json(EpochRecord, json.dumps(misaligned))
    nested = {
        **good,
        "workers": [{"worker_id": "w-cp2-g2", "first_gpu": 2, "degree": 2, "lifecycle": "active"},
                    {"worker_id": "w-cp8-g0", "first_gpu": 0, "degree": 8, "lifecycle": "active"}],
    }
    with pytest.raises(SchemaError, match="overlaps"):
        from_json(EpochRecord, json.dumps(nested))


def test_epoch_record_refuses_a_huge_degree_at_once() -> None:
    """A degree of 2^40 passed the checks by building a set of 2^40 GPU ids (a MemoryError,
    or the OOM killer, in every reader: a rank host's follower died of it for good). It is
    bad input, named, before anything is built."""
    huge = {"epoch": 1, "committed_at_s": 1.0, "workers": [
        {"worker_id": f"w-cp{1 << 40}-g0", "first_gpu": 0, "degree": 1 << 40,
         "lifecycle": "active"}]}
    with pytest.raises(SchemaError) as err:
        from_json(EpochRecord, json.dumps(huge))
    assert "degree" in str(err.value)


def test_a_tp_worker_s_id_must_name_its_group() -> None:
    """A TP worker whose id names other GPUs than its group (``w-tp2-g2`` at first GPU 0): a
    rank host chose it by the group, its rank daemon took the GPUs from the id, and two
    workers served GPUs 2-3 while 0-1 went unacknowledged. Refused now, as for CP workers."""
    bad = {"epoch": 1, "committed_at_s": 1.0, "workers": [
        {"worker_id": "w-tp2-g2", "kind": "tp", "first_gpu": 0, "degree": 2,
         "lifecycle": "active"}]}
    with pytest.raises(SchemaError, match="is not 'w-tp2-g0'"):
        from_json(EpochRecord, json.dumps(bad))
    bad["workers"][0]["worker_id"] = "w-tp2-g0"
    assert from_json(EpochRecord, json.dumps(bad)).workers[0].group.gpus == range(0, 2)


def test_msgpack_rejections_are_typed() -> None:
    with pytest.raises(SchemaError) as err:
        from_msgpack(KvChunk, b"\xc1")
    assert err.value.field == "<payload>"
    with pytest.raises(SchemaError) as err:
        from_msgpack(KvChunk, msgpack.packb([1, 2]))
    assert err.value.model == "KvChunk"
    bad = json.loads(to_json(SAMPLES[-1][1]))
    bad.update(index=3, data=b"x")
    with pytest.raises(SchemaError, match="chunk index"):
        from_msgpack(KvChunk, msgpack.packb(bad))
    with pytest.raises(SchemaError, match="content type"):
        decode(KvChunk, b"", {CONTENT_TYPE: "text/plain"})


def test_first_token_needs_token_or_error() -> None:
    with pytest.raises(SchemaError):
        from_json(FirstToken, b'{"request_id":"r","token":null,"stages":{},"finished_at_s":1}')


@pytest.mark.parametrize(
    "raw",
    [
        b'{"type":"stored","worker":"w","event_id":1,"parent_hash":1,"block_hashes":[1,2]}',
        b'{"type":"stored","worker":"w","event_id":1,"block_hashes":[1,1]}',
        b'{"type":"removed","worker":"w","event_id":1,"block_hashes":[3,3]}',
        b'{"type":"snapshot","worker":"w","last_event_id":1,"blocks":[[2,1]]}',
        b'{"type":"snapshot","worker":"w","last_event_id":1,"blocks":[[1,null],[1,null]]}',
    ],
)
def test_malformed_cache_events_rejected(raw: bytes) -> None:
    with pytest.raises(SchemaError):
        from_json(CacheEvent, raw)


def test_cache_event_wire_matches_cachemgr_events() -> None:
    """The cache manager's own wire dicts (services/cachemgr/events.py) decode unchanged."""
    from services.cachemgr import events  # in-repo: a broken import fails, never skips
    samples = [
        events.Stored("w-cp2-g0", 1, None, (1, 2)),
        events.Stored("w-cp2-g0", 2, 2, (3,)),
        events.Removed("w-cp2-g0", 3, (3,)),
        events.Cleared("w-cp2-g0", 4),
    ]
    for ev in samples:
        wire = ev.to_wire()
        decoded = from_json(CacheEvent, json.dumps(wire))
        assert decoded.model_dump(exclude={"schema_version"}, exclude_none=False) == {
            **wire,
            **({"parent_hash": wire.get("parent_hash")} if wire["type"] == "stored" else {}),
        }


STATS = RequestStats(
    request_id="r-1", reporter="s-0", worker_id="w-cp2-g0", degree=2, input_len=1100,
    block_hashes=[11, 22], reused_blocks=2, prefix_tokens=1024, preferred_degree=2,
    preferred_worker="w-cp2-g0", predicted_s=0.25, policy="vertumnus", at_s=1.0,
)


def test_token_bound_is_the_trace_readers() -> None:
    """Every request a trace can replay is a valid message (and nothing longer is)."""
    from sim.workloads import parsing  # in-repo: a broken import fails, never skips
    assert MAX_TOKENS == parsing.MAX_TOKENS == 1 << 24


def test_request_stats_at_the_token_bound_round_trip() -> None:
    for msg in (STATS, STATS.model_copy(update={"input_len": MAX_TOKENS,
                                                "prefix_tokens": MAX_TOKENS - 1})):
        assert from_json(RequestStats, to_json(msg)) == msg
        assert from_msgpack(RequestStats, to_msgpack(msg)) == msg
    raw = _raw(INTAKE, input_len=MAX_TOKENS)
    assert from_json(IntakeRequest, json.dumps(raw)).input_len == MAX_TOKENS


@pytest.mark.parametrize(
    ("target", "base", "changes", "field"),
    [
        # Algorithm 1's L: one huge value would inflate a prefix's missed benefit for ever.
        (RequestStats, STATS, {"input_len": MAX_TOKENS + 1}, "input_len"),
        (RequestStats, STATS, {"input_len": 10**30}, "input_len"),
        (RequestStats, STATS, {"prefix_tokens": MAX_TOKENS + 1}, "prefix_tokens"),
        (RequestStats, STATS, {"reused_blocks": MAX_TOKENS + 1}, "reused_blocks"),
        (RequestStats, STATS, {"reused_blocks": -1}, "reused_blocks"),
        (RequestStats, STATS, {"block_hashes": [2**64]}, "block_hashes.0"),
        # Where RequestStats' input_len comes from: refused at the intake already.
        (IntakeRequest, INTAKE, {"input_len": MAX_TOKENS + 1}, "input_len"),
    ],
)
def test_token_counts_beyond_the_bound_are_refused(
    target: type[BaseModel], base: BaseModel, changes: dict[str, object], field: str
) -> None:
    raw = _raw(base, **changes)
    payloads = [(json.dumps(raw).encode(), JSON)]
    with contextlib.suppress(OverflowError):  # msgpack has no ints beyond 64 bits
        payloads.append((msgpack.packb(raw), MSGPACK))
    for payload, ctype in payloads:
        with pytest.raises(SchemaError) as err:
            decode(target, payload, {CONTENT_TYPE: ctype})
        assert err.value.model == target.__name__ and err.value.field == field
