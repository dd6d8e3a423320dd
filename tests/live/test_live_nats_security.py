"""Services on a NATS server that authenticates clients and encrypts connections: tokens,
users, nkeys, JWT credentials (operator mode) and mutual TLS, each against a real
``nats-server`` configured for it; the keys, JWTs and certificates are made per test
(``natssecurity_support``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import nkeys
import pytest
from nats.micro.request import Request
from natssecurity_support import make_pki, new_nkey, operator_mode, secured_server, tls_block
from pydantic import BaseModel, ConfigDict
from service_support import service_running
from structlog.testing import capture_logs

from services.rankd.backend import SimBackend
from services.rankd.host import RankdHost
from services.rankd.settings import RankdSettings
from services.rankd.torch_backend import NatsKVHandoff
from shared.natsauth import security_options
from shared.natsserver import EmbeddedNats
from shared.service import Endpoint, MicroService, call, request_model
from shared.settings import ServiceSettings
from shared.subjects import Subjects
from vertumnus.live.tap import connect_cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    return make_pki(tmp_path)


# -- a service to reach ------------------------------------------------------------------------


class Ask(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    text: str


class Echo(MicroService):
    """Answers ``<prefix>.echo.say`` with the text it was sent."""

    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(settings, name="vtm-echo", version="0.1.0",
                         group=f"{settings.subject_prefix}.echo")

    def endpoints(self) -> Sequence[Endpoint]:
        return [Endpoint("say", self._say)]

    async def _say(self, request: Request) -> Ask:
        return request_model(request, Ask)


async def _served_through(settings: ServiceSettings, prefix: str) -> str:
    """Run an Echo with ``settings`` and ask it something over a client connected with the
    same settings' options; returns the answer."""
    async with service_running(Echo(settings), timeout_s=15):
        nc = await nats.connect(settings.nats_servers, connect_timeout=5,
                                **security_options(settings))
        try:
            answer = await call(nc, f"{prefix}.echo.say", Ask(text="hello"), Ask, timeout_s=10)
        finally:
            await nc.drain()
    return answer.text


async def _refused(url: str, **options: Any) -> str:
    """The error a client connecting with ``options`` gets (it must get one)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    with pytest.raises((nats.errors.Error, OSError, TimeoutError)):
        nc = await asyncio.wait_for(nats.connect(url, connect_timeout=2, allow_reconnect=False,
                                                 error_cb=on_error, **options), timeout=5)
        await nc.close()
    return " ".join(errors)


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("way", ["token", "user", "nkey", "creds"])
async def test_a_service_reaches_a_server_that_authenticates_each_way(
        way: str, tmp_path: Path, uniq: str) -> None:
    settings: dict[str, Any] = {}
    if way == "token":
        args: tuple[str, ...] = ("--auth", "s3cret-token")
        settings["nats_token"] = "s3cret-token"
    elif way == "user":
        args = ("--user", "vtm", "--pass", "pw-123")
        settings.update(nats_user="vtm", nats_password="pw-123")
    elif way == "nkey":
        seed, user = new_nkey(nkeys.PREFIX_BYTE_USER)
        conf = tmp_path / "nkey.conf"
        public = user.public_key.decode()
        conf.write_text(f'authorization {{ users = [ {{ nkey: "{public}" }} ] }}\n')
        (tmp_path / "user.nk").write_text(seed + "\n")
        args = ("-c", str(conf))
        settings["nats_nkey_seed"] = tmp_path / "user.nk"
    else:
        conf, creds = operator_mode(tmp_path)
        args = ("-c", str(conf))
        settings["nats_creds"] = creds
    with EmbeddedNats(jetstream=False, extra_args=args) as srv:
        assert "Authorization Violation" in await _refused(srv.url)  # anonymous: no
        given = ServiceSettings(nats_url=srv.url, subject_prefix=uniq, **settings)
        assert await _served_through(given, uniq) == "hello"


async def test_mutual_tls_verifies_both_sides(pki: dict[str, Path], tmp_path: Path,
                                              uniq: str) -> None:
    conf = tmp_path / "tls.conf"
    conf.write_text(tls_block(pki))
    with EmbeddedNats(jetstream=False, extra_args=("-c", str(conf))) as srv:
        assert srv.url.startswith("tls://")
        # No CA: the client cannot trust the server. A CA but no certificate: the server
        # cannot trust the client.
        assert "CERTIFICATE_VERIFY_FAILED" in await _refused(srv.url)
        ca_only = security_options(ServiceSettings(nats_tls_ca=pki["ca"]))
        await _refused(srv.url, **ca_only)
        given = ServiceSettings(nats_url=srv.url, subject_prefix=uniq, nats_tls_ca=pki["ca"],
                                nats_tls_cert=pki["client_cert"], nats_tls_key=pki["client_key"])
        assert await _served_through(given, uniq) == "hello"
        # The certificate names 127.0.0.1 and localhost, nothing else.
        wrong_name = given.model_copy(update={"nats_tls_hostname": "nats.example.org"})
        assert "CERTIFICATE_VERIFY_FAILED" in await _refused(srv.url,
                                                             **security_options(wrong_name))


async def test_the_cli_and_the_kv_handoff_use_the_same_settings(
        tmp_path: Path, uniq: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with EmbeddedNats(jetstream=False, extra_args=("--auth", "cli-token")) as srv:
        monkeypatch.setenv("VTM_NATS_TOKEN", "wrong")
        with pytest.raises(OSError):
            await connect_cli(srv.url, "vtm-test", timeout_s=1.0)
        monkeypatch.setenv("VTM_NATS_TOKEN", "cli-token")
        nc = await connect_cli(srv.url, "vtm-test", timeout_s=5.0)
        assert nc.is_connected
        await nc.close()
        monkeypatch.setenv("VTM_NATS_USER", "also")
        with pytest.raises(OSError, match="more than one way to authenticate"):
            await connect_cli(srv.url, "vtm-test")
        # The torch backend's KV hand-off opens a connection of its own.
        handoff = NatsKVHandoff(None, Subjects(uniq), servers=[srv.url],
                                connect_options={"token": "cli-token"})
        kv_nc = await asyncio.wait_for(handoff._conn(), timeout=10)
        assert kv_nc.is_connected
        await kv_nc.close()


async def test_a_rank_host_connects_with_its_settings_and_stops_while_refused(
        uniq: str) -> None:
    with EmbeddedNats(extra_args=("--auth", "host-token")) as srv:
        for token, serves in (("wrong", False), ("host-token", True)):
            settings = RankdSettings(nats_url=srv.url, subject_prefix=uniq, nats_token=token,
                                     heartbeat_s=0.2, drain_timeout_s=5)
            host = RankdHost(settings, range(0, 2), lambda wid, kind: SimBackend(),
                             initial=["w-cp2-g0"])
            with capture_logs() as logs:
                task = asyncio.create_task(host.run(handle_signals=False))
                async with asyncio.timeout(60):  # a bound on a loaded machine, not a speed check
                    if serves:
                        while "w-cp2-g0" not in host.services:
                            assert not task.done()
                            await asyncio.sleep(0.05)
                    else:  # refused: it keeps trying (refused again) until told to stop
                        while sum(e["event"] == "nats refused the connection"
                                  for e in logs) < 2:
                            assert not task.done()
                            await asyncio.sleep(0.05)
                        assert not task.done() and host.services == {}
            host.request_stop()
            await asyncio.wait_for(task, timeout=30)
            assert host.services == {}


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[EmbeddedNats, dict[str, str]]]:
    """A JetStream server with mutual TLS whose only user is an nkey, and the environment a
    service process needs to reach it."""
    conf, env = secured_server(tmp_path)
    with EmbeddedNats(extra_args=("-c", str(conf))) as srv:
        yield srv, {**env, "VTM_NATS_URL": srv.url, "VTM_LOG__FORMAT": "json"}


def _start(module: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", module], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env})


async def _stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM and its exit status; a process that ignores it is killed (nothing leaks) and
    the test fails."""
    proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.to_thread(proc.wait, 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        await asyncio.to_thread(proc.wait, 30)
        raise AssertionError("the service did not stop on SIGTERM") from None


async def test_a_service_process_runs_on_a_secured_server_from_its_environment(
        secured: tuple[EmbeddedNats, dict[str, str]], tmp_path: Path, uniq: str) -> None:
    srv, env = secured
    env = {**env, "VTM_SUBJECT_PREFIX": uniq}
    proc = _start("services.cachemgr", env, tmp_path / "cachemgr.log")
    try:
        settings = ServiceSettings(**{k[4:].lower(): v for k, v in env.items()
                                      if k.startswith("VTM_NATS")})
        nc = await nats.connect(srv.url, **security_options(settings))
        try:
            deadline = time.monotonic() + 60
            while True:  # until the cache manager answers discovery (it made its buckets)
                try:
                    ping = json.loads((await nc.request("$SRV.PING.vtm-cachemgr", b"",
                                                        timeout=1)).data)
                    if ping["metadata"].get("prefix") == uniq:
                        break
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                    pass
                assert proc.poll() is None, (tmp_path / "cachemgr.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "cachemgr.log").read_text()
                await asyncio.sleep(0.2)
        finally:
            await nc.drain()
    finally:
        rc = await _stop(proc)
    log = (tmp_path / "cachemgr.log").read_text()
    assert rc == 0, log
    assert "nats refused" not in log and "Traceback" not in log


async def test_refused_credentials_are_an_error_naming_the_settings_and_the_service_waits(
        secured: tuple[EmbeddedNats, dict[str, str]], tmp_path: Path) -> None:
    _, env = secured
    seed, _ = new_nkey(nkeys.PREFIX_BYTE_USER)  # a user the server does not know
    (tmp_path / "stranger.nk").write_text(seed)
    log = tmp_path / "stranger.log"
    proc = _start("services.cachemgr", {**env, "VTM_NATS_NKEY_SEED": str(tmp_path / "stranger.nk"),
                                        "VTM_RECONNECT_WAIT_S": "0.2"}, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
            refused = [x for x in lines if x.get("event") == "nats refused the connection"]
            if len(refused) >= 2:  # it tried again
                break
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.2)
        assert refused[0]["level"] == "error"
        assert "VTM_NATS_NKEY_SEED" in refused[0]["hint"]
        assert proc.poll() is None  # still running, still trying
    finally:
        rc = await _stop(proc)
    # A stop while it waits for the server ends it cleanly (it did not hang in its start).
    assert rc == 0, log.read_text()
    assert "service stopped before it had started" in log.read_text()


@pytest.mark.parametrize(("env", "message"), [
    ({"VTM_NATS_TLS_CA": "{junk}"}, "cannot start: VTM_NATS_TLS_CA"),
    ({"VTM_NATS_TOKEN": "t", "VTM_NATS_USER": "u", "VTM_NATS_PASSWORD": "p"},
     "more than one way to authenticate to NATS"),
], ids=["junk-ca", "two-ways"])
def test_a_service_with_unusable_security_settings_exits_2_naming_them(
        env: dict[str, str], message: str, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    env = {k: v.format(junk=junk) for k, v in env.items()}
    proc = subprocess.run([sys.executable, "-m", "services.scheduler"], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "VTM_NATS_URL": "nats://127.0.0.1:9", **env})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
