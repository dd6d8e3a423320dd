"""``vertumnus replay`` without ``--nats`` cannot see the results tap (the reused tokens) nor
the epoch records: its report and JSON say "not measured" (null), where they used to say a hit
rate of 0.0% and 0 reconfigurations. Real loopback sockets, a minimal stand-in gateway (HTTP
only: nothing of NATS is involved without ``--nats``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from sim.workloads.workload import Request
from vertumnus.cmd_live import _replay_main


class Gateway:
    """Answers ``/health``, ``/v1/workers`` and every completion (TTFT 0.05 s wall on a CP2
    worker; like the real gateway's answer, no reused-token count)."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ")[1]
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        body = await reader.readexactly(length)
        if path == b"/health":
            out: dict = {"status": "ok"}
        elif path == b"/v1/workers":
            out = {"workers": [{"worker_id": "w-cp2-g0", "lifecycle": "active"}]}
        else:
            out = {"vtm": {"request_id": json.loads(body)["request_id"], "ttft_s": 0.05,
                           "stages": {"prefill_s": 0.03}, "worker_id": "w-cp2-g0",
                           "time_scale": 0.1}}
        data = json.dumps(out).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)
        await writer.drain()
        writer.close()


async def test_replay_without_nats_reports_hit_rate_and_reconfigurations_as_unknown(
        tmp_path: Path) -> None:
    gw = Gateway()
    url = await gw.start()
    out = tmp_path / "r.json"
    try:
        summary = await _replay_main(
            url, [Request("q1", 0.0, 600, 1, (1,)), Request("q2", 0.0, 600, 1, (1,))],
            time_scale=0.1, rate_scale=1.0, nats_url=None, prefix="vtm", progress=False,
            meta={}, json_path=out)
    finally:
        await gw.stop()
    assert summary["completed"] == 2
    data = json.loads(out.read_text())
    assert data["completed"] == 2
    assert data["hit_rate"] is None, data["hit_rate"]
    assert data["reconfigurations"] is None and data["per_degree"]["2"]["hit_rate"] is None
