"""The calibrated scan thresholds (sim/calibration.py, SCAN) mean what their docstring says.

Driven through Algorithm 1 (``record_request``) and Algorithm 2 (``scan``) on a small trie, with
the simulator's scan path (``lists=False``) and the full-list path agreeing:

* θ_intra: a prefix reused n times per scan settles at 2n (decay 0.5); more than 4 reuses per
  scan per replica earn a same-degree copy, 3 never do;
* θ_reclaim: a duplicate survives a couple of quiet scans after a single reuse, and goes once
  its degree has seen no reuse for about three scans;
* θ_inter (0.25 s): requests preferring a degree that lacks the node, each missing one
  block's worth (0.03 s) of Ê, earn a first replica there from the ninth in one scan on
  (9 × 0.03 = 0.27 s > 0.25 s); eight (0.24 s) or fewer do not.
"""

from __future__ import annotations

import pytest

from services.cachemgr.actions import Reclaim, Replicate
from services.cachemgr.trie import PrefixTrie
from shared.ids import WorkerId
from sim.calibration import SCAN

W = WorkerId
PATH = (11, 12, 13)  # a 3-block prefix (block size 4 in these tries)
L = 14  # request length: every block of PATH is a full block before the last token


def _per_block(r: int, p: int, c: int) -> float:
    """A model in which each cached block saves 0.03 s at every degree (calibration's scale)."""
    return 0.1 + 0.0075 * r + 0.0 * p + 0.0 * c


def _reuse(t: PrefixTrie, worker: str, degree: int, times: int) -> None:
    m = t.match(PATH)
    for _ in range(times):
        t.record_request(m, W(worker), degree, len(m.path), degree, L, _per_block)


@pytest.mark.parametrize("lists", [True, False])
def test_more_than_four_reuses_per_scan_earn_a_second_copy(make_trie, lists: bool) -> None:
    t, f = make_trie({"a": 4, "b": 4})
    f.store("a", list(PATH))
    actions = []
    for _ in range(4):  # 5 per scan: 5, 7.5, 8.75 -> over 8 on the third scan
        _reuse(t, "a", 4, 5)
        actions += [a for a in t.scan(SCAN, lists=lists).actions if isinstance(a, Replicate)]
    assert actions and actions[0].kind == "intra" and actions[0].dest == "b"


@pytest.mark.parametrize("lists", [True, False])
def test_three_reuses_per_scan_never_do(make_trie, lists: bool) -> None:
    t, f = make_trie({"a": 4, "b": 4})
    f.store("a", list(PATH))
    for _ in range(12):  # settles at 6 < 8
        _reuse(t, "a", 4, 3)
        res = t.scan(SCAN, lists=lists)
        assert not [a for a in res.actions if isinstance(a, Replicate)]


@pytest.mark.parametrize("lists", [True, False])
def test_a_duplicate_outlives_two_quiet_scans_after_a_reuse(make_trie, lists: bool) -> None:
    t, f = make_trie({"a": 4, "b": 4})
    f.store("a", list(PATH))
    f.store("b", list(PATH))
    _reuse(t, "a", 4, 2)  # access 2 at degree 4, r = 2
    reclaimed_at = None
    for k in range(6):
        res = t.scan(SCAN, lists=lists)
        if any(isinstance(a, Reclaim) for a in res.actions):
            reclaimed_at = k
            break
    # 2 -> 1 -> 0.5 -> 0.25 -> 0.125: below r·θ_reclaim = 0.5 only at the fourth scan.
    assert reclaimed_at == 3


@pytest.mark.parametrize("lists", [True, False])
def test_eight_missing_requests_are_not_inter_demand_but_nine_are(make_trie,
                                                                  lists: bool) -> None:
    # Each request misses 0.03 s of Ê at degree 2: 8 miss 0.24 s <= θ_inter = 0.25 s,
    # 9 miss 0.27 s > θ_inter.
    assert SCAN.theta_inter == 0.25
    for n, expect in ((1, False), (8, False), (9, True)):
        t, f = make_trie({"a": 4, "b": 2})
        f.store("a", list(PATH))
        m = t.match(PATH)
        for _ in range(n):  # prefers degree 2, where nobody holds PATH
            t.record_request(m, W("b"), 2, 0, 2, L, _per_block)
        res = t.scan(SCAN, lists=lists)
        inter = [a for a in res.actions if isinstance(a, Replicate) and a.kind == "inter"]
        assert bool(inter) is expect, (n, res.inter)
        if expect:
            assert [(a.dest, a.degree) for a in inter][:1] == [(W("b"), 2)]
