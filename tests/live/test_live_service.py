"""The micro-service base on a real server: endpoints, typed errors, discovery, shutdown."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

import pytest
from nats.aio.client import Client
from nats.micro.request import Request
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel, ConfigDict

from shared.ids import InvalidInput, UnknownWorker, VertumnusError
from shared.natsserver import EmbeddedNats
from shared.service import (
    Endpoint,
    MicroService,
    RemoteError,
    call,
    error_code,
    request_model,
)
from shared.settings import ServiceSettings
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
    task = asyncio.create_task(svc.run(handle_signals=False))
    await asyncio.wait_for(svc.started.wait(), timeout=10)
    yield svc
    svc.request_stop()
    await asyncio.wait_for(task, timeout=10)


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


async def test_discovery_ping_info_stats(toy: Toy, nc: Client, uniq: str) -> None:
    ping = json.loads((await nc.request("$SRV.PING.vtm-toy", b"", timeout=10)).data)
    assert ping["name"] == "vtm-toy" and ping["version"] == "1.2.3"
    assert ping["metadata"] == {"prefix": uniq, "epoch": "0"}
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
    assert add["num_requests"] >= 1 and add["num_errors"] >= 1


async def test_stop_cleans_up(nats_server: EmbeddedNats, nc: Client, uniq: str) -> None:
    svc = Toy(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq))
    task = asyncio.create_task(svc.run(handle_signals=False))
    await asyncio.wait_for(svc.started.wait(), timeout=10)
    svc.request_stop()
    await asyncio.wait_for(task, timeout=10)
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
