"""``TorchPool`` start-up, with no rank process: an initial worker outside the pool's GPU range
is refused (naming it and the range) before the world is spawned, and the embedded decode role
of a single worker (``_PoolBackend``) counts as started only once it did start, so a failed
first start is retried by the next request instead of leaving every hand-off to time out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from services.rankd import torch_backend
from services.rankd.torch_backend import (
    TorchBackend,
    TorchPool,
    TorchSettings,
    _PoolBackend,
)
from shared.ids import InvalidInput
from shared.subjects import Subjects

# -- initial workers outside the GPU range --------------------------------------------------------


class _SpawnedWorld(Exception):
    pass


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Stub the world: record the spec it would be spawned with, spawn nothing."""
    specs: list[Any] = []

    class FakeWorld:
        def __init__(self, spec: Any) -> None:
            specs.append(spec)

        def start(self) -> FakeWorld:
            return self

    monkeypatch.setattr(torch_backend, "TorchWorld", FakeWorld)
    return specs


@pytest.mark.parametrize(("gpus", "worker", "where"), [
    (range(2, 4), "w-cp2-g0", "GPUs 2-3"),   # negative indices: a silently wrong world
    (range(4, 6), "w-cp2-g0", "GPUs 4-5"),   # IndexError before
    (range(1, 3), "w-cp2-g2", "GPUs 1-2"),   # straddles the range's end: IndexError
    (range(2, 6), "w-cp4-g0", "GPUs 2-5"),   # straddles its start: silently wrong
])
def test_an_initial_worker_outside_the_range_is_refused_before_spawning(
        spawned: list[Any], gpus: range, worker: str, where: str) -> None:
    with pytest.raises(InvalidInput, match=worker) as info:
        TorchPool.start(gpus, initial_workers=[worker], settings=TorchSettings(handoff="local"))
    assert where in str(info.value)
    assert spawned == []


def test_initial_workers_in_range_set_their_ranks_degrees(spawned: list[Any]) -> None:
    TorchPool.start(range(4, 8), initial_workers=["w-cp2-g6", "w-cp1-g4"],
                    settings=TorchSettings(handoff="nats"))
    (spec,) = spawned
    assert spec.initial_degrees == (1, 1, 2, 2) and spec.gpu_offset == 4


# -- the device (VTM_TORCH_DEVICE) of the ranks and the decode role ------------------------------


@pytest.mark.parametrize(("device", "gpus", "present", "needles"), [
    ("cuda", range(0, 1), 0, ["VTM_TORCH_DEVICE is cuda", "no CUDA device"]),
    ("cuda", range(2, 4), 2, ["VTM_TORCH_DEVICE is cuda", "GPUs 2-3", "device_count() is 2"]),
    ("tpu", range(0, 1), 0, ["VTM_TORCH_DEVICE must be 'cpu' or 'cuda'", "'tpu'"]),
    ("gpu", range(0, 2), 2, ["VTM_TORCH_DEVICE must be 'cpu' or 'cuda'", "'gpu'"]),
])
@pytest.mark.parametrize("handoff", ["nats", "local"])
def test_a_bad_device_is_refused_at_start_naming_the_setting(
        spawned: list[Any], cuda: list[int], monkeypatch: pytest.MonkeyPatch, device: str,
        gpus: range, present: int, needles: list[str], handoff: str) -> None:
    """Before, ``cuda`` on a machine without it started the world (whose ranks then failed in
    ``torch.cuda.set_device``) and the decode role's model on the CPU; an unknown value was
    refused without naming the variable."""
    built: list[Any] = []
    monkeypatch.setattr(torch_backend, "_decode_model", lambda *a: built.append(a))
    cuda[0] = present
    with pytest.raises(InvalidInput) as info:
        TorchPool.start(gpus, settings=TorchSettings(device=device, handoff=handoff))
    assert all(n in str(info.value) for n in needles), str(info.value)
    assert spawned == [] and built == []  # nothing spawned, no decode model built


@pytest.mark.parametrize(("device", "gpus", "present", "where"), [
    ("cuda", range(2, 4), 4, "cuda:2"),  # the range's first GPU (its global rank 0's)
    ("cuda", range(0, 1), 1, "cuda:0"),
    ("cpu", range(2, 4), 0, "cpu"),       # cpu needs no CUDA
])
def test_the_decode_model_goes_on_the_configured_device(
        spawned: list[Any], cuda: list[int], monkeypatch: pytest.MonkeyPatch, device: str,
        gpus: range, present: int, where: str) -> None:
    built: list[tuple[Any, ...]] = []
    monkeypatch.setattr(torch_backend, "_decode_model", lambda *a: built.append(a) or "model")
    cuda[0] = present
    local = TorchPool.start(gpus, settings=TorchSettings(device=device, handoff="local"))
    assert local.decode_device == where and spawned[-1].device == device
    assert [a[1:] for a in built] == [(where,)]  # the local hand-off's decode model
    assert isinstance(local.handoff, torch_backend.LocalKVHandoff)
    assert local.handoff.model == "model"
    nats = TorchPool.start(gpus, settings=TorchSettings(device=device, handoff="nats"))
    assert nats.decode_device == where  # where start_decode_role builds the role's model


def test_a_local_decode_model_that_cannot_be_built_leaves_no_world(
        spawned: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The local hand-off's model is built before the world is spawned: before, a model that
    failed to build (a bad path, a device out of memory) left the world's rank processes
    running with no pool to close them."""
    def fail(*_a: Any) -> Any:
        raise FileNotFoundError("no checkpoint at /nowhere")

    monkeypatch.setattr(torch_backend, "_decode_model", fail)
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        TorchPool.start(range(0, 2), settings=TorchSettings(handoff="local"))
    assert spawned == []


# -- the embedded decode role of a single worker ------------------------------------------------


class _FakeWorld:
    spec = SimpleNamespace(pages_per_rank=8, block_size=16)

    def members(self, first: int, degree: int) -> tuple[int, ...]:
        return tuple(range(degree))


def _pool_backend(starts: list[int], fail_first: int) -> _PoolBackend:
    async def start_decode_role() -> Any:
        starts.append(1)
        await asyncio.sleep(0)
        if len(starts) <= fail_first:
            raise OSError("nats: connection refused")
        return object()

    pool = SimpleNamespace(world=_FakeWorld(), handoff=None,
                           settings=TorchSettings(handoff="nats", embedded_decode=True),
                           start_decode_role=start_decode_role)
    return _PoolBackend(pool, "w-cp1-g0", torch_backend.WorkerKind.CP)  # type: ignore[arg-type]


@pytest.fixture
def prefilled(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    done: list[Any] = []

    async def prefill(self: TorchBackend, assignment: Any) -> Any:
        done.append(assignment)
        return "result"

    monkeypatch.setattr(TorchBackend, "prefill", prefill)
    return done


def test_a_failed_decode_role_start_is_retried_by_the_next_request(prefilled) -> None:
    starts: list[int] = []
    backend = _pool_backend(starts, fail_first=1)

    async def go() -> None:
        with pytest.raises(RuntimeError, match="decode role did not start.*connection refused"):
            await backend.prefill("a1")  # type: ignore[arg-type]
        assert prefilled == []  # no prefill whose hand-off nobody would answer
        assert await backend.prefill("a2") == "result"  # type: ignore[arg-type]
        assert await backend.prefill("a3") == "result"  # type: ignore[arg-type]

    asyncio.run(go())
    assert len(starts) == 2 and prefilled == ["a2", "a3"]


def test_concurrent_first_requests_start_one_role(prefilled) -> None:
    starts: list[int] = []
    backend = _pool_backend(starts, fail_first=0)

    async def go() -> list[Any]:
        return await asyncio.gather(*(backend.prefill(a) for a in ("a1", "a2")))  # type: ignore[arg-type]

    assert asyncio.run(go()) == ["result", "result"]
    assert len(starts) == 1


def test_start_decode_role_leaves_no_connection_behind_when_it_fails(monkeypatch) -> None:
    import shared.natsclient

    conns: list[Any] = []

    class FakeNc:
        def __init__(self) -> None:
            self.drained = False
            self.subs: list[str] = []

        async def drain(self) -> None:
            self.drained = True

        def new_inbox(self) -> str:
            return "_INBOX.x"

        async def subscribe(self, subject: str, **_k: Any) -> Any:
            self.subs.append(subject)
            return SimpleNamespace(unsubscribe=lambda: asyncio.sleep(0))

        async def flush(self) -> None:
            return None

    async def connect(**_k: Any) -> FakeNc:
        conns.append(FakeNc())
        return conns[-1]

    models = iter([RuntimeError("model load failed"), "model"])

    def decode_model(_ts: Any, device: str) -> Any:
        assert device == pool.decode_device == "cpu"
        m = next(models)
        if isinstance(m, Exception):
            raise m
        return m

    monkeypatch.setattr(shared.natsclient, "connect", connect)
    monkeypatch.setattr(torch_backend, "_decode_model", decode_model)
    pool = TorchPool(world=_FakeWorld(), subjects=Subjects(),  # type: ignore[arg-type]
                     settings=TorchSettings(handoff="nats"))

    async def go() -> None:
        with pytest.raises(RuntimeError, match="model load failed"):
            await pool.start_decode_role()
        assert pool._decode_nc is None and pool.decode_role is None
        assert conns[0].drained
        role = await pool.start_decode_role()
        assert pool.decode_role is role and pool._decode_nc is conns[1]

    asyncio.run(go())
    assert len(conns) == 2 and not conns[1].drained
