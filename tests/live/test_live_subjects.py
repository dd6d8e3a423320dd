"""Subject builders: exact spellings, prefix handling, and typed rejection of bad tokens."""

from __future__ import annotations

import pytest

from shared.ids import InvalidInput
from shared.subjects import (
    SubjectError,
    Subjects,
    micro_service_name,
    validate_subject,
)


def test_default_spellings() -> None:
    s = Subjects()
    assert s.intake_requests() == "vtm.intake.requests"
    assert s.intake_stream() == "VTM_INTAKE"
    assert s.worker_assign("w-cp4-g8") == "vtm.worker.assign.w-cp4-g8"
    assert s.worker_queue("w-cp4-g8") == "vtm.worker.queue.w-cp4-g8"
    assert s.worker_group() == "vtm.worker"
    assert s.worker_assign_all() == "vtm.worker.assign.*"
    assert s.worker_queue_all() == "vtm.worker.queue.*"
    assert s.rank_ctl(3) == "vtm.rank.ctl.3"
    assert s.ctl_drain() == "vtm.ctl.drain" and s.ctl_reconf() == "vtm.ctl.reconf"
    assert s.ctl_composition() == "vtm.ctl.composition"
    assert s.service_group("scheduler") == "vtm.scheduler"
    assert s.assignment_bucket() == "VTM_ASSIGNMENTS"
    assert s.idempotency_bucket() == "VTM_IDEMPOTENCY"
    assert s.epoch_ack(3) == "vtm.epoch.ack.3"
    assert s.cache_events("w-cp2-g0") == "vtm.cache.events.w-cp2-g0"
    assert s.cache_snapshot("w-cp2-g0") == "vtm.cache.snapshot.w-cp2-g0"
    assert s.cache_cmd("w-cp2-g0") == "vtm.cache.cmd.w-cp2-g0"
    assert s.window_demand("sched-1") == "vtm.window.demand.sched-1"
    assert s.window_demand_again("sched-1") == "vtm.window.demand.again.sched-1"
    assert s.window_demand_again_all() == "vtm.window.demand.again.*"
    assert s.result("r-17") == "vtm.result.r-17"
    assert s.kv_handoff("r-17") == "vtm.kv.r-17"
    assert s.worker_state_bucket() == "VTM_WORKERS"
    assert (s.epoch_bucket(), s.epoch_key()) == ("VTM_EPOCH", "current")
    assert s.cache_events_all() == "vtm.cache.events.*"
    assert s.everything() == "vtm.>"


ID = "idx-7"
"""An id no builder uses as a fixed token (so finding it locates the id)."""

ID_BUILDERS = ["worker_assign", "worker_queue", "rank_ctl", "epoch_ack", "cache_events",
               "cache_snapshot", "cache_cmd", "cache_pending", "window_demand",
               "window_demand_again", "cache_stats", "result", "kv_handoff"]


@pytest.mark.parametrize("builder", ID_BUILDERS)
def test_ids_come_last(builder: str) -> None:
    """conventions.md: ids last. Every builder that takes an id puts it in the last token and
    nowhere else (a NATS filter selects one kind with a single trailing ``*``)."""
    arg: object = 7 if builder in ("rank_ctl", "epoch_ack") else ID
    tokens = getattr(Subjects(), builder)(arg).split(".")
    assert tokens[-1] == str(arg) and str(arg) not in tokens[:-1], tokens


def _matches(filt: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, a last ``>`` one or more tokens."""
    f, t = filt.split("."), subject.split(".")
    for i, tok in enumerate(f):
        if tok == ">":
            return len(t) > i
        if i >= len(t) or (tok != "*" and tok != t[i]):
            return False
    return len(f) == len(t)


def test_filters_keep_their_meaning() -> None:
    """Each ``..._all`` filter matches its own kind only; the renamed copies of window reports
    (``window.demand.again.{src}``) stay out of the reports' filter and inside the filter that
    takes both -- even for a reporter named ``again``."""
    s = Subjects()
    subjects = {
        "assign": s.worker_assign("w-cp2-g0"), "queue": s.worker_queue("w-cp2-g0"),
        "report": s.window_demand("sched-1"), "report_again": s.window_demand("again"),
        "copy": s.window_demand_again("sched-1"), "copy_again": s.window_demand_again("again"),
        "events": s.cache_events("w-cp2-g0"), "pending": s.cache_pending("w-cp2-g0"),
        "stats": s.cache_stats("sched-1"), "ack": s.epoch_ack(3), "result": s.result("r-1"),
    }
    expected = {
        s.worker_assign_all(): {"assign"},
        s.worker_queue_all(): {"queue"},
        s.window_demand_all(): {"report", "report_again"},
        s.window_demand_again_all(): {"copy", "copy_again"},
        s.window_demand_with_copies(): {"report", "report_again", "copy", "copy_again"},
        s.cache_events_all(): {"events"},
        s.cache_pending_all(): {"pending"},
        s.cache_stats_all(): {"stats"},
        s.epoch_ack_all(): {"ack"},
        s.result_all(): {"result"},
        s.everything(): set(subjects),
    }
    for filt, kinds in expected.items():
        got = {k for k, subj in subjects.items() if _matches(filt, subj)}
        assert got == kinds, (filt, got)


def test_multi_token_prefix_names() -> None:
    s = Subjects("dev.vtm-a")
    assert s.result("x") == "dev.vtm-a.result.x"
    assert s.intake_stream() == "DEV_VTM_A_INTAKE"
    assert s.worker_state_bucket() == "DEV_VTM_A_WORKERS"
    assert s.assignment_bucket() == "DEV_VTM_A_ASSIGNMENTS"
    assert s.idempotency_bucket() == "DEV_VTM_A_IDEMPOTENCY"
    assert s.ctl_drain() == "dev.vtm-a.ctl.drain"


@pytest.mark.parametrize("bad", ["W-CP4", "a b", "a.b", "*", ">", "$sys", "", "-x", "a\tb"])
def test_bad_ids_rejected(bad: str) -> None:
    with pytest.raises(SubjectError):
        Subjects().worker_assign(bad)


def test_bad_prefix_and_types() -> None:
    for prefix in ("VTM", "vtm.", "$srv", "a.*"):
        with pytest.raises(SubjectError):
            Subjects(prefix)
    with pytest.raises(SubjectError):
        Subjects(".".join(["a"] * 13))
    with pytest.raises(SubjectError):
        Subjects().rank_ctl(-1)
    with pytest.raises(SubjectError):
        Subjects().rank_ctl(True)  # type: ignore[arg-type]
    assert issubclass(SubjectError, InvalidInput)


def test_validate_subject_limits() -> None:
    assert validate_subject("a.*.c.>", allow_wildcards=True)
    with pytest.raises(SubjectError):
        validate_subject("a.>.c", allow_wildcards=True)
    with pytest.raises(SubjectError):
        validate_subject(".".join(["a"] * 17))
    assert validate_subject(".".join(["a"] * 16))


def test_micro_service_name() -> None:
    assert micro_service_name("rankd") == "vtm-rankd"
    with pytest.raises(SubjectError):
        micro_service_name("rank d")
