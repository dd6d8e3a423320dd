"""A handler's reply goes out through the same error mapping as the handler itself.

The reply used to be encoded and sent after the handler's ``try``: a reply whose body fits
the server's max_payload but not with its headers cost the service its connection for good
(the server's "Maximum Payload Violation"), an encode or respond error reached nats.micro's
own fallback (its ``repr`` sent in ``Nats-Service-Error``), and a request without a reply
subject ended in nats.micro's failed error answer (a "nats error" warning, or a traceback on
a plain client). Against a real nats-server whose max_payload is 1 KiB; bounds (``WAIT_S``)
are liveness bounds, never speed checks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.micro.request import Request
from pydantic import BaseModel
from service_support import service_running
from structlog.testing import capture_logs

from shared.ids import InvalidInput
from shared.natsserver import EmbeddedNats
from shared.service import Endpoint, MicroService, RemoteError, call, message_size
from shared.settings import ServiceSettings

WAIT_S = 15.0
LIMIT = 1024  # small_server's max_payload (conftest.py)
JSON_HEADERS = {"Content-Type": "application/json"}


class Text(BaseModel):
    s: str


class Opaque(BaseModel):
    value: Any  # an object() here cannot be encoded


class Replies(MicroService):
    """``model``: a Text of the requested JSON size; ``raw``: that many bytes; ``opaque``: a
    reply that does not encode; ``quiet``: answers ``ok``, or rejects a body ``no`` (400);
    each request is recorded in ``seen``."""

    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(settings, name="vtm-replies", version="0.1.0",
                         group=f"{settings.subject_prefix}.svc")
        self.seen: list[bytes] = []

    def endpoints(self) -> Sequence[Endpoint]:
        async def model(request: Request) -> Text:
            size = int(request.data)  # of the JSON body
            return Text(s="x" * (size - len(b'{"s":""}')))

        async def raw(request: Request) -> bytes:
            return b"x" * int(request.data)

        async def opaque(request: Request) -> Opaque:
            return Opaque(value=object())

        async def quiet(request: Request) -> bytes:
            self.seen.append(request.data)
            if request.data == b"no":
                raise InvalidInput("no is refused")
            return b"ok"

        return [Endpoint("model", model), Endpoint("raw", raw), Endpoint("opaque", opaque),
                Endpoint("quiet", quiet)]


@pytest.fixture
async def svc(small_server: EmbeddedNats, uniq: str) -> AsyncIterator[Replies]:
    service = Replies(ServiceSettings(nats_url=small_server.url, subject_prefix=uniq))
    async with service_running(service, timeout_s=WAIT_S):
        assert service.nc.max_payload == LIMIT
        yield service


@pytest.fixture
async def client(small_server: EmbeddedNats) -> AsyncIterator[Client]:
    nc = await nats.connect(small_server.url, connect_timeout=5)
    try:
        yield nc
    finally:
        await nc.close()


async def still_serves(svc: Replies, client: Client) -> None:
    assert not svc.nc.is_closed and svc.nc.is_connected
    answer = await client.request(f"{svc.subjects.prefix}.svc.raw", b"3", timeout=WAIT_S)
    assert answer.data == b"xxx"


async def test_a_reply_that_fits_alone_but_not_with_its_headers_is_answered_500(
        svc: Replies, client: Client) -> None:
    body = LIMIT - 5
    assert body <= LIMIT < message_size(b"x" * body, JSON_HEADERS)
    with pytest.raises(RemoteError) as err:
        await call(client, f"{svc.subjects.prefix}.svc.model", str(body).encode(), Text,
                   timeout_s=WAIT_S)
    assert (err.value.code, err.value.description) == (500, "reply too large")
    await still_serves(svc, client)  # the server did not close the service's connection
    # At the limit with its headers the reply goes out as before.
    fits = LIMIT - message_size(b"", JSON_HEADERS)
    got = await call(client, f"{svc.subjects.prefix}.svc.model", str(fits).encode(), Text,
                     timeout_s=WAIT_S)
    assert len(got.s) == fits - len(b'{"s":""}')


async def test_a_reply_over_max_payload_is_answered_500_without_internals(
        svc: Replies, client: Client) -> None:
    with pytest.raises(RemoteError) as err:
        await call(client, f"{svc.subjects.prefix}.svc.raw", str(LIMIT + 10).encode(), bytes,
                   timeout_s=WAIT_S)
    assert (err.value.code, err.value.description) == (500, "reply too large")
    await still_serves(svc, client)


async def test_a_reply_that_does_not_encode_goes_through_the_error_mapping(
        svc: Replies, client: Client) -> None:
    with capture_logs() as logs:
        with pytest.raises(RemoteError) as err:
            await call(client, f"{svc.subjects.prefix}.svc.opaque", b"", Opaque,
                       timeout_s=WAIT_S)
    # The module's 500: no exception repr sent (nats.micro's fallback sent one).
    assert (err.value.code, err.value.description) == (500, "internal error")
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["handler failed"]
    await still_serves(svc, client)


@pytest.mark.parametrize("body", [b"fine", b"no"])
async def test_a_request_without_a_reply_subject_is_handled_and_nothing_is_answered(
        svc: Replies, client: Client, body: bytes) -> None:
    subject = f"{svc.subjects.prefix}.svc.quiet"
    with capture_logs() as logs:
        await client.publish(subject, body)  # no reply subject
        # One subscription handles its requests one at a time: once the next is answered,
        # everything of the first -- nats.micro's error answer, its error callback -- is done.
        assert (await client.request(subject, b"after", timeout=WAIT_S)).data == b"ok"
    assert svc.seen == [body, b"after"]
    assert [e for e in logs if e["log_level"] in ("warning", "error", "critical")] == []
    if body == b"no":  # a rejection is still logged as the module's table says
        assert [e["event"] for e in logs] == ["request rejected"]
