"""Pure helpers of the controller and cache-manager adapters (no server needed)."""

from __future__ import annotations

import pytest

from services.cachemgr.events import MalformedEvent, Snapshot, Stored, event_from_json
from services.cachemgr.service import diff_compositions
from services.controller.service import ControllerSettings, replay_report, report_rule_matches
from services.controller.windows import DemandWindows, WindowSummary
from shared.schemas import SchemaError, WindowReport, from_json, to_json
from shared.worker import GpuGroup, worker_restarted


def groups(*pairs: tuple[int, int]) -> dict:
    return {GpuGroup(g, d).worker_id: GpuGroup(g, d) for g, d in pairs}


def test_diff_finds_splits_merges_and_plain_changes() -> None:
    old = groups((0, 4), (4, 2), (6, 2), (8, 8))
    new = groups((0, 2), (2, 2), (4, 4), (8, 4), (12, 2), (14, 2))
    splits, merges, removed, added = diff_compositions(old, new)
    assert splits == [("w-cp4-g0", ("w-cp2-g0", "w-cp2-g2"))]
    assert merges == [(("w-cp2-g4", "w-cp2-g6"), "w-cp4-g4")]
    # w-cp8-g8 became a CP4 and two CP2s: not one adjacent operation.
    assert removed == ["w-cp8-g8"] and sorted(added) == ["w-cp2-g12", "w-cp2-g14", "w-cp4-g8"]
    assert diff_compositions(old, old) == ([], [], [], [])


def test_only_a_changed_nonempty_incarnation_is_a_restart() -> None:
    assert worker_restarted("a", "b")
    assert not worker_restarted("a", "a")
    assert not worker_restarted("a", "")  # an older rank daemon: never a reset
    assert not worker_restarted(None, "a") and not worker_restarted("", "a")  # first seen
    assert not worker_restarted(None, "") and not worker_restarted("", "")


def test_window_report_replays_exact_demand_count_and_long_fraction() -> None:
    rep = WindowReport(
        reporter="s1",
        window_index=7,
        window_start_s=140.0,
        window_s=20.0,
        epoch=0,
        demand_s=12.0,
        requests=4,
        long_requests=1,
    )
    w = DemandWindows(window_s=20.0, long_threshold_tokens=32_768, start_s=140.0)
    for t, s, n, preferred, degree in replay_report(rep, 32_768):
        assert 140.0 <= t < 160.0 and preferred is None and degree is None
        w.record(t, s, n)
    (closed,) = w.advance(160.0)
    assert closed.demand_s == pytest.approx(12.0)
    assert closed.requests == 4 and closed.long_requests == 1
    empty = rep.model_copy(update={"requests": 0, "long_requests": 0, "demand_s": 0.0})
    assert replay_report(empty, 32_768) == []


V1_REPORT = (
    b'{"schema_version": 1, "reporter": "s1", "window_index": 7, "window_start_s": 140.0, '
    b'"window_s": 20.0, "epoch": 0, "demand_s": 12.0, "requests": 5, "long_requests": 1, '
    b'"demand_by_degree": {"2": 12.0}}'
)


def v2_report(by_preferred: dict[int, float], **kw) -> WindowReport:
    base = dict(
        reporter="s1", window_index=7, window_start_s=140.0, window_s=20.0, epoch=0,
        demand_s=12.0, requests=5, long_requests=1, demand_by_preferred=by_preferred,
        preferred_degrees=[2, 4], preferred_speedup=1.15,
    )
    base.update(kw)
    return WindowReport(**base)


def test_window_report_replays_the_preferred_degree_breakdown_exactly() -> None:
    rep = v2_report({2: 3.0, 4: 7.0})  # 2.0 s of demand from requests with no preference
    assert rep.schema_version == 2
    assert from_json(WindowReport, to_json(rep)) == rep
    w = DemandWindows(window_s=20.0, long_threshold_tokens=32_768, start_s=140.0)
    replay = replay_report(rep, 32_768, with_preferred=True)
    assert len(replay) == 5
    for t, s, n, preferred, degree in replay:
        w.record(t, s, n, degree, preferred)
    (closed,) = w.advance(160.0)
    assert closed.demand_s == pytest.approx(12.0)
    assert closed.requests == 5 and closed.long_requests == 1
    assert dict(closed.demand_by_preferred) == {2: pytest.approx(3.0), 4: pytest.approx(7.0)}
    # Without the controller's rule the breakdown is not replayed.
    assert all(p is None for *_, p, _ in replay_report(rep, 32_768))
    # Every request in a bucket: D(k) is still exact (rounding goes to the last bucket).
    full = v2_report({2: 5.0, 4: 7.0 - 1e-12}, requests=2, long_requests=0)
    got = replay_report(full, 32_768, with_preferred=True)
    assert [p for *_, p, _ in got] == [2, 4]
    assert sum(s for _, s, *_ in got) == pytest.approx(12.0, abs=1e-15)


def replayed(rep: WindowReport, *, with_preferred: bool) -> WindowSummary:
    w = DemandWindows(window_s=20.0, long_threshold_tokens=32_768, start_s=140.0)
    replay = replay_report(rep, 32_768, with_preferred=with_preferred)
    assert len(replay) == rep.requests
    for t, s, n, preferred, degree in replay:
        w.record(t, s, n, degree, preferred)
    (closed,) = w.advance(160.0)
    assert closed.demand_s == pytest.approx(rep.demand_s, abs=1e-12)
    assert (closed.requests, closed.long_requests) == (rep.requests, rep.long_requests)
    return closed


@pytest.mark.parametrize("with_preferred", [True, False])
def test_window_report_replays_the_placed_degree_breakdown_exactly(with_preferred: bool) -> None:
    # D = 12: by preferred degree 3 / 7 (2 s with none), by placed degree 5 / 6.5 (0.5 s with
    # none): both breakdowns come back exact, cut into at most five pieces.
    rep = v2_report({2: 3.0, 4: 7.0}, demand_by_degree={2: 5.0, 4: 6.5})
    closed = replayed(rep, with_preferred=with_preferred)
    assert dict(closed.demand_by_degree) == {2: pytest.approx(5.0), 4: pytest.approx(6.5)}
    want = {2: pytest.approx(3.0), 4: pytest.approx(7.0)} if with_preferred else {}
    assert dict(closed.demand_by_preferred) == want
    # Too few requests for every piece: the degree breakdown is left out, the rest is exact.
    few = v2_report({2: 3.0, 4: 7.0}, demand_by_degree={2: 5.0, 4: 6.5}, requests=3)
    closed = replayed(few, with_preferred=True)
    assert closed.demand_by_degree == ()
    assert dict(closed.demand_by_preferred) == {2: pytest.approx(3.0), 4: pytest.approx(7.0)}
    # A version-1 report's breakdown by degree is replayed too.
    closed = replayed(from_json(WindowReport, V1_REPORT), with_preferred=True)
    assert dict(closed.demand_by_degree) == {2: pytest.approx(12.0)}


def test_window_report_versions_decode_and_bad_breakdowns_are_refused() -> None:
    old = from_json(WindowReport, V1_REPORT)  # an older scheduler's report still decodes
    assert old.schema_version == 1 and old.demand_by_preferred == {}
    assert old.preferred_speedup is None
    assert not report_rule_matches(old, 1.15, [2, 4])
    assert report_rule_matches(v2_report({2: 1.0}), 1.15, [4, 2])
    assert not report_rule_matches(v2_report({2: 1.0}), 1.3, [2, 4])
    assert not report_rule_matches(v2_report({2: 1.0}), 1.15, [1, 2, 4])
    assert not report_rule_matches(v2_report({2: 1.0}), None, [2, 4])
    bad = [
        dict(schema_version=1),  # a v1 report carries no breakdown
        dict(preferred_speedup=None, preferred_degrees=[]),  # breakdown without its rule
        dict(preferred_degrees=[4, 2]),
        dict(preferred_degrees=[2, 2, 4]),
        dict(preferred_speedup=0.5),
        {"demand_by_preferred": {8: 1.0}},  # a degree outside the rule's set
        {"demand_by_preferred": {2: 10.0, 4: 3.0}},  # more than D(k)
        {"demand_by_preferred": {2: -1.0}},
        {"demand_by_preferred": {2: 1.0, 4: 1.0}, "requests": 1, "long_requests": 0},
        dict(preferred_speedup=1.15, preferred_degrees=[], demand_by_preferred={}),
        dict(demand_by_degree={0: 1.0}),  # not a degree
        dict(demand_by_degree={2: 10.0, 4: 3.0}),  # more than D(k)
        dict(demand_by_degree={2: -1.0}),
        dict(demand_by_degree={2: 1.0, 4: 1.0}, requests=1, long_requests=0,
             demand_by_preferred={2: 1.0}),
    ]
    for kw in bad:
        by = kw.pop("demand_by_preferred", {2: 1.0})
        with pytest.raises(SchemaError):
            from_json(WindowReport, v2_report({}).model_copy(
                update={"demand_by_preferred": by, **kw}).model_dump_json())


def test_cache_events_accept_both_wire_forms_and_reject_garbage() -> None:
    ev = event_from_json(
        b'{"schema_version": 1, "type": "stored", "worker": "w-cp2-g0", '
        b'"event_id": 1, "parent_hash": null, "block_hashes": [1, 2]}'
    )
    assert isinstance(ev, Stored) and ev.block_hashes == (1, 2)
    snap = event_from_json(
        b'{"type": "snapshot", "worker_id": "w-cp2-g0", '
        b'"last_event_id": 2, "blocks": [[1, null], [2, 1]]}'
    )
    assert isinstance(snap, Snapshot) and snap.last_event_id == 2
    for bad in (
        b"nope",
        b"[]",
        b'{"type": "stored"}',
        b'{"schema_version": 2, "type": "cleared", "worker": "w", "event_id": 1}',
        # Found by throwing bad input at a live stack: these raised TypeError /
        # RecursionError past the services' handlers (nats-py's error callback caught them).
        b'{"type": {}, "worker": "w", "event_id": 1}',
        b'{"type": ["stored"], "worker": "w", "event_id": 1}',
        b'{"type": "snapshot", "worker": "w", "last_event_id": 0, "blocks": 1}',
        b"[" * 100_000,
    ):
        with pytest.raises(MalformedEvent):
            event_from_json(bad)


def test_controller_settings_map_onto_the_core_config(monkeypatch) -> None:
    monkeypatch.setenv("VTM_KAPPA", '{"2": 8, "4": 14.5}')
    monkeypatch.setenv("VTM_PERSISTENCE", "3")
    monkeypatch.setenv("VTM_DEGREES", "[2, 4]")
    st = ControllerSettings()
    cfg = st.controller_config()
    assert cfg.persistence == 3 and cfg.window_s == st.window_s == 20.0
    prof = st.load_profile()
    assert prof.kappa_for(2) == 8.0 and prof.kappa_for(4) == 14.5
    assert st.lattice().degrees == frozenset({2, 4})


def test_the_profiles_kappa_is_rescaled_to_the_controllers_window(monkeypatch, tmp_path
                                                                   ) -> None:
    """κ in a profile file is per window of the profile's window_s; the controller judges
    windows of its own VTM_WINDOW_S, so it loads κ per window of that (an override is
    already per window of VTM_WINDOW_S)."""
    from shared.costmodel import Profile

    for name in ("KAPPA", "WINDOW_S", "PROFILE_PATH", "TIME_SCALE"):
        monkeypatch.delenv(f"VTM_{name}", raising=False)
    f = tmp_path / "profile.json"
    Profile(kappa={2: 10.0, 4: 16.0}, window_s=20.0).save(f)
    monkeypatch.setenv("VTM_PROFILE_PATH", str(f))
    monkeypatch.setenv("VTM_WINDOW_S", "10")
    prof = ControllerSettings().load_profile()
    assert (prof.window_s, dict(prof.kappa)) == (10.0, {2: 5.0, 4: 8.0})
    monkeypatch.setenv("VTM_KAPPA", '{"4": 7}')
    assert dict(ControllerSettings().load_profile().kappa) == {2: 5.0, 4: 7.0}
    # Ranks at time scale 0.5 (vertumnus up): 10 wall seconds are 20 modelled ones.
    monkeypatch.delenv("VTM_KAPPA")
    monkeypatch.setenv("VTM_TIME_SCALE", "0.5")
    assert dict(ControllerSettings().load_profile().kappa) == {2: 10.0, 4: 16.0}


def test_the_reconcile_traffic_estimate_is_each_members_cached_blocks() -> None:
    """The planner's tie-break between operations of equal drain (§6.2): the blocks each
    worker of the composition caches, as its state reported; what the simulator passes."""
    import time

    from services.controller.lattice import Composition, Lattice
    from services.controller.service import reconcile_traffic
    from shared.schemas import WorkerState
    from shared.worker import Lifecycle

    def state(wid: str, first: int, cached: int | None) -> WorkerState:
        return WorkerState(worker_id=wid, degree=2, gpus=[first, first + 1], epoch=0,
                           lifecycle=Lifecycle.ACTIVE, queue_len=0, outstanding_s=0.0,
                           kv_free_blocks=10, kv_total_blocks=10, kv_cached_blocks=cached,
                           heartbeat_s=time.time())

    comp = Composition.parse(Lattice(8, (2, 4)), "2CP2/1CP4")  # w-cp4-g0, w-cp2-g4, -g6
    states = {"w-cp2-g4": state("w-cp2-g4", 4, 7), "w-cp2-g6": state("w-cp2-g6", 6, None),
              "w-cp2-g0": state("w-cp2-g0", 0, 3)}  # w-cp2-g0 is no member (a split's left)
    assert reconcile_traffic(states, comp) == {"w-cp2-g4": 7.0}


def test_the_reconfiguration_drain_bound_is_not_the_connection_drain_bound(monkeypatch) -> None:
    """The controller's bound on a reconfiguration's drain has its own name: the base
    ``drain_timeout_s`` (the NATS connection's drain at a stop) keeps every service's default,
    and each is set through its own variable."""
    from shared.settings import ServiceSettings

    for name in ("DRAIN_TIMEOUT_S", "RECONFIG_DRAIN_TIMEOUT_S"):
        monkeypatch.delenv(f"VTM_{name}", raising=False)
    st = ControllerSettings()
    base = ServiceSettings.model_fields["drain_timeout_s"].default
    assert (st.drain_timeout_s, st.reconfig_drain_timeout_s) == (base, 120.0)
    monkeypatch.setenv("VTM_RECONFIG_DRAIN_TIMEOUT_S", "30")
    monkeypatch.setenv("VTM_DRAIN_TIMEOUT_S", "4")
    st = ControllerSettings()
    assert (st.drain_timeout_s, st.reconfig_drain_timeout_s) == (4.0, 30.0)


def test_a_controller_file_sets_the_thresholds_and_each_variable_wins_over_it(
        monkeypatch, tmp_path) -> None:
    from dataclasses import replace

    from services.calibration import CONTROLLER

    for name in ("UPPER", "SPLIT_TARGET", "PERSISTENCE", "LARGE_FLOOR", "BACKLOG_S"):
        monkeypatch.delenv(f"VTM_{name}", raising=False)
    assert ControllerSettings().controller_config() == CONTROLLER  # nothing set: calibrated
    mine = tmp_path / "ctl.toml"
    mine.write_text("upper = 0.9\nsplit_target = 0.9\nlarge_floor = false\npersistence = 3\n")
    monkeypatch.setenv("VTM_CONTROLLER_FILE", str(mine))
    assert ControllerSettings().controller_config() == replace(
        CONTROLLER, upper=0.9, split_target=0.9, large_floor=None, persistence=3)
    # A variable wins over the file, and `null` is None (a rule off) as `false` is in a file.
    monkeypatch.setenv("VTM_PERSISTENCE", "4")
    monkeypatch.setenv("VTM_BACKLOG_S", "null")
    cfg = ControllerSettings().controller_config()
    assert (cfg.persistence, cfg.backlog_s, cfg.upper, cfg.large_floor) == (4, None, 0.9, None)


def test_a_bad_controller_file_or_threshold_stops_the_controller_before_it_connects(
        monkeypatch, tmp_path, capsys) -> None:
    from services.controller.main import parse_settings

    mine = tmp_path / "ctl.toml"
    cases = [
        ({"VTM_CONTROLLER_FILE": str(tmp_path / "none.toml")},
         "VTM_CONTROLLER_FILE: controller file not found"),
        ({"VTM_CONTROLLER_FILE": str(mine)},
         "VTM_CONTROLLER_FILE, VTM_PREFERENCE_HEADROOM: " + str(mine)
         + ": ControllerConfig.preference_headroom must be None or in (0, upper=0.8]"),
        ({"VTM_UPPER": "0.3"},
         "VTM_UPPER, VTM_LOWER: ControllerConfig needs 0 < lower < upper, got lower=0.5, "
         "upper=0.3"),
    ]
    mine.write_text("upper = 0.8\n")
    for env, words in cases:
        for name in ("VTM_CONTROLLER_FILE", "VTM_UPPER"):
            monkeypatch.delenv(name, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(SystemExit) as exc:
            parse_settings([])
        assert exc.value.code == 2
        assert words in " ".join(capsys.readouterr().err.split())
