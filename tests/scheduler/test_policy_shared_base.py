"""The baselines' shared shell and helpers (services/scheduler/policies/base.py)."""

from __future__ import annotations

import random

import pytest

from services.scheduler.policies.base import BaselinePolicy, check_int_at_least, draw_tie
from services.scheduler.registry import make_policy, policy_names
from shared.ids import InvalidInput


def test_draw_tie_draws_only_on_a_tie() -> None:
    rng, ref = random.Random(7), random.Random(7)
    assert draw_tie(rng, [3]) == 3
    assert rng.random() == ref.random()  # a single candidate leaves the stream alone
    rng, ref = random.Random(7), random.Random(7)
    assert draw_tie(rng, [1, 2, 5]) == ref.choice([1, 2, 5])
    assert rng.random() == ref.random()


@pytest.mark.parametrize("bad", [True, 1.0, "3", -1, None])
def test_check_int_at_least_refuses_all_but_an_int_at_the_bound(bad: object) -> None:
    with pytest.raises(InvalidInput, match=r"^x must be an integer >= 0, got "):
        check_int_at_least("x", bad, 0)
    check_int_at_least("x", 0, 0)


def test_every_evaluate_baseline_names_itself_by_its_registry_name() -> None:
    shells = {n: make_policy(n) for n in policy_names()}
    baselines = {n for n, p in shells.items() if isinstance(p, BaselinePolicy)}
    assert baselines >= {"static", "vllm", "sglang", "dynamo", "llmd", "round_robin"}
    for n in baselines:
        assert shells[n].name == n
