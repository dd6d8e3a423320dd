"""``shared.service.message_size`` counts what the NATS server checks against its max_payload:
hand-worked, and at the limit against a real nats-server (at it: delivered; one byte over: the
server closes the connection, the failure the gateway's size check exists to avoid)."""

from __future__ import annotations

import asyncio

import nats

from shared.natsserver import EmbeddedNats
from shared.service import message_size

WAIT_S = 30.0  # liveness bound only
LIMIT = 1024  # small_server's max_payload (conftest.py)
HEADERS = {"Content-Type": "application/json", "Nats-Msg-Id": "req-7 "}


def test_the_headers_block_is_counted_as_nats_py_writes_it() -> None:
    assert message_size(b"abc") == 3
    assert message_size(b"abc", {}) == 3
    # "NATS/1.0\r\n" 10 + "Content-Type: application/json\r\n" 32 + "Nats-Msg-Id: req-7\r\n"
    # 20 (the value stripped) + "\r\n" 2 = 64
    assert message_size(b"abc", HEADERS) == 3 + 64



async def test_at_the_limit_a_message_passes_and_one_byte_over_the_server_cuts_it_off(
        small_server: EmbeddedNats) -> None:
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats.connect(small_server.url, allow_reconnect=False, error_cb=on_error)
    try:
        assert nc.max_payload == LIMIT
        sub = await nc.subscribe("size.check")
        fits = b"x" * (LIMIT - message_size(b"", HEADERS))
        assert message_size(fits, HEADERS) == LIMIT
        await nc.publish("size.check", fits, headers=HEADERS)
        got = await sub.next_msg(timeout=WAIT_S)
        assert got.data == fits and got.headers["Nats-Msg-Id"] == "req-7"
        # nats-py lets this through (its check counts the payload alone); the server does not.
        await nc.publish("size.check", fits + b"x", headers=HEADERS)
        async with asyncio.timeout(WAIT_S):
            while not nc.is_closed:
                await asyncio.sleep(0.02)
        # Why it closed, by whichever of three ways nats-py saw it: the server's -ERR 'Maximum
        # Payload Violation' (last_error only), the EOF after it (error_cb and last_error), or a
        # reset of the socket (last_error only). The error callback alone misses the first and
        # the third, so the client's last_error is the cause to check.
        cause = nc.last_error
        assert cause is not None
        assert ("maximum payload" in str(cause).lower()
                or isinstance(cause, (nats.errors.UnexpectedEOF, OSError))), cause
    finally:
        await nc.close()
