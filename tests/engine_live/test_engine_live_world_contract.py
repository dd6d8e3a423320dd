"""TorchWorld's contract on a real gloo world: a rank failure outside the input checks breaks
the world (WorldBroken); an id beyond int64 is bad input that leaves every rank usable; a CP
collective gives up after the world's collective timeout; a merge back works when a member
never adopted the split, and the leader's block mirror follows what the engine really holds
after a switch (kept, revived or fresh cache)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch

from services.rankd.blockcache import BlockCache
from services.rankd.engine.errors import TokenOutOfVocab
from services.rankd.torch_backend import TorchBackend
from services.rankd.torch_world import TorchWorld, WorldBroken, WorldSpec
from shared.blockhash import chain_hashes
from shared.ids import WorkerFault, WorkerId
from shared.schemas import Assignment, IntakeRequest

CFG = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
           max_position_embeddings=256)
B = 4


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def assignment(tokens: list[int], worker: str = "w-cp1-g0", degree: int = 1, *,
               checked: bool = True) -> Assignment:
    """``checked=False``: the request is built without the schema's checks (as a caller in
    the same process could hand it over), so ids the bus refuses reach the backend."""
    now = time.time()
    fields = dict(request_id="r1", input_len=len(tokens), tokens=tokens, block_size=B,
                  arrival_s=now)
    req = IntakeRequest(**fields) if checked else IntakeRequest.model_construct(**fields)
    return Assignment(request=req, worker_id=worker, epoch=0, degree=degree, prefix_tokens=0,
                      recompute_tokens=len(tokens), predicted_s=0.1, assigned_at_s=now)


def mirror_matches_engine(w: TorchWorld, ranks: list[int]) -> None:
    for worker, blocks in w.engine_blocks(ranks):
        assert w.cached_blocks(worker) == blocks, worker


@pytest.fixture(scope="module")
def single() -> Iterator[TorchWorld]:
    with TorchWorld(WorldSpec(world_size=1, degrees=(1,), model_config=CFG, block_size=B)) as w:
        yield w


def test_an_id_beyond_int64_is_token_out_of_vocab_on_the_ranks(single: TorchWorld) -> None:
    good = single.prefill([0], [1, 2, 3])[0].token
    for bad in (2**63, 2**63 - 1, 256):
        with pytest.raises(TokenOutOfVocab):
            single.prefill([0], [1, 2, bad])
    assert single.broken is None
    assert single.prefill([0], [1, 2, 3])[0].token == good  # every rank still serves


async def test_an_id_beyond_int64_is_refused_by_the_backend(single: TorchWorld) -> None:
    """The schema refuses a token id of 2^32 or more on the bus (``MAX_TOKEN_ID``); the
    backend still refuses one handed to it unchecked, and an id the schema takes that is
    beyond the vocabulary."""
    with pytest.raises(ValueError, match="4294967295"):
        assignment([1, 2, 2**63])
    be = TorchBackend(single, "w-cp1-g0")
    for bad in (assignment([1, 2, 2**63], checked=False), assignment([1, 2, 2**32 - 1])):
        with pytest.raises(TokenOutOfVocab):
            await be.prefill(bad)
    assert single.broken is None and be.health() is None
    expected = single.prefill([0], [1, 2, 3])[0].token
    assert (await be.prefill(assignment([1, 2, 3]))).token == expected


def test_a_rank_failure_outside_the_input_checks_breaks_the_world() -> None:
    with TorchWorld(WorldSpec(world_size=1, degrees=(1,), model_config=CFG,
                              block_size=B)) as w:
        # A malformed command: the rank's handler raises ValueError (not an input check),
        # which the rank answers ("fatal", traceback) -- the stand-in for any such failure.
        with pytest.raises(WorldBroken) as err:
            w._round([0], ("prefill",))
        assert isinstance(err.value, WorkerFault)
        assert "rank 0 failed: ValueError" in str(err.value)
        assert w.broken is not None and w.broken.startswith("rank 0 failed")
        with pytest.raises(WorldBroken):
            w.info()  # broken for good


def test_a_stopped_rank_ends_without_the_interpreters_teardown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank told to stop ends once it stopped in order, not after the interpreter's
    teardown of torch, which took seconds on a loaded machine while close() waited for it:
    ``vertumnus up``'s rank daemon then overran its stop deadline (exit status 70). Here the
    teardown is made to last a minute (an exit handler each rank's interpreter installs at
    its start, from a sitecustomize): close() waits 10 s for a rank and then kills it, so
    before, every rank ended killed; now each exits by itself, status 0."""
    # The spawn start method's resource tracker is a process of its own, started with the
    # first rank; started here first, it does not get the slow exit (it ends with pytest).
    resource_tracker.ensure_running()
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, time\natexit.register(time.sleep, 60)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    w = TorchWorld(WorldSpec(world_size=2, degrees=(1,), model_config=CFG, block_size=B))
    with w:
        assert w.prefill([0], [1, 2, 3])[0].token >= 0
    assert [p.exitcode for p in w._procs] == [0, 0]


def test_a_cp_collective_gives_up_after_the_collective_timeout() -> None:
    spec = WorldSpec(world_size=2, degrees=(1, 2), initial_degrees=(2,), model_config=CFG,
                     block_size=B, collective_timeout_s=20)
    # The reply timeout far above the collective timeout: whichever fires first names itself.
    with TorchWorld(spec, reply_timeout_s=280) as w:
        # Only rank 0 of w-cp2-g0 steps: its all-gather waits for rank 1, which never joins.
        with pytest.raises(WorldBroken) as err:
            w._round([0], ("prefill", ids(12, 1), False, {}, None, None))
        msg = str(err.value)
        assert "did not answer" not in msg  # not the leader's hang guard ...
        assert "rank 0 failed" in msg  # ... but the rank's collective failing by itself


def test_a_merge_where_one_member_never_split_serves_and_revives() -> None:
    spec = WorldSpec(world_size=2, degrees=(1, 2), initial_degrees=(2,), model_config=CFG,
                     block_size=B, pages_per_rank=16, collective_timeout_s=60)
    with TorchWorld(spec, reply_timeout_s=240) as w:
        doc = ids(12, 1)
        first = w.step([0, 1], 0, doc)[1][0].token
        w.step([0], 1, ids(9, 2))  # w-cp1-g0 switches rank 0; w-cp1-g1 never runs
        assert [w.geometry(r) for r in (0, 1)] == [(1, 1), (0, 2)]
        switched, replies, _ = w.step([0, 1], 2, doc)  # rank 1 is still w-cp2-g0
        assert [s.new_worker for s in switched] == ["w-cp2-g0", "w-cp2-g0"]
        assert replies[0].token == first
        assert replies[0].prefix_len > 0  # rank 0 revived its copy and rank 1 kept its own
        assert w.broken is None
        mirror_matches_engine(w, [0, 1])


def test_a_fresh_cache_after_a_merge_resets_the_leaders_mirror() -> None:
    spec = WorldSpec(world_size=2, degrees=(1, 2), initial_degrees=(2,), model_config=CFG,
                     block_size=B, pages_per_rank=4, collective_timeout_s=60)
    with TorchWorld(spec, reply_timeout_s=240) as w:
        doc = ids(25, 80)  # 6 full blocks: 3 pages per rank
        w.step([0, 1], 0, doc)
        assert len(w.cached_blocks("w-cp2-g0")) == 6
        w.step([0], 1, ids(17, 81))  # 4 pages: rank 0 reclaims its retired w-cp2-g0 cache
        w.step([1], 1, ids(5, 82))
        w.switch([0, 1], 2, 2)  # merge back: revival refused, a fresh cache on every member
        assert [b for _, b in w.engine_blocks([0, 1])] == [frozenset(), frozenset()]
        assert w.cached_blocks("w-cp2-g0") == frozenset()
        mirror_matches_engine(w, [0, 1])
        # What host-mode seeding then reports held is only what the engine holds.
        be = TorchBackend(w, "w-cp2-g0")
        be.bind_cache(BlockCache(WorkerId("w-cp2-g0"), 64))
        hs = chain_hashes(doc, B)
        seeded = be._inherit(list(zip(hs, [None, *hs[:-1]], strict=True)))
        for _, held in w.engine_blocks([0, 1]):
            assert {h for h, _ in seeded} == held & set(hs)


def test_a_merge_where_the_kept_cache_is_missing_elsewhere_starts_fresh_everywhere() -> None:
    spec = WorldSpec(world_size=2, degrees=(1, 2), initial_degrees=(2,), model_config=CFG,
                     block_size=B, pages_per_rank=4, collective_timeout_s=60)
    with TorchWorld(spec, reply_timeout_s=240) as w:
        doc = ids(25, 80)
        first = w.step([0, 1], 0, doc)[1][0].token
        w.step([0], 1, ids(17, 81))  # rank 0 reclaims its retired copy; rank 1 never splits
        switched, replies, _ = w.step([0, 1], 2, doc)
        assert len(switched) == 2
        # Rank 1 still had w-cp2-g0 active, rank 0 no longer: neither keeps it.
        assert replies[0].prefix_len == 0 and replies[0].token == first
        assert w.broken is None
        mirror_matches_engine(w, [0, 1])
