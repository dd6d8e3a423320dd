"""The pure parts of the live CLI: prompt synthesis keeps prefix sharing, ids, compositions,
settings discovery, the report's keys."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from services.gateway.settings import GatewaySettings
from shared.blockhash import chain_hashes
from sim.workloads.workload import Request
from vertumnus.live.registry import SERVICES, SIM_RANKD, env_names, filter_env, module_runnable
from vertumnus.live.replay import BlockTokens, ReplayRecord, wire_id
from vertumnus.live.report import (
    CACHE_MANAGER_COUNTERS,
    REQUIRED_KEYS,
    SCHEDULER_CACHE_COUNTERS,
    CompositionChange,
    LiveReport,
    describe_change,
    reconfigurations,
    scheduler_recovery,
    summed_counters,
)
from vertumnus.live.stack import default_composition, notation, phased_config


def _req(rid: str, hashes: tuple[int, ...], length: int) -> Request:
    return Request(rid, 0.0, length, 1, hashes)


def test_equal_block_ids_give_equal_gateway_hashes() -> None:
    gen = BlockTokens(block_size=16)
    a = gen.prompt(_req("a", (11, 12, 13), 48))
    b = gen.prompt(_req("b", (11, 12, 99), 48))
    c = gen.prompt(_req("c", (11, 12), 70))  # longer than its ids: unique tail
    assert len(a) == 48 and len(c) == 70
    ha, hb, hc = (chain_hashes(x, 16) for x in (a, b, c))
    assert ha[:2] == hb[:2] == hc[:2]  # shared prefix of two blocks survives
    assert ha[2] != hb[2]
    assert len(set(hc[2:]) & set(ha)) == 0
    assert all(0 <= t < gen.vocab for t in a)


def test_wire_ids_are_subject_tokens() -> None:
    assert wire_id(_req("Mooncake.Trace/7", (), 1), "x1-") == "x1-mooncake-trace-7"
    assert wire_id(_req("-odd", (), 1)) == "r-odd"


def test_default_compositions_and_notation() -> None:
    assert default_composition(8, (2, 4)) == ("w-cp2-g0", "w-cp2-g2", "w-cp2-g4", "w-cp2-g6")
    assert default_composition(6, (4, 8)) == ("w-cp4-g0", "w-cp1-g4", "w-cp1-g5")
    assert notation(("w-cp4-g0", "w-cp2-g4", "w-cp2-g6")) == "2CP2/1CP4"
    cfg = phased_config(240.0, 2.0)
    assert math.isclose(sum(p.duration_s for p in cfg.phases), 240.0)
    assert len({p.rate_multiplier for p in cfg.phases}) > 1  # real load phases


def test_registry_knows_modules_and_settings() -> None:
    assert module_runnable("services.gateway") and module_runnable(SIM_RANKD.module)
    # A package without __main__ (services.rankd has one now: python -m services.rankd).
    assert not module_runnable("services.nope") and not module_runnable("shared")
    names = env_names(GatewaySettings)
    assert {"VTM_NATS_URL", "VTM_HTTP_PORT", "VTM_TELEMETRY__EXPORTER"} <= names
    assert SERVICES["gateway"].settings_class() is GatewaySettings
    kept, dropped = filter_env(GatewaySettings, {"VTM_HTTP_PORT": "0", "VTM_NOPE": "1"})
    assert kept == {"VTM_HTTP_PORT": "0"} and dropped == ["VTM_NOPE"]
    rankd = SIM_RANKD.settings_class()
    assert rankd is not None and {"VTM_TRUTH", "VTM_HOST_GPUS"} <= env_names(rankd)


def test_composition_changes_are_named() -> None:
    a = CompositionChange(1, -1.0, ("w-cp4-g0", "w-cp4-g4"))
    b = CompositionChange(2, 3.0, ("w-cp2-g0", "w-cp2-g2", "w-cp4-g4"))
    b2 = CompositionChange(3, 3.1, b.workers)  # lifecycle-only record
    c = CompositionChange(4, 9.0, a.workers)
    assert describe_change(a, b).startswith("split w-cp4-g0 → w-cp2-g0, w-cp2-g2")
    assert describe_change(b2, c).startswith("merge")
    assert reconfigurations([a, b, b2, c]) == 2
    assert b.label() == "2×CP2 + 1×CP4"
    assert CompositionChange(1, 0.0, ("w-tp4-g0", "w-tp4-g4")).label() == "2×TP4"


def test_report_keys_and_overhead() -> None:
    ok = ReplayRecord("r1", 0.0, 1000, 200, ttft_s=0.05, intake_wait_s=0.001,
                      queue_wait_s=0.01, prefill_s=0.03, kv_transfer_s=0.004,
                      first_decode_s=0.0, prefix_tokens=512, worker_id="w-cp2-g0")
    bad = ReplayRecord("r2", 1.0, 9000, 503, error="no worker")
    s = LiveReport([ok, bad], time_scale=0.1).summary()
    assert all(k in s for k in REQUIRED_KEYS)
    assert (s["requests"], s["completed"], s["failed"]) == (2, 1, 1)
    assert math.isclose(s["mean_ttft_s"], 0.5)  # modelled = wall / time scale
    assert math.isclose(s["overhead_p50_ms"], 5.0)
    assert math.isclose(s["hit_rate"], 0.512)
    # 0.5 s ≤ 1 s for L < 8192, but the failed 9000-token request is a miss.
    assert s["slo_attainment"] == pytest.approx(1000 / 10_000)
    assert s["slo_attainment_completed"] == 1.0
    assert (s["input_tokens"], s["failed_input_tokens"], s["unanswered"]) == (10_000, 9000, 0)
    assert s["errors"] == {"no worker": 1}


def test_failed_and_unanswered_requests_are_slo_misses_weighted_by_length() -> None:
    """design.md "Metrics": Σ L·[TTFT ≤ τ(L)] / Σ L over every request, as the simulator
    counts it; the TTFT figures stay over the completed requests."""
    import io

    from rich.console import Console

    met = ReplayRecord("r1", 0.0, 4000, 200, ttft_s=0.05, worker_id="w-cp2-g0")  # 0.5 s
    late = ReplayRecord("r2", 0.0, 1000, 200, ttft_s=0.2, worker_id="w-cp2-g0")  # 2 s > 1 s
    refused = ReplayRecord("r3", 0.0, 2000, 503, error="not scheduled")
    timed_out = ReplayRecord("r4", 0.0, 3000, 0, error="TimeoutError: no answer")
    report = LiveReport([met, late, refused, timed_out], time_scale=0.1)
    s = report.summary()
    assert (s["requests"], s["completed"], s["failed"], s["unanswered"]) == (4, 2, 2, 1)
    assert s["slo_attainment"] == pytest.approx(4000 / 10_000)
    assert s["slo_attainment_completed"] == pytest.approx(4000 / 5000)
    assert (s["input_tokens"], s["failed_input_tokens"]) == (10_000, 5000)
    assert math.isclose(s["mean_ttft_s"], 1.25)  # (0.5 + 2) / 2: completed only
    assert LiveReport([met, late], time_scale=0.1).summary()["slo_attainment"] == \
        s["slo_attainment_completed"]
    out = io.StringIO()
    report.render(Console(file=out, width=300))
    text = out.getvalue()
    assert "4 / 2 / 2 (1)" in text and "40.0% (completed only 80.0%)" in text
    assert "failed = miss" in text


def test_rankd_env_carries_the_ground_truth_only_for_the_sim_backend(tmp_path: Path) -> None:
    from vertumnus.live.stack import LiveStack, UpConfig

    sim = LiveStack(UpConfig(gpus=4, backend="sim"), log_dir=tmp_path).service_env("rankd", "nats://x:1")
    assert sim["VTM_BACKEND"] == "sim" and sim["VTM_TRUTH"] == "noisy"
    assert not [k for k in sim if k.startswith("VTM_TORCH_")]
    torch = LiveStack(UpConfig(gpus=4, backend="torch"), log_dir=tmp_path).service_env("rankd", "nats://x:1")
    assert torch["VTM_BACKEND"] == "torch" and torch["VTM_TORCH_DEVICE"] == "cpu"
    assert "VTM_TRUTH" not in torch and "VTM_TRUTH_SEED" not in torch
    # A profile given (or fitted on the engine) reaches every service that predicts.
    prof = LiveStack(UpConfig(gpus=4, backend="torch", profile=Path("/p/profile.json")),
                     log_dir=tmp_path)
    for name in ("scheduler", "controller", "cachemgr"):
        assert prof.service_env(name, "nats://x:1")["VTM_PROFILE_PATH"] == "/p/profile.json"


def test_a_hardware_file_reaches_the_rank_daemons_and_is_checked_first(tmp_path: Path) -> None:
    from vertumnus.live.stack import LiveStack, UpConfig

    hw = tmp_path / "hw.toml"
    hw.write_text('gpu = "H200"\n')
    cfg = UpConfig(gpus=4, backend="sim", hardware=Path(os.path.relpath(hw)))
    assert cfg.hardware == hw.resolve()  # children may start elsewhere
    env = LiveStack(cfg, log_dir=tmp_path).service_env("rankd", "nats://x:1")
    assert env["VTM_HARDWARE_PATH"] == str(hw.resolve())
    plain = LiveStack(UpConfig(gpus=4), log_dir=tmp_path).service_env("rankd", "nats://x:1")
    assert "VTM_HARDWARE_PATH" not in plain
    with pytest.raises(ValueError, match="the torch engine runs on this machine"):
        UpConfig(gpus=4, backend="torch", hardware=hw)
    hw.write_text('gpu = "H100"\n')
    with pytest.raises(ValueError, match=r"hw\.toml: gpu: unknown GPU preset 'H100'"):
        UpConfig(gpus=4, hardware=hw)
    for bad in (dict(backend="torch"), dict(profile=Path("/p/profile.json"))):
        with pytest.raises(ValueError, match="--per-degree shapes the profile"):
            UpConfig(gpus=4, per_degree=True, **bad)  # type: ignore[arg-type]


def test_up_torch_without_the_engine_extra_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    import asyncio
    import io
    import sys

    import pytest
    from rich.console import Console

    from vertumnus.live.stack import StackError, UpConfig, run_up

    # As on an install without the engine extra: the engine's modules cannot be imported.
    monkeypatch.setitem(sys.modules, "services.rankd.engine.profiling", None)
    cfg = UpConfig(gpus=4, backend="torch", log_dir=tmp_path, max_requests=2)
    quiet = Console(file=io.StringIO())
    with pytest.raises(StackError, match="needs the 'engine' extra"):
        asyncio.run(run_up(cfg, console=quiet, err_console=quiet, show_progress=False))
    assert not (tmp_path / "pids.json").exists()  # nothing was started


def test_each_policy_is_deployed_as_the_simulator_deploys_it(tmp_path: Path) -> None:
    """``up --policy P`` starts P's own pool, held (sim/experiments.py's table): a baseline
    runs neither the controller's splits and merges nor the cache manager's copies."""
    import pytest

    from sim.experiments import ALL_POLICIES
    from vertumnus.live.stack import LiveStack, UpConfig

    expect = {
        "vertumnus": ("w-cp2-g0,w-cp2-g2,w-cp2-g4,w-cp2-g6", "cp", "true", None),
        "static": ("w-cp2-g0,w-cp2-g2,w-cp2-g4,w-cp2-g6", "cp", "false", "0"),
        "homo_cp2": ("w-cp2-g0,w-cp2-g2,w-cp2-g4,w-cp2-g6", "cp", "false", "0"),
        "vllm": ("w-tp4-g0,w-tp4-g4", "tp", "false", "0"),
        **{p: ("w-cp4-g0,w-cp4-g4", "cp", "false", "0")
           for p in ("homo", "sglang", "dynamo", "llmd", "round_robin")},
    }
    assert set(expect) >= set(ALL_POLICIES) - {"sglang_unbounded"}
    for policy, (workers, kind, adaptive, actions) in expect.items():
        stack = LiveStack(UpConfig(gpus=8, policy=policy), log_dir=tmp_path)
        rankd = stack.service_env("rankd", "nats://x:1")
        ctl = stack.service_env("controller", "nats://x:1")
        cm = stack.service_env("cachemgr", "nats://x:1")
        assert (rankd["VTM_INITIAL_WORKERS"], rankd["VTM_KIND"]) == (workers, kind), policy
        assert (ctl["VTM_KIND"], ctl["VTM_ADAPTIVE"]) == (kind, adaptive), policy
        assert cm.get("VTM_MAX_ACTIONS_PER_LIST") == actions, policy
    # A given start replaces the pool for every policy (the kind stays the policy's).
    mixed = ("w-cp2-g0", "w-cp2-g2", "w-cp4-g4")
    assert UpConfig(policy="static", initial_workers=mixed).workers() == mixed
    assert UpConfig(policy="homo", initial_workers=mixed).workers() == mixed
    assert UpConfig(policy="vllm", initial_workers=mixed).workers() == (
        "w-tp2-g0", "w-tp2-g2", "w-tp4-g4")
    # Without degree 4, the homogeneous baselines take the largest degree (as the simulator).
    assert UpConfig(gpus=16, degrees=(2, 8), policy="sglang").workers() == (
        "w-cp8-g0", "w-cp8-g8")
    # The torch engine runs CP workers only: vllm's TP pool is refused before anything starts,
    # and so is a policy the registry does not know.
    with pytest.raises(ValueError, match="deploys TP workers"):
        UpConfig(gpus=8, backend="torch", policy="vllm")
    with pytest.raises(ValueError, match="'nosuch' is not a policy; known: dynamo, homo"):
        UpConfig(gpus=8, policy="nosuch")
    with pytest.raises(ValueError, match="--gpus 6 --degrees 4: .*not a multiple"):
        UpConfig(gpus=6, degrees=(4,))


def test_scheduler_gets_the_time_scale_and_scaled_policy_periods(tmp_path: Path) -> None:
    """Under `up`'s time scale the scheduler counts elapsed time in modelled seconds and the
    policies' own periods (vLLM's 100 ms count refresh, SGLang's 30 s eviction) are scaled like
    every other period; parameters given for the run win over the scaled defaults."""
    import json

    from vertumnus.live.stack import LiveStack, UpConfig

    def env(**kw):  # type: ignore[no-untyped-def]
        return LiveStack(UpConfig(gpus=8, **kw), log_dir=tmp_path).service_env(
            "scheduler", "nats://x:1")

    assert env()["VTM_TIME_SCALE"] == "0.1" and "VTM_POLICY_PARAMS" not in env()
    assert json.loads(env(policy="vllm")["VTM_POLICY_PARAMS"]) == {"refresh_period_s": 0.01}
    assert json.loads(env(policy="sglang", time_scale=0.5)["VTM_POLICY_PARAMS"]) == {
        "eviction_interval_s": 15.0}
    given = env(policy="vllm", env={"scheduler": {"VTM_POLICY_PARAMS": '{"waiting_weight": 2}'}})
    assert json.loads(given["VTM_POLICY_PARAMS"]) == {"refresh_period_s": 0.01,
                                                      "waiting_weight": 2}
    # Unscaled (time scale 1, or a real engine): nothing to scale.
    assert "VTM_POLICY_PARAMS" not in env(policy="vllm", time_scale=1.0)


def test_scheduler_replicas_are_children_that_differ_by_instance_id(tmp_path: Path) -> None:
    import pytest

    from vertumnus.live.stack import MAX_SCHEDULERS, LiveStack, UpConfig

    specs = LiveStack(UpConfig(schedulers=3), log_dir=tmp_path).specs("nats://x:1")
    sched = [spec for info, spec in specs if info.name == "scheduler"]
    assert [s.name for s in sched] == ["scheduler", "scheduler-2", "scheduler-3"]
    assert [s.env["VTM_INSTANCE_ID"] for s in sched] == [
        "scheduler-0", "scheduler-1", "scheduler-2"]
    # Everything else is the same: one deployment, one intake consumer.
    assert {frozenset((k, v) for k, v in s.env.items() if k != "VTM_INSTANCE_ID")
            for s in sched} == {frozenset((k, v) for k, v in sched[0].env.items()
                                          if k != "VTM_INSTANCE_ID")}
    assert len([1 for info, _ in specs if info.name == "gateway"]) == 1
    for bad in (0, MAX_SCHEDULERS + 1):
        with pytest.raises(ValueError, match=f"--schedulers must be 1..{MAX_SCHEDULERS}"):
            UpConfig(schedulers=bad)


def test_fault_injection_options_are_checked_before_anything_starts() -> None:
    """``--kill-at`` / ``--restart-after`` / ``--kill-service``: each refusal names the option
    and the problem; a valid set becomes the crash plan (none without a kill)."""
    import pytest

    from vertumnus.live.faults import CrashPlan
    from vertumnus.live.stack import UpConfig

    assert UpConfig().crash_plans() == ()
    assert UpConfig(kill_at_wall_s=30.0, restart_after_wall_s=5.0).crash_plans() == (
        CrashPlan(30.0, 5.0, "rankd"),)
    assert UpConfig(kill_at_wall_s=0.0).crash_plans() == (CrashPlan(0.0, None),)
    assert UpConfig(kill_at_wall_s=2.0, kill_service="scheduler").crash_plans() == (
        CrashPlan(2.0, None, "scheduler"),)
    # Any service but the rank daemon can be crashed with the torch backend too.
    assert UpConfig(gpus=4, backend="torch", kill_at_wall_s=1.0,
                    kill_service="cachemgr").crash_plans() == (CrashPlan(1.0, None, "cachemgr"),)
    # Several services: one time each (or one for all), one restart delay each (or one).
    assert UpConfig(kill_at_wall_s=(20.0, 25.0), restart_after_wall_s=3.0,
                    kill_service="scheduler,rankd").crash_plans() == (
        CrashPlan(20.0, 3.0, "scheduler"), CrashPlan(25.0, 3.0, "rankd"))
    assert UpConfig(kill_at_wall_s=(5.0,), restart_after_wall_s=(1.0, 2.0),
                    kill_service="gateway, nats").crash_plans() == (
        CrashPlan(5.0, 1.0, "gateway"), CrashPlan(5.0, 2.0, "nats"))
    with pytest.raises(ValueError, match=r"--kill-at has 3 values for 2 service\(s\)"):
        UpConfig(kill_at_wall_s=(1.0, 2.0, 3.0), kill_service="scheduler,rankd")
    with pytest.raises(ValueError, match=r"--restart-after has 2 values for 1 service\(s\)"):
        UpConfig(kill_at_wall_s=1.0, restart_after_wall_s=(1.0, 2.0))
    with pytest.raises(ValueError, match="--kill-service names a service twice"):
        UpConfig(kill_at_wall_s=1.0, kill_service="rankd,rankd")
    with pytest.raises(ValueError, match=r"--kill-at must be finite and >= 0 .*got -2"):
        UpConfig(kill_at_wall_s=(1.0, -2.0), kill_service="scheduler,rankd")
    with pytest.raises(ValueError, match=r"--kill-at must be finite and >= 0 .*got -1"):
        UpConfig(kill_at_wall_s=-1.0)
    with pytest.raises(ValueError, match=r"--kill-at must be finite .*got nan"):
        UpConfig(kill_at_wall_s=math.nan)
    with pytest.raises(ValueError, match=r"--restart-after must be finite and >= 0 .*-0.5"):
        UpConfig(kill_at_wall_s=1.0, restart_after_wall_s=-0.5)
    with pytest.raises(ValueError, match="--restart-after needs --kill-at"):
        UpConfig(restart_after_wall_s=5.0)
    with pytest.raises(ValueError, match="--kill-service 'redis' is not a service; known: "
                                         "gateway, scheduler, controller, cachemgr, rankd, nats"):
        UpConfig(kill_at_wall_s=1.0, kill_service="redis")
    assert UpConfig(kill_at_wall_s=1.0, kill_service="nats").crash_plans() == (CrashPlan(
        1.0, None, "nats"),)
    assert UpConfig(kill_at_wall_s=1.0, restart_after_wall_s=2.0,
                    kill_service="nats-empty").crash_plans() == (CrashPlan(1.0, 2.0,
                                                                           "nats-empty"),)
    # One scheduler replica of several, by its child name (the first one is 'scheduler').
    assert UpConfig(schedulers=3, kill_at_wall_s=(1.0, 2.0), restart_after_wall_s=(None, 1.0),
                    kill_service="scheduler,scheduler-3").crash_plans() == (
        CrashPlan(1.0, None, "scheduler"), CrashPlan(2.0, 1.0, "scheduler-3"))
    with pytest.raises(ValueError, match="--kill-service 'scheduler-3' is not a service; known: "
                                         "gateway, .*, nats, nats-empty, scheduler-2$"):
        UpConfig(schedulers=2, kill_at_wall_s=1.0, kill_service="scheduler-3")
    with pytest.raises(ValueError, match="only for --backend sim.*--backend torch runs one "
                                         "process per GPU rank"):
        UpConfig(gpus=4, backend="torch", kill_at_wall_s=1.0)
    with pytest.raises(ValueError, match="--serve runs no replay"):
        UpConfig(serve=True, kill_at_wall_s=1.0, restart_after_wall_s=1.0)
    with pytest.raises(ValueError, match="kill_at_s must be finite and >= 0"):
        CrashPlan(-1.0)


def test_the_cli_refuses_a_bad_fault_option_with_its_name() -> None:
    """The refusal reaches the user as one error line (exit 2), before anything starts."""
    from typer.testing import CliRunner

    from vertumnus.cli import app

    res = CliRunner().invoke(app, ["up", "--restart-after", "5"])
    assert res.exit_code == 2
    assert "--restart-after needs --kill-at" in res.output
    res = CliRunner().invoke(app, ["up", "--kill-at", "5", "--kill-service", "redis"])
    assert res.exit_code == 2
    assert "--kill-service 'redis' is not a service" in res.output
    res = CliRunner().invoke(app, ["up", "--kill-at", "5,x", "--kill-service", "gateway,nats"])
    assert res.exit_code == 2
    assert "--kill-at must be comma-separated seconds, got '5,x'" in res.output
    res = CliRunner().invoke(app, ["up", "--kill-at", "5,6", "--kill-service", "gateway"])
    assert res.exit_code == 2
    assert "--kill-at has 2 values for 1 service(s)" in res.output
    res = CliRunner().invoke(app, ["replay", "--gateway", "http://127.0.0.1:9",
                                   "--max-requests", "1", "--retry", "-1"])
    assert res.exit_code == 2
    assert "--retry must be finite and >= 0" in res.output


def test_report_counts_errors_by_message_whatever_the_request_id() -> None:
    recs = [ReplayRecord(f"q-{i}", 0.0, 100, 503,
                         error=f"not scheduled: no eligible worker for request 'q-{i}' (w: x)")
            for i in range(3)]
    recs.append(ReplayRecord("q-9", 0.0, 100, 504, error=None))
    assert LiveReport(recs, time_scale=0.1).summary()["errors"] == {
        "not scheduled: no eligible worker for request '<id>' (w: x)": 3, "HTTP 504": 1}


def test_report_lists_the_injected_faults() -> None:
    """``faults`` is in every summary (empty when none); the printed report has one line."""
    import io

    from rich.console import Console

    ok = ReplayRecord("r1", 0.0, 1000, 200, ttft_s=0.05, worker_id="w-cp2-g0")
    assert LiveReport([ok], time_scale=0.1).summary()["faults"] == []
    faults = [{"action": "kill", "service": "rankd", "at_s": 30.012, "pid": 812, "status": -9},
              {"action": "restart", "service": "rankd", "at_s": 35.02, "pid": 901}]
    report = LiveReport([ok], time_scale=0.1, faults=faults)
    assert report.summary()["faults"] == faults
    out = io.StringIO()
    report.render(Console(file=out, width=200))
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("faults")]
    assert lines == ["faults and restarts (wall s after the replay start): kill rankd (pid 812) at "
                     "30.0 s, restart rankd (pid 901) at 35.0 s"]


def test_scheduler_recovery_sums_the_replicas_counters() -> None:
    """Each replica's ``$SRV.STATS`` answer carries its SchedulerStats in every endpoint's
    ``data``: counted once per replica; missing, malformed or negative values count 0."""
    def answer(**data: object) -> dict[str, object]:
        return {"endpoints": [{"name": "status", "data": data}, {"name": "x", "data": data}]}

    got = scheduler_recovery([answer(predecessor_naked=3, adopted=2, lost_handed_back=1),
                              answer(adopted=5, redelivered_acked="7", resent=-1),
                              {"endpoints": [{"name": "status", "data": None}]}, {}])
    assert got == {"predecessor_naked": 3, "peer_naked": 0, "adopted": 7, "adopted_lost": 0,
                   "lost_handed_back": 1, "gone_handed_back": 0, "redelivered_acked": 0,
                   "fail_found_answered": 0, "resent": 0, "republished_held": 0,
                   "republished_answered": 0, "republished_placed": 0,
                   "republished_listings": 0}
    assert set(scheduler_recovery([])) == set(got) and not any(scheduler_recovery([]).values())


def test_report_names_the_route_time_pulls_among_the_cache_commands() -> None:
    """The cache manager's ``$SRV.STATS`` counters (summed over answers as the scheduler's
    are) give the pulls; the row says how many of the replicate commands they were."""
    import io

    from rich.console import Console

    ok = ReplayRecord("r1", 0.0, 1000, 200, ttft_s=0.05, worker_id="w-cp2-g0")
    answer = {"endpoints": [{"name": "inspect", "data": {"pulls": 23, "commands_ok": 34}}]}
    counts = summed_counters([answer], CACHE_MANAGER_COUNTERS)
    assert counts == {"pulls": 23, "rehomed": 0, "commands_sent": 0, "commands_ok": 34,
                      "commands_failed": 0, "demotes_ok": 0, "demotes_failed": 0,
                      "reconciled_notices": 0}

    def row(meta: dict[str, object]) -> list[str]:
        out = io.StringIO()
        LiveReport([ok], time_scale=0.1, meta=meta).render(Console(file=out, width=400))
        return [ln for ln in out.getvalue().splitlines() if "cache commands" in ln]

    cmds = {"reclaim": 7, "replicate": 25}
    assert "7 reclaim, 25 replicate (23 route-time pulls among the replicates)" in \
        row({"cache_commands": cmds, "cache_manager": counts})[0]
    none = row({"cache_commands": cmds, "cache_manager": summed_counters([], ["pulls"])})[0]
    assert "25 replicate" in none and "pulls" not in none and "demote" not in none
    # With the pull a move: the demotes are counted by op, and failed ones are named.
    moved = row({"cache_commands": {**cmds, "demote": 20},
                 "cache_manager": {**counts, "demotes_ok": 18, "demotes_failed": 2}})[0]
    assert "20 demote" in moved and "(2 demotes failed)" in moved


def test_report_counts_the_pending_prefixes_when_a_reconcile_published_some() -> None:
    """The cache manager's reconcile notices, the schedulers' marks of them and the
    placements J counted on a pending prefix: one row, only when a split or merge published
    a notice."""
    import io

    from rich.console import Console

    ok = ReplayRecord("r1", 0.0, 1000, 200, ttft_s=0.05, worker_id="w-cp2-g0")
    sched = summed_counters(
        [{"endpoints": [{"name": "status", "data": {"reconciled_applied": 3,
                                                    "pending_credited": 2}}]},
         {"endpoints": [{"name": "status", "data": {"reconciled_applied": 3}}]}],
        SCHEDULER_CACHE_COUNTERS)
    assert sched == {"reconciled_applied": 6, "pending_credited": 2}

    def rows(notices: int) -> list[str]:
        out = io.StringIO()
        meta = {"cache_commands": {"replicate": 1},
                "cache_manager": {"reconciled_notices": notices}, "scheduler_cache": sched}
        LiveReport([ok], time_scale=0.1, meta=meta).render(Console(file=out, width=400))
        return [ln for ln in out.getvalue().splitlines() if "pending prefixes" in ln]

    (row,) = rows(3)
    assert "3 reconcile notices published, 6 marked by the schedulers, 2 placements counted " \
        "on one" in row
    assert rows(0) == []


def test_report_prints_the_scheduler_recovery_only_when_there_was_some() -> None:
    import io

    from rich.console import Console

    ok = ReplayRecord("r1", 0.0, 1000, 200, ttft_s=0.05, worker_id="w-cp2-g0")

    def lines(recovery: dict[str, int]) -> list[str]:
        out = io.StringIO()
        LiveReport([ok], time_scale=0.1, meta={"scheduler_recovery": recovery}).render(
            Console(file=out, width=400))
        return [ln for ln in out.getvalue().splitlines() if ln.startswith("scheduler recovery")]

    assert lines(scheduler_recovery([])) == []
    rec = {**scheduler_recovery([]), "predecessor_naked": 4, "lost_handed_back": 2}
    assert lines(rec) == ["scheduler recovery (replicas running at the end; a killed process' "
                          "counts went with it): 4 held messages given back by a restarted "
                          "replica, 2 handed back for a lost worker"]


def test_report_warns_when_the_workers_ran_at_another_time_scale() -> None:
    """A replay's --time-scale converts wall TTFTs to modelled seconds; workers answering with
    another time_scale make those figures off by the ratio, and the report says so."""
    import io

    from rich.console import Console

    from vertumnus.live.replay import record_from_response

    req = Request("r1", 0.0, 1000, 1)
    answer = {"vtm": {"ttft_s": 0.05, "stages": {}, "worker_id": "w-cp2-g0", "time_scale": 0.1}}
    rec = record_from_response(req, 200, answer, 0.06)
    assert rec.worker_time_scale == 0.1
    assert record_from_response(req, 200, {"vtm": {"time_scale": "x"}}, 0.1) \
        .worker_time_scale is None

    def printed(scale: float) -> str:
        out = io.StringIO()
        report = LiveReport([rec], time_scale=scale)
        assert report.summary()["worker_time_scales"] == [0.1]
        report.render(Console(file=out, width=400))
        return out.getvalue()

    assert "warning" not in printed(0.1)
    assert "workers ran at time scale 0.1, this report divides by 1" in printed(1.0)


def test_a_controller_file_reaches_the_controller_and_the_replicas_and_is_checked_first(
        tmp_path: Path) -> None:
    from services.calibration import CONTROLLER
    from vertumnus.live.stack import LiveStack, UpConfig

    mine = tmp_path / "ctl.toml"
    mine.write_text("window_s = 10.0\nmerge_speedup = 1.3\nupper = 0.9\nsplit_target = 0.9\n"
                    "long_threshold_tokens = 16384\n")
    cfg = UpConfig(gpus=4, controller=Path(os.path.relpath(mine)), time_scale=0.5)
    assert cfg.controller == mine.resolve()  # children may start elsewhere
    stack = LiveStack(cfg, log_dir=tmp_path)
    ctl = stack.service_env("controller", "nats://x:1")
    sched = stack.service_env("scheduler", "nats://x:1")
    scan = stack.service_env("cachemgr", "nats://x:1")
    assert ctl["VTM_CONTROLLER_FILE"] == str(mine.resolve())
    # The file's window, scaled like the default one, for every service that counts windows.
    assert ctl["VTM_WINDOW_S"] == sched["VTM_WINDOW_S"] == scan["VTM_SCAN_INTERVAL_S"] == "5"
    # The controller knows the ranks' scale: its 5 wall-second window is 10 modelled seconds.
    assert ctl["VTM_TIME_SCALE"] == sched["VTM_TIME_SCALE"] == "0.5"
    assert sched["VTM_MERGE_SPEEDUP"] == "1.3"  # the replicas' breakdown uses rule 9's threshold
    # ... and their reports' long share the file's cut (rules 12 and 15 judge it).
    assert sched["VTM_LONG_THRESHOLD_TOKENS"] == "16384"
    plain = LiveStack(UpConfig(gpus=4, time_scale=0.5), log_dir=tmp_path)
    assert "VTM_CONTROLLER_FILE" not in plain.service_env("controller", "nats://x:1")
    assert "VTM_MERGE_SPEEDUP" not in plain.service_env("scheduler", "nats://x:1")
    assert plain.service_env("scheduler", "nats://x:1")["VTM_WINDOW_S"] == f"{20.0 * 0.5:g}"
    assert CONTROLLER.window_s == 20.0
    mine.write_text("upper = 0.8\n")
    with pytest.raises(ValueError, match=r"--controller: .*ctl\.toml: ControllerConfig\."
                                         r"preference_headroom"):
        UpConfig(gpus=4, controller=mine)
