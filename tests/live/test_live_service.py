"""The micro-service base on a real server: endpoints, typed errors, discovery, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from uuid import uuid4

import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import Request
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel, ConfigDict
from service_support import service_running

import shared.natsclient as natsclient
from shared.ids import InvalidInput, UnknownWorker, VertumnusError
from shared.natsserver import EmbeddedNats
from shared.service import (
    JETSTREAM_CHECK_S,
    Endpoint,
    MicroService,
    RemoteError,
    call,
    error_code,
    request_model,
    until_served,
)
from shared.settings import ServiceSettings
from shared.subjects import BUS_PROTOCOL
from shared.telemetry import tracer


class Add(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    a: int
    b: int


class Sum(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    total: int


class Toy(MicroService):
    """Adds numbers; refuses negative ones (400), unknown names (404), 13 (409), 99 (500)."""

    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(
            settings,
            name="vtm-toy",
            version="1.2.3",
            group=f"{settings.subject_prefix}.toy",
            metadata={"epoch": "0"},
        )
        self.setup_ran = False
        self.cleaned_up = False

    async def setup(self, stack) -> None:
        self.setup_ran = True
        stack.callback(setattr, self, "cleaned_up", True)

    def endpoints(self) -> Sequence[Endpoint]:
        return [Endpoint("add", self._add), Endpoint("lookup", self._lookup, subject="find")]

    async def _add(self, request: Request) -> Sum:
        body = request_model(request, Add)
        if body.a < 0:
            raise InvalidInput("a must be >= 0")
        if body.a == 13:
            raise VertumnusError("busy: draining")
        if body.a == 99:
            raise RuntimeError("secret internals")
        return Sum(total=body.a + body.b)

    async def _lookup(self, request: Request) -> bytes:
        raise UnknownWorker(f"no worker {request.data.decode()!r}")


@pytest.fixture
async def toy(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[Toy]:
    svc = Toy(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq))
    async with service_running(svc, timeout_s=10):
        yield svc


async def test_endpoint_errors_and_keeps_serving(
    toy: Toy, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    subj = f"{uniq}.toy.add"
    with tracer().start_as_current_span("caller") as caller:
        assert await call(nc, subj, Add(a=1, b=2), Sum, timeout_s=10) == Sum(total=3)
    server_span = next(s for s in spans.get_finished_spans() if s.name == "vtm-toy.add")
    assert server_span.parent.span_id == caller.get_span_context().span_id

    expected = [
        (b'{"a": 1}', 400, "Add: field 'b'"),
        (b"not json", 400, "Add"),
        (Add(a=-1, b=0), 400, "a must be >= 0"),
        (Add(a=13, b=0), 409, "draining"),
        (Add(a=99, b=0), 500, "internal error"),
    ]
    for body, code, text in expected:
        with pytest.raises(RemoteError) as err:
            await call(nc, subj, body, Sum, timeout_s=10)
        assert err.value.code == code and text in err.value.description
        assert "secret" not in err.value.description
    with pytest.raises(RemoteError) as err:
        await call(nc, f"{uniq}.toy.find", b"w-x", Sum, timeout_s=10)
    assert err.value.code == 404

    assert await call(nc, subj, Add(a=2, b=2), Sum, timeout_s=10) == Sum(total=4)
    assert toy.setup_ran


async def test_a_handlers_log_lines_carry_the_callers_trace_id(
    toy: Toy, nc: Client, uniq: str
) -> None:
    """conventions.md: the trace id is bound per message; the wrapper binds the caller's (its
    ``traceparent``, sampled or not) with the endpoint on every line the handler logs."""
    from structlog.contextvars import merge_contextvars
    from structlog.testing import capture_logs

    tid = "4bf92f3577b34da6a3ce929d0e0e4736"
    for flags in ("01", "00"):
        with capture_logs(processors=[merge_contextvars]) as logs:
            reply = await nc.request(f"{uniq}.toy.add", Add(a=-1, b=0).model_dump_json().encode(),
                                     timeout=10,
                                     headers={"traceparent": f"00-{tid}-00f067aa0ba902b7-{flags}"})
        assert reply.headers and reply.headers.get("Nats-Service-Error-Code") == "400"
        (line,) = [e for e in logs if e["event"] == "request rejected"]
        assert line["trace_id"] == tid and line["endpoint"] == "add", flags


async def test_discovery_ping_info_stats(toy: Toy, nc: Client, uniq: str) -> None:
    ping = json.loads((await nc.request("$SRV.PING.vtm-toy", b"", timeout=10)).data)
    assert ping["name"] == "vtm-toy" and ping["version"] == "1.2.3"
    # the bus contract it speaks, for `vertumnus status` to find mixed releases
    assert ping["metadata"] == {"prefix": uniq, "protocol": BUS_PROTOCOL, "epoch": "0"}
    toy.set_metadata(epoch="5")
    info = json.loads(
        (await nc.request(f"$SRV.INFO.vtm-toy.{toy.service.id}", b"", timeout=10)).data
    )
    assert info["metadata"]["epoch"] == "5"
    assert {e["subject"] for e in info["endpoints"]} == {f"{uniq}.toy.add", f"{uniq}.toy.find"}
    assert all(e["queue_group"] == "q" for e in info["endpoints"])
    with pytest.raises(RemoteError):
        await call(nc, f"{uniq}.toy.add", b"{}", Sum, timeout_s=10)
    stats = json.loads((await nc.request("$SRV.STATS.vtm-toy", b"", timeout=10)).data)
    add = next(e for e in stats["endpoints"] if e["name"] == "add")
    assert (add["num_requests"], add["num_errors"]) == (1, 1)  # the one refused call above
    assert add.get("data") is None  # no counters of its own (stats_data: None)


class CountingToy(Toy):
    """A Toy that reports its own counters (MicroService.stats_data)."""

    def __init__(self, settings: ServiceSettings, served: int) -> None:
        super().__init__(settings)
        self.served = served

    def stats_data(self) -> dict[str, int]:
        return {"served": self.served}


async def test_a_service_warns_of_services_of_its_prefix_speaking_another_bus_protocol(
        nats_server: EmbeddedNats, nc: Client, uniq: str) -> None:
    """A rolling upgrade across a change of the bus contract: the new service says, at its
    start, which services of its prefix speak another protocol (an older release reports
    none); services of other prefixes, and its own replicas of this release, are no
    concern."""
    from nats.micro import add_service
    from nats.micro.service import ServiceConfig
    from structlog.testing import capture_logs

    old = "1" if BUS_PROTOCOL != "1" else "0"
    peers = [await add_service(nc, ServiceConfig(name=name, version="0.1.0", metadata=meta))
             for name, meta in (("vtm-scheduler", {"prefix": uniq, "protocol": old}),
                                ("vtm-rankd", {"prefix": uniq}),
                                ("vtm-gateway", {"prefix": uniq, "protocol": BUS_PROTOCOL}),
                                ("vtm-rankd", {"prefix": uniq + "x", "protocol": old}))]
    svc = Toy(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq))
    try:
        with capture_logs() as logs:
            task = asyncio.create_task(svc.run(handle_signals=False))
            await asyncio.wait_for(svc.protocols_checked.wait(), timeout=30)
        assert svc.peer_protocols == {f"vtm-scheduler {peers[0].id}": old,
                                      f"vtm-rankd {peers[1].id}": "none"}
        warned = [e for e in logs if "another bus protocol" in e["event"]]
        assert len(warned) == 1 and warned[0]["log_level"] == "warning"
        assert warned[0]["others"] == dict(sorted(svc.peer_protocols.items()))
        svc.request_stop()
        await asyncio.wait_for(task, timeout=10)

        # One release throughout: nothing to say.
        for p in peers[:2]:
            await p.stop()
        again = Toy(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq))
        with capture_logs() as logs:
            task = asyncio.create_task(again.run(handle_signals=False))
            await asyncio.wait_for(again.protocols_checked.wait(), timeout=30)
        assert again.peer_protocols == {}
        assert not [e for e in logs if "another bus protocol" in e["event"]]
        again.request_stop()
        await asyncio.wait_for(task, timeout=10)
    finally:
        for p in peers[2:]:
            await p.stop()


async def test_every_replica_reports_its_own_counters_in_stats(
        nats_server: EmbeddedNats, nc: Client, uniq: str) -> None:
    """``$SRV.STATS``: each replica answers with its counters as every endpoint's ``data``
    (an endpoint request would reach only one of them, through the queue group)."""
    from vertumnus.live.observe import service_stats

    toys = [CountingToy(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq), n)
            for n in (3, 4)]
    async with contextlib.AsyncExitStack() as running:
        for t in toys:
            await running.enter_async_context(service_running(t, timeout_s=10))
        answers = await service_stats(nc, "vtm-toy", prefix=uniq, window_s=0.5)
        assert len(answers) == 2
        data = sorted(e["data"]["served"] for a in answers for e in a["endpoints"]
                      if e["name"] == "add")
        assert data == [3, 4]
        toys[0].served = 7  # read at each request
        again = await service_stats(nc, "vtm-toy", prefix=uniq, window_s=0.5)
        assert sorted(a["endpoints"][0]["data"]["served"] for a in again) == [4, 7]
        assert await service_stats(nc, "vtm-toy", prefix="other", window_s=0.2) == []


async def test_stop_cleans_up(nats_server: EmbeddedNats, nc: Client, uniq: str) -> None:
    svc = Toy(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq))
    async with service_running(svc, timeout_s=10):
        pass  # started, then stopped
    assert svc.cleaned_up
    assert svc.nc.is_closed


def test_construction_validates() -> None:
    s = ServiceSettings()
    with pytest.raises(InvalidInput):
        MicroService(s, name="bad name", version="1.0.0", group="vtm.x")
    with pytest.raises(InvalidInput):
        MicroService(s, name="ok", version="1.0", group="vtm.x")
    with pytest.raises(InvalidInput):
        MicroService(s, name="ok", version="1.0.0", group="vtm.*")


def test_error_code_table() -> None:
    assert error_code(InvalidInput("x")) == "400"
    assert error_code(UnknownWorker("w")) == "404"
    assert error_code(VertumnusError("x")) == "409"
    assert error_code(KeyError("x")) == "500"


# -- PullConsumer: continuous pull, each message on arrival --------------------------------------


async def _work_queue(nc: Client, uniq: str, ack_wait: float = 30) -> tuple[str, str, str]:
    from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

    js = nc.jetstream()
    stream, subject = f"S{uniq.replace('.', '_')}", f"{uniq}.work"
    await js.add_stream(StreamConfig(name=stream, subjects=[subject],
                                     retention=RetentionPolicy.WORK_QUEUE))
    await js.add_consumer(stream, ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT,
                                                 ack_wait=ack_wait))
    return stream, "c", subject


async def test_pull_consumer_hands_over_each_message_before_the_batch_fills(
        nc: Client, uniq: str) -> None:
    """One message with 16 requested and a 60 s pull: handed over without the other 15 or the
    pull's expiry (nats-py's fetch(16, 60) would hold it up to 60 s); order kept; credit
    renewed past the first batch."""
    from shared.service import PullConsumer

    stream, consumer, subject = await _work_queue(nc, uniq)
    got: list[bytes] = []
    first = asyncio.Event()

    async def handler(msg) -> None:
        got.append(msg.data)
        assert msg.metadata.stream == stream  # a JetStream delivery: ack/metadata work
        await msg.ack()
        first.set()

    pc = PullConsumer(nc, stream=stream, consumer=consumer, handler=handler, batch=16,
                      expires_s=60.0)
    await pc.start()
    try:
        js = nc.jetstream()
        await js.publish(subject, b"0")
        await asyncio.wait_for(first.wait(), timeout=20)  # far below the pull's 60 s
        for i in range(1, 50):
            await js.publish(subject, str(i).encode())
        async with asyncio.timeout(30):
            while len(got) < 50:
                await asyncio.sleep(0.01)
        assert got == [str(i).encode() for i in range(50)]
        assert pc.pulls >= 50 // 16  # credit renewed, not one pull per message
        assert pc.pulls < 50
    finally:
        await pc.stop()


async def test_pull_consumer_back_pressure_and_expiry(nc: Client, uniq: str) -> None:
    """A handler that waits holds back the next delivery; after every pull expired the
    consumer pulls again, so a later message still arrives."""
    from shared.service import PullConsumer

    stream, consumer, subject = await _work_queue(nc, uniq)
    gate = asyncio.Event()
    seen: list[bytes] = []

    async def handler(msg) -> None:
        seen.append(msg.data)
        await gate.wait()
        await msg.ack()

    pc = PullConsumer(nc, stream=stream, consumer=consumer, handler=handler, batch=4,
                      expires_s=0.2, grace_s=0.1)
    await pc.start()
    try:
        js = nc.jetstream()
        for i in range(3):
            await js.publish(subject, str(i).encode())
        # Settled: the other two delivered and the pull's expiry status (408) come, all
        # queued behind the handler -- then nothing else may have been handed over.
        async with asyncio.timeout(20):
            while len(seen) < 2 and (pc._sub is None or pc._sub.pending_msgs < 3):
                await asyncio.sleep(0.01)
        await nc.flush()
        assert seen == [b"0"]  # the handler has not returned: nothing else handed over
        assert pc._sub.pending_msgs >= 3
        gate.set()
        async with asyncio.timeout(20):
            while len(seen) < 3:
                await asyncio.sleep(0.01)
        pulls = pc.pulls
        async with asyncio.timeout(20):  # several expiries pass with nothing to deliver
            while pc.pulls < pulls + 2:
                await asyncio.sleep(0.05)
        await js.publish(subject, b"late")
        async with asyncio.timeout(20):
            while len(seen) < 4:
                await asyncio.sleep(0.01)
        assert seen == [b"0", b"1", b"2", b"late"]
    finally:
        await pc.stop()


async def test_pull_consumer_stop_hands_back_what_it_holds(nc: Client, uniq: str) -> None:
    """Deliveries received but not handed over when ``stop`` runs are NAK'ed: the next
    consumer gets them at once, not after ack_wait (an hour here, far above any wait in this
    test: only the NAK can bring them back); the one being handled is finished (acked), not
    handed back."""
    from shared.service import PullConsumer

    stream, consumer, subject = await _work_queue(nc, uniq, ack_wait=3600)
    gate = asyncio.Event()
    first: list[bytes] = []

    async def blocked(msg) -> None:
        first.append(msg.data)
        await gate.wait()
        await msg.ack()

    pc = PullConsumer(nc, stream=stream, consumer=consumer, handler=blocked, batch=8)
    await pc.start()
    js = nc.jetstream()
    for i in range(3):
        await js.publish(subject, str(i).encode())
    async with asyncio.timeout(20):
        while not first:
            await asyncio.sleep(0.01)
        while pc._sub.pending_msgs < 2:  # the other two delivered, queued behind the handler
            await asyncio.sleep(0.01)
    stopping = asyncio.create_task(pc.stop())
    async with asyncio.timeout(20):
        while not pc._stopping:  # stop has begun before the handler returns
            await asyncio.sleep(0)
    gate.set()
    await asyncio.wait_for(stopping, timeout=20)
    assert first == [b"0"]

    second: list[bytes] = []

    async def take(msg) -> None:
        second.append(msg.data)
        await msg.ack()

    pc2 = PullConsumer(nc, stream=stream, consumer=consumer, handler=take, batch=8)
    await pc2.start()
    try:
        async with asyncio.timeout(15):  # far below ack_wait
            while len(second) < 2:
                await asyncio.sleep(0.01)
        assert sorted(second) == [b"1", b"2"]
    finally:
        await pc2.stop()


def test_pull_consumer_validates() -> None:
    from shared.service import PullConsumer

    async def handler(msg) -> None:
        return None

    with pytest.raises(InvalidInput):
        PullConsumer(None, stream="S", consumer="c", handler=handler, batch=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        PullConsumer(None, stream="S.x", consumer="c", handler=handler)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        PullConsumer(None, stream="S", consumer="c", handler=handler, expires_s=0)  # type: ignore[arg-type]


WAIT_UNTIL_S = 30.0  # a correctness bound on a loaded machine, not a speed check


async def test_until_served_waits_for_a_responder_and_bounds_the_wait(nc: Client) -> None:
    """``until_served`` returns once the subject answers (even with an error reply) and raises
    ``TimeoutError`` naming the subject when nothing ever subscribes."""
    subject = "t-until." + uuid4().hex

    async def reject(msg: Msg) -> None:  # a bad request reply still proves a responder
        await nc.publish(msg.reply, b"", headers={"Nats-Service-Error-Code": "400"})

    with pytest.raises(TimeoutError, match=subject):
        await until_served(nc, subject + ".none", timeout_s=0.3)
    sub = await nc.subscribe(subject, cb=reject)
    try:
        await until_served(nc, subject, timeout_s=WAIT_UNTIL_S)
    finally:
        await sub.unsubscribe()


async def crash_and_restart(server: EmbeddedNats, port: int) -> EmbeddedNats:
    """SIGKILL nats-server, then start another on its port with its JetStream store."""
    import os
    import signal

    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    # Reaped before its port is reused (``running`` polls the process, which reaps it); not
    # EmbeddedNats.kill(), which would remove the store the next server starts on.
    async with asyncio.timeout(10):
        while server.running:
            await asyncio.sleep(0.01)
    return EmbeddedNats(port=port, store_dir=server.store_dir).start()


async def test_a_server_restart_is_survived_and_logged_as_warnings(uniq: str) -> None:
    """nats-server killed and started again on its port with its JetStream store: the service
    reconnects by itself and serves again. The blip is logged as warnings through the
    service's logger (nats_callbacks), not as nats-py's default error with a traceback."""

    from structlog.testing import capture_logs

    server = EmbeddedNats().start()
    port = int(server.url.rsplit(":", 1)[1])
    svc = Toy(ServiceSettings(nats_url=server.url, subject_prefix=uniq))
    again: EmbeddedNats | None = None
    try:
        async with service_running(svc, timeout_s=15):
            with capture_logs() as logs:
                again = await crash_and_restart(server, port)
                client = await natsclient.connect(again.url)
                try:
                    await until_served(client, f"{uniq}.toy.add", timeout_s=30)
                    assert (await call(client, f"{uniq}.toy.add", Add(a=2, b=3), Sum)).total == 5
                finally:
                    await client.close()
            events = {(e["event"], e["log_level"]) for e in logs}
            assert ("nats disconnected", "warning") in events
            assert ("nats reconnected", "info") in events
            assert not [e for e in logs if e["log_level"] in ("error", "critical")]
    finally:
        if again is not None:
            again.stop()
        server.stop()


class ToyWithJetStream(Toy):
    """Toy whose JetStream assets are "not ready" at the first try after a reconnect."""

    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(settings)
        self.ensured = 0

    async def ensure_jetstream(self) -> None:
        self.ensured += 1
        if self.ensured == 1:
            raise nats.errors.Error("jetstream not ready")


async def checks_after(svc: MicroService, seen: int, more: int) -> None:
    """Wait (bounded) until the JetStream keeper of ``svc`` completed ``more`` checks after
    the ``seen``-th."""
    async with asyncio.timeout(10 + 5 * more * JETSTREAM_CHECK_S):
        while svc.jetstream_checks < seen + more:
            await asyncio.sleep(0.05)


async def test_jetstream_assets_are_ensured_again_after_each_reconnect(uniq: str) -> None:
    """A service that has JetStream assets ensures them again once its connection is back
    (until that succeeds: a failure is tried again at the next check); only after a
    reconnect; a service without any runs no such task."""

    server = EmbeddedNats().start()
    port = int(server.url.rsplit(":", 1)[1])
    settings = ServiceSettings(nats_url=server.url, subject_prefix=uniq)
    svc, plain = ToyWithJetStream(settings), Toy(settings)
    again: EmbeddedNats | None = None
    try:
        async with contextlib.AsyncExitStack() as running:
            for s in (svc, plain):
                await running.enter_async_context(service_running(s, timeout_s=15))
            # One keeper: svc's (both are named vtm-toy; plain has no JetStream assets).
            assert sum(t.get_name() == "vtm-toy-jetstream" for t in asyncio.all_tasks()) == 1
            await checks_after(svc, svc.jetstream_checks, 2)  # two checks, each of them seen
            assert svc.ensured == 0  # no reconnect, nothing to do
            assert plain.jetstream_checks == 0
            again = await crash_and_restart(server, port)
            async with asyncio.timeout(30):
                while svc.ensured < 2:
                    await asyncio.sleep(0.05)
            # Two more completed checks (the one that succeeded may be one of them, not both).
            await checks_after(svc, svc.jetstream_checks, 2)
            assert svc.ensured == 2  # ensured once it succeeded: not again without a reconnect
    finally:
        if again is not None:
            again.stop()
        server.stop()


async def test_kv_watch_is_made_again_after_a_server_restart(uniq: str) -> None:
    """KvWatch: after nats-server is killed and started again (same port, same store), the
    watch is made again once the client reconnected -- it replays the key's current value and
    the end-of-initial-values marker, then delivers what is written after the restart."""
    from shared.service import KvWatch, epoch_kv
    from shared.subjects import Subjects

    server = EmbeddedNats().start()
    port = int(server.url.rsplit(":", 1)[1])
    again: EmbeddedNats | None = None
    nc = await natsclient.connect(server.url, reconnect_time_wait=0.2)
    got: list[bytes | None] = []
    # What each watch delivered, by watch (``remade`` when the entry came): what the old
    # watch still had queued at the loss may come before the remake (a repeat of "1" or of
    # its marker: harmless to a follower), and only the new watch's replay is checked.
    by_watch: dict[int, list[bytes | None]] = {}
    try:
        s = Subjects(uniq)
        kv = await epoch_kv(nc.jetstream(), s)
        watch = await KvWatch(nc, kv, s.epoch_key(), check_s=0.1).start()

        async def follow() -> None:
            async for e in watch:
                got.append(None if e is None else e.value)
                by_watch.setdefault(watch.remade, []).append(got[-1])

        task = asyncio.create_task(follow())
        await kv.put(s.epoch_key(), b"1")
        async with asyncio.timeout(10):
            while got != [None, b"1"]:
                await asyncio.sleep(0.05)
        again = await crash_and_restart(server, port)
        async with asyncio.timeout(20):
            while watch.remade < 1:
                await asyncio.sleep(0.05)
            # The new watch's replay ends with its marker before "2" is written: a write that
            # raced the replay would come before the marker (its consumer counts it pending).
            while by_watch.get(1) != [b"1", None]:
                await asyncio.sleep(0.05)
            await kv.put(s.epoch_key(), b"2")
            while got[-1:] != [b"2"]:
                await asyncio.sleep(0.05)
        # The new watch: the replay of "1" and its marker, then the new value; the old one
        # delivered "1" and its marker first, and nothing but repeats of them after.
        assert by_watch[1] == [b"1", None, b"2"], by_watch
        assert by_watch[0][:2] == [None, b"1"] and set(by_watch[0]) <= {None, b"1"}, by_watch
        await watch.stop()
        await asyncio.wait_for(task, timeout=5)  # stop ends the iteration
    finally:
        await nc.close()
        if again is not None:
            again.stop()
        server.stop()


def test_kv_watch_validates() -> None:
    from shared.service import KvWatch

    with pytest.raises(InvalidInput, match="check_s"):
        KvWatch(None, None, check_s=0)  # type: ignore[arg-type]


async def test_a_stop_while_the_server_is_down_ends_cleanly(uniq: str) -> None:
    """Stopped while its nats-server is down (killed, not back yet: ``up`` ends a run between
    an injected nats kill and its restart), a service closes its reconnecting connection and
    its run returns: nats-py refuses to drain such a connection (ConnectionReconnectingError),
    which ended the process in a traceback and exit status 1."""
    import os
    import signal

    server = EmbeddedNats().start()
    svc = Toy(ServiceSettings(nats_url=server.url, subject_prefix=uniq))
    try:
        async with service_running(svc, timeout_s=15):  # raises what the stop raised
            assert server.pid is not None
            os.kill(server.pid, signal.SIGKILL)
            async with asyncio.timeout(30):
                while not svc.nc.is_reconnecting:
                    await asyncio.sleep(0.05)
    finally:
        server.stop()
    assert svc.cleaned_up and svc.nc.is_closed
