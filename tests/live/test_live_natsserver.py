"""EmbeddedNats starts a real server with JetStream, reports its URLs, and stops cleanly."""

from __future__ import annotations

import json
import urllib.request

import nats
import pytest

from shared.natsserver import (
    EmbeddedNats,
    NatsServerNotFound,
    NatsServerStartError,
    find_nats_server,
)


def test_find_binary() -> None:
    assert find_nats_server().name == "nats-server"


def test_explicit_missing_binary_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(NatsServerNotFound, match="not an executable"):
        find_nats_server(tmp_path / "nope")


def test_a_server_behind_a_wrapper_of_another_name_starts(tmp_path, monkeypatch) -> None:
    """``VTM_NATS_SERVER_BIN`` naming a wrapper script (not called nats-server) that execs
    the server: the server names its ports file after its own executable, not the wrapper,
    and the start finds it. Before, it waited for ``<wrapper>_<pid>.ports`` until it timed
    out."""
    wrapper = tmp_path / "my-nats"
    wrapper.write_text(f'#!/bin/sh\nexec "{find_nats_server()}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("VTM_NATS_SERVER_BIN", str(wrapper))
    with EmbeddedNats(jetstream=False, startup_timeout_s=10) as srv:
        assert srv.running and srv.url.startswith("nats://127.0.0.1:")


def test_bad_arguments_rejected() -> None:
    with pytest.raises(ValueError):
        EmbeddedNats(port=70000)
    with pytest.raises(ValueError):
        EmbeddedNats(startup_timeout_s=0)


def test_sync_lifecycle_and_monitor() -> None:
    with EmbeddedNats() as srv:
        assert srv.running and srv.url.startswith("nats://127.0.0.1:")
        with urllib.request.urlopen(f"{srv.monitor_url}/varz", timeout=5) as r:
            varz = json.loads(r.read())
        assert varz["jetstream"]["config"]["store_dir"].startswith(str(srv.store_dir))
        store = srv.store_dir
    assert not srv.running
    assert not store.exists()
    with pytest.raises(RuntimeError):
        _ = srv.url
    srv.stop()  # idempotent


async def test_async_lifecycle_with_jetstream() -> None:
    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url)
        js = nc.jetstream()
        await js.add_stream(name="S", subjects=["s.>"])
        ack = await js.publish("s.x", b"1")
        assert ack.seq == 1
        await nc.close()
    assert not srv.running


def test_start_failure_reports_the_server_log() -> None:
    srv = EmbeddedNats(extra_args=("--no-such-flag",), startup_timeout_s=10)
    with pytest.raises(NatsServerStartError, match="exited"):
        srv.start()
    assert not srv.running


async def test_a_killed_server_leaves_its_given_store_for_the_next_one(tmp_path) -> None:
    """kill(): a crash (SIGKILL), not a stop; a server started again on the same port and
    store finds the stream the first one had."""
    store = tmp_path / "store"
    first = EmbeddedNats(store_dir=store).start()
    port = int(first.url.rsplit(":", 1)[1])
    nc = await nats.connect(first.url)
    await nc.jetstream().add_stream(name="KEEP", subjects=["keep.>"])
    await nc.jetstream().publish("keep.a", b"1")
    await nc.close()
    assert first.kill() == -9
    assert not first.running and first.kill() is None and store.is_dir()
    again = EmbeddedNats(port=port, store_dir=store).start()
    try:
        nc = await nats.connect(again.url)
        info = await nc.jetstream().stream_info("KEEP")
        assert info.state.messages == 1
        await nc.close()
    finally:
        again.stop()
