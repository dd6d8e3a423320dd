"""``vertumnus tap`` prints messages decoded by Content-Type (real server, real CLI process);
the decoder itself on JSON, msgpack, text and binary payloads."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess

import msgpack
import nats
from live_up_support import REPO, cli

from shared.natsserver import EmbeddedNats
from shared.schemas import CONTENT_TYPE, JSON, MSGPACK
from vertumnus.live.tap import render_payload


async def test_tap_prints_a_published_json_message_decoded(nats_server: EmbeddedNats) -> None:
    proc = subprocess.Popen(
        cli("tap", "tapt.>", "--nats", nats_server.url, "--count", "1", "--timeout", "60"),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    nc = await nats.connect(nats_server.url)
    try:
        payload = json.dumps({"worker_id": "w-cp2-g0", "queue_len": 3}).encode()
        # The tap subscribes some time after it starts: publish until it has printed one.
        for _ in range(600):
            if proc.poll() is not None:
                break
            await nc.publish("tapt.worker.state", payload, headers={CONTENT_TYPE: JSON})
            await asyncio.sleep(0.1)
    finally:
        await nc.drain()
        if proc.poll() is None:
            proc.kill()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "tapt.worker.state" in out and "(json," in out
    assert '"worker_id": "w-cp2-g0"' in out  # pretty-printed (indented), not the raw bytes
    assert '  "queue_len": 3' in out.replace("    ", "  ")


def test_render_json_msgpack_text_binary() -> None:
    kind, text = render_payload(b'{"a":1,"b":[1,2]}', {CONTENT_TYPE: JSON})
    assert kind == "json" and json.loads(text) == {"a": 1, "b": [1, 2]} and "\n" in text

    packed = msgpack.packb({"request_id": "r1", "data": b"\x00\x01" * 40}, use_bin_type=True)
    kind, text = render_payload(packed, {CONTENT_TYPE: MSGPACK})
    assert kind == "msgpack"
    obj = json.loads(text)
    assert obj["request_id"] == "r1" and obj["data"].startswith("<80 bytes: 00 01")

    assert render_payload(b"hello", None) == ("text", "hello")
    kind, text = render_payload(b"\xff\xfe\x00garbage", None)
    assert kind == "binary" and text.startswith("<10 bytes: ff fe 00")
    kind, text = render_payload(b"\xc1", {CONTENT_TYPE: MSGPACK})  # 0xc1: never used
    assert kind == "binary" and "undecodable msgpack" in text
    assert render_payload(b"", {CONTENT_TYPE: JSON}) == ("empty", "")


async def test_an_unreachable_server_is_one_clear_error() -> None:
    """nats-py would retry an unreachable server for minutes with a traceback each time; the
    tools say at once that they cannot reach it (OSError, the CLI's "cannot reach NATS")."""
    import socket

    import pytest

    from vertumnus.live.tap import tap

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(OSError, match="no server answered|Connect|refused|NoServers"):
        await tap(f"nats://127.0.0.1:{port}", "x.>", timeout_s=1, connect_timeout_s=0.5)


def test_the_cli_names_the_unreachable_server() -> None:
    proc = subprocess.run(cli("tap", "x.>", "--nats", "nats://127.0.0.1:9", "--timeout", "1"),
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "cannot reach NATS at nats://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_a_reader_that_goes_away_ends_the_tap_quietly(nats_server: EmbeddedNats) -> None:
    """``tap | head -1``: once nobody reads its output, tap stops (exit 0, nothing on
    stderr). Before, the broken pipe was reported as "cannot reach NATS" (status 1), or --
    with the reader gone after the first line -- tap went on for ever printing one
    BrokenPipeError per message on stderr."""
    proc = subprocess.Popen(
        cli("tap", "tapq.>", "--nats", nats_server.url, "--timeout", "120"),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # "# listening on ...": subscribed
    proc.stdout.close()  # the reader goes away
    nc = await nats.connect(nats_server.url)
    try:
        for _ in range(600):
            if proc.poll() is not None:
                break
            await nc.publish("tapq.x", b'{"a": 1}', headers={CONTENT_TYPE: JSON})
            await asyncio.sleep(0.1)
    finally:
        await nc.drain()
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    proc.wait(timeout=30)
    assert first.startswith("# listening on")
    assert proc.returncode == 0, err
    assert "cannot reach" not in err and "BrokenPipe" not in err and "Traceback" not in err


def test_the_unreachable_server_is_named_without_its_password() -> None:
    """A password in --nats is shown as *** when the server cannot be reached, by tap as by
    status (before, both printed the URL as typed)."""
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"nats://vtm:s3cret-pw@127.0.0.1:{port}"
    for args, code in ((["tap", "x.>", "--nats", url, "--timeout", "1"], 1),
                       (["status", "--nats", url, "--timeout", "0.3"], 2)):
        proc = subprocess.run(cli(*args), cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == code, proc.stderr
        assert f"cannot reach NATS at nats://***@127.0.0.1:{port}" in proc.stderr
        assert "s3cret" not in proc.stderr + proc.stdout
