"""``vertumnus up`` end to end: real nats-server, every service that exists as a child process,
a tiny replay through the gateway's HTTP API, the report and the JSON results; a rank daemon
killed and restarted during the replay loses no request; and Ctrl-C (SIGINT to the
``vertumnus up`` process, twice) or SIGTERM stops every child and the server.

Each ``up`` costs ~15-25 s on two cores, about a third of it fitting the services' profile on
the modelled hardware. So the runs are shared where their checks allow it (why, and the rules):

* The default run (``default_run``) is the one that checks that ``up`` fits that profile
  itself; every other run on the default hardware, SLO, degrees and seed is given that very
  profile with ``--profile`` (``fitted_profile``, fitted once per session in conftest.py by
  the child process ``up`` runs for it; the default run checks that it fits the same file).
  ``up`` fits the profile and then goes on exactly as with ``--profile`` of the file it wrote
  (stack.py: the config's profile is replaced by the fitted path), so those runs take the
  same path past the fit. A run whose point is the fit (``--hardware``, ``--per-degree``,
  ``--slo``) still fits its own.
* ``--hardware``, ``--slo`` and ``--schedulers`` are independent options checked on their own
  outputs, so one run (``options_run``) takes all three and each check stays its own test.
* Runs that inject a fault, interrupt ``up`` or fail keep a run each, no longer than their
  check needs (the comments at their options say why that is long enough).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from live_up_support import REPO, alive, cli, healthy_up, kill_leftovers, run_cli, wait_until

from vertumnus.live.report import REQUIRED_KEYS
from vertumnus.live.stack import MAX_RESTARTS


@dataclass(frozen=True)
class UpRun:
    """One finished ``vertumnus up``: the process, its log dir and its ``--json`` path."""

    proc: subprocess.CompletedProcess[str]
    logs: Path
    out: Path

    def results(self) -> dict[str, Any]:
        """The JSON results, once the run is asserted to have succeeded (exit 0): a test on a
        shared run that failed says so itself, with the run's output."""
        assert self.proc.returncode == 0, self.proc.stdout + self.proc.stderr
        return json.loads(self.out.read_text())


def run_up(tmp_path: Path, *args: str) -> UpRun:
    """``vertumnus up args`` with its results to ``tmp_path/results.json`` and its logs in
    ``tmp_path/logs``, without a progress bar, stopping within 10 s; what it left running is
    killed. Asserts nothing: :meth:`UpRun.results` does."""
    out = tmp_path / "results.json"
    logs = tmp_path / "logs"
    try:
        proc = run_cli(["up", *args, "--log-dir", str(logs), "--json", str(out),
                        "--no-progress", "--stop-timeout", "10"])
    finally:
        kill_leftovers(logs)
    return UpRun(proc, logs, out)


def run_up_40(tmp_path: Path, *extra: str, profile: Path) -> tuple[
        subprocess.CompletedProcess[str], dict[str, Any], Path]:
    """``vertumnus up --profile profile`` on 40 requests (arrivals over ≈3 wall s) with
    ``extra`` options; returns the process, its JSON results and its log dir (what it left
    running is killed). Asserts the run itself succeeded."""
    run = run_up(tmp_path, "--max-requests", "40", "--duration", "60", "--time-scale", "0.05",
                 "--profile", str(profile), *extra)
    return run.proc, run.results(), run.logs


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> UpRun:
    """``up`` on 12 requests with every other option at its default: it fits the services'
    profile on the default hardware first (the one ``fitted_profile`` hands on)."""
    return run_up(tmp_path_factory.mktemp("up-default"), "--max-requests", "12",
                  "--duration", "60", "--time-scale", "0.05")


@pytest.fixture(scope="module")
def options_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[UpRun, Path]:
    """``up`` on 40 requests of the pool of a hardware file (an H200), a profile fitted on it
    with one coefficient set per degree, against deepseek-v4-flash's deadlines, with two
    scheduler replicas. Returns the run and the hardware file."""
    tmp = tmp_path_factory.mktemp("up-options")
    hw = tmp / "h200.toml"
    hw.write_text('gpu = "H200"\n')
    return run_up(tmp, "--max-requests", "40", "--duration", "60", "--time-scale", "0.05",
                  "--hardware", str(hw), "--per-degree", "--slo", "deepseek-v4-flash",
                  "--schedulers", "2"), hw


def test_up_tiny_run_reports_and_writes_json(default_run: UpRun) -> None:
    proc, logs = default_run.proc, default_run.logs
    data = default_run.results()
    assert "TTFT" in proc.stdout and "SLO attainment" in proc.stdout, proc.stdout
    missing = [k for k in REQUIRED_KEYS if k not in data]
    assert not missing, missing
    assert data["requests"] == 12
    assert data["completed"] + data["failed"] == 12
    assert data["completed"] == 12, data["errors"]
    assert data["mean_ttft_s"] > 0 and data["p50_ttft_s"] <= data["p99_ttft_s"]
    assert 0.0 <= data["slo_attainment"] <= 1.0
    assert 0.0 <= data["hit_rate"] <= 1.0
    assert isinstance(data["reconfigurations"], int)
    # With no --profile the default hardware is profiled first: the services judge capacity
    # by κ_C measured on it, not by the built-in profile's placeholder (it has no κ).
    fitted = logs / "hardware-profile" / "profile.json"
    assert data["profile"] == str(fitted)
    kappa = json.loads(fitted.read_text())["kappa"]
    assert {"2", "4"} <= set(kappa) and all(k > 0 for k in kappa.values())
    assert data["services_missing"] == []  # every service ran, the controller included
    # The initial epoch record was observed (4×CP2 by default on 8 GPUs).
    assert data["composition"][0]["label"] == "4×CP2", data["composition"]
    # Clean stop: every child and the server are gone, and the services exited by SIGTERM
    # handling (status 0), not by SIGKILL.
    pids = json.loads((logs / "pids.json").read_text())
    assert {"gateway", "scheduler", "rankd", "nats-server"} <= set(pids)
    assert not [n for n, p in pids.items() if alive(p)]
    assert all(code == 0 for code in data["exit_codes"].values()), data["exit_codes"]


def test_up_fits_the_profile_the_other_runs_are_given(default_run: UpRun,
                                                     fitted_profile: Path) -> None:
    """The runs given ``--profile fitted_profile`` (conftest.py) take the path the default run
    takes past its fit: its fit writes that very file, byte for byte."""
    fitted = default_run.logs / "hardware-profile" / "profile.json"
    assert fitted.is_file(), default_run.proc.stdout + default_run.proc.stderr
    assert fitted.read_bytes() == fitted_profile.read_bytes()


def test_up_models_the_hardware_of_a_file(options_run: tuple[UpRun, Path]) -> None:
    """``--hardware``: the rank daemons model the file's GPUs and the services predict with
    a profile fitted on them first (not the default H20's), here one set per degree."""
    run, hw = options_run
    proc, data, logs = run.proc, run.results(), run.logs
    assert data["completed"] == 40, data["errors"]
    assert data["hardware"] == str(hw.resolve())
    fitted = logs / "hardware-profile" / "profile.json"
    assert data["profile"] == str(fitted)
    report = json.loads((logs / "hardware-profile" / "profile_report.json").read_text())
    assert report["hardware"]["gpu"]["name"] == "H200"
    assert set(json.loads(fitted.read_text())["per_degree"]) == {"1", "2", "4"}
    assert "hardware profile" in " ".join(proc.stderr.split())
    # The workers' caches are what the file's GPUs leave for KV at their degree, as in the
    # simulator (not the rank daemons' 65,536-block default).
    from shared.worker import GpuGroup
    from sim.hardware import load_ground_truth

    truth = load_ground_truth(hw)
    assert data["kv_total_blocks"] and all(
        blocks == truth.kv_capacity_blocks(GpuGroup.from_worker_id(wid).degree) != 65_536
        for wid, blocks in data["kv_total_blocks"].items()), data["kv_total_blocks"]


def test_up_holds_the_pool_to_the_given_slo(options_run: tuple[UpRun, Path]) -> None:
    """``--slo``: the report counts attainment against those deadlines, and the services'
    profile is measured first so that κ_C is the demand that keeps them."""
    run, _ = options_run
    proc, data, logs = run.proc, run.results(), run.logs
    assert data["completed"] == 40, data["errors"]
    assert data["slo"] == {"name": "deepseek-v4-flash",
                           "bounds": [[8192, 0.5], [32768, 2.0], ["inf", 5.0]]}
    fitted = logs / "hardware-profile" / "profile.json"
    assert data["profile"] == str(fitted)
    report = json.loads((logs / "hardware-profile" / "profile_report.json").read_text())
    assert report["kappa_ramp"]["slo"]["name"] == "deepseek-v4-flash"
    assert "deepseek-v4-flash" in proc.stdout


def test_up_baseline_runs_on_its_own_held_pool(tmp_path: Path, fitted_profile: Path) -> None:
    """``--policy vllm`` deploys vLLM's pool, as the simulator's comparison does: TP-4 workers,
    held (no split or merge), and they serve every request."""
    out = tmp_path / "results.json"
    logs = tmp_path / "logs"
    proc = run_cli(["up", "--policy", "vllm", "--max-requests", "8", "--duration", "60",
                    "--time-scale", "0.05", "--profile", str(fitted_profile), "--log-dir",
                    str(logs), "--json", str(out), "--no-progress", "--stop-timeout", "10"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["completed"] == 8, data["errors"]
    assert data["reconfigurations"] == 0 and data["policy"] == "vllm"
    assert data["services_missing"] == []  # every service ran, the controller included
    assert data["composition"][0]["label"] == "2×TP4", data["composition"]
    assert "TP4" in proc.stdout
    # The CP-fitted profile does not describe TP workers: not measured, as `simulate` says
    # (it used to report a MAPE of ~66%).
    assert data["prediction_mape"] is None and data["prediction_mape_tp_requests"] == 8
    assert "TP workers: the CP profile does not describe them" in " ".join(proc.stdout.split())


def test_up_survives_a_rank_daemon_crash_and_restart(tmp_path: Path,
                                                     fitted_profile: Path) -> None:
    """``--kill-at 1 --restart-after 1``: the rank daemon (every worker) is
    SIGKILLed while requests are arriving (the replay's arrivals span ≈2 wall s) and started
    again a second later; every request still completes, ``faults`` lists both actions, and
    the restarted process is the one pids.json names and the stop reports (status 0)."""
    proc, data, logs = run_up_40(tmp_path, "--kill-at", "1", "--restart-after", "1",
                                 profile=fitted_profile)
    assert (data["requests"], data["completed"], data["failed"]) == (40, 40, 0), data["errors"]
    kill, restart = data["faults"]
    assert (kill["action"], kill["service"], kill["status"]) == ("kill", "rankd", -9)
    assert (restart["action"], restart["service"]) == ("restart", "rankd")
    assert kill["at_s"] >= 1.0 - 1e-3 and restart["at_s"] >= kill["at_s"] + 1.0 - 1e-3
    assert restart["pid"] != kill["pid"]
    assert "faults and restarts" in proc.stdout and "restart rankd" in proc.stdout, proc.stdout
    pids = json.loads((logs / "pids.json").read_text())
    assert pids["rankd"] == restart["pid"]
    assert not [n for n, p in pids.items() if n != "orchestrator" and alive(p)]
    assert data["exit_codes"]["rankd"] == 0, data["exit_codes"]


def test_up_survives_a_gateway_crash_and_restart(tmp_path: Path,
                                                 fitted_profile: Path) -> None:
    """``--kill-service gateway``: the gateway dies with requests open on it while more are
    arriving, and starts again a second later on the same port; the replay sends the refused
    and the cut-off requests again under their ids, and every one completes, once."""
    proc, data, logs = run_up_40(tmp_path, "--kill-service", "gateway", "--kill-at", "1",
                                 "--restart-after", "1", profile=fitted_profile)
    assert (data["requests"], data["completed"], data["failed"]) == (40, 40, 0), data["errors"]
    assert [(f["action"], f["service"]) for f in data["faults"]] == [
        ("kill", "gateway"), ("restart", "gateway")]
    assert data["retried"] >= 1  # arrivals went on through the outage
    listening = [json.loads(line)["url"] for line in
                 (logs / "gateway.log").read_text().splitlines()
                 if '"http listening"' in line]
    assert len(listening) == 2 and listening[0] == listening[1]  # the same address again
    # Each request was computed once: one result each went by on the results subject.
    assert data["results_seen"] == 40
    assert data["exit_codes"]["gateway"] == 0, data["exit_codes"]


def test_up_survives_a_nats_server_crash_and_restart(tmp_path: Path,
                                                     fitted_profile: Path) -> None:
    """``--kill-service nats``: the server is SIGKILLed while requests arrive and started
    again a second later on its port and JetStream store. Every service reconnects, the
    gateway holds the requests that arrive meanwhile until it can enqueue them
    (``nats_wait_s``), and every request completes."""
    proc, data, logs = run_up_40(tmp_path, "--kill-service", "nats", "--kill-at", "1",
                                 "--restart-after", "1", profile=fitted_profile)
    assert (data["requests"], data["completed"], data["failed"]) == (40, 40, 0), data["errors"]
    kill, restart = data["faults"]
    assert (kill["action"], kill["service"], kill["status"]) == ("kill", "nats", -9)
    assert (restart["action"], restart["service"]) == ("restart", "nats")
    pids = json.loads((logs / "pids.json").read_text())
    assert pids["nats-server"] == restart["pid"]
    assert "Traceback" not in proc.stderr  # the orchestrator's own client reconnects quietly
    assert "kv watch" not in proc.stdout + proc.stderr  # ... and so does its epoch watch
    assert all(code == 0 for code in data["exit_codes"].values()), data["exit_codes"]


def test_up_crashes_two_services_each_at_its_time(tmp_path: Path,
                                                   fitted_profile: Path) -> None:
    """``--kill-service scheduler,rankd --kill-at 1,2 --restart-after 1``: the scheduler
    dies, and while its successor starts the rank daemon dies too; each is started again a
    second after its kill, and every request completes."""
    proc, data, logs = run_up_40(tmp_path, "--kill-service", "scheduler,rankd",
                                 "--kill-at", "1,2", "--restart-after", "1",
                                 profile=fitted_profile)
    assert (data["requests"], data["completed"], data["failed"]) == (40, 40, 0), data["errors"]
    by = {(f["action"], f["service"]): f for f in data["faults"]}
    assert set(by) == {("kill", "scheduler"), ("restart", "scheduler"), ("kill", "rankd"),
                       ("restart", "rankd")}, data["faults"]
    # The restarted scheduler answered $SRV.STATS with its recovery counters (how many
    # depends on what was in flight at the kills).
    recovery = data["scheduler_recovery"]
    assert {"predecessor_naked", "adopted", "lost_handed_back"} <= set(recovery), recovery
    assert all(isinstance(v, int) and v >= 0 for v in recovery.values()), recovery
    assert by[("kill", "scheduler")]["at_s"] >= 1.0 - 1e-3
    assert by[("kill", "rankd")]["at_s"] >= 2.0 - 1e-3
    for name in ("scheduler", "rankd"):
        assert by[("restart", name)]["at_s"] >= by[("kill", name)]["at_s"] + 1.0 - 1e-3
    assert "kill scheduler" in proc.stdout and "kill rankd" in proc.stdout, proc.stdout
    assert data["exit_codes"]["scheduler"] == 0 and data["exit_codes"]["rankd"] == 0


def test_up_runs_scheduler_replicas(options_run: tuple[UpRun, Path]) -> None:
    """``--schedulers 2``: two scheduler processes share the intake (both answer $SRV.PING
    before the replay starts, both are stopped cleanly) and every request completes once."""
    run, _ = options_run
    proc, data, logs = run.proc, run.results(), run.logs
    assert "'vtm-scheduler': 2" in proc.stderr.replace("\n", " "), proc.stderr
    assert (data["requests"], data["completed"], data["failed"]) == (40, 40, 0), data["errors"]
    assert data["results_seen"] == 40
    pids = json.loads((logs / "pids.json").read_text())
    assert {"scheduler", "scheduler-2"} <= set(pids)
    assert data["exit_codes"]["scheduler"] == data["exit_codes"]["scheduler-2"] == 0
    started = [json.loads(line) for name in ("scheduler.log", "scheduler-2.log")
               for line in (logs / name).read_text().splitlines()
               if '"service started"' in line]
    assert len(started) == 2


def test_up_restarts_a_service_that_dies_on_its_own(tmp_path: Path,
                                                     fitted_profile: Path) -> None:
    """The rank daemon is SIGKILLed from outside (not by ``up``'s fault injection) once the
    replay runs: ``up`` supervises its children as compose's ``restart: unless-stopped``
    would, so it starts the rank daemon again; every request completes and ``faults`` lists
    the exit (status -9) and the restart."""
    with healthy_up(tmp_path, "--max-requests", "40", "--duration", "60", "--time-scale",
                    "0.05", "--profile", str(fitted_profile)) as (proc, logs, err):
        killed = json.loads((logs / "pids.json").read_text())["rankd"]
        os.kill(killed, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, stdout + err.read_text()
    data = json.loads((tmp_path / "results.json").read_text())
    assert (data["requests"], data["completed"], data["failed"]) == (40, 40, 0), data["errors"]
    exited, restarted = data["faults"]
    assert (exited["action"], exited["service"], exited["pid"], exited["status"]) == (
        "exit", "rankd", killed, -9)
    assert (restarted["action"], restarted["service"]) == ("restart", "rankd")
    assert json.loads((logs / "pids.json").read_text())["rankd"] == restarted["pid"] != killed
    assert data["exit_codes"]["rankd"] == 0, data["exit_codes"]


def test_up_reports_a_service_that_stays_down_and_exits_1(tmp_path: Path,
                                                           fitted_profile: Path) -> None:
    """The cache manager is SIGKILLed from outside once more than ``up`` restarts a service
    (MAX_RESTARTS): the last exit is said at once (stderr), listed in ``faults`` and in
    ``services_down``, the replay goes on without it, and ``up`` exits 1 after its report.
    Before, the service stayed down silently and ``up`` exited 0."""
    killed: list[int] = []
    # ≈9 wall s of arrivals: the kills below take ≈2 s (each restart is seen by up's next
    # supervision round, every 0.5 s), so the replay is still on after the last of them.
    with healthy_up(tmp_path, "--max-requests", "40", "--duration", "60", "--time-scale",
                    "0.15", "--profile", str(fitted_profile)) as (proc, logs, err):

        def cachemgr() -> int:
            return int(json.loads((logs / "pids.json").read_text())["cachemgr"])

        for n in range(MAX_RESTARTS + 1):
            if n:  # the restarted one
                wait_until(lambda: cachemgr() != killed[-1], "the cache manager's restart")
            killed.append(cachemgr())
            os.kill(killed[-1], signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=180)
    said = err.read_text()
    assert proc.returncode == 1, stdout + said
    assert f"cachemgr (pid {killed[-1]}) exited with status -9 after {MAX_RESTARTS} " \
        "restarts" in said and "cachemgr exited for good during the run" in said
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["services_down"] == ["cachemgr"]
    exits = [(f["pid"], f["status"]) for f in data["faults"]
             if f["action"] == "exit" and f["service"] == "cachemgr"]
    assert exits == [(pid, -9) for pid in killed]
    assert data["requests"] == 40


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["sigint", "sigterm", "sighup"])
def test_interrupt_leaves_no_child_processes(tmp_path: Path, sig: signal.Signals,
                                             fitted_profile: Path) -> None:
    logs = tmp_path / "logs"
    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh:
        # Long enough that the replay is still running when we interrupt it (≈30 wall s), and
        # no longer: every prompt is encoded before the start (≈2 s per 1,000 requests).
        proc = subprocess.Popen(
            cli("up", "--duration", "600", "--time-scale", "0.05", "--profile",
                str(fitted_profile), "--log-dir", str(logs), "--no-progress",
                "--stop-timeout", "10", "--json", str(tmp_path / "r.json")),
            cwd=REPO, stdout=subprocess.PIPE, stderr=fh, text=True)
    try:
        wait_until(lambda: "healthy:" in err.read_text() or proc.poll() is not None,
                   "the stack to become healthy")
        assert proc.poll() is None, err.read_text()
        pids = json.loads((logs / "pids.json").read_text())
        assert {"gateway", "scheduler", "rankd", "nats-server"} <= set(pids)
        children = {n: p for n, p in pids.items() if n != "orchestrator"}
        assert all(alive(p) for p in children.values())
        proc.send_signal(sig)
        if sig == signal.SIGINT:
            # Impatient Ctrl-Cs must not abort the shutdown, wherever they fall: while the
            # replay winds down, between its end and the stop, during the stop or the report.
            for _ in range(12):
                time.sleep(0.1)
                if proc.poll() is not None or "stopping services" in err.read_text():
                    break
                proc.send_signal(sig)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(logs)
    # 130, or killed by the SIGINT itself (what a shell also reports as 130) when a Ctrl-C
    # lands once the handlers are gone, as the interpreter exits.
    assert proc.returncode in (130, -signal.SIGINT), err.read_text()
    assert "interrupted" in stdout
    left = [n for n, p in children.items() if alive(p)]
    assert not left, f"still running after Ctrl-C: {left}"
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["interrupted"] is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_even_sigkill_of_up_leaves_no_processes(tmp_path: Path, fitted_profile: Path) -> None:
    # Children (and the nats-server shim) ask the kernel for SIGTERM when `up` dies.
    logs = tmp_path / "logs"
    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            cli("up", "--serve", "--time-scale", "0.05", "--profile", str(fitted_profile),
                "--log-dir", str(logs)),
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=fh, text=True)
    try:
        wait_until(lambda: "serving until" in err.read_text() or proc.poll() is not None,
                   "the stack to serve")
        assert proc.poll() is None, err.read_text()
        pids = json.loads((logs / "pids.json").read_text())
        children = {n: p for n, p in pids.items() if n != "orchestrator"}
        assert all(alive(p) for p in children.values())
        proc.kill()
        proc.wait()
        # They stop gracefully on their own (drain), within their stop deadline
        # (VTM_STOP_TIMEOUT_S, 45 s), so wait a bounded time beyond it.
        try:
            wait_until(lambda: not any(alive(p) for p in children.values()),
                       "children to exit after SIGKILL of up", timeout_s=90)
        except AssertionError:
            left = {n: p for n, p in children.items() if alive(p)}
            tails = "\n".join(f"--- {n}.log\n{(logs / f'{n}.log').read_text()[-3000:]}"
                               for n in left if (logs / f"{n}.log").exists())
            raise AssertionError(f"still running after SIGKILL of up: {left}\n{tails}") from None
        # A child ended by its deadline rather than its own graceful stop is a stop that hung:
        # told (with what it waited for) without failing the test, which is about leftovers.
        for n in children:
            text = (logs / f"{n}.log").read_text() if (logs / f"{n}.log").exists() else ""
            if "graceful stop overran" in text:
                warnings.warn(f"{n} overran its stop deadline:\n{text[-3000:]}", stacklevel=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(logs)


@pytest.mark.parametrize("option", ["--nats-port", "--http-port"])
def test_up_refuses_a_port_in_use_before_anything_starts(tmp_path: Path, option: str) -> None:
    """A --nats-port or --http-port in use: exit 2 naming the option and the port, before
    anything starts (it used to start nats and every service, then fail with status 1: the
    gateway's port; or print nats-server's whole start-up banner: the server's port), not a
    traceback."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run_cli(["up", option, str(port), "--duration", "5", "--no-progress",
                     "--log-dir", str(tmp_path / "logs")])
    text = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stderr
    assert f"{option} {port}: the port cannot be bound" in text and "Traceback" not in text, text
    assert "[INF]" not in text and "profiling" not in text, text  # nothing started
    assert not (tmp_path / "logs" / "pids.json").exists()


def test_up_stops_its_services_cleanly_when_the_trace_collector_refuses(
        tmp_path: Path, fitted_profile: Path) -> None:
    """Tracing to a collector that refuses every connection: the services' telemetry flush
    at exit ends by their own stop deadline, which ``up`` sets to their stop stage's share of
    ``--stop-timeout`` (``VTM_STOP_TIMEOUT_S``), so each exits by itself (status 0) before
    ``up`` would SIGKILL it. Before, the children kept the 45 s default, the flush ran on
    (7-13 s of the exporter's retries) past their stage's share, and ``up`` killed every
    service (status -9)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed again: connections there are refused
    out, logs = tmp_path / "results.json", tmp_path / "logs"
    # --stop-timeout 10: a stage's share (≈3.3 s) is still well under the exporter's 7-13 s,
    # so children without their own deadline are SIGKILLed here as before the fix.
    try:
        proc = run_cli(["up", "--max-requests", "12", "--duration", "60", "--time-scale",
                        "0.05", "--profile", str(fitted_profile), "--log-dir", str(logs),
                        "--json", str(out), "--no-progress", "--stop-timeout", "10"],
                       env={"VTM_TELEMETRY__EXPORTER": "otlp",
                            "VTM_TELEMETRY__PROTOCOL": "http",
                            "VTM_TELEMETRY__ENDPOINT": f"http://127.0.0.1:{port}/v1/traces"})
    finally:
        kill_leftovers(logs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["completed"] == 12, data["errors"]
    assert all(code == 0 for code in data["exit_codes"].values()), data["exit_codes"]
