"""rankd's torch backend on a real gloo world of 2 rank processes, KV hand-off over a real
nats-server: first tokens equal the single-process model's greedy tokens before and after a
split (2 → 1 + 1) and a merge back, with the same rank processes throughout; bad input is a
clear typed error and every rank stays up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_live_support import assignment
from nats.aio.client import Client

from services.rankd.backend import ExecutionBackend
from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.errors import GroupError, SequenceTooLong, TokenOutOfVocab
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.torch_backend import (
    TINY_MODEL,
    KVDecodeRole,
    LocalKVHandoff,
    NatsKVHandoff,
    TorchBackend,
    request_token_ids,
)
from services.rankd.torch_world import TorchWorld, WorldSpec
from shared.ids import UnknownWorker
from shared.schemas import MAX_TOKENS, Assignment, IntakeRequest
from shared.subjects import Subjects

# The project's tiny random Qwen3 (TINY_MODEL), with a smaller vocabulary and context.
CFG = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": 512}
SEED = 7
B = 16  # engine block size = the requests' block size, so trace hashes and engine pages align


@pytest.fixture(scope="module")
def world() -> Iterator[TorchWorld]:
    spec = WorldSpec(
        world_size=2,
        degrees=(1, 2),
        initial_degrees=(2,),
        model_config=CFG,
        seed=SEED,
        block_size=B,
        pages_per_rank=64,
    )
    with TorchWorld(spec) as w:
        yield w


@pytest.fixture(scope="module")
def model() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.random(Qwen3Config.from_dict(CFG), seed=SEED)


def greedy(model: Qwen3ForCausalLM, ids: list[int]) -> tuple[int, int]:
    """(prefill token, first decode token) of the single-process reference."""
    first, second = model.greedy_generate(torch.tensor(ids), 2)
    return first, second


async def run_and_check(
    backend: TorchBackend, a: Assignment, model: Qwen3ForCausalLM, *, prefix: int | None = None
) -> None:
    ids = request_token_ids(a.request, backend.world.vocab_size)
    res = await backend.prefill(a)
    first, second = greedy(model, ids)
    out = backend.outcomes[a.request.request_id]
    assert res.token == first == out.token, a.request.request_id
    assert out.decode_token == second
    assert out.handoff is not None and out.handoff.chunks >= 1
    assert out.handoff.largest_chunk <= 512 * 1024
    assert res.prefill_s > 0 and res.finished_at_s >= res.started_at_s
    if prefix is not None:
        assert out.prefix_len == prefix, (a.request.request_id, out.prefix_len)


async def test_prefill_split_merge_same_processes(
    world: TorchWorld, model: Qwen3ForCausalLM, nc: Client, uniq: str
) -> None:
    subjects = Subjects(uniq)
    role = KVDecodeRole(model, subjects)
    await role.start(nc)
    handoff = NatsKVHandoff(nc, subjects, timeout_s=120)
    pids = world.pids
    assert len(set(pids)) == 2

    cp2 = TorchBackend(world, "w-cp2-g0", handoff=handoff)
    assert isinstance(cp2, ExecutionBackend)
    g = torch.Generator().manual_seed(1)
    real = torch.randint(0, CFG["vocab_size"], (45,), generator=g).tolist()
    await run_and_check(cp2, assignment("r1", "w-cp2-g0", epoch=0, tokens=real), model, prefix=0)
    # Synthesised ids (a trace request: length and hashes only); a second request sharing
    # the first two block hashes reuses 2 blocks of the engine's own cache.
    await run_and_check(
        cp2, assignment("r2", "w-cp2-g0", epoch=0, input_len=50, hashes=[11, 12]), model
    )
    await run_and_check(
        cp2, assignment("r3", "w-cp2-g0", epoch=0, input_len=61, hashes=[11, 12, 99]), model,
        prefix=2 * B
    )
    assert cp2.outcomes["r2"].synthesised_ids and not cp2.outcomes["r1"].synthesised_ids
    assert role.served == 3

    # Split 2 -> 1 + 1 at epoch 1: eager on the left worker, lazily (first step) on the right.
    left = TorchBackend(world, "w-cp1-g0", handoff=handoff)
    right = TorchBackend(world, "w-cp1-g1", handoff=handoff)
    reps = await left.adopt(1)
    assert [(r.old_worker, r.new_worker, r.epoch) for r in reps] == [("w-cp2-g0", "w-cp1-g0", 1)]
    await run_and_check(
        left, assignment("r4", "w-cp1-g0", epoch=1, input_len=40, hashes=[11, 12]), model, prefix=0
    )  # a new worker: its cache starts empty
    await run_and_check(
        right, assignment("r5", "w-cp1-g1", epoch=1, input_len=37, hashes=[21]), model
    )
    assert [r.new_worker for r in right.outcomes["r5"].switches] == ["w-cp1-g1"]
    assert [world.geometry(r) for r in (0, 1)] == [(1, 1), (1, 1)]
    assert right.outcomes["r5"].pids == (pids[1],) and left.outcomes["r4"].pids == (pids[0],)

    # A stale switch is refused before anything is sent; nothing changes.
    with pytest.raises(GroupError, match="not newer"):
        world.switch([0, 1], 1, 2)
    assert [world.geometry(r) for r in (0, 1)] == [(1, 1), (1, 1)]

    # Merge back at epoch 2 (lazily at the merged worker's first step): the retired CP2 cache
    # is revived on both ranks, so r6 reuses r2's two blocks.
    merged = TorchBackend(world, "w-cp2-g0", handoff=handoff)
    await run_and_check(
        merged,
        assignment("r6", "w-cp2-g0", epoch=2, input_len=70, hashes=[11, 12, 13]),
        model,
        prefix=2 * B,
    )
    sw = merged.outcomes["r6"].switches
    assert sorted((r.old_worker, r.new_worker) for r in sw) == [
        ("w-cp1-g0", "w-cp2-g0"),
        ("w-cp1-g1", "w-cp2-g0"),
    ]
    assert merged.outcomes["r6"].pids == pids
    assert world.pids == pids and all(world.alive())
    info = world.info()
    assert [(i.epoch, i.degree, i.worker, i.pid) for i in info] == [
        (2, 2, "w-cp2-g0", pids[0]),
        (2, 2, "w-cp2-g0", pids[1]),
    ]
    for b in (cp2, left, right, merged):
        for e, secs, reps in b.switches:
            print(
                f"switch epoch {e}: leader wall {secs * 1e3:.2f} ms, per rank "
                f"{[round(r.seconds * 1e3, 2) for r in reps]} ms"
            )
        await b.close()  # does not own the world: the processes stay
    assert all(world.alive())
    await role.stop()


async def test_bad_input_is_a_clear_error_and_ranks_stay_up(
    world: TorchWorld, model: Qwen3ForCausalLM
) -> None:
    pids = world.pids
    epoch = max(world.geometry(r)[0] for r in (0, 1)) + 1
    backend = TorchBackend(world, "w-cp2-g0", handoff=LocalKVHandoff(model))
    bad = [1, 2, 3, CFG["vocab_size"] + 5, 4]
    with pytest.raises(TokenOutOfVocab, match=r"token id 261 outside the vocabulary \[0, 256\)"):
        await backend.prefill(assignment("bad1", "w-cp2-g0", epoch=epoch, tokens=bad))
    with pytest.raises(UnknownWorker):
        await backend.prefill(assignment("bad2", "w-cp1-g1", epoch=epoch, tokens=[1, 2]))
    assert all(world.alive()) and world.broken is None
    ids = list(range(1, 30))
    res = await backend.prefill(assignment("good", "w-cp2-g0", epoch=epoch, tokens=ids))
    first, second = greedy(model, ids)
    assert res.token == first
    out = backend.outcomes["good"]
    assert out.decode_token == second and out.handoff is not None
    assert out.handoff.via == "in-process"
    assert world.pids == pids and all(world.alive())


async def test_a_prompt_longer_than_the_model_is_refused_before_ids_are_made(
    world: TorchWorld, model: Qwen3ForCausalLM
) -> None:
    """An assignment's input_len is bounded only by the schema (MAX_TOKENS, 2^24): one past the
    model's positions is refused by the leader before it synthesises (or ships) ids, so the
    largest valid length costs no memory or event-loop time, and every rank stays up."""
    epoch = max(world.geometry(r)[0] for r in (0, 1)) + 1
    backend = TorchBackend(world, "w-cp2-g0", handoff=LocalKVHandoff(model))
    assert world.max_positions == CFG["max_position_embeddings"]
    for n in (CFG["max_position_embeddings"] + 1, MAX_TOKENS):
        with pytest.raises(SequenceTooLong, match=f"prompt of {n} tokens exceeds"):
            await backend.prefill(assignment(f"long-{n}", "w-cp2-g0", epoch=epoch, input_len=n))
    assert all(world.alive()) and world.broken is None


async def test_with_a_handoff_a_prompt_leaves_a_position_for_its_first_decoded_token(
    world: TorchWorld, model: Qwen3ForCausalLM
) -> None:
    """The hand-off's decode step puts the first token at position P: a prompt filling every
    position of the model is refused before any step (before, it was prefilled and then
    failed in the decode), one token shorter is served with its decoded token, and the
    worker publishes that limit."""
    epoch = max(world.geometry(r)[0] for r in (0, 1)) + 1
    backend = TorchBackend(world, "w-cp2-g0", handoff=LocalKVHandoff(model))
    positions = CFG["max_position_embeddings"]
    assert backend.max_seq_len == positions - 1
    with pytest.raises(SequenceTooLong, match=f"prompt of {positions} tokens exceeds the "
                       f"model's {positions} positions \\(one kept for the hand-off"):
        await backend.prefill(assignment("full", "w-cp2-g0", epoch=epoch, tokens=[7] * positions))
    ids = [(3 * i) % 200 + 1 for i in range(positions - 1)]
    res = await backend.prefill(assignment("fits", "w-cp2-g0", epoch=epoch, tokens=ids))
    first, second = greedy(model, ids)
    assert res.token == first and backend.outcomes["fits"].decode_token == second
    assert all(world.alive()) and world.broken is None


def test_the_published_state_carries_the_models_positions(world: TorchWorld) -> None:
    """The worker's WorkerState says how long a prompt its engine serves (the model's
    max_position_embeddings), so the scheduler refuses or routes a longer one before placing
    it here; before the world started the limit is not known (None)."""
    from services.rankd.service import RankdService
    from services.rankd.settings import RankdSettings

    backend = TorchBackend(world, "w-cp2-g0")  # not bound or run: only its state is read
    assert backend.max_seq_len == CFG["max_position_embeddings"] == world.max_positions
    state = RankdService(RankdSettings(worker_id="w-cp2-g0"), backend).current_state()
    assert state.max_seq_len == CFG["max_position_embeddings"]
    unstarted = TorchWorld(WorldSpec(world_size=2, degrees=(1, 2), initial_degrees=(2,),
                                     model_config=CFG, block_size=B, pages_per_rank=64))
    assert TorchBackend(unstarted, "w-cp2-g0").max_seq_len is None


def test_synthesised_ids_follow_the_hash_chain() -> None:
    """Equal hash prefixes give equal token prefixes; tails depend on the request id; real
    ids pass through unchanged (out-of-vocabulary ones are the engine's to reject)."""

    def req(rid: str, n: int, hashes: list[int], tokens: list[int] | None = None) -> IntakeRequest:
        return IntakeRequest(
            request_id=rid,
            input_len=n,
            tokens=tokens,
            block_hashes=hashes,
            block_size=B,
            arrival_s=0.0,
        )

    a = request_token_ids(req("a", 40, [5, 6, -7]), 100)
    b = request_token_ids(req("b", 45, [5, 6, 8]), 100)
    assert len(a) == 40 and len(b) == 45 and all(0 <= t < 100 for t in a + b)
    assert a[: 2 * B] == b[: 2 * B] and a[2 * B :] != b[2 * B : 40]
    assert a == request_token_ids(req("a", 40, [5, 6, -7]), 100)  # deterministic
    assert request_token_ids(req("c", 3, [], [1, 2, 999]), 100) == [1, 2, 999]
