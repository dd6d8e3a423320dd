"""``python -m services.gateway`` and ``python -m services.scheduler`` start alone, configured
by environment and flags, are discoverable as micro services, serve, and stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from live_sched_support import WAIT_S, http
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.natsserver import EmbeddedNats

ROOT = Path(__file__).resolve().parents[2]


def spawn(module: str, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    full = {**os.environ, "VTM_LOG__FORMAT": "json", **env}
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def find_service(nc: Client, name: str, prefix: str) -> dict:
    """$SRV.INFO of the service ``name`` whose metadata prefix is ``prefix``, once it lists
    its endpoints (waits for it: a micro service answers discovery from ``add_service`` on,
    before its endpoints are added)."""
    found: list[dict] = []

    async def on_reply(msg: Msg) -> None:
        if not msg.data:  # a no-responders status: nobody has started yet
            return
        info = json.loads(msg.data)
        if info.get("metadata", {}).get("prefix") == prefix and info.get("endpoints"):
            found.append(info)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        async def ask() -> bool:
            await nc.publish(f"$SRV.INFO.{name}", b"", reply=inbox)
            await asyncio.sleep(0.1)
            return bool(found)

        for _ in range(int(WAIT_S / 0.1)):
            if await ask():
                return found[0]
        raise AssertionError(f"{name} with prefix {prefix} never answered $SRV.INFO")
    finally:
        await sub.unsubscribe()


def stop(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:  # pragma: no cover - failure path
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out.decode(errors="replace")


async def test_gateway_and_scheduler_processes(nats_server: EmbeddedNats, nc: Client,
                                               uniq: str) -> None:
    env = {"VTM_NATS_URL": nats_server.url}
    gw = spawn("services.gateway", env, "--prefix", uniq, "--port", "0", "--block-size", "16")
    sched = spawn("services.scheduler", {**env, "VTM_SUBJECT_PREFIX": uniq},
                  "--policy", "vllm", "--instance-id", "sched-proc")
    try:
        ginfo = await find_service(nc, "vtm-gateway", uniq)
        assert ginfo["version"] == "0.1.0"
        assert [e["subject"] for e in ginfo["endpoints"]] == [f"{uniq}.gateway.completions"]
        port = int(ginfo["metadata"]["http"].rsplit(":", 1)[1])
        health = await http(port, "GET", "/health")
        assert health.status == 200 and health.json()["status"] == "ok"
        sinfo = await find_service(nc, "vtm-scheduler", uniq)
        assert sinfo["metadata"]["policy"] == "vllm"
        assert sinfo["metadata"]["reporter"] == "sched-proc"
        status = await nc.request(f"{uniq}.scheduler.status", b"", timeout=WAIT_S)
        assert json.loads(status.data)["policy"] == "vllm"
    finally:
        results = [stop(gw), stop(sched)]
    for code, out in results:
        assert code == 0, out[-3000:]
        assert "service stopping" in out


async def test_bad_configuration_fails_at_start(nats_server: EmbeddedNats) -> None:
    proc = spawn("services.scheduler", {"VTM_NATS_URL": nats_server.url},
                 "--policy", "no_such_policy")
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode != 0
    assert b"unknown policy 'no_such_policy'" in out
