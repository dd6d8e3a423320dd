"""The replay client sends a request again when a gateway restarts: a refused connection (nothing
listens yet) and a connection dropped before any response (the gateway died with it open) are
retried with the same body until ``ReplayConfig.retry_s`` after the first failure, and the
time lost counts in the request's TTFT; a request that got no answer keeps its input length and
is a miss in the report's SLO attainment. Real loopback sockets, a minimal HTTP responder."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import time

import pytest

from sim.workloads.workload import Request
from vertumnus.live.http import ConnectionDropped, ConnectionRefused, request
from vertumnus.live.replay import ReplayConfig, replay
from vertumnus.live.report import LiveReport

GATEWAY_TTFT_S = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    """A stand-in gateway on ``port``: the first ``drop`` connections are closed after the
    request is read (no response); every other one gets a 200 whose TTFT is
    :data:`GATEWAY_TTFT_S`. Records each request body it read."""

    def __init__(self, port: int, drop: int = 0) -> None:
        self.port, self.drop = port, drop
        self.bodies: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        body = await reader.readexactly(length)
        self.bodies.append(body)
        if self.drop:
            self.drop -= 1
            writer.close()
            return
        rid = json.loads(body)["request_id"]
        out = json.dumps({"vtm": {"request_id": rid, "ttft_s": GATEWAY_TTFT_S,
                                  "stages": {"prefill_s": 0.2}, "worker_id": "w-cp2-g0"}})
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(out)).encode() + b"\r\nConnection: close\r\n\r\n" + out.encode())
        await writer.drain()
        writer.close()


def one_request() -> list[Request]:
    return [Request("q1", 0.0, 600, 1, (1,))]


async def test_the_http_client_tells_refused_from_dropped() -> None:
    port = free_port()
    with pytest.raises(ConnectionRefused):
        await request(f"http://127.0.0.1:{port}/v1/completions", "POST", b"{}", timeout_s=5)
    gw = Gateway(port, drop=1)
    await gw.start()
    try:
        with pytest.raises(ConnectionDropped):
            await request(f"http://127.0.0.1:{port}/v1/completions", "POST",
                          b'{"request_id": "x"}', timeout_s=5)
    finally:
        await gw.stop()


async def test_a_gateway_that_is_not_up_yet_is_waited_for() -> None:
    """Refused (a gateway restarting) until it comes up -- only after the replay saw a
    refusal -- then answered: one record, retried, its TTFT = the wait + the gateway's own
    TTFT."""
    port = free_port()
    gw = Gateway(port)
    failed: list[Exception] = []
    refused = asyncio.Event()

    def on_failed_try(exc: Exception) -> None:
        failed.append(exc)
        refused.set()

    async def come_up() -> None:
        await refused.wait()
        await gw.start()

    up = asyncio.create_task(come_up())
    began = time.monotonic()
    try:
        recs = await replay(f"http://127.0.0.1:{port}", one_request(),
                            ReplayConfig(retry_s=10.0, block_size=512,
                                         on_failed_try=on_failed_try))
    finally:
        took = time.monotonic() - began
        if not up.done():
            up.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await up
        if gw.server is not None:
            await gw.stop()
    (rec,) = recs
    assert failed and all(isinstance(e, ConnectionRefused) for e in failed)
    assert rec.ok and rec.retries == len(failed) and len(gw.bodies) == 1
    # The wait is counted, and is part of the replay's own time (a consistency check, not a
    # speed bound: how long the refusals last depends on the machine's load).
    assert 0 < rec.retry_wait_s <= took
    assert rec.ttft_s == pytest.approx(GATEWAY_TTFT_S + rec.retry_wait_s)
    assert rec.overhead_s == pytest.approx(GATEWAY_TTFT_S - 0.2)  # the wait is not overhead


async def test_a_dropped_request_is_sent_again_with_the_same_body() -> None:
    port = free_port()
    gw = Gateway(port, drop=1)
    await gw.start()
    try:
        (rec,) = await replay(f"http://127.0.0.1:{port}", one_request(),
                              ReplayConfig(retry_s=10.0, block_size=512))
    finally:
        await gw.stop()
    assert rec.ok and rec.retries == 1 and rec.request_id == "q1"
    assert len(gw.bodies) == 2 and gw.bodies[0] == gw.bodies[1]  # same request id, same prompt


async def test_retries_stop_at_the_budget_and_none_without_one() -> None:
    """Counted, not timed: without a budget one try; with 0.6 s the backoff (0.05, 0.1, 0.2,
    then 0.4 s would pass the budget) allows at most three retries -- fewer only on a machine
    slow enough to spend the budget in the tries themselves -- and always the first."""
    port = free_port()  # nothing ever listens
    tries: list[Exception] = []
    (rec,) = await replay(f"http://127.0.0.1:{port}", one_request(),
                          ReplayConfig(retry_s=0.0, block_size=512,
                                       on_failed_try=tries.append))
    assert not rec.ok and rec.status == 0 and "ConnectionRefused" in (rec.error or "")
    assert rec.retries == 0 and math.isnan(rec.ttft_s)
    assert len(tries) == 1 and isinstance(tries[0], ConnectionRefused)
    tries.clear()
    (rec,) = await replay(f"http://127.0.0.1:{port}", one_request(),
                          ReplayConfig(retry_s=0.6, block_size=512,
                                       on_failed_try=tries.append))
    assert not rec.ok and rec.status == 0 and "ConnectionRefused" in (rec.error or "")
    assert all(isinstance(e, ConnectionRefused) for e in tries)
    assert 2 <= len(tries) <= 4  # retried within its budget, and stopped at it


async def test_a_request_that_got_no_answer_lowers_the_slo_attainment() -> None:
    """One request answered within its deadline, one sent where nothing listens: the failed
    one's record keeps the workload's input length and weighs in as a miss."""
    port = free_port()
    gw = Gateway(port)
    await gw.start()
    try:
        (ok,) = await replay(f"http://127.0.0.1:{port}", one_request(),
                             ReplayConfig(retry_s=0.0, block_size=512))
    finally:
        await gw.stop()
    (lost,) = await replay(f"http://127.0.0.1:{free_port()}",
                           [Request("q2", 0.0, 1800, 1, (2,))],
                           ReplayConfig(retry_s=0.0, block_size=512))
    assert ok.ok and not lost.ok and (lost.status, lost.input_len) == (0, 1800)
    s = LiveReport([ok, lost], time_scale=1.0).summary()  # 0.25 s TTFT: within 1 s
    assert s["slo_attainment"] == pytest.approx(600 / 2400)
    assert s["slo_attainment_completed"] == 1.0
    assert (s["failed"], s["unanswered"], s["failed_input_tokens"]) == (1, 1, 1800)


def test_the_retry_budget_is_checked() -> None:
    with pytest.raises(ValueError, match="retry_s must be finite and >= 0"):
        ReplayConfig(retry_s=-1.0)
