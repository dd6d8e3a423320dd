"""match() and Algorithm 1 (record_request), with values derived by hand from Eq. 2."""

from __future__ import annotations

import pytest

from services.cachemgr.events import Removed
from shared.costmodel import Coefficients, Profile
from shared.ids import InvalidInput, UnknownWorker


def test_match_path_and_held_prefixes(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 2, "c": 4})
    f.store("a", [1, 2, 3, 4])
    f.store("b", [1, 2])
    f.store("c", [1, 2, 3])
    f.store("c", [9], parent=3)
    m = t.match([1, 2, 3, 4, 5])
    assert m.path == (1, 2, 3, 4) and m.matched_blocks == 4
    assert dict(m.held_blocks) == {"a": 4, "b": 2, "c": 3}
    assert m.held("zz") == 0
    # The chain breaks where the request's next block is not a child of the previous one.
    assert t.match([1, 3]).path == (1,)
    assert t.match([2, 3]).path == ()
    assert t.match([]).path == () and t.match([]).held_blocks == {}


def test_match_counts_only_complete_valid_prefixes(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 2})
    f.store("a", [1, 2, 3])
    f.store("b", [1, 2, 3])
    t.apply(Removed("b", 2, (1,)))  # b keeps 2, 3 as orphans
    m = t.match([1, 2, 3])
    assert m.path == (1, 2, 3)  # the path exists regardless of holders
    assert dict(m.held_blocks) == {"a": 3}  # workers at 0 are omitted


def test_match_rejects_bad_input(make_trie) -> None:
    t, _ = make_trie({"a": 2})
    with pytest.raises(InvalidInput):
        t.match("abc")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        t.match(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        t.match([[1]])  # type: ignore[list-item]


# Eq. 2 with simple coefficients: Ê_C(R, P) = 1 + 0.5R + 0.25P + (2R + 0.01·(RP + R(R+1)/2)) / C
PROFILE = Profile(coefficients=Coefficients(d=1.0, a=0.5, b=0.25, c=2.0, alpha=0.01))


def test_hand_derived_missed_benefit(make_trie) -> None:
    # block size 4, L = 10, path of 3 nodes (prefix lengths 4, 8, 12 -> clamped to L-1 = 9).
    # At C = 2:  Ê(10,0) = 1+5+0+(20+0.55)/2   = 16.275
    #            Ê(6,4)  = 1+3+1+(12+0.45)/2   = 11.225
    #            Ê(2,8)  = 1+1+2+(4+0.19)/2    =  6.095
    #            Ê(1,9)  = 1+0.5+2.25+(2+0.1)/2 =  4.8
    # benefits: node0 16.275-11.225 = 5.05, node1 11.225-6.095 = 5.13, node2 6.095-4.8 = 1.295
    t, f = make_trie({"a": 4, "b": 4})
    f.store("a", [1, 2, 3])
    m = t.match([1, 2, 3])
    res = t.record_request(m, "b", 4, 0, 2, 10, PROFILE.predict)
    assert res.missed_nodes == 3 and res.accessed_nodes == 0
    assert t.missed(1, 2) == pytest.approx(5.05)
    assert t.missed(2, 2) == pytest.approx(5.13)
    assert t.missed(3, 2) == pytest.approx(1.295)
    assert res.missed_benefit == pytest.approx(5.05 + 5.13 + 1.295)
    assert all(t.missed(h, 4) == 0 for h in (1, 2, 3))
    assert all(t.access(h, 4) == 0 for h in (1, 2, 3))  # b reused nothing


def test_access_on_reused_path_and_no_missed_where_a_replica_exists(make_trie) -> None:
    t, f = make_trie({"a": 4, "b": 2})
    f.store("a", [1, 2, 3])
    f.store("b", [1])  # a degree-2 replica of node 1 only
    m = t.match([1, 2, 3])
    t.record_request(m, "a", 4, 2, 2, 10, PROFILE.predict)
    assert [t.access(h, 4) for h in (1, 2, 3)] == [1.0, 1.0, 0.0]  # ReusedPath = 2 nodes
    assert t.missed(1, 2) == 0.0  # ReplicaCount(1, 2) = 1
    assert t.missed(2, 2) == pytest.approx(5.13)
    assert t.missed(3, 2) == pytest.approx(1.295)


def test_full_hit_still_recomputes_last_token(make_trie) -> None:
    # L = 8 = two full blocks: node1 covers tokens 4..7 but P1 is capped at 7 (R = 1).
    t, f = make_trie({"a": 4})
    f.store("a", [1, 2])
    t.record_request(t.match([1, 2]), "a", 4, 2, 2, 8, PROFILE.predict)
    e = PROFILE.predict
    assert t.missed(2, 2) == pytest.approx(e(4, 4, 2) - e(1, 7, 2))
    # A node lying wholly past L-1 adds nothing (L = 4: node1 would start at P0 = 4 > 3).
    t2, f2 = make_trie({"a": 4})
    f2.store("a", [1, 2])
    t2.record_request(t2.match([1, 2]), "a", 4, 0, 2, 4, PROFILE.predict)
    assert t2.missed(2, 2) == 0.0
    assert t2.missed(1, 2) == pytest.approx(e(4, 0, 2) - e(1, 3, 2))


def test_record_request_validates_and_changes_nothing_on_error(make_trie) -> None:
    t, f = make_trie({"a": 4})
    f.store("a", [1, 2])
    m = t.match([1, 2])
    with pytest.raises(UnknownWorker):
        t.record_request(m, "zz", 4, 0, 2, 10, PROFILE.predict)
    with pytest.raises(InvalidInput):
        t.record_request(m, "a", 2, 0, 2, 10, PROFILE.predict)  # not a's degree
    with pytest.raises(InvalidInput):
        t.record_request(m, "a", 4, 3, 2, 10, PROFILE.predict)  # reused > matched
    with pytest.raises(InvalidInput):
        t.record_request(m, "a", 4, 0, 8, 10, PROFILE.predict)  # unsupported degree
    with pytest.raises(InvalidInput):
        t.record_request(m, "a", 4, 0, 2, 0, PROFILE.predict)

    def broken(r: int, p: int, c: int) -> float:
        raise ZeroDivisionError

    with pytest.raises(InvalidInput):
        t.record_request(m, "a", 4, 2, 2, 10, broken)
    assert all(t.access(h, 4) == 0 and t.missed(h, 2) == 0 for h in (1, 2))
