"""A rank host's start-up on a real nats-server: a stop during it ends it at once and cleanly,
a server lost during it ends the run with :class:`StartUpLost` (logged; the process exits
for a restart), and a stop while a new worker's seed runs waits for the seed, then closes
its backend, with nothing of it left running."""

from __future__ import annotations

import asyncio

import nats
import pytest
from frozen import freeze, resume
from nats.aio.client import Client
from rankd_host_support import Closing, record
from structlog.testing import capture_logs

from services.rankd import main as rankd_main
from services.rankd.host import RankdHost
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.service import StartUpLost, drain_or_close, epoch_kv
from shared.subjects import Subjects

WAIT_S = 30.0  # a liveness bound (a start-up waits up to a JetStream timeout), not a speed check






def settings(server: EmbeddedNats, uniq: str) -> RankdSettings:
    """The host's and its workers' settings: a JetStream step the lost server leaves
    unanswered times out after 1 s (``jetstream_timeout_s``; nats-py's default is 5 s)."""
    return RankdSettings(nats_url=server.url, subject_prefix=uniq, heartbeat_s=0.2,
                         drain_timeout_s=2, redirect_timeout_s=2, jetstream_timeout_s=1.0)


async def until(cond: object, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.02)


def host_tasks() -> list[str]:
    """The rank host's and its workers' tasks still running."""
    return sorted(t.get_name() for t in asyncio.all_tasks()
                  if not t.done() and t.get_name().startswith("rankd"))


@pytest.mark.parametrize("how", ["killed", "frozen"])
async def test_a_stop_during_the_start_up_ends_it_at_once(
    own_nats_server: EmbeddedNats, uniq: str, how: str
) -> None:
    """The server goes away while the host starts its first worker (as the worker's backend is
    built): ``killed``, the host waits for it to come back to start the worker again;
    ``frozen`` (SIGSTOP: it answers nothing), the worker's start waits for its JetStream
    set-up. A stop then ends the start-up at once: ``run`` returns (no error), the second
    worker is never built, every backend built is closed, the connection is closed and no task
    of the host or its workers is left. Before, the stop waited for the start-up: the worker's
    JetStream set-up timed out and ``run`` raised ``nats: timeout`` (exit status 1 with a
    traceback)."""
    built: list[Closing] = []

    def backend(wid: str, kind: object) -> Closing:
        if not built:  # the bus goes away during the start-up
            if how == "killed":
                own_nats_server.kill()
            else:
                freeze(own_nats_server)
        built.append(Closing(wid))
        return built[-1]

    host = RankdHost(settings(own_nats_server, uniq), range(0, 2), backend,
                     initial=["w-cp1-g0", "w-cp1-g1"])
    task = asyncio.create_task(host.run(handle_signals=False))
    try:
        with capture_logs() as logs:
            if how == "killed":
                # The first attempt failed (its backend closed): the host waits for the bus.
                await until(lambda: any(e["event"].startswith("worker did not start while the "
                                                              "bus was away") for e in logs),
                            "the host waits for the bus")
                assert built[0].closed
            else:
                # The worker's start is under way (registered; its set-up awaits the server).
                await until(lambda: "w-cp1-g0" in host.services, "the worker starts")
            host.request_stop()
            await asyncio.wait_for(task, timeout=WAIT_S)  # raises what the run raised
    finally:
        if how == "frozen":
            resume(own_nats_server)
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
    assert [b.wid for b in built] == ["w-cp1-g0"] and all(b.closed for b in built)
    assert host.services == {} and host._nc is not None and host._nc.is_closed
    assert host_tasks() == []
    assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
    assert any(e["event"] == "rank host stopped during its start-up" for e in logs), logs


async def test_a_server_lost_during_the_start_up_ends_the_run_with_start_up_lost(
    own_nats_server: EmbeddedNats, uniq: str
) -> None:
    """The server is lost before the host's first JetStream step answers (killed under the
    host's connection): the step times out and ``run`` raises :class:`StartUpLost` after an
    error log naming the lost server; no worker was built. Before, it raised nats-py's
    TimeoutError, and the process ended with status 1 and a traceback."""
    nc = await nats.connect(own_nats_server.url, max_reconnect_attempts=-1,
                            reconnect_time_wait=0.2)
    built: list[Closing] = []

    def backend(wid: str, kind: object) -> Closing:
        built.append(Closing(wid))
        return built[-1]

    host = RankdHost(settings(own_nats_server, uniq), range(0, 2), backend,
                     initial=["w-cp1-g0"])
    try:
        own_nats_server.kill()
        await until(lambda: nc.is_reconnecting, "the connection lost its server")
        with capture_logs() as logs, pytest.raises(StartUpLost, match="NATS server lost"):
            await asyncio.wait_for(host.run(nc, handle_signals=False), timeout=WAIT_S)
    finally:
        await drain_or_close(nc, 1.0)  # a reconnecting connection: closed, its loop ended
    assert built == [] and host.services == {}
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [e["event"] for e in errors] == [
        "rank host did not start: its NATS server was lost during the start-up; stopping "
        "what started and exiting for a restart"], logs
    assert host_tasks() == []


def test_main_exits_for_a_restart_after_a_start_up_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m services.rankd.main`` (and ``vertumnus rankd``) ends a start-up that lost
    its server with WORKER_FAULT_EXIT (EX_TEMPFAIL: start it again), not a traceback."""
    from vertumnus.live import rankd_sim

    def lost(settings: object, serve: object) -> None:
        raise StartUpLost("NATS server lost during the rank host's start-up")

    monkeypatch.setattr(rankd_main, "run_service", lost)
    for main in (rankd_main.main, rankd_sim.main):
        with pytest.raises(SystemExit) as exc:
            main([])
        assert exc.value.code == rankd_main.WORKER_FAULT_EXIT


class SlowInherit(Closing):
    """A backend whose ``inherit_prefixes`` (a torch backend's seed: its ranks switch and
    install pages on a thread) runs until the test releases it, and which notes whether it was
    closed before the seed ended."""

    def __init__(self, wid: str) -> None:
        super().__init__(wid)
        self.inheriting = asyncio.Event()
        self.release = asyncio.Event()
        self.inherited = False
        self.closed_while_inheriting = False

    async def inherit_prefixes(self, pairs: object, epoch: int) -> list[tuple[int, int | None]]:
        self.inheriting.set()
        await asyncio.shield(self.release.wait())  # a thread: a cancel does not stop it
        self.inherited = True
        return []

    async def close(self) -> None:
        if self.inheriting.is_set() and not self.inherited:
            self.closed_while_inheriting = True
        await super().close()


async def test_a_stop_while_a_new_worker_inherits_its_pages_waits_for_the_seed(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A split's child seeds its cache before its service starts (torch: ``inherit_prefixes``
    on a thread, which a cancel does not stop). A stop in the middle of it lets the seed end,
    then closes the child's backend and starts nothing: the host's run returns with no task
    left. Before, the cancel cut the seed short: the host returned with the child's page
    installs still running and its backend never closed."""
    s = Subjects(uniq)
    built: dict[str, SlowInherit] = {}

    def backend(wid: str, kind: object) -> SlowInherit:
        built[wid] = SlowInherit(wid)
        return built[wid]

    host = RankdHost(settings(nats_server, uniq), range(0, 2), backend,
                     initial=["w-cp2-g0"])
    task = asyncio.create_task(host.run(handle_signals=False))
    try:
        await until(lambda: "w-cp2-g0" in host.services
                    and host.services["w-cp2-g0"].started.is_set(), "the parent started")
        await until(lambda: "rankd-host-epochs" in host_tasks(), "the host follows records")
        epochs = await epoch_kv(nc.jetstream(), s)
        await epochs.put(s.epoch_key(), record(1, "w-cp1-g0", "w-cp1-g1"))
        await until(lambda: "w-cp1-g0" in built, "the child is built")
        child = built["w-cp1-g0"]
        await asyncio.wait_for(child.inheriting.wait(), timeout=WAIT_S)
        host.request_stop()
        follow = next(t for t in asyncio.all_tasks() if t.get_name() == "rankd-host-epochs")
        await until(lambda: follow.cancelling() > 0, "the stop cancelled the follower")
        assert not child.closed and not task.done()  # held: the seed has not ended
        child.release.set()
        await asyncio.wait_for(task, timeout=WAIT_S)
    finally:
        for b in built.values():
            b.release.set()
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
    assert child.inherited and child.closed and not child.closed_while_inheriting
    assert "w-cp1-g1" not in built  # nothing more was started
    assert host.services == {} and host_tasks() == []
    assert all(b.closed for b in built.values())
