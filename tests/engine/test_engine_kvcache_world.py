"""A too-small prefix cache on a real degree-2 gloo worker (engine_cache_cases): the ranks
agree on every stored and evicted block even when their page needs differ and one of them
cannot get room, a rank gives up no page for a store that cannot happen, and reused prefixes
carry the right KV (single-process oracle, float64, relative error <= 1e-10)."""

from __future__ import annotations

from typing import Any

import pytest
from engine_cache_cases import shared_pool_world, tight_cache_world
from engine_dist import run_world

TOL = 1e-10


@pytest.fixture(scope="module")
def tight() -> list[dict[str, Any]]:
    return run_world(tight_cache_world, 2)


def test_ranks_agree_on_a_cache_too_small_for_the_chain(tight) -> None:
    r0, r1 = tight
    for key in (
        "first",
        "second",
        "protected_import",
        "blocks_after_protected",
        "again",
        "plain_import",
        "reuse",
        "blocks",
    ):
        assert r0[key] == r1[key], key
    doc = r0["hashes"]["doc"]
    assert r0["first"] == {"P": 0, "stored": doc[:4], "evicted": []}  # page 4: rank 0 full
    assert r0["second"]["P"] == 16 and r0["second"]["stored"] == []
    assert [r["pool"] for r in tight] == [2, 2]


def test_a_store_that_cannot_happen_evicts_nothing(tight) -> None:
    r0 = tight[0]
    doc = r0["hashes"]["doc"]
    assert r0["protected_import"] == {"stored": [], "evicted": []}
    assert r0["blocks_after_protected"] == sorted(doc[:4])
    assert r0["again"]["P"] == 16


def test_reused_prefixes_match_the_oracle(tight) -> None:
    for res in tight:
        for rec in res["records"]:
            for key in ("hidden", "logits", "kv", "cached"):
                assert rec[key] <= TOL, f"{rec['case']}: {key} {rec[key]:.3g}"
            assert rec["token_ok"] and rec["pages_here_ok"], rec
    assert tight[0]["plain_import"]["stored"] == tight[0]["hashes"]["other"]
    assert tight[0]["reuse"]["P"] == 8
    assert set(tight[0]["hashes"]["other"]) <= set(tight[0]["blocks"])


@pytest.fixture(scope="module")
def shared() -> list[dict[str, Any]]:
    return run_world(shared_pool_world, 2)


def test_every_cache_of_a_rank_lives_in_its_one_page_pool(shared) -> None:
    r0, r1 = shared
    for r in shared:
        assert r["before_split"] == {"pool": 3, "blocks": 6}
        assert r["retired_after_split"] == ["w-cp2-g0"]
        assert r["caches_share_the_pool"] and r["pool_capacity"] == 4
    assert r0["retired_before_merge"] == []  # reclaimed for the 4-page prompt
    assert r1["retired_before_merge"] == ["w-cp2-g0"]


def test_a_merge_back_revives_only_a_cache_every_member_still_has(shared) -> None:
    r0, r1 = shared
    assert r0["merged_blocks"] == r1["merged_blocks"] == []  # a new cache on both ranks
    assert r0["merged_P"] == r1["merged_P"] == 0
    assert r0["again_P"] == r1["again_P"] > 0
    for res in shared:
        for rec in res["records"]:
            for key in ("hidden", "logits", "kv", "cached"):
                assert rec[key] <= TOL, f"{rec['case']}: {key} {rec[key]:.3g}"
            assert rec["token_ok"] and rec["pages_here_ok"], rec
