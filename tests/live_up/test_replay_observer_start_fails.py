"""``vertumnus replay --nats URL`` whose observer fails to start (its subscriptions: the
results tap, the cache commands, the epoch records) closes the NATS connection it opened for
it before the error goes on. The connection was left open: the replay's error ended the
command, but a caller of ``_replay_main`` kept a live client (and its reconnect task) behind.

A real nats-server (tests/conftest.py) and a minimal stand-in gateway on loopback (HTTP only:
its /health and /v1/workers, all the replay asks before it connects to NATS). The observer's
failure is provoked in the observer itself, after its real subscriptions were made."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import vertumnus.live.tap as tap
from shared.natsserver import EmbeddedNats
from vertumnus.cmd_live import _replay_main
from vertumnus.live.observe import Observer


class _Gateway:
    """Answers ``/health`` and ``/v1/workers`` (one active worker)."""

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
        out: dict[str, Any] = ({"status": "ok"} if path == b"/health" else
                               {"workers": [{"worker_id": "w-cp2-g0", "lifecycle": "active"}]})
        data = json.dumps(out).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)
        await writer.drain()
        writer.close()


class ObserverFailed(RuntimeError):
    pass


async def test_a_failed_observer_start_closes_the_connection(
        nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    clients: list[Any] = []
    real_connect, real_start = tap.connect_cli, Observer.start

    async def connect(*args: Any, **kwargs: Any) -> Any:
        nc = await real_connect(*args, **kwargs)
        clients.append(nc)
        return nc

    async def start(self: Observer) -> None:
        await real_start(self)
        raise ObserverFailed("the observer's start failed")

    monkeypatch.setattr(tap, "connect_cli", connect)
    monkeypatch.setattr(Observer, "start", start)
    gw = _Gateway()
    url = await gw.start()
    try:
        with pytest.raises(ObserverFailed):
            await _replay_main(url, [], time_scale=0.1, rate_scale=1.0,
                               nats_url=nats_server.url, prefix="vtm", progress=False,
                               meta={})
    finally:
        await gw.stop()
    (nc,) = clients
    try:
        assert nc.is_closed, "the replay's NATS connection was left open"
    finally:
        if not nc.is_closed:
            await nc.close()
