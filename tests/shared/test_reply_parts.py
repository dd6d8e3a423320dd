"""``respond_in_parts`` / ``request_in_parts``: a reply larger than the server's max_payload
goes out in ordered parts and comes back whole, against a real nats-server whose max_payload
is 1 KiB (a worker's cache snapshot of tens of thousands of blocks is over the default 1 MiB).
Plain replies pass through unchanged; errors, missing responders and bad parts are raised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request

import shared.natsclient as natsclient
from shared.natsserver import EmbeddedNats
from shared.schemas import SchemaError
from shared.service import (
    MAX_REPLY_PARTS,
    PART_HEADER,
    RemoteError,
    message_size,
    request_in_parts,
    respond_in_parts,
)

WAIT_S = 30.0  # liveness bound only
LIMIT = 1024  # small_server's max_payload (conftest.py)
SUBJECT = "parts.check"
JSON_HEADERS = {"Content-Type": "application/json"}



@pytest.fixture
async def client(small_server: EmbeddedNats) -> AsyncIterator[Client]:
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await natsclient.connect(small_server.url, allow_reconnect=False, error_cb=on_error)
    assert nc.max_payload == LIMIT
    try:
        yield nc
        # No message of the exchange was over the limit: the server would have cut us off.
        assert not errors and not nc.is_closed
    finally:
        await nc.close()


async def responder(nc: Client, answer: Callable[[Msg], Awaitable[None]]) -> None:
    await nc.subscribe(SUBJECT, cb=answer)
    await nc.flush()


async def test_a_reply_over_max_payload_comes_back_whole_in_order(client: Client) -> None:
    data = bytes(i % 251 for i in range(10 * LIMIT + 17))
    sent: list[int] = []

    async def answer(msg: Msg) -> None:
        sent.append(await respond_in_parts(client, Request(msg), data, JSON_HEADERS))

    await responder(client, answer)
    got, headers = await request_in_parts(client, SUBJECT, b"{}", timeout_s=WAIT_S)
    assert got == data
    assert headers == JSON_HEADERS  # the first part's headers, without the part header
    assert sent[0] > 10  # every part fitted under 1 KiB with its headers


async def test_each_part_fits_and_carries_its_number(client: Client) -> None:
    data = b"y" * (3 * LIMIT)

    async def answer(msg: Msg) -> None:
        await respond_in_parts(client, Request(msg), data, JSON_HEADERS)

    await responder(client, answer)
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    await client.publish(SUBJECT, b"", reply=inbox)
    first = await sub.next_msg(timeout=WAIT_S)
    n = int(first.headers[PART_HEADER].split("/")[1])
    parts = [first] + [await sub.next_msg(timeout=WAIT_S) for _ in range(n - 1)]
    assert [p.headers[PART_HEADER] for p in parts] == [f"{i}/{n}" for i in range(1, n + 1)]
    assert first.headers["Content-Type"] == "application/json"
    assert all(message_size(p.data, p.headers) <= LIMIT for p in parts)
    assert b"".join(p.data for p in parts) == data


async def test_a_reply_that_fits_is_one_plain_message(client: Client) -> None:
    async def answer(msg: Msg) -> None:
        assert await respond_in_parts(client, Request(msg), b'{"a": 1}', JSON_HEADERS) == 1

    await responder(client, answer)
    plain = await client.request(SUBJECT, b"", timeout=WAIT_S)
    assert plain.data == b'{"a": 1}' and PART_HEADER not in plain.headers
    assert await request_in_parts(client, SUBJECT, b"", timeout_s=WAIT_S) == (
        b'{"a": 1}', JSON_HEADERS)


async def test_a_plain_responder_is_read_as_one_part(client: Client) -> None:
    async def answer(msg: Msg) -> None:
        await msg.respond(b"plain")

    await responder(client, answer)
    assert await request_in_parts(client, SUBJECT, b"", timeout_s=WAIT_S) == (b"plain", {})


async def test_no_responder_and_a_micro_error_are_raised(client: Client) -> None:
    with pytest.raises(nats.errors.NoRespondersError):
        await request_in_parts(client, "parts.nobody", b"", timeout_s=WAIT_S)

    async def answer(msg: Msg) -> None:
        await client.publish(msg.reply, b"",
                             headers={ERROR_HEADER: "bad request", ERROR_CODE_HEADER: "400"})

    await responder(client, answer)
    with pytest.raises(RemoteError) as err:
        await request_in_parts(client, SUBJECT, b"", timeout_s=WAIT_S)
    assert err.value.code == 400


@pytest.mark.parametrize("headers", [
    [{PART_HEADER: "2/2"}],  # starts in the middle
    [{PART_HEADER: "1/3"}, {PART_HEADER: "3/3"}],  # skips one
    [{PART_HEADER: "1/2"}, {PART_HEADER: "2/3"}],  # changes its count
    [{PART_HEADER: "x/2"}],
    [{PART_HEADER: "0/2"}],
    [{PART_HEADER: f"1/{MAX_REPLY_PARTS + 1}"}],  # more parts than are taken
])
async def test_parts_out_of_order_or_badly_numbered_are_refused(
        client: Client, headers: list[dict[str, str]]) -> None:
    async def answer(msg: Msg) -> None:
        for h in headers:
            await client.publish(msg.reply, b"z", headers=h)

    await responder(client, answer)
    with pytest.raises(SchemaError):
        await request_in_parts(client, SUBJECT, b"", timeout_s=WAIT_S)


async def test_a_missing_last_part_times_out(client: Client) -> None:
    async def answer(msg: Msg) -> None:
        await client.publish(msg.reply, b"z", headers={PART_HEADER: "1/2"})

    await responder(client, answer)
    with pytest.raises(nats.errors.TimeoutError):
        await request_in_parts(client, SUBJECT, b"", timeout_s=0.5)
    # The inbox is gone once the exchange ends: nothing is left subscribed.
    await asyncio.sleep(0)
    assert len(client._subs) == 1  # the responder's
