"""``vertumnus replay`` drives an already running stack (started here with the orchestrator's
Python API: real nats-server and service processes) and reports; per-service commands
delegate to the service mains."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from live_up_support import REPO, WAIT_S, alive, cli, run_cli
from service_support import service_running

from services.gateway.adapter import GatewayService
from services.gateway.settings import GatewaySettings
from shared.natsserver import EmbeddedNats
from vertumnus.live.report import REQUIRED_KEYS
from vertumnus.live.stack import LiveStack, UpConfig


async def test_replay_against_a_running_stack(tmp_path: Path) -> None:
    cfg = UpConfig(time_scale=0.05, health_timeout_wall_s=120.0, stop_timeout_wall_s=10.0)
    stack = LiveStack(cfg, log_dir=tmp_path / "logs")
    # A log directory used before: its JetStream store (the last run's intake, whose answers
    # the de-duplication window replayed to this run's request ids) is not reused.
    stale = tmp_path / "logs" / "nats-store" / "jetstream" / "stale-run"
    stale.mkdir(parents=True)
    try:
        health = await stack.start()
        assert stack.nats is not None and not stale.exists()
        out = tmp_path / "replay.json"
        proc = await asyncio.create_subprocess_exec(
            *cli("replay", "--gateway", health.gateway_url, "--trace", "synthetic",
                 "--duration", "60", "--max-requests", "8", "--rate-scale", "2",
                 "--time-scale", "0.05", "--nats", stack.nats.url, "--json", str(out),
                 "--no-progress"),
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 180)
        assert proc.returncode == 0, stderr.decode()
        assert "TTFT" in stdout.decode()
        data = json.loads(out.read_text())
        assert all(k in data for k in REQUIRED_KEYS)
        assert data["requests"] == 8 and data["completed"] == 8, data["errors"]
        # With --nats the results tap supplies P: the hit rate is measured, not assumed.
        assert data["hit_rate"] is not None and 0.0 <= data["hit_rate"] <= 1.0
        assert data["composition"], "the epoch record was observed over --nats"
    finally:
        await stack.stop()
    assert not [c.name for c in stack.children.children if alive(c.pid)]


def test_service_commands_delegate_to_the_service_mains() -> None:
    proc = run_cli(["gateway", "--help"], timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    assert "--max-prompt-tokens" in proc.stdout  # the gateway's own argparse help
    proc = run_cli(["scheduler", "--help"], timeout_s=60)
    assert proc.returncode == 0 and "--policy" in proc.stdout, proc.stderr


async def test_replay_and_up_send_the_gateways_api_key(tmp_path: Path) -> None:
    """A gateway with API keys: ``up`` finds it healthy with the first key (its health check
    reads /v1/workers), ``replay`` without a key stops at once naming the option, and with
    ``VTM_API_KEY`` (the second key) every request is served."""
    cfg = UpConfig(time_scale=0.05, health_timeout_wall_s=120.0, stop_timeout_wall_s=10.0,
                   env={"gateway": {"VTM_API_KEYS": "key-a,key-b"}})
    stack = LiveStack(cfg, log_dir=tmp_path / "logs")
    assert stack.api_key == "key-a"
    try:
        health = await stack.start()
        args = ("replay", "--gateway", health.gateway_url, "--trace", "synthetic", "--duration",
                "60", "--max-requests", "4", "--time-scale", "0.05", "--no-progress")
        for env, ok in (({}, False), ({"VTM_API_KEY": "key-b"}, True)):
            proc = await asyncio.create_subprocess_exec(
                *cli(*args, "--json", str(tmp_path / "replay.json")), cwd=REPO,
                env={k: v for k, v in os.environ.items() if k != "VTM_API_KEY"} | env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            _, stderr = await asyncio.wait_for(proc.communicate(), 180)
            if ok:
                assert proc.returncode == 0, stderr.decode()
                data = json.loads((tmp_path / "replay.json").read_text())
                assert data["completed"] == 4, data["errors"]
            else:
                assert proc.returncode != 0
                text = " ".join(stderr.decode().split())
                assert "refused a request without API key (--api-key / VTM_API_KEY)" in text
    finally:
        await stack.stop()


async def test_an_interrupted_replay_reports_what_finished(tmp_path: Path) -> None:
    """Ctrl-C ends ``vertumnus replay`` early with its report and --json, exit 130 as ``up``
    (it used to exit 0). Later Ctrl-Cs only say so (tests/live/test_interrupt_guard.py):
    asyncio's own handling raised KeyboardInterrupt on the second, wherever the command was,
    a traceback and no report."""
    cfg = UpConfig(time_scale=0.05, health_timeout_wall_s=120.0, stop_timeout_wall_s=10.0)
    stack = LiveStack(cfg, log_dir=tmp_path / "logs")
    try:
        health = await stack.start()
        assert stack.observer is not None
        out = tmp_path / "replay.json"
        proc = await asyncio.create_subprocess_exec(
            *cli("replay", "--gateway", health.gateway_url, "--trace", "synthetic",
                 "--duration", "3000", "--time-scale", "0.05", "--json", str(out),
                 "--no-progress"),
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        # Replaying: results come back. The observer counts them on the bus, before the
        # gateway's answers reach the replay (a Ctrl-C right after the third found the
        # replay with two once); ten on the bus leave the replay at least one.
        async with asyncio.timeout(120):
            while stack.observer.results < 10:
                assert proc.returncode is None
                await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        await stack.stop()
    assert proc.returncode == 130, stderr.decode()
    assert "Traceback" not in stderr.decode(), stderr.decode()
    assert "TTFT" in stdout.decode()
    data = json.loads(out.read_text())
    assert data["interrupted"] is True
    # What finished before the Ctrl-C, of the ~6,000 the 3,000 s would have sent.
    assert 1 <= data["completed"] <= data["requests"] < 1000, data


async def test_a_replay_in_which_no_request_completed_exits_1(
        nats_server: EmbeddedNats, uniq: str, tmp_path: Path) -> None:
    """A real gateway that refuses every prompt of the workload (413: longer than its
    max_prompt_tokens): the replay reports, writes --json, and exits 1 with one line saying
    that no request completed and why. Before, it exited 0 as if the run had been sound."""
    gw = GatewayService(GatewaySettings(nats_url=nats_server.url, subject_prefix=uniq,
                                        http_port=0, max_prompt_tokens=16))
    async with service_running(gw, timeout_s=WAIT_S):
        out = tmp_path / "replay.json"
        proc = await asyncio.create_subprocess_exec(
            *cli("replay", "--gateway", f"http://127.0.0.1:{gw.http_port}", "--trace",
                 "synthetic", "--duration", "60", "--max-requests", "3", "--time-scale", "0.05",
                 "--retry", "0", "--json", str(out), "--no-progress"),
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 180)
    err = stderr.decode()
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: no request completed: all 3 requests failed"), err
    assert "max_prompt_tokens" in last, last  # the gateway's 413, as the report has it
    assert "TTFT" in stdout.decode()  # the report is out all the same
    data = json.loads(out.read_text())
    assert (data["requests"], data["completed"], data["failed"]) == (3, 0, 3)
