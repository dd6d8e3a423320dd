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
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from live_accept_support import InProcess, prompt_tokens, wait_until
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from test_accept_dispatch_unknown import running
from test_accept_scheduler_restart_worker_lost import w_dies_and_w2_answers_x
from test_accept_worker_lost import W2, W, rankd_process, wait_holds

from services.controller.service import ControllerService, ControllerSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import EpochRecord, EpochWorker, decode, to_json
from shared.service import REPUBLISHED_HEADER, epoch_kv
from shared.worker import Lifecycle
from vertumnus.live.http import request

B = 16


async def complete(gw: object, rid: str, length: int | None = None) -> int:
    """POST one request to the gateway (a short prompt, or ``length`` tokens); its HTTP
    status."""
    rng = random.Random(rid)
    prompt = prompt_tokens(rid, rng, prefix_len=64, min_tail=30, max_tail=60) \
        if length is None else [rng.randrange(1, 50_000) for _ in range(length)]
    body = json.dumps({"prompt": prompt, "request_id": rid}).encode()
    r = await request(f"http://127.0.0.1:{gw.http_port}/v1/completions",  # type: ignore[attr-defined]
                      "POST", body, timeout_s=60)
    return r.status


class LosableServer:
    """A nats-server on a store of its own; :meth:`lose` kills it and starts a new one on the
    same port with an empty store, as a server without a persistent volume comes back."""

    def __init__(self, tmp_path: Path) -> None:
        self._tmp = tmp_path
        self.servers = [EmbeddedNats(store_dir=tmp_path / "store-1").start()]

    @property
    def url(self) -> str:
        return self.servers[-1].url

    def lose(self) -> None:
        port = int(self.url.rsplit(":", 1)[1])
        self.servers[-1].kill()
        self.servers.append(EmbeddedNats(
            port=port, store_dir=self._tmp / f"store-{len(self.servers) + 1}").start())

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@contextlib.asynccontextmanager
async def losable(tmp_path: Path) -> AsyncIterator[tuple[LosableServer, InProcess]]:
    """A :class:`LosableServer` and services in this process under a fresh prefix; all
    stopped afterwards."""
    server = LosableServer(tmp_path)
    live = InProcess(server.url, "t" + os.urandom(5).hex())
    try:
        yield server, live
    finally:
        await live.close()
        server.stop()


async def controller(live: InProcess, composition: str = "1CP2") -> ControllerService:
    """A controller of ``composition`` (CP2 workers only), in this process."""
    gpus = 2 * int(composition.split("CP", 1)[0])
    return await live.run(ControllerService(ControllerSettings(  # type: ignore[no-any-return]
        nats_url=live.url, subject_prefix=live.prefix, instance_id="ctl", num_gpus=gpus,
        degrees=[2], initial_composition=composition, kappa={2: 1.0}, window_s=1.0)))


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


async def intake_messages(nc: nats.NATS, live: InProcess) -> int:
    info = await nc.jetstream().stream_info(live.subjects.intake_stream())
    return int(info.state.messages)


async def intake_holds(url: str, live: InProcess, n: int) -> None:
    """Until the intake stream holds ``n`` messages."""
    nc = await nats.connect(url)
    try:
        await eventually(lambda: _holds(nc, live, n), f"{n} messages in the intake")
    finally:
        await nc.close()


async def _holds(nc: nats.NATS, live: InProcess, n: int) -> bool:
    return await intake_messages(nc, live) == n


async def test_a_server_back_without_its_store_serves_again(tmp_path: Path) -> None:
    async with losable(tmp_path) as (server, live):
        ctl = await controller(live)
        await live.rankd(W)
        sched = await live.scheduler(block_size=B)
        gw = await live.gateway(block_size=B)
        await wait_until(lambda: len(sched.core.view) == 1, "W in the scheduler's view")
        assert await complete(gw, "before") == 200
        epoch = ctl.record.epoch

        server.lose()
        nc = await nats.connect(server.url)
        try:
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
        finally:
            await nc.close()
        assert await complete(gw, "after") == 200


async def test_a_request_lost_with_the_store_before_delivery_is_sent_again(
        tmp_path: Path) -> None:
    """No scheduler runs while x is published, so x waits in the intake, undelivered; the
    server then comes back empty. The gateway finds the intake stream made anew and sends x
    again; the scheduler (started now) finds no worker holding it and places it: x is
    answered. Before, x was lost with the store and its client got a 504."""
    async with losable(tmp_path) as (server, live):
        await controller(live)
        await live.rankd(W)
        gw = await live.gateway(block_size=B, result_timeout_s=60.0)
        x = asyncio.create_task(complete(gw, "x"))
        await intake_holds(server.url, live, 1)

        server.lose()
        sched = await live.scheduler(block_size=B)
        assert await x == 200
        assert gw.counters["intake_remade"] == gw.counters["republished"] == 1
        assert sched.stats.republished_placed == 1
        assert sched.stats.republished_held == sched.stats.republished_answered == 0


async def test_a_request_a_worker_holds_is_not_placed_again_after_the_store_is_lost(
        tmp_path: Path) -> None:
    """Scheduler A dispatches x to one of two idle workers, where it runs (a long prefill),
    and stops; the server comes back empty. The gateway sends x again (it cannot know x was
    dispatched); scheduler B, started now, asks the workers and finds x held. Without the
    check B placed x afresh -- on the other worker, idle while x's worker reports A's work --
    and x ran twice."""
    async with losable(tmp_path) as (server, live):
        await controller(live, "2CP2")
        workers = [await live.rankd(w, prefill_s=30.0) for w in (W, W2)]
        a = await live.scheduler(block_size=B)
        gw = await live.gateway(block_size=B, result_timeout_s=120.0)
        await wait_until(lambda: len(a.core.view) == 2, "both workers in A's view")
        # Long enough that x's worker still reports ~10 s of A's work to B after the restart
        # (the default profile predicts ~11 s at CP2).
        x = asyncio.create_task(complete(gw, "x", length=64_000))
        await wait_until(lambda: a.stats.dispatched == 1, "x dispatched")
        await live.stop(a)

        server.lose()
        await wait_until(lambda: gw.counters["republished"] == 1, "x sent again")
        nc = await nats.connect(server.url)
        try:
            async def states_back() -> bool:
                kv = await nc.jetstream().key_value(live.subjects.worker_state_bucket())
                return all([bool((await kv.get(w)).value) for w in (W, W2)])

            await eventually(states_back, "both workers' states published again")
        finally:
            await nc.close()
        b = await live.scheduler(block_size=B)
        st = b.stats
        await wait_until(lambda: st.republished_held + st.republished_placed
                         + st.republished_answered == 1 or st.dispatched > 0,
                         "the re-sent x handled")
        assert sum(len(w.core) for w in workers) == 1  # x, on one worker only
        assert st.dispatched == 0 and st.republished_held == 1
        x.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await x


async def test_the_gateways_re_send_is_tried_again_and_never_doubles_a_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """x and y wait undelivered when the store is lost. The gateway's first re-send fails
    (an injected publish timeout): the sweeper's next round sends both. A second re-send of
    the same requests is dropped by the new stream as duplicates (same ``Nats-Msg-Id``): the
    intake holds each once, and a scheduler answers both."""
    real_publish = JetStreamContext.publish
    failures = [1]

    async def flaky(self: JetStreamContext, subject: str, payload: bytes = b"",
                    **kw: Any) -> Any:
        if REPUBLISHED_HEADER in (kw.get("headers") or {}) and failures[0] > 0:
            failures[0] -= 1
            raise nats.errors.TimeoutError
        return await real_publish(self, subject, payload, **kw)

    monkeypatch.setattr(JetStreamContext, "publish", flaky)
    async with losable(tmp_path) as (server, live):
        await controller(live)
        await live.rankd(W)
        gw = await live.gateway(block_size=B, result_timeout_s=60.0)
        calls = [asyncio.create_task(complete(gw, rid)) for rid in ("x", "y")]
        await intake_holds(server.url, live, 2)

        server.lose()
        await wait_until(lambda: gw.counters["republished"] == 2, "x and y sent again")
        assert failures == [0]  # the first try failed
        await gw._republish_waiting()  # again: both are duplicates now
        assert gw.counters["republished"] == 2
        await intake_holds(server.url, live, 2)
        await live.scheduler(block_size=B)
        assert await asyncio.gather(*calls) == [200, 200]


async def test_a_re_sent_request_whose_scheduler_is_gone_is_recovered_when_its_worker_dies(
        tmp_path: Path) -> None:
    """Scheduler A dispatches x to W (a process; x would run for hours) and dies, then the
    server loses its store -- A's held message and its record with it. B, started after,
    gets the gateway's re-send, finds x held by W and adopts it; W is SIGKILLed: B hands x
    back and W2 answers it. When B only acked the re-send (W will answer it), nobody knew x
    any more once W died, and its client got a 504."""
    server = LosableServer(tmp_path)
    try:
        async with running(server.servers[0]) as (live, nc, tap):
            with rankd_process(live, W, time_scale=1000.0) as proc:
                await live.until_served(live.subjects.worker_assign(W))
                kw = dict(policy="round_robin", block_size=B, retry_delay_s=0.05, lease_s=1.5,
                          ack_wait_s=1.5)
                a = await live.scheduler(instance_id="sched-a", **kw)
                gw = await live.gateway(block_size=B, result_timeout_s=120.0)
                x = asyncio.create_task(complete(gw, "x"))
                await wait_holds(nc, live, W, "x")
                a._held.clear()  # as a SIGKILL would leave it: neither renewed nor NAKed
                await live.stop(a)

                server.lose()
                b = await live.scheduler(instance_id="sched-b", **kw)
                await wait_until(lambda: "x" in b.ledger, "B adopts x")
                assert b.stats.republished_held == 1
                assert b.ledger.get("x").worker_id == W  # type: ignore[union-attr]
                await w_dies_and_w2_answers_x(live, nc, tap, proc, b)
                assert await x == 200
    finally:
        server.stop()


async def x_answered(live: InProcess) -> tuple[Any, Any, Any]:
    """A controller, worker W, a scheduler and a gateway; request x answered through them.
    Returns (W, the scheduler, the gateway)."""
    await controller(live)
    w = await live.rankd(W)
    sched = await live.scheduler(block_size=B)
    gw = await live.gateway(block_size=B, result_timeout_s=30.0)
    await wait_until(lambda: len(sched.core.view) == 1, "W in the scheduler's view")
    assert await complete(gw, "x") == 200
    return w, sched, gw


async def test_a_client_retry_after_the_store_is_lost_gets_the_workers_answer_again(
        tmp_path: Path) -> None:
    """x is answered; the server then loses its store, and with it the intake's
    de-duplication and the results stream that kept x's answer. The client sends x again
    (same id, as after a gateway crash cut it off): the intake takes it as new and the
    scheduler places it on W, which answered x already and does not run it twice -- it sends
    its kept answer again. Before, W acked the assignment and sent nothing: the retry got a
    504."""
    async with losable(tmp_path) as (server, live):
        w, sched, gw = await x_answered(live)
        # The gateway has x's answer as soon as the server forwards it, maybe before the
        # results stream's acknowledgement reaches W. An answer unacknowledged when the store
        # is lost is published again after the reconnect (publish_result) and answers a
        # retry waiting then, before the scheduler's assignment reaches W (the next test).
        # Here the old store acknowledged it: W has nothing to publish again.
        await wait_until(lambda: not w._handoffs, "x's answer acknowledged by the store")

        server.lose()
        assert await complete(gw, "x") == 200
        assert w.answers_resent == 1
        assert len(w.core) == 0 and w.core.served == 1  # not run twice


async def test_a_retry_at_a_restarted_gateway_after_the_store_is_lost_gets_the_answer(
        tmp_path: Path) -> None:
    """As above, but the gateway is restarted too (it crashed, which is why the client sends
    x again): neither its memory nor the shared bucket -- lost with the store -- knows x's
    claim, so the retry is a new claim, stored anew, and the gateway takes only the results
    of this attempt. W sends its kept answer again stamped with the retry's arrival. Before,
    it went out with the first attempt's stamp, which the gateway passed over: 504 after the
    result timeout (one request of 1,789 in `vertumnus up --kill-service
    gateway,nats-empty,controller`)."""
    async with losable(tmp_path) as (server, live):
        w, sched, gw = await x_answered(live)
        await wait_until(lambda: not w._handoffs, "x's answer acknowledged by the store")
        await live.stop(gw)
        server.lose()
        gw2 = await live.gateway(block_size=B, result_timeout_s=15.0)
        assert await complete(gw2, "x") == 200
        assert w.answers_resent == 1
        assert len(w.core) == 0 and w.core.served == 1  # not run twice


async def test_a_retry_at_a_restarted_gateway_while_the_first_attempt_runs_gets_the_answer(
        tmp_path: Path) -> None:
    """As above, but x is still running on W when the store is lost, and the client sends x
    again to another gateway (as after a crash of its own: neither that gateway's memory nor
    the lost bucket knows x's claim, so the retry is stored anew and waits for its own
    attempt's answer). The retry is assigned to W while W runs x: W does not run it twice,
    and x's answer, once out, answers both attempts -- the retry's copy stamped with its
    arrival. Before, the answer carried only the first attempt's stamp, which the other
    gateway passed over (504)."""
    async with losable(tmp_path) as (server, live):
        await controller(live)
        w = await live.rankd(W, prefill_s=3.0)
        sched = await live.scheduler(block_size=B)
        gw = await live.gateway(block_size=B, result_timeout_s=60.0)
        first = asyncio.create_task(complete(gw, "x"))
        await wait_until(lambda: w.core.running is not None, "x running on W")
        server.lose()
        gw2 = await live.gateway(block_size=B, result_timeout_s=15.0)
        retry = asyncio.create_task(complete(gw2, "x"))
        await wait_until(lambda: sched.stats.dispatched == 2 or w.core.running is None,
                         "the retry assigned to W while x runs")
        assert w.core.running is not None, "x ended before the retry came: no test"
        assert (await retry, await first) == (200, 200)
        assert w.core.served == 1  # not run twice


async def test_an_answer_the_lost_store_never_acknowledged_is_published_again_for_a_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """x is answered, but the server dies before it acknowledges W's publish of the answer
    (held back here). W publishes it again after the reconnect (``publish_result``), into
    the results stream made anew; the client's retry of x, waiting at the gateway then (no
    scheduler runs, so no assignment reaches W), is answered with it: x's own answer, from
    the worker that ran it, and x is not run twice."""
    real_publish = JetStreamContext.publish
    lost = asyncio.Event()
    held: list[str] = []

    async def ack_lost(self: JetStreamContext, subject: str, payload: bytes = b"",
                       **kw: Any) -> Any:
        if subject.endswith(".result.x") and not held:
            held.append(subject)  # the first publish reaches the gateway; its ack never comes
            await self._nc.publish(subject, payload, headers=kw.get("headers"))
            await lost.wait()
            raise nats.errors.TimeoutError
        return await real_publish(self, subject, payload, **kw)

    monkeypatch.setattr(JetStreamContext, "publish", ack_lost)
    async with losable(tmp_path) as (server, live):
        w, sched, gw = await x_answered(live)
        assert len(w._handoffs) == 1  # x's answer, unacknowledged
        await live.stop(sched)

        server.lose()
        retry = asyncio.create_task(complete(gw, "x"))
        await intake_holds(server.url, live, 1)  # the retry waits at the gateway
        lost.set()
        assert await retry == 200
        assert w.answers_resent == 0  # no assignment reached W: its first publish answered
        assert len(w.core) == 0 and w.core.served == 1  # not run twice


async def test_a_controller_started_after_the_store_is_lost_takes_the_workers_composition(
        tmp_path: Path) -> None:
    """The worker runs 1×CP4 at epoch 2 (records written here, as a controller would); the
    server loses its store; a controller started now writes its initial 2×CP2 at epoch 0,
    which the worker ignores as older. It finds the worker's state ahead of its record and
    rebuilds the record from the workers' states: epoch 3, 1×CP4, which the worker adopts.
    Before, it planned from 2×CP2 -- workers that do not exist -- until its epochs passed the
    worker's, which then took that composition without a drain."""
    cp4 = "w-cp4-g0"
    async with losable(tmp_path) as (server, live):
        nc = await nats.connect(server.url)
        try:
            kv = await epoch_kv(nc.jetstream(), live.subjects)
            await kv.create(live.subjects.epoch_key(), to_json(EpochRecord(
                epoch=2, workers=[EpochWorker(worker_id=cp4, first_gpu=0, degree=4,
                                              lifecycle=Lifecycle.ACTIVE)],
                committed_at_s=time.time(), reason="as a controller would")))
        finally:
            await nc.close()
        w = await live.rankd(cp4)
        await wait_until(lambda: w.core.epoch == 2, "the worker at epoch 2")

        server.lose()
        ctl = await live.run(ControllerService(ControllerSettings(
            nats_url=live.url, subject_prefix=live.prefix, instance_id="ctl", num_gpus=4,
            degrees=[2, 4], initial_composition="2CP2", kappa={2: 1.0, 4: 1.0},
            window_s=1.0)))
        await wait_until(lambda: ctl.record.epoch == 3, "the record rebuilt from the workers")
        assert [x.worker_id for x in ctl.record.workers] == [cp4]
        assert ctl.counters["rebuilt_from_workers"] == 1
        assert [x.worker_id for x in ctl.core.protocol.workers()] == [cp4]
        await wait_until(lambda: w.core.epoch == 3, "the worker adopts the rebuilt record")
        assert w.core.lifecycle is Lifecycle.ACTIVE
