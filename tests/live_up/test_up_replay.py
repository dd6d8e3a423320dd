"""``vertumnus replay`` drives an already running stack (started here with the orchestrator's
Python API: real nats-server and service processes) and reports; per-service commands
delegate to the service mains."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path
from urllib.parse import urlsplit

from live_up_support import REPO, WAIT_S, alive, cli, run_cli
from service_support import service_running

from services.gateway.adapter import GatewayService
from services.gateway.settings import GatewaySettings
from shared.natsserver import EmbeddedNats
from vertumnus.live.report import REQUIRED_KEYS
from vertumnus.live.stack import LiveStack, UpConfig


class AnswerRelay:
    """A TCP relay in front of the gateway that counts the answers ``vertumnus replay`` has
    taken in: a ``POST /v1/completions`` whose 200 it relayed and whose connection the replay
    then closed.

    Exact, not a guess: the replay's client (``vertumnus.live.http.request``) closes its
    connection only once it has read the whole response, and the socket is shut (what this
    relay sees) after asyncio has woken the request's task. That task then makes the
    request's record without another await, so the record exists before a Ctrl-C sent
    afterwards can cancel anything (the replay handles signals in its loop: InterruptGuard).
    Results seen on the bus say nothing of that: the gateway's answers trail them, and a
    Ctrl-C sent after ten of them once found the replay with none (a starved replay)."""

    def __init__(self, target_url: str) -> None:
        parts = urlsplit(target_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.taken_in = 0
        self.server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        """Listen on a free loopback port; returns the URL to give the replay."""
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        """Stop listening and end the connections still relayed (answers still awaited)."""
        if self.server is not None:
            self.server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _relay(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self._conns.add(me)
        me.add_done_callback(self._conns.discard)
        try:
            gw_r, gw_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            client_w.close()
            return
        first = {"request": b"", "response": b""}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, key: str) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    if len(first[key]) < 64:
                        first[key] += data[:64]
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()

        up = asyncio.create_task(copy(client_r, gw_w, "request"))
        down = asyncio.create_task(copy(gw_r, client_w, "response"))
        try:
            await up  # until the replay closed its end: it has read all it wanted
            if (first["request"].startswith(b"POST /v1/completions ")
                    and first["response"].startswith(b"HTTP/1.1 200 ")):
                self.taken_in += 1
            await down
        finally:
            for t in (up, down):
                t.cancel()
            client_w.close()
            gw_w.close()


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
    relay: AnswerRelay | None = None
    try:
        health = await stack.start()
        relay = AnswerRelay(health.gateway_url)
        out = tmp_path / "replay.json"
        proc = await asyncio.create_subprocess_exec(
            *cli("replay", "--gateway", await relay.start(), "--trace", "synthetic",
                 "--duration", "3000", "--time-scale", "0.05", "--json", str(out),
                 "--no-progress"),
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        # Replaying: the Ctrl-C once the replay has taken in answers (AnswerRelay: not the
        # results on the bus, which its answers trail).
        async with asyncio.timeout(120):
            while relay.taken_in < 3:
                assert proc.returncode is None
                await asyncio.sleep(0.05)
        taken_in = relay.taken_in  # the Ctrl-C comes after each of these
        proc.send_signal(signal.SIGINT)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if relay is not None:
            await relay.close()
        await stack.stop()
    assert proc.returncode == 130, stderr.decode()
    assert "Traceback" not in stderr.decode(), stderr.decode()
    assert "TTFT" in stdout.decode()
    data = json.loads(out.read_text())
    assert data["interrupted"] is True
    # What finished before the Ctrl-C (each answer taken in by then, at least), of the
    # ~6,000 the 3,000 s would have sent.
    assert 3 <= taken_in <= data["completed"] <= data["requests"] < 1000, (taken_in, data)


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
