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

    def decode_model(_ts: Any) -> Any:
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
