"""A service whose NATS server is lost during its start-up, on a real nats-server: the start-up
ends with :class:`~shared.service.StartUpLost` after one error naming the loss, once what had
started (a KV watch, a subscription, the micro service, the connection) has stopped -- for a
service of this module and for each of the project's five; the process then exits with
:data:`~shared.servicemain.RESTART_EXIT` (start me again), not a traceback. A stop during the
start-up ends it at once and cleanly (the process exits 0), also while a KV watch is being made
(it is made to its end, then undone) and when a step fails by the loss as the stop comes. An
error of a server that answers is no loss: it is raised as it is.

The server is killed (SIGKILL) or frozen (SIGSTOP: it answers nothing) by the service's own
start-up, between two of its steps -- in its setup, or in its ``serving`` (the endpoints up) --
so the loss falls where it is meant to, every time. Before, the step timed out and ``run``
raised ``nats: timeout``: exit status 1 and a traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from frozen import freeze, resume
from nats.js.errors import NotFoundError
from structlog.testing import capture_logs

from services.cachemgr.service import CacheMgrService, CacheMgrSettings
from services.controller.service import ControllerService, ControllerSettings
from services.gateway.adapter import GatewayService
from services.gateway.settings import GatewaySettings
from services.rankd.backend import SimBackend
from services.rankd.main import WORKER_FAULT_EXIT
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.natsserver import EmbeddedNats
from shared.service import KvWatch, MicroService, StartUpLost, ensure_key_value
from shared.servicemain import RESTART_EXIT
from shared.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # a liveness bound (a lost start-up waits out a JetStream timeout), no speed check
JS_TIMEOUT_S = 1.0  # the JetStream step the lost server leaves unanswered times out
LOST_EVENT = ("vtm-startuptest did not start: its NATS server was lost during the start-up; "
              "stopping what started and exiting for a restart")


class Losing(MicroService):
    """A service whose start-up makes a KV watch and a subscription, then takes its server away
    (``how``: ``kill``, ``freeze``) in ``where`` (``setup``, ``serving``) and takes one more
    JetStream step, which the server never answers."""

    def __init__(self, settings: ServiceSettings, server: EmbeddedNats, how: str,
                 where: str) -> None:
        super().__init__(settings, name="vtm-startuptest", version="0.1.0",
                         group="vtm.startuptest")
        self.server, self.how, self.where = server, how, where
        self.watch: KvWatch | None = None

    async def setup(self, stack: AsyncExitStack) -> None:
        js = self.nc.jetstream(timeout=JS_TIMEOUT_S)
        kv = await ensure_key_value(js, f"{self.subjects.prefix}-a")
        self.watch = await KvWatch(self.nc, kv, "k").start()
        stack.push_async_callback(self.watch.stop)
        sub = await self.nc.subscribe(f"{self.subjects.prefix}.x")
        stack.push_async_callback(sub.unsubscribe)
        if self.where == "setup":
            await self.lose()

    async def serving(self) -> None:
        if self.where == "serving":
            await self.lose()

    async def lose(self) -> None:
        if self.how == "kill":
            self.server.kill()
        else:
            freeze(self.server)
        await ensure_key_value(self.nc.jetstream(timeout=JS_TIMEOUT_S),
                               f"{self.subjects.prefix}-b")


def left_running() -> list[str]:
    """The tasks of this loop still running but the caller's."""
    return sorted(repr(t.get_coro()) for t in asyncio.all_tasks()
                  if t is not asyncio.current_task() and not t.done())


async def until_nothing_runs() -> list[str]:
    """:func:`left_running`, once empty or after a bound: tasks cancelled by a close end
    within a loop step or two, tasks left behind never do."""
    try:
        async with asyncio.timeout(WAIT_S):
            while left_running():
                await asyncio.sleep(0.02)
    except TimeoutError:
        pass
    return left_running()


@pytest.mark.parametrize("where", ["setup", "serving"])
@pytest.mark.parametrize("how", ["kill", "freeze"])
async def test_a_start_up_that_loses_its_server_stops_what_started_and_raises_start_up_lost(
        own_nats_server: EmbeddedNats, uniq: str, how: str, where: str) -> None:
    settings = ServiceSettings(nats_url=own_nats_server.url, subject_prefix=uniq,
                               drain_timeout_s=30, reconnect_wait_s=0.2)
    svc = Losing(settings, own_nats_server, how, where)
    try:
        with capture_logs() as logs, pytest.raises(StartUpLost, match="NATS server lost"):
            await asyncio.wait_for(svc.run(handle_signals=False), timeout=WAIT_S)
    finally:
        if how == "freeze":
            resume(own_nats_server)
    errors = [e for e in logs if e["log_level"] in ("error", "critical")]
    assert [e["event"] for e in errors] == [LOST_EVENT], logs
    assert "timeout" in errors[0]["error"]
    # Its undoing tries no round trip with a server that answers nothing: no bound is waited
    # out, no warning of work cut short (the connection's own warnings of the loss aside).
    assert not [e for e in logs if e["log_level"] == "warning"
                and not e["event"].startswith("nats ")], logs
    assert not svc.started.is_set()
    assert svc.nc.is_closed
    assert await until_nothing_runs() == []


@pytest.mark.parametrize("how", ["kill", "freeze"])
async def test_a_stop_during_the_start_up_ends_it_at_once(
        own_nats_server: EmbeddedNats, uniq: str, how: str) -> None:
    """The start-up waits for a server that is gone; a stop ends it at once: ``run`` returns
    (no error), nothing is left. The step it waits in would time out only after the test's
    bound, so a stop that waited for it fails the test."""
    settings = ServiceSettings(nats_url=own_nats_server.url, subject_prefix=uniq,
                               drain_timeout_s=2, reconnect_wait_s=0.2)
    waiting = asyncio.Event()

    class Waiting(Losing):
        async def lose(self) -> None:
            if self.how == "kill":
                self.server.kill()
            else:
                freeze(self.server)
            waiting.set()
            await ensure_key_value(self.nc.jetstream(timeout=10 * WAIT_S),
                                   f"{self.subjects.prefix}-b")

    svc = Waiting(settings, own_nats_server, how, "setup")
    task = asyncio.create_task(svc.run(handle_signals=False))
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(waiting.wait(), timeout=WAIT_S)
            svc.request_stop()
            await asyncio.wait_for(task, timeout=WAIT_S)  # raises what the run raised
    finally:
        if how == "freeze":
            resume(own_nats_server)
        svc.request_stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=WAIT_S)
    assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
    assert any(e["event"] == "service stopped before it had started" for e in logs), logs
    assert svc.nc.is_closed
    assert await until_nothing_runs() == []


async def test_a_start_up_failing_by_its_lost_server_as_the_stop_comes_is_a_stop(
        own_nats_server: EmbeddedNats, uniq: str) -> None:
    """The server and the service told to stop at once (``vertumnus up`` killed): a step that
    fails by the server's loss once the stop is asked for ends the start-up as a stop -- ``run``
    returns (the process exits 0), no error is logged -- not as a lost start-up. The failing
    step is a publish without an outbound buffer while reconnecting (the gateway's
    ``pending_size=0``), which raises at once."""
    settings = ServiceSettings(nats_url=own_nats_server.url, subject_prefix=uniq,
                               drain_timeout_s=2, reconnect_wait_s=0.2)

    class StoppedAsItFails(Losing):
        def connect_options(self) -> dict[str, object]:
            return {"pending_size": 0}

        async def lose(self) -> None:
            self.server.kill()
            async with asyncio.timeout(WAIT_S):
                while self.nc.is_connected:
                    await asyncio.sleep(0.01)
            self.request_stop()
            await self.nc.publish(f"{self.subjects.prefix}.x", b"")  # no await before it raises

    svc = StoppedAsItFails(settings, own_nats_server, "kill", "setup")
    with capture_logs() as logs:
        await asyncio.wait_for(svc.run(handle_signals=False), timeout=WAIT_S)
    assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
    assert any(e["event"] == "start-up ended by its NATS server's loss while stopping"
               for e in logs), logs
    assert svc.nc.is_closed
    assert await until_nothing_runs() == []


async def test_a_stop_while_the_start_up_makes_a_kv_watch_waits_for_it_then_undoes_it(
        own_nats_server: EmbeddedNats, uniq: str) -> None:
    """The server is frozen while nats-py makes the start-up's KV watch (its subscription and
    two tasks made, its last request unanswered), and a stop comes: the stop waits for the
    making to end (the request times out), then the watch is undone and ``run`` returns,
    with none of the watch's tasks running once it has. Before, the cancel cut the making
    short: its subscription and tasks stayed on the connection, the heartbeat check running
    on after ``run`` returned."""
    settings = ServiceSettings(nats_url=own_nats_server.url, subject_prefix=uniq,
                               drain_timeout_s=2, reconnect_wait_s=0.2)
    frozen = asyncio.Event()

    class FrozenInTheWatch(Losing):
        async def setup(self, stack: AsyncExitStack) -> None:
            kv = await ensure_key_value(self.nc.jetstream(timeout=JS_TIMEOUT_S),
                                        f"{self.subjects.prefix}-a")

            async def freeze_once_subscribed() -> None:
                # Every loop step: the watch's subscription is seen before its last request
                # can have been answered (a round trip), and the freeze blocks the loop.
                while not watch_tasks() and not any(
                        getattr(s, "_jsi", None) for s in self.nc._subs.values()):
                    await asyncio.sleep(0)
                freeze(self.server)
                frozen.set()

            freezer = asyncio.create_task(freeze_once_subscribed())
            try:
                self.watch = await KvWatch(self.nc, kv, "k").start()
            finally:
                freezer.cancel()
            stack.push_async_callback(self.watch.stop)

    svc = FrozenInTheWatch(settings, own_nats_server, "freeze", "setup")
    task = asyncio.create_task(svc.run(handle_signals=False))
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(frozen.wait(), timeout=WAIT_S)
            svc.request_stop()
            await asyncio.wait_for(task, timeout=WAIT_S)  # raises what the run raised
            left = watch_tasks()  # as the run returns
    finally:
        resume(own_nats_server)
        svc.request_stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=WAIT_S)
    assert left == []
    assert svc.watch is None  # its start never returned
    assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
    assert any(e["event"] == "service stopped before it had started" for e in logs), logs
    assert svc.nc.is_closed
    assert await until_nothing_runs() == []


def a_service(name: str, server: EmbeddedNats, prefix: str,
              timeouts: list[float | None]) -> MicroService:
    """One of the project's services, on ``server``, whose first JetStream step (its
    ``ensure_jetstream``, the first thing its setup does) finds that server killed; its
    JetStream requests time out after JS_TIMEOUT_S (``jetstream_timeout_s``; the gateway's
    ``publish_timeout_s`` too, the longer of the two bounding its context). Each JetStream
    context it makes appends its timeout to ``timeouts``."""
    common = {"nats_url": server.url, "subject_prefix": prefix,
              "jetstream_timeout_s": JS_TIMEOUT_S}
    cls: type[MicroService]
    args: tuple[object, ...]
    if name == "gateway":
        cls, args = GatewayService, (GatewaySettings(**common, http_port=0,
                                                     publish_timeout_s=JS_TIMEOUT_S),)
    elif name == "scheduler":
        cls, args = SchedulerService, (SchedulerSettings(**common),)
    elif name == "controller":
        cls, args = ControllerService, (ControllerSettings(**common),)
    elif name == "cachemgr":
        cls, args = CacheMgrService, (CacheMgrSettings(**common),)
    else:
        cls, args = RankdService, (RankdSettings(**common), SimBackend(time_scale=1.0))

    class LostAtTheFirstStep(cls):  # type: ignore[valid-type,misc]
        async def ensure_jetstream(self) -> None:
            made = self.nc.jetstream

            def recorded(**kwargs: Any) -> Any:
                timeouts.append(kwargs.get("timeout"))
                return made(**kwargs)

            self.nc.jetstream = recorded
            server.kill()
            await super().ensure_jetstream()

    return LostAtTheFirstStep(*args)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["gateway", "scheduler", "controller", "cachemgr", "rankd"])
async def test_every_service_whose_start_up_loses_its_server_raises_start_up_lost(
        own_nats_server: EmbeddedNats, uniq: str, name: str) -> None:
    """Killed before the service's first JetStream step: every service ends the same way,
    after the JetStream timeout its settings give (``jetstream_timeout_s``; before, each waited
    out nats-py's 5 s, whatever its settings)."""
    timeouts: list[float | None] = []
    svc = a_service(name, own_nats_server, uniq, timeouts)
    with capture_logs() as logs, pytest.raises(StartUpLost, match="NATS server lost"):
        await asyncio.wait_for(svc.run(handle_signals=False), timeout=WAIT_S)
    errors = [e for e in logs if e["log_level"] in ("error", "critical")]
    assert [e["event"] for e in errors] == [LOST_EVENT.replace("vtm-startuptest", svc.name)]
    assert timeouts == [JS_TIMEOUT_S]
    assert svc.nc.is_closed
    assert await until_nothing_runs() == []


async def test_a_start_up_refused_by_a_server_that_answers_is_no_lost_server(
        own_nats_server: EmbeddedNats, uniq: str) -> None:
    """An error the server gives while it answers (here: a stream that does not exist) is
    raised as it is -- a restart would meet it again -- and logged as no lost server."""
    settings = ServiceSettings(nats_url=own_nats_server.url, subject_prefix=uniq)

    class Refused(Losing):
        async def lose(self) -> None:
            await self.nc.jetstream(timeout=JS_TIMEOUT_S).stream_info(f"{uniq}-none")

    svc = Refused(settings, own_nats_server, "refused", "setup")
    with capture_logs() as logs, pytest.raises(NotFoundError):
        await asyncio.wait_for(svc.run(handle_signals=False), timeout=WAIT_S)
    assert not [e for e in logs if e["event"] == LOST_EVENT], logs
    assert svc.nc.is_closed


def watch_tasks() -> list[str]:
    """The tasks of a KV watch's ordered consumer still running (nats-py's ``_JSI``)."""
    return sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks()
                  if not t.done() and "_JSI." in getattr(t.get_coro(), "__qualname__", ""))


# -- the process: its exit status ---------------------------------------------------------------

# A service process in miniature: run_service (as every service main) around the Losing
# service of this module, its server given by URL and pid.
SERVICE = """
import asyncio, os, signal, sys
sys.path[:0] = [{tests!r}, {live!r}]
from test_live_service_startup_lost import Losing
from shared.service import ensure_key_value
from shared.servicemain import run_service
from shared.settings import ServiceSettings

class Server:  # what Losing needs of the server: its pid, to kill or freeze it
    def __init__(self, pid):
        self.pid = pid
    def kill(self):
        os.kill(self.pid, signal.SIGKILL)

HOW, PID = sys.argv[1], int(sys.argv[2])

async def serve(settings):
    svc = Losing(settings, Server(PID), HOW, "setup")
    if HOW == "stop":  # killed, then told to stop while the start-up waits for it
        async def lose():
            svc.server.kill()
            print("waiting", flush=True)
            await ensure_key_value(svc.nc.jetstream(timeout=3600), settings.subject_prefix + "-b")
        svc.lose = lose
    await svc.run()

run_service(ServiceSettings(drain_timeout_s=30, reconnect_wait_s=0.2), serve)
"""


def run_process(server: EmbeddedNats, uniq: str, how: str) -> subprocess.Popen[str]:
    code = SERVICE.format(tests=str(REPO / "tests"), live=str(REPO / "tests" / "live"))
    env = {**os.environ, "VTM_NATS_URL": server.url, "VTM_SUBJECT_PREFIX": uniq,
           "VTM_SERVICE_NAME": "vtm-startuptest", "VTM_LOG__FORMAT": "json",
           "VTM_TELEMETRY__EXPORTER": "none"}
    assert server.pid is not None
    return subprocess.Popen([sys.executable, "-c", code, how, str(server.pid)], cwd=REPO,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def log_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_the_process_exits_for_a_restart_after_a_start_up_that_lost_its_server(
        own_nats_server: EmbeddedNats, uniq: str, how: str) -> None:
    """``run_service`` ends the process with RESTART_EXIT after the one error line, without a
    traceback. Before: status 1 and ``nats: timeout``'s traceback."""
    proc = run_process(own_nats_server, uniq, how)
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if how == "freeze":
            resume(own_nats_server)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == RESTART_EXIT, out + err
    assert "Traceback" not in out + err
    errors = [x for x in log_lines(out + err) if x.get("level") in ("error", "critical")]
    assert [x["event"] for x in errors] == [LOST_EVENT], out + err


def test_a_rank_daemon_asks_for_a_restart_with_the_same_status() -> None:
    """A rank daemon exits with its own constant after a worker fault or a lost start-up of
    its host; a supervisor should read one status as "start me again"."""
    assert WORKER_FAULT_EXIT == RESTART_EXIT


def test_the_process_exits_0_after_a_stop_during_its_start_up(
        own_nats_server: EmbeddedNats, uniq: str) -> None:
    """Its server killed, the start-up waits in a JetStream step (of an hour's timeout); a
    SIGTERM ends it at once: exit status 0 as after a start-up, no error, no traceback."""
    proc = run_process(own_nats_server, uniq, "stop")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "waiting", proc.communicate(timeout=WAIT_S)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert "Traceback" not in out + err
    lines = log_lines(out + err)
    assert not [x for x in lines if x.get("level") in ("error", "critical")], out + err
    assert any(x.get("event") == "service stopped before it had started" for x in lines), out + err
