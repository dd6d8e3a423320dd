"""The live CLI's report and ``up``'s plan read as a new user expects (a user review of
``replay``, ``up`` and ``synthetic``): what was not measured reads "–" / null, not 0; the
first line and the fault plan say how long the replay really is under ``--rate-scale``; a
service an injected kill left down makes the run unclean (exit 1); an ``up --serve`` report
says it served external traffic; the cost-model error on TP workers is not measured (as
``simulate``); a fixed port in use is refused before anything starts; nats-server's start
failure is its fatal line, not its banner; ``synthetic --for-up`` writes ``up``'s own
default workload; an invalid ``VTM_*`` setting is not called a NATS security setting."""

from __future__ import annotations

import io
import json
import math
import socket
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from shared.natsserver import EmbeddedNats, NatsServerStartError
from vertumnus.cli import app
from vertumnus.cmd_live import run_verdict
from vertumnus.live.faults import CrashPlan, FaultEvent, killed_for_good
from vertumnus.live.replay import ReplayRecord
from vertumnus.live.report import CompositionChange, LiveReport
from vertumnus.live.stack import (
    UpConfig,
    check_ports,
    fault_plan_lines,
    load_requests,
    nats_start_failure,
    up_banner,
    write_json,
)


def rendered(report: LiveReport) -> str:
    out = io.StringIO()
    report.render(Console(file=out, width=300, color_system=None))
    return out.getvalue()


def row(text: str, label: str) -> str:
    """The value cell of the report table's row ``label`` (whitespace collapsed)."""
    line = next(ln for ln in text.splitlines() if label in ln)
    return " ".join(line.split("│")[2].split())


def records() -> list[ReplayRecord]:
    # The HTTP answer carries no reused-token count (prefix_tokens 0): only the tap has it.
    return [ReplayRecord("r1", 0.0, 1000, 200, ttft_s=0.05, prefill_s=0.03,
                         worker_id="w-cp2-g0", predicted_prefill_s=0.25),
            ReplayRecord("r2", 1.0, 3000, 200, ttft_s=0.08, prefill_s=0.05,
                         worker_id="w-cp4-g4", predicted_prefill_s=0.5)]


# -- 1. replay without --nats: hit rate and reconfigurations not measured ---------------------


def test_without_the_results_tap_and_the_epochs_hit_rate_and_reconfigurations_are_unknown(
        tmp_path: Path) -> None:
    report = LiveReport(records(), 0.1, followed_epochs=False, followed_results=False)
    s = report.summary()
    assert math.isnan(s["hit_rate"]) and s["reconfigurations"] is None
    assert s["reconfigurations_warmup"] is None
    assert all(math.isnan(v["hit_rate"]) for v in s["per_degree"].values())
    assert s["per_degree"]["2"]["requests"] == 1  # the rest of the per-degree figures stay
    text = rendered(report)
    assert row(text, "prefix hit rate") == "– (not measured: give --nats URL)"
    assert row(text, "reconfigurations") == "– (not followed)"
    per_degree = [ln for ln in text.splitlines() if "│    CP" in ln]
    assert len(per_degree) == 2 and all("0.0%" not in ln and "–" in ln for ln in per_degree)
    write_json(tmp_path / "r.json", s)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["hit_rate"] is None and data["reconfigurations"] is None
    assert data["per_degree"]["4"]["hit_rate"] is None


def test_with_the_tap_a_zero_hit_rate_and_no_reconfiguration_are_measured() -> None:
    s = LiveReport(records(), 0.1).summary()
    assert s["hit_rate"] == 0.0 and s["reconfigurations"] == 0
    tapped = LiveReport(records(), 0.1, prefix_tokens={"r2": 1500}).summary()
    assert tapped["hit_rate"] == pytest.approx(1500 / 4000)


# -- 2. --rate-scale compresses the replay: the first line and the fault plan say so ----------


def test_the_banner_gives_the_compressed_replay_length() -> None:
    line = up_banner(UpConfig(duration_s=60.0, time_scale=0.1, rate_scale=3.0), 60,
                     Path("logs"))
    assert ("60 requests over 60 modelled s, its arrivals ×3 faster (--rate-scale): replayed "
            "in 20 modelled s at time scale 0.1 (≈2 s wall)") in line, line


def test_a_restart_planned_after_the_last_arrival_is_warned_about() -> None:
    inside, late_kill, late_restart = fault_plan_lines(
        [CrashPlan(1.0, 0.5, "rankd"), CrashPlan(5.0, None, "gateway"),
         CrashPlan(1.5, 3.0, "scheduler")], last_arrival_wall_s=2.0)
    assert inside == "fault: rankd killed 1 wall s after the replay starts, restarted 0.5 s later"
    assert "after the last arrival at ≈2 s" in late_kill
    assert "the restart, at 4.5 s, comes after the last arrival at ≈2 s" in late_restart


# -- 3. `synthetic --for-up GPUS` is up's own default workload --------------------------------


def test_synthetic_for_up_writes_the_workload_up_replays_by_default(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["synthetic", "--for-up", "8"])
    assert res.exit_code == 0, res.output
    path = tmp_path / "up8.toml"
    path.write_text(res.stdout)
    cfg = UpConfig(gpus=8)
    kw = {"duration_s": cfg.duration_s, "rate": None, "seed": 0, "max_requests": None,
          "default_rate": cfg.base_rate}
    _, from_file = load_requests(str(path), **kw)
    _, default = load_requests("synthetic", **kw)

    def shape(reqs: list) -> list[tuple]:  # the replay starts the clock at the first arrival
        t0 = reqs[0].arrival_s
        return [(round(r.arrival_s - t0, 9), r.input_len, r.output_len, r.block_hashes)
                for r in reqs]

    assert shape(from_file) == shape(default)
    assert "rate = 2.0" in res.stdout  # 0.25 req/s per GPU, not simulate's 8 for 40 GPUs


@pytest.mark.parametrize(("argv", "words"), [
    (["synthetic", "--for-up", "0"], "--for-up must be a number of GPUs >= 1"),
    (["synthetic", "--duration", "60"], "--duration is the length of the --for-up workload"),
    (["synthetic", "--for-up", "8", "--duration", "nan"], "--duration must be a finite"),
])
def test_synthetic_for_up_refuses_bad_values(argv: list[str], words: str) -> None:
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2 and words in " ".join(res.output.split()), res.output


# -- 4. an injected kill never undone is a service down for good ------------------------------


def test_a_kill_never_restarted_is_down_for_good_and_up_exits_1() -> None:
    events = [FaultEvent("kill", "rankd", 5.0, 100, -9).as_dict(),
              FaultEvent("kill", "gateway", 1.0, 200, -9).as_dict(),
              FaultEvent("restart", "gateway", 2.0, 201).as_dict(),
              FaultEvent("exit", "cachemgr", 3.0, 300, 1).as_dict(),
              FaultEvent("restart", "cachemgr", 3.0, 301).as_dict()]
    assert killed_for_good(events) == ["rankd"]
    report = LiveReport(records(), 0.1, faults=events,
                        meta={"services_killed": killed_for_good(events), "services_down": []})
    s = report.summary()
    code, line = run_verdict(s)
    assert code == 1 and line is not None and "rankd killed by --kill-at and never started" \
        in line
    assert "down at the end: rankd (killed by --kill-at and never started again" in \
        " ".join(rendered(report).split())
    assert run_verdict({**s, "services_killed": []}) == (0, None)


# -- 5. up --serve: request figures not measured, external traffic said -----------------------


def test_a_serving_report_marks_its_request_figures_not_measured() -> None:
    changes = [CompositionChange(1, -1.0, ("w-cp2-g0", "w-cp2-g2")),
               CompositionChange(2, 5.0, ("w-cp4-g0",))]
    report = LiveReport([], 0.1, changes=changes, serving=True,
                        meta={"results_seen": 42, "cache_commands": {"replicate": 3}})
    s = report.summary()
    assert s["served_external"] is True
    assert (s["requests"], s["completed"], s["failed"]) == (None, None, None)
    assert s["reconfigurations"] == 1
    text = " ".join(rendered(report).split())
    assert "0 / 0 / 0" not in text
    assert "not measured: the stack served external traffic (42 results seen on the bus)" \
        in text
    assert "up --serve: the stack served external traffic" in text
    assert "composition changes (1 while serving, 0 in warm-up)" in text
    assert run_verdict(s, serving=True) == (0, None)


# -- 6. the vllm baseline's TP workers: no cost-model error ----------------------------------


def test_the_cost_model_error_on_tp_workers_is_not_measured() -> None:
    tp = [ReplayRecord("r1", 0.0, 1000, 200, ttft_s=0.05, prefill_s=0.03,
                       worker_id="w-tp4-g0", predicted_prefill_s=0.9)]
    report = LiveReport(tp, 0.1)
    s = report.summary()
    assert math.isnan(s["prediction_mape"]) and s["prediction_mape_tp_requests"] == 1
    assert row(rendered(report), "cost-model error") == \
        "– (TP workers: the CP profile does not describe them)"
    cp = LiveReport(records(), 0.1).summary()  # CP workers: measured as before
    assert cp["prediction_mape"] == pytest.approx((0.05 / 0.3 + 0.0) / 2)  # modelled s
    assert cp["prediction_mape_tp_requests"] == 0


# -- 7. an interrupted start-up's report says where it stopped --------------------------------


def test_an_interrupted_start_up_names_its_phase_not_a_missing_controller() -> None:
    report = LiveReport([], 0.1, meta={"interrupted": True, "interrupted_during":
                                       "start-up: waiting for the services to be healthy"})
    text = " ".join(rendered(report).split())
    assert "no controller running" not in text
    assert "composition: no epoch record yet (interrupted during start-up: waiting for the " \
        "services to be healthy)" in text


# -- 8. ports in use: refused before anything starts; the server's fatal line only -----------


@pytest.mark.parametrize("option", ["http_port", "nats_port"])
def test_a_fixed_port_in_use_is_refused_naming_the_option(option: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        flag = "--" + option.replace("_", "-")
        with pytest.raises(ValueError, match=f"^{flag} {port}: the port cannot be bound"):
            check_ports(UpConfig(**{option: port}))
    check_ports(UpConfig(**{option: port}))  # free again: passes
    with pytest.raises(ValueError, match="both"):
        check_ports(UpConfig(http_port=port, nats_port=port))


def test_a_nats_server_start_failure_is_its_fatal_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(NatsServerStartError) as info:
            EmbeddedNats(port=port).start()
    assert str(info.value).count("\n") > 10  # the whole banner, as the server printed it
    line = nats_start_failure(str(info.value), UpConfig(nats_port=port))
    assert "\n" not in line and "[INF]" not in line and "[FTL]" not in line, line
    assert line.startswith(f"nats-server did not start (--nats-port {port}): Error listening")
    assert "address already in use" in line


# -- 9. an invalid VTM_* setting is not a "NATS security setting" -----------------------------


def test_an_invalid_setting_is_not_labelled_a_nats_security_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTM_LOG__LEVEL", "verbose")
    with pytest.raises(ValueError) as info:
        UpConfig()
    assert str(info.value).startswith("invalid settings")
    assert "VTM_LOG__LEVEL" in str(info.value) and "NATS security" not in str(info.value)
