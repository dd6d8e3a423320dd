"""The server comes back without its JetStream store: the live system serves again (real
nats-server killed and started on its port with an empty store, services in-process).

A server without a persistent volume, or one replaced by a new node, restarts empty: the
intake and results streams, the intake consumer and every KV bucket are gone. Each service
makes what it needs again after the reconnect (``MicroService.ensure_jetstream``), the
controller writes its epoch record again, and the rank daemon its state. Before, the services
reconnected to a server with no intake stream: every request got a 503 from the gateway for
as long as the processes lived.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
from live_accept_support import InProcess, prompt_tokens, wait_until
from nats.js.errors import NotFoundError

from services.controller.service import ControllerService, ControllerSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import EpochRecord, decode
from shared.service import epoch_kv
from vertumnus.live.http import request

W = "w-cp2-g0"
B = 16


async def complete(gw: object, rid: str) -> int:
    """POST one request to the gateway; its HTTP status."""
    body = json.dumps({"prompt": prompt_tokens(rid, random.Random(rid), prefix_len=64,
                                               min_tail=30, max_tail=60),
                       "request_id": rid}).encode()
    r = await request(f"http://127.0.0.1:{gw.http_port}/v1/completions",  # type: ignore[attr-defined]
                      "POST", body, timeout_s=60)
    return r.status


async def eventually(check: Callable[[], Awaitable[bool]], what: str,
                     timeout_s: float = 60.0) -> None:
    """Until ``check()`` is true; a JetStream "not found" counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(NotFoundError):
            if await check():
                return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_server_back_without_its_store_serves_again(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "store-1").start()
    port = int(server.url.rsplit(":", 1)[1])
    again: EmbeddedNats | None = None
    live = InProcess(server.url, "t" + os.urandom(5).hex())
    nc = None
    try:
        ctl = await live.run(ControllerService(ControllerSettings(
            nats_url=live.url, subject_prefix=live.prefix, instance_id="ctl", num_gpus=2,
            degrees=[2], initial_composition="1CP2", kappa={2: 1.0}, window_s=1.0)))
        await live.rankd(W)
        sched = await live.scheduler(block_size=B)
        gw = await live.gateway(block_size=B)
        await wait_until(lambda: len(sched.core.view) == 1, "W in the scheduler's view")
        assert await complete(gw, "before") == 200
        epoch = ctl.record.epoch

        server.kill()
        again = EmbeddedNats(port=port, store_dir=tmp_path / "store-2").start()
        nc = await nats.connect(again.url)
        js = nc.jetstream()

        await wait_until(lambda: ctl.counters["records_rewritten"] == 1,
                         "the controller's record written again")
        kv = await epoch_kv(js, live.subjects)
        rec = decode(EpochRecord, (await kv.get(live.subjects.epoch_key())).value)
        assert rec.epoch == epoch and [w.worker_id for w in rec.workers] == [W]

        async def intake_back() -> bool:
            await js.consumer_info(live.subjects.intake_stream(),
                                   live.subjects.intake_consumer())
            return True

        async def w_state_back() -> bool:
            states = await js.key_value(live.subjects.worker_state_bucket())
            return bool((await states.get(W)).value)

        await eventually(intake_back, "the intake stream and its consumer made again")
        await eventually(w_state_back, "W's state published again")
        assert await complete(gw, "after") == 200
    finally:
        if nc is not None:
            await nc.close()
        await live.close()
        if again is not None:
            again.stop()
        server.stop()
