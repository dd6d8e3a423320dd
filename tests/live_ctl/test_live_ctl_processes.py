"""``python -m services.controller`` and ``python -m services.cachemgr`` start alone, answer
their ``inspect`` endpoint and ``$SRV.PING``, and stop cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from live_ctl_support import eventually
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("module", "args", "key"),
    [
        (
            "services.controller",
            ["--initial", "2CP4", "--gpus", "8", "--degrees", "2,4"],
            "composition",
        ),
        ("services.cachemgr", ["--degrees", "2,4", "--scan-interval-s", "5"], "nodes"),
    ],
)
async def test_service_process_starts_alone_and_stops_on_sigterm(
    nc: Client, nats_server, uniq: str, module: str, args: list[str], key: str
):
    env = dict(os.environ, VTM_LOG__FORMAT="json", PYTHONPATH=str(ROOT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        "--nats-url",
        nats_server.url,
        "--prefix",
        uniq,
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    group = "controller" if module.endswith("controller") else "cachemgr"
    try:

        async def answers() -> dict | None:
            try:
                msg = await nc.request(f"{uniq}.{group}.inspect", b"", timeout=1)
            except (NoRespondersError, NatsTimeout):
                assert proc.returncode is None, "the service exited"
                return None
            return json.loads(msg.data)

        body = await eventually(answers, what=f"{module} answers inspect", timeout=60)
        assert key in body
        if module.endswith("controller"):
            assert body["composition"] == "2CP4"
        ping = await nc.request(f"$SRV.PING.vtm-{group}", b"", timeout=30)  # liveness bound
        assert json.loads(ping.data)["name"] == f"vtm-{group}"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, out.decode()[-2000:]
