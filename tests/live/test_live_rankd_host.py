"""A rankd host follows split and merge epochs without restarting its process."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from rankd_host_support import Closing, record

from services.rankd.backend import SimBackend
from services.rankd.host import START_ATTEMPTS, RankdHost
from services.rankd.settings import RankdSettings
from shared.ids import InvalidInput
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    EpochAck,
    FirstToken,
    IntakeRequest,
    decode,
)
from shared.service import call, epoch_kv
from shared.subjects import Subjects
from shared.worker import GpuGroup

WAIT_S = 20.0


def assignment(rid: str, wid: str, epoch: int) -> Assignment:
    now = time.time()
    degree = GpuGroup.from_worker_id(wid).degree
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=100, arrival_s=now),
        worker_id=wid,
        epoch=epoch,
        degree=degree,
        prefix_tokens=0,
        recompute_tokens=100,
        predicted_s=0.01,
        assigned_at_s=now,
    )




async def wait_for_workers(host: RankdHost, wanted: set[str]) -> None:
    """Until the host runs exactly ``wanted`` and each of them has started (endpoints
    subscribed): a worker is in ``host.services`` from the moment its start begins, and a
    test that then kills the server would catch it half-registered (a different case from a
    running worker riding out a restart)."""
    async with asyncio.timeout(WAIT_S):
        while host.worker_ids != wanted or len(host.services) != len(wanted):
            host.changed.clear()
            await host.changed.wait()
        await asyncio.gather(*(svc.started.wait() for svc in host.services.values()))


def start_restart_host(server: EmbeddedNats, uniq: str, backend: Any
                       ) -> tuple[RankdHost, asyncio.Task[None]]:
    """The server-restart tests' host: GPUs 0-1, one CP2 worker to start, running."""
    settings = RankdSettings(nats_url=server.url, subject_prefix=uniq, heartbeat_s=0.2,
                             drain_timeout_s=5)
    host = RankdHost(settings, range(0, 2), backend, initial=["w-cp2-g0"])
    return host, asyncio.create_task(host.run(handle_signals=False))


async def stop_after_restart(host: RankdHost, task: asyncio.Task[None], nc: Client | None,
                             again: EmbeddedNats | None, server: EmbeddedNats) -> None:
    """The server-restart tests' teardown: the host, the test's client, both servers."""
    host.request_stop()
    await asyncio.wait_for(task, timeout=20)
    if nc is not None:
        await nc.close()
    if again is not None:
        again.stop()
    server.stop()


async def call_when_up(nc: Client, subject: str, msg: object, reply: type) -> object:
    """``call`` once the worker's endpoint has subscribed: a worker appears in ``host.services``
    just before its micro endpoints are registered, so early requests find no responders."""
    async with asyncio.timeout(WAIT_S):
        while True:
            try:
                return await call(nc, subject, msg, reply, timeout_s=WAIT_S)
            except NoRespondersError:
                await asyncio.sleep(0.05)


async def reaped(server: EmbeddedNats) -> None:
    """Wait (bounded) until a SIGKILLed ``server`` has exited and been reaped (``running``
    polls the process, which reaps it), so its port can be taken again. Not
    EmbeddedNats.kill(): that also removes the store the next server starts on."""
    async with asyncio.timeout(WAIT_S):
        while server.running:
            await asyncio.sleep(0.01)


async def test_split_then_merge(nats_server: EmbeddedNats, nc: Client, uniq: str) -> None:
    s = Subjects(uniq)
    settings = RankdSettings(
        nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2, drain_timeout_s=5
    )
    host = RankdHost(
        settings,
        range(0, 4),
        lambda wid, kind: SimBackend(time_scale=1.0),
        initial=["w-cp4-g0"],
    )
    acks: list[EpochAck] = []

    async def on_ack(msg: Msg) -> None:
        acks.append(decode(EpochAck, msg.data, msg.headers))

    sub = await nc.subscribe(s.epoch_ack_all(), cb=on_ack)
    task = asyncio.create_task(host.run(handle_signals=False))
    try:
        await wait_for_workers(host, {"w-cp4-g0"})
        ack = await call_when_up(
            nc, s.worker_assign("w-cp4-g0"), assignment("a-0", "w-cp4-g0", 0), AssignmentAck
        )
        assert ack.queue_position == 0

        epochs = await nc.jetstream().key_value(s.epoch_bucket())
        await epochs.put(s.epoch_key(), record(1, "w-cp2-g0", "w-cp2-g2"))
        await wait_for_workers(host, {"w-cp2-g0", "w-cp2-g2"})
        async with asyncio.timeout(WAIT_S):
            while len({(a.gpu, a.epoch) for a in acks if a.epoch == 1}) < 4:
                await asyncio.sleep(0.02)
        assert {(a.gpu, a.worker_id) for a in acks if a.epoch == 1} == {
            (0, "w-cp2-g0"),
            (1, "w-cp2-g0"),
            (2, "w-cp2-g2"),
            (3, "w-cp2-g2"),
        }
        result = await nc.subscribe(s.result("b-1"))
        await call_when_up(
            nc, s.worker_assign("w-cp2-g2"), assignment("b-1", "w-cp2-g2", 1), AssignmentAck
        )
        first = decode(FirstToken, (await result.next_msg(timeout=WAIT_S)).data)
        assert first.worker_id == "w-cp2-g2" and first.token is not None

        await epochs.put(s.epoch_key(), record(2, "w-cp4-g0"))
        await wait_for_workers(host, {"w-cp4-g0"})
        ack = await call_when_up(
            nc, s.worker_assign("w-cp4-g0"), assignment("c-2", "w-cp4-g0", 2), AssignmentAck
        )
        assert ack.epoch == 2
        with pytest.raises(NoRespondersError):
            await call(
                nc,
                s.worker_assign("w-cp2-g2"),
                assignment("d-2", "w-cp2-g2", 1),
                AssignmentAck,
                timeout_s=WAIT_S,
            )
    finally:
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
        await sub.unsubscribe()
    assert host.services == {}


def test_host_validates_its_range() -> None:
    s = RankdSettings()
    with pytest.raises(InvalidInput):
        RankdHost(s, range(0, 4), lambda w, k: SimBackend(), initial=["w-cp4-g4"])
    with pytest.raises(InvalidInput):
        RankdHost(s, range(0), lambda w, k: SimBackend())


def test_settings_host_mode() -> None:
    s = RankdSettings(host_gpus="8-15", initial_workers="w-cp4-g8, w-cp4-g12")
    assert s.host_range == range(8, 16)
    assert s.initial_worker_ids == ["w-cp4-g8", "w-cp4-g12"]
    with pytest.raises(ValueError):
        RankdSettings(host_gpus="7-0")
    with pytest.raises(ValueError):
        RankdSettings(initial_workers="nope")


async def test_a_server_restart_is_survived(uniq: str) -> None:
    """nats-server killed and started again on its port with its store: the host's workers
    serve again, a record written after the restart still reaches the host (its epoch watch
    resumes), and the blip is logged as warnings, not errors."""
    import os
    import signal

    import nats
    from structlog.testing import capture_logs

    server = EmbeddedNats().start()
    port = int(server.url.rsplit(":", 1)[1])
    s = Subjects(uniq)
    host, task = start_restart_host(server, uniq,
                                    lambda wid, kind: SimBackend(time_scale=1.0))
    again: EmbeddedNats | None = None
    nc: Client | None = None
    try:
        # A record adopted first: the host's epoch watch is running when the server dies.
        await wait_for_workers(host, {"w-cp2-g0"})
        nc = await nats.connect(server.url)
        epochs = await epoch_kv(nc.jetstream(), s)
        await epochs.put(s.epoch_key(), record(1, "w-cp1-g0", "w-cp1-g1"))
        await wait_for_workers(host, {"w-cp1-g0", "w-cp1-g1"})
        await nc.close()
        with capture_logs() as logs:
            assert server.pid is not None
            os.kill(server.pid, signal.SIGKILL)
            await reaped(server)
            again = EmbeddedNats(port=port, store_dir=server.store_dir).start()
            nc = await nats.connect(again.url)
            ack = await call_when_up(nc, s.worker_assign("w-cp1-g1"),
                                     assignment("a-0", "w-cp1-g1", 1), AssignmentAck)
            assert ack.queue_position == 0
            epochs = await nc.jetstream().key_value(s.epoch_bucket())
            await epochs.put(s.epoch_key(), record(2, "w-cp2-g0"))
            await wait_for_workers(host, {"w-cp2-g0"})
        assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
        assert any(e["event"] == "nats disconnected" for e in logs)
    finally:
        await stop_after_restart(host, task, nc, again, server)


async def test_a_stop_while_the_server_is_down_ends_cleanly(uniq: str) -> None:
    """Stopped while its nats-server is down (killed, not back yet), the host closes its
    reconnecting connection and its run returns (nats-py refuses to drain such a connection:
    the process ended in a traceback and exit status 1)."""
    import os
    import signal

    server = EmbeddedNats().start()
    settings = RankdSettings(nats_url=server.url, subject_prefix=uniq, drain_timeout_s=5)
    host = RankdHost(settings, range(0, 2), lambda wid, kind: SimBackend(time_scale=1.0),
                     initial=["w-cp2-g0"])
    task = asyncio.create_task(host.run(handle_signals=False))
    try:
        await wait_for_workers(host, {"w-cp2-g0"})
        async with asyncio.timeout(WAIT_S):  # started: following the epoch record
            while not any(t.get_name() == "rankd-host-epochs" for t in asyncio.all_tasks()):
                await asyncio.sleep(0.05)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        async with asyncio.timeout(WAIT_S):
            while host._nc is None or not host._nc.is_reconnecting:
                await asyncio.sleep(0.05)
    finally:
        host.request_stop()
        await asyncio.wait_for(task, timeout=30)  # raises what the stop raised
        server.stop()
    assert host._nc.is_closed


async def test_a_worker_that_cannot_start_does_not_stop_the_others(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """An epoch record naming a worker this host cannot build (here its backend refuses it)
    costs that worker only: the record's other workers start and serve, and the host keeps
    following the record."""
    s = Subjects(uniq)
    settings = RankdSettings(
        nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2, drain_timeout_s=5
    )

    def backend(wid: str, kind: object) -> SimBackend:
        if wid == "w-cp1-g0":
            raise InvalidInput("this host cannot build w-cp1-g0")
        return SimBackend(time_scale=1.0)

    host = RankdHost(settings, range(0, 2), backend)
    epochs = await epoch_kv(nc.jetstream(), s)
    await epochs.put(s.epoch_key(), record(1, "w-cp1-g0", "w-cp1-g1"))
    task = asyncio.create_task(host.run(handle_signals=False))
    try:
        await wait_for_workers(host, {"w-cp1-g1"})
        result = await nc.subscribe(s.result("e-1"))
        await call_when_up(
            nc, s.worker_assign("w-cp1-g1"), assignment("e-1", "w-cp1-g1", 1), AssignmentAck
        )
        first = decode(FirstToken, (await result.next_msg(timeout=WAIT_S)).data)
        assert first.worker_id == "w-cp1-g1" and first.token is not None
        await epochs.put(s.epoch_key(), record(2, "w-cp2-g0"))
        await wait_for_workers(host, {"w-cp2-g0"})
    finally:
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
    assert host.services == {}


async def test_a_worker_starting_while_the_server_restarts_starts_again(uniq: str) -> None:
    """nats-server killed while a new worker of an epoch record sets up (here: at the moment
    its backend is built, before its JetStream set-up): its start fails, and the host starts
    it again once its connection is back, so the worker serves after the restart. Before, it
    was lost for the whole epoch (the record counted as applied) and every assignment to it
    found no responders."""
    import os
    import signal

    import nats
    from structlog.testing import capture_logs

    server = EmbeddedNats().start()
    port = int(server.url.rsplit(":", 1)[1])
    s = Subjects(uniq)
    killed = asyncio.Event()

    def backend(wid: str, kind: object) -> SimBackend:
        if wid == "w-cp1-g1" and not killed.is_set():
            assert server.pid is not None
            os.kill(server.pid, signal.SIGKILL)
            killed.set()
        return SimBackend(time_scale=1.0)

    host, task = start_restart_host(server, uniq, backend)
    again: EmbeddedNats | None = None
    nc: Client | None = None
    try:
        await wait_for_workers(host, {"w-cp2-g0"})
        nc = await nats.connect(server.url)
        epochs = await epoch_kv(nc.jetstream(), s)
        with capture_logs() as logs:
            await epochs.put(s.epoch_key(), record(1, "w-cp1-g0", "w-cp1-g1"))
            await nc.close()
            nc = None
            await asyncio.wait_for(killed.wait(), WAIT_S)
            await reaped(server)
            again = EmbeddedNats(port=port, store_dir=server.store_dir).start()
            nc = await nats.connect(again.url)
            ack = await call_when_up(nc, s.worker_assign("w-cp1-g1"),
                                     assignment("a-0", "w-cp1-g1", 1), AssignmentAck)
            assert ack.queue_position == 0
            await wait_for_workers(host, {"w-cp1-g0", "w-cp1-g1"})
        assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
        assert any(e["event"].startswith("worker did not start while the bus was away")
                   and e["worker_id"] == "w-cp1-g1" for e in logs), logs
    finally:
        await stop_after_restart(host, task, nc, again, server)




async def test_a_worker_whose_every_start_fails_costs_only_itself(
    nats_server: EmbeddedNats, nc: Client, uniq: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker of a record whose every start fails on the bus (its JetStream set-up times
    out through all START_ATTEMPTS, as while a restarted server recovers): the record's other
    worker starts all the same, and every backend built for the failed starts is closed.
    Before, the error left the record half applied (the other worker never started, the
    record counted as applied) and each attempt left its backend open."""
    import nats.errors

    from services.rankd import service as rankd_service

    real = rankd_service.RankdService.ensure_jetstream

    async def flaky(self: rankd_service.RankdService) -> None:
        if self.core.worker_id == "w-cp1-g0":
            raise nats.errors.TimeoutError
        await real(self)

    monkeypatch.setattr(rankd_service.RankdService, "ensure_jetstream", flaky)
    built: list[Closing] = []

    def backend(wid: str, kind: object) -> Closing:
        built.append(Closing(wid))
        return built[-1]

    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2,
                             drain_timeout_s=5)
    host = RankdHost(settings, range(0, 2), backend)
    s = Subjects(uniq)
    epochs = await epoch_kv(nc.jetstream(), s)
    await epochs.put(s.epoch_key(), record(1, "w-cp1-g0", "w-cp1-g1"))
    task = asyncio.create_task(host.run(handle_signals=False))
    try:
        await wait_for_workers(host, {"w-cp1-g1"})
        failed = [b for b in built if b.wid == "w-cp1-g0"]
        assert len(failed) == START_ATTEMPTS and all(b.closed for b in failed)
        await epochs.put(s.epoch_key(), record(2, "w-cp2-g0"))  # still following
        await wait_for_workers(host, {"w-cp2-g0"})
    finally:
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
    assert all(b.closed for b in built)


async def test_a_record_that_cannot_be_decoded_leaves_the_follower_following(
    nats_server: EmbeddedNats, nc: Client, uniq: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding a record may fail with more than a SchemaError (before the schema's degree
    bound, a degree of 2^40 was a MemoryError): the record is ignored and the next one is
    applied. Before, the follower task died of it and the host applied no record again."""
    from services.rankd import host as host_module

    real = host_module.decode
    bad = b'{"epoch": 1, "poison": true}'

    def decode(target: object, payload: bytes, *args: object, **kw: object) -> object:
        if payload == bad:
            raise MemoryError
        return real(target, payload, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(host_module, "decode", decode)
    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2,
                             drain_timeout_s=5)
    host = RankdHost(settings, range(0, 2), lambda wid, kind: SimBackend(time_scale=1.0),
                     initial=["w-cp2-g0"])
    s = Subjects(uniq)
    epochs = await epoch_kv(nc.jetstream(), s)
    task = asyncio.create_task(host.run(handle_signals=False))
    try:
        await wait_for_workers(host, {"w-cp2-g0"})
        await epochs.put(s.epoch_key(), bad)
        await epochs.put(s.epoch_key(), record(2, "w-cp1-g0", "w-cp1-g1"))
        await wait_for_workers(host, {"w-cp1-g0", "w-cp1-g1"})
    finally:
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
