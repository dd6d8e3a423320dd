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
    assert s.worker_assign("w-cp4-g8") == "vtm.worker.w-cp4-g8.assign"
    assert s.rank_ctl(3) == "vtm.rank.ctl.3"
    assert s.ctl_drain() == "vtm.ctl.drain" and s.ctl_reconf() == "vtm.ctl.reconf"
    assert s.ctl_composition() == "vtm.ctl.composition"
    assert s.service_group("scheduler") == "vtm.scheduler"
    assert s.assignment_bucket() == "VTM_ASSIGNMENTS"
    assert s.epoch_ack(3) == "vtm.epoch.ack.3"
    assert s.cache_events("w-cp2-g0") == "vtm.cache.events.w-cp2-g0"
    assert s.cache_snapshot("w-cp2-g0") == "vtm.cache.snapshot.w-cp2-g0"
    assert s.cache_cmd("w-cp2-g0") == "vtm.cache.cmd.w-cp2-g0"
    assert s.window_demand("sched-1") == "vtm.window.demand.sched-1"
    assert s.result("r-17") == "vtm.result.r-17"
    assert s.kv_handoff("r-17") == "vtm.kv.r-17"
    assert s.worker_state_bucket() == "VTM_WORKERS"
    assert (s.epoch_bucket(), s.epoch_key()) == ("VTM_EPOCH", "current")
    assert s.cache_events_all() == "vtm.cache.events.*"
    assert s.everything() == "vtm.>"


def test_multi_token_prefix_names() -> None:
    s = Subjects("dev.vtm-a")
    assert s.result("x") == "dev.vtm-a.result.x"
    assert s.intake_stream() == "DEV_VTM_A_INTAKE"
    assert s.worker_state_bucket() == "DEV_VTM_A_WORKERS"
    assert s.assignment_bucket() == "DEV_VTM_A_ASSIGNMENTS"
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
