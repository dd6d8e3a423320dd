"""The live services start from the simulator's calibrated values (sim/calibration.py), so a
live run and a simulation of the same trace and policy decide alike; an operator's explicit
setting still wins."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.cachemgr.service import CacheMgrSettings
from services.controller.service import ControllerService, ControllerSettings
from services.scheduler.placement import PullCredit
from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.costmodel import Profile
from sim import calibration


def test_cachemgr_scan_defaults_are_the_calibrated_scan() -> None:
    live = CacheMgrSettings().scan_config()
    for field in ("theta_inter", "theta_intra", "theta_reclaim", "decay",
                  "max_actions_per_list", "max_replications"):
        assert getattr(live, field) == getattr(calibration.SCAN, field), field


def test_cachemgr_explicit_threshold_wins() -> None:
    live = CacheMgrSettings(theta_intra=calibration.SCAN.theta_intra + 3).scan_config()
    assert live.theta_intra == calibration.SCAN.theta_intra + 3
    assert dataclasses.replace(live, theta_intra=calibration.SCAN.theta_intra).theta_inter == \
        calibration.SCAN.theta_inter


def test_cachemgr_rehome_defaults_to_the_calibrated_rehome_and_can_be_off(monkeypatch) -> None:
    monkeypatch.delenv("VTM_REHOME_DISPLACE", raising=False)
    assert CacheMgrSettings().rehome_config() == calibration.REHOME
    assert calibration.REHOME.displace  # a split's copies displace a full peer's colder blocks
    assert CacheMgrSettings(rehome=False).rehome_config() is None
    monkeypatch.setenv("VTM_REHOME_DISPLACE", "0")  # only into free room, as before
    assert CacheMgrSettings().rehome_config() == dataclasses.replace(
        calibration.REHOME, displace=False)


def test_cachemgr_pull_defaults_to_the_calibrated_pull_and_can_be_off() -> None:
    assert CacheMgrSettings().pull_config() == calibration.PULL
    assert CacheMgrSettings(pull=False).pull_config() is None
    assert CacheMgrSettings(pull_min_blocks=7).pull_config().min_blocks == 7


def test_cachemgr_pull_demote_defaults_on_and_vtm_pull_demote_turns_it_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A landed pull demotes its source's private copy by default (the calibrated
    ``PULL.demote_source``); ``VTM_PULL_DEMOTE=0`` (or ``false``) keeps the pull a copy."""
    monkeypatch.delenv("VTM_PULL_DEMOTE", raising=False)
    assert calibration.PULL.demote_source is True
    assert CacheMgrSettings().pull_demote is True
    assert CacheMgrSettings().pull_config().demote_source is True  # type: ignore[union-attr]
    for off in ("0", "false"):
        monkeypatch.setenv("VTM_PULL_DEMOTE", off)
        config = CacheMgrSettings().pull_config()
        assert config is not None and config.demote_source is False
        assert config.min_blocks == calibration.PULL.min_blocks
    monkeypatch.setenv("VTM_PULL_DEMOTE", "1")
    assert CacheMgrSettings().pull_config().demote_source is True  # type: ignore[union-attr]
    explicit = CacheMgrSettings(pull_demote=False).pull_config()  # an explicit setting wins
    assert explicit is not None and explicit.demote_source is False


def test_scheduler_pull_credit_follows_the_cache_managers_pull(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """J's pull credit is on by default (calibrated: 256 blocks, priced
    PULL_DISPLACE_BLOCK_S a copied block, with its wait) with the pull's min_blocks;
    VTM_PULL_CREDIT_BLOCKS, VTM_PULL_DISPLACE_BLOCK_S and VTM_PULL_WAIT move it. The
    scheduler reads the same VTM_PULL / VTM_PULL_MIN_BLOCKS as the cache manager, so one
    setting turns both off or moves both."""
    for var in ("VTM_PULL", "VTM_PULL_MIN_BLOCKS", "VTM_PULL_CREDIT_BLOCKS",
                "VTM_PULL_DISPLACE_BLOCK_S", "VTM_PULL_WAIT"):
        monkeypatch.delenv(var, raising=False)
    assert (calibration.PULL_CREDIT_BLOCKS, calibration.PULL_DISPLACE_BLOCK_S,
            calibration.PULL_WAIT) == (256, 0.01, True)
    credit = SchedulerService(SchedulerSettings()).core.policy.pull  # type: ignore[attr-defined]
    assert credit == PullCredit(min_blocks=calibration.PULL.min_blocks, max_blocks=256,
                                displace_block_s=0.01, wait=True)
    monkeypatch.setenv("VTM_PULL_CREDIT_BLOCKS", "32")
    monkeypatch.setenv("VTM_PULL_DISPLACE_BLOCK_S", "0")
    monkeypatch.setenv("VTM_PULL_WAIT", "false")
    credit = SchedulerService(SchedulerSettings()).core.policy.pull  # type: ignore[attr-defined]
    assert credit == PullCredit(min_blocks=calibration.PULL.min_blocks, max_blocks=32)
    monkeypatch.delenv("VTM_PULL_WAIT")
    monkeypatch.setenv("VTM_PULL_DISPLACE_BLOCK_S", "-1")
    with pytest.raises(ValueError, match="pull_displace_block_s"):
        SchedulerSettings()
    monkeypatch.delenv("VTM_PULL_DISPLACE_BLOCK_S")
    monkeypatch.setenv("VTM_PULL_MIN_BLOCKS", "5")
    assert SchedulerSettings().pull_credit().min_blocks == 5  # type: ignore[union-attr]
    assert CacheMgrSettings().pull_config().min_blocks == 5  # type: ignore[union-attr]
    monkeypatch.setenv("VTM_PULL", "false")
    assert SchedulerSettings().pull_credit() is None and CacheMgrSettings().pull_config() is None
    monkeypatch.delenv("VTM_PULL")
    monkeypatch.setenv("VTM_PULL_CREDIT_BLOCKS", "0")
    off = SchedulerService(SchedulerSettings()).core.policy
    assert off.pull is None  # type: ignore[attr-defined]
    monkeypatch.setenv("VTM_PULL_CREDIT_BLOCKS", "4")  # below min_blocks 5
    with pytest.raises(ValueError, match="pull_credit_blocks"):
        SchedulerSettings()
    monkeypatch.setenv("VTM_PULL_CREDIT_BLOCKS", "9")
    # A baseline that is not J takes no credit.
    assert not hasattr(SchedulerService(SchedulerSettings(policy="dynamo")).core.policy, "pull")


def test_scheduler_vertumnus_weights_default_to_calibrated() -> None:
    svc = SchedulerService(SchedulerSettings(policy="vertumnus"))
    policy = svc.core.policy
    assert (policy.beta, policy.lam) == (calibration.BETA, calibration.LAM)  # type: ignore[attr-defined]


def test_scheduler_explicit_weights_win_and_baselines_keep_their_defaults() -> None:
    svc = SchedulerService(SchedulerSettings(policy="vertumnus",
                                             policy_params={"beta": 1.0}))
    assert svc.core.policy.beta == 1.0  # type: ignore[attr-defined]
    assert svc.core.policy.lam == calibration.LAM  # type: ignore[attr-defined]
    # The queue-following β is off unless asked for (VTM_POLICY_PARAMS), like any J weight.
    assert svc.core.policy.beta_queue_scale == 0.0  # type: ignore[attr-defined]
    on = SchedulerService(SchedulerSettings(policy="vertumnus",
                                            policy_params={"beta_queue_scale": 2.0}))
    assert on.core.policy.beta_queue_scale == 2.0  # type: ignore[attr-defined]
    assert calibration.policy_params("dynamo") == {}
    assert calibration.policy_params("homo") == {"beta": calibration.BETA, "lam": calibration.LAM,
                                                 "beta_busy_power": calibration.BETA_BUSY_POWER}
    # The busy-share β is on by default (calibrated), and a setting of 0 turns it off.
    assert svc.core.policy.beta_busy_power == calibration.BETA_BUSY_POWER > 0  # type: ignore
    fixed = SchedulerService(SchedulerSettings(policy="vertumnus",
                                               policy_params={"beta_busy_power": 0}))
    assert fixed.core.policy.beta_busy_power == 0.0  # type: ignore[attr-defined]


def test_controller_judges_a_pooled_kappa_as_it_is_unless_told_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A single worker's κ (vertumnus profile) × the calibrated pool factor, as the simulator's
    # sweeps with --profile; a pooled κ (vertumnus simulate's profile.json) as it is.
    single = Profile(kappa={2: 10.0, 4: 12.0})
    pooled = dataclasses.replace(single, kappa_pooled=True)
    monkeypatch.delenv("VTM_KAPPA_SCALE", raising=False)
    s = ControllerSettings()
    assert s.judging_profile(single).kappa == {2: 10.0 * calibration.KAPPA_SCALE,
                                               4: 12.0 * calibration.KAPPA_SCALE}
    assert s.judging_profile(pooled).kappa == {2: 10.0, 4: 12.0}
    # The controller adapter reports and uses the factor it applied.
    path = tmp_path / "profile.json"
    pooled.save(path)
    svc = ControllerService(ControllerSettings(profile_path=path))
    assert (svc.kappa_scale, dict(svc.profile.kappa)) == (1.0, {2: 10.0, 4: 12.0})
    # An operator's explicit factor wins, from the environment as from the constructor.
    assert ControllerSettings(kappa_scale=1.5).judging_profile(pooled).kappa[2] == 15.0
    monkeypatch.setenv("VTM_KAPPA_SCALE", "2.0")
    assert ControllerSettings().judging_profile(pooled).kappa[2] == 20.0


def test_standalone_services_agree_on_the_degrees() -> None:
    """Started without configuration, the three control-plane services use one degree set, so
    the controller's merge gate reads the scheduler's breakdown (report_rule_matches) and the
    cache manager tracks every worker the controller can make."""
    from services.controller.service import ControllerSettings, report_rule_matches
    from services.controller.windows import WindowSummary

    sched, ctl, cm = SchedulerSettings(), ControllerSettings(), CacheMgrSettings()
    assert sched.degrees == ctl.degrees == cm.degrees
    assert set(ctl.degrees) == set(ctl.lattice().degrees)
    report = SchedulerService(sched).window_report(WindowSummary(0, 0.0, 2.0, 0.0, 0, 0))
    assert report_rule_matches(report, ctl.merge_speedup, ctl.degrees)
    # The rule the gate checks does distinguish degree sets (so the assertion above can fail).
    assert not report_rule_matches(report, ctl.merge_speedup, [2, 4, 8])


def test_degrees_flag_parses_and_bad_values_name_the_flag(capsys: object) -> None:
    import pytest

    from services.cachemgr.main import parse_settings as cm_parse
    from services.controller.main import parse_settings as ctl_parse
    from services.scheduler.main import parse_settings as sched_parse

    for parse in (sched_parse, ctl_parse, cm_parse):
        assert parse(["--degrees", "2, 4,8"]).degrees == [2, 4, 8]
        with pytest.raises(SystemExit):
            parse(["--degrees", "2,four"])
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "--degrees" in err and "'2,four'" in err
