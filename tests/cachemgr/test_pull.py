"""The route-time pull (services/cachemgr/pull.py): a request's prefix copied to the worker it
was routed to from the worker holding the most of it."""

from __future__ import annotations

import pytest

from services.cachemgr.actions import Demote, Reclaim, Replicate
from services.cachemgr.events import Removed, Stored
from services.cachemgr.pull import PullConfig, demotion, pull_on_route
from services.cachemgr.trie import PrefixTrie
from shared.ids import InvalidInput, UnknownWorker

A, B, C, D = "w-cp2-g0", "w-cp2-g2", "w-cp4-g4", "w-cp4-g8"
ONE = PullConfig(min_blocks=1)
REQ = [1, 2, 3, 4, 5, 6]


def setup(cap: int = 100) -> PrefixTrie:
    t = PrefixTrie([2, 4], block_size=4)
    for w, d in ((A, 2), (B, 2), (C, 4), (D, 4)):
        t.add_worker(w, d, cap)
    t.apply(Stored(C, 1, None, (1, 2, 3, 4, 5)))  # C holds 5 of the request's 6 blocks
    t.apply(Stored(A, 1, None, (1, 2)))  # A holds 2
    return t


def test_the_part_the_worker_lacks_comes_from_the_longest_holder_in_flight() -> None:
    t = setup()
    m = t.match(REQ)
    acts = pull_on_route(t, m, A, ONE)
    # A has blocks 1-2: only 3-5 move, from C (the only holder of 5), at A's degree.
    assert acts == (Replicate(5, 2, C, A, (3, 4, 5), "route"),)
    assert t.inflight() == acts
    # Not visible before A's own Stored event; then held, and the copy is retired by it.
    assert t.match(REQ).held(A) == 2
    t.apply(Stored(A, 2, 2, (3, 4, 5)))
    assert t.match(REQ).held(A) == 5
    assert t.inflight() == ()


def test_nothing_when_the_worker_holds_the_longest_prefix_or_the_gap_is_small() -> None:
    t = setup()
    m = t.match(REQ)
    assert pull_on_route(t, m, C, ONE) == ()  # C holds the most already
    assert pull_on_route(t, m, A, PullConfig(min_blocks=4)) == ()  # lacks 3 < 4
    assert pull_on_route(t, m, B, PullConfig(min_blocks=5)) == (
        Replicate(5, 2, C, B, (1, 2, 3, 4, 5), "route"),)  # B lacks all 5
    t2 = PrefixTrie([2, 4], block_size=4)
    t2.add_worker(A, 2, 10)
    assert pull_on_route(t2, t2.match(REQ), A, ONE) == ()  # nobody holds any of it


def test_a_holder_of_the_destinations_degree_is_preferred_then_the_lowest_id() -> None:
    t = setup()
    t.apply(Stored(B, 1, None, (1, 2, 3, 4, 5)))
    t.apply(Stored(D, 1, None, (1, 2, 3, 4, 5)))
    m = t.match(REQ)
    # Holders of 5 blocks: B (CP2), C, D (CP4). A is CP2: B, whose pages map rank to rank.
    assert pull_on_route(t, m, A, ONE)[0].source == B
    # For a CP4 destination that holds nothing... make one: D drops its blocks.
    t.apply(Removed(D, 2, (1, 2, 3, 4, 5)))
    assert pull_on_route(t, t.match(REQ), D, ONE)[0].source == C


def test_a_holder_whose_copy_is_being_reclaimed_is_no_source() -> None:
    # B would be the source (the destination's degree), but the scan is reclaiming its copy of
    # the prefix: the copy comes from C, whose blocks stay; with C's being reclaimed too,
    # there is no pull (it would race the removal at its source).
    t = setup()
    t.apply(Stored(B, 1, None, (1, 2, 3, 4, 5)))
    t._begin(Reclaim(B, 5, (5, 4)))
    acts = pull_on_route(t, t.match(REQ), A, ONE)
    assert [a.source for a in acts] == [C]
    t2 = setup()
    t2.apply(Stored(B, 1, None, (1, 2, 3, 4, 5)))
    t2._begin(Reclaim(B, 5, (5,)))
    t2._begin(Reclaim(C, 5, (5, 4, 3)))
    assert pull_on_route(t2, t2.match(REQ), A, ONE) == ()
    # A reclaim of other blocks (a branch the request does not take) does not matter.
    t3 = setup()
    t3.apply(Stored(B, 1, None, (1, 2, 3, 4, 5)))
    t3.apply(Stored(B, 2, 2, (9,)))
    t3._begin(Reclaim(B, 9, (9,)))
    assert [a.source for a in pull_on_route(t3, t3.match(REQ), A, ONE)] == [B]


def test_no_second_copy_while_one_to_the_worker_is_in_flight() -> None:
    t = setup()
    first = pull_on_route(t, t.match(REQ), B, ONE)
    assert len(first) == 1
    # The next turn of the same session, routed to B again before the copy landed.
    assert pull_on_route(t, t.match(REQ), B, ONE) == ()
    # A copy that landed or failed no longer blocks one.
    assert t.replication_failed(first[0])
    assert pull_on_route(t, t.match(REQ), B, ONE) == first


def test_the_part_beyond_a_copy_in_flight_is_pulled_on_its_own() -> None:
    t = setup()
    # An earlier, shorter request of the line brought blocks 1-3 to B: still on their way.
    first = pull_on_route(t, t.match([1, 2, 3]), B, ONE)
    assert first == (Replicate(3, 2, C, B, (1, 2, 3), "route"),)
    # The longer request routed to B: no second copy of 1-3, but 4-5 come on their own
    # (they follow the first copy on B's links and complete the path).
    rest = pull_on_route(t, t.match(REQ), B, ONE)
    assert rest == (Replicate(5, 2, C, B, (4, 5), "route"),)
    assert set(t.inflight()) == {*first, *rest}
    # With both in flight, nothing more.
    assert pull_on_route(t, t.match(REQ), B, ONE) == ()
    # Both retired by B's Stored events as they land.
    t.apply(Stored(B, 1, None, (1, 2, 3)))
    t.apply(Stored(B, 2, 3, (4, 5)))
    assert t.inflight() == () and t.match(REQ).held(B) == 5


def test_min_blocks_gates_the_whole_gap_not_the_rest_beyond_a_copy_in_flight() -> None:
    t = setup()
    three = PullConfig(min_blocks=3)
    first = pull_on_route(t, t.match([1, 2, 3]), B, three)  # B lacks 3 >= 3: pulled
    assert first == (Replicate(3, 2, C, B, (1, 2, 3), "route"),)
    # B lacks 5 >= 3 of the longer request; the 2 blocks beyond the copy still come.
    assert pull_on_route(t, t.match(REQ), B, three) == (
        Replicate(5, 2, C, B, (4, 5), "route"),)
    # A lacks only 3-5 of it, and 4 blocks are the least worth a copy there: nothing.
    assert pull_on_route(t, t.match(REQ), A, PullConfig(min_blocks=4)) == ()


def test_a_copy_in_flight_behind_a_gap_still_blocks_the_pull() -> None:
    t = setup()
    to_a = pull_on_route(t, t.match(REQ), A, ONE)
    assert to_a == (Replicate(5, 2, C, A, (3, 4, 5), "route"),)
    # A loses 1-2 while 3-5 are on their way: the blocks it lacks begin before the copy, so
    # a pull of 1-2 alone would not make a path with it, and one of 1-5 would copy 3-5 twice.
    t.apply(Removed(A, 2, (2, 1)))
    assert t.match(REQ).held(A) == 0
    assert pull_on_route(t, t.match(REQ), A, ONE) == ()


def test_a_prefix_longer_than_the_destination_can_hold_is_not_pulled() -> None:
    t = setup()
    t.add_worker("w-cp2-g12", 2, 4)  # room for 4 blocks, the prefix is 5
    assert pull_on_route(t, t.match(REQ), "w-cp2-g12", ONE) == ()


def test_a_stale_destination_is_not_pulled_to() -> None:
    t = setup()
    t.apply(Stored(B, 5, None, (9,)))  # event 5 after none: a gap, B goes stale
    assert pull_on_route(t, t.match(REQ), B, ONE) == ()


MOVE = PullConfig(min_blocks=1, demote_source=True)


def test_a_landed_pull_demotes_the_copied_blocks_at_its_source() -> None:
    t = setup()
    (act,) = pull_on_route(t, t.match(REQ), A, MOVE)
    t.apply(Stored(A, 2, 2, (3, 4, 5)))  # landed
    # 3-4-5 is one line of requests (no block of it has two children): all of it goes first.
    assert demotion(act, MOVE, t) == Demote(C, (3, 4, 5))
    assert Demote(C, (3, 4, 5)).to_wire() == {"type": "demote", "worker": C,
                                              "blocks": [3, 4, 5]}
    assert demotion(act, ONE, t) is None  # a copy unless asked (the calibrated PULL asks)
    assert not PullConfig(min_blocks=2).demote_source
    # Only a pull moves a prefix: the scan's replicas and reconcile copies are wanted in both
    # places (or their source is retired).
    for kind in ("inter", "intra", "reconcile"):
        assert demotion(Replicate(5, 2, C, A, (3, 4, 5), kind), MOVE, t) is None  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        demotion(act.to_wire(), MOVE, t)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        demotion(act, {"min_blocks": 1}, t)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        demotion(act, MOVE, {})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        PullConfig(min_blocks=1, demote_source=1)  # type: ignore[arg-type]


def test_shared_blocks_of_a_pull_are_not_demoted() -> None:
    """A block with two continuations cached somewhere (a tool description, a system prompt,
    a document with several questions) is as likely to be reused at the source as at the
    destination: it and its ancestors stay; only the private tail below it is demoted."""
    t = setup()
    t.apply(Stored(D, 1, None, (1, 2, 3, 9)))  # block 3 now has two children: 4 and 9
    (act,) = pull_on_route(t, t.match(REQ), A, MOVE)
    assert act.blocks == (3, 4, 5)
    assert demotion(act, MOVE, t) == Demote(C, (4, 5))
    t.apply(Stored(B, 1, None, (1, 2, 3, 4, 8)))  # and 4 too: only 5 is private
    assert demotion(act, MOVE, t) == Demote(C, (5,))
    t.apply(Stored(B, 2, 4, (5, 7)))  # and 5 too, with children 7 and 6: nothing is private
    t.apply(Stored(C, 2, 5, (6,)))
    assert demotion(act, MOVE, t) is None


def test_a_copy_whose_last_block_goes_on_elsewhere_is_not_demoted() -> None:
    """The source holds a longer history than the request shares (3-4-5 and then 6): the
    copy's last block 5 goes on at the source, so the whole copy lies on the source's own
    line of requests and nothing is demoted. A child only at the destination (the request
    finished there before the copy landed) does not count: the copy is still private."""
    t = setup()
    (act,) = pull_on_route(t, t.match(REQ), A, MOVE)
    assert act.blocks == (3, 4, 5)
    t.apply(Stored(A, 2, 2, (3, 4, 5, 8)))  # landed, and the request's own block 8 at A
    assert demotion(act, MOVE, t) == Demote(C, (3, 4, 5))
    t = setup()
    (act,) = pull_on_route(t, t.match(REQ), A, MOVE)
    t.apply(Stored(C, 2, 5, (6,)))  # C, the source, goes on past 5 (5's only child)
    t.apply(Stored(A, 2, 2, (3, 4, 5)))  # landed
    assert demotion(act, MOVE, t) is None
    t = setup()
    (act,) = pull_on_route(t, t.match(REQ), A, MOVE)
    t.apply(Stored(D, 1, None, (1, 2, 3, 4, 5, 7)))  # or another worker does
    assert demotion(act, MOVE, t) is None


def test_only_the_blocks_the_destination_took_are_demoted() -> None:
    """A destination short of room takes the leading part of the copy: the rest stays recent
    at the source, whose copy is the only one. The branch point is still sought in the whole
    copy: a shared block the destination did not take keeps its ancestors off the list."""
    t = setup()
    (act,) = pull_on_route(t, t.match(REQ), A, MOVE)
    assert act.blocks == (3, 4, 5)
    assert demotion(act, MOVE, t, landed=3) == demotion(act, MOVE, t) == Demote(C, (3, 4, 5))
    assert demotion(act, MOVE, t, landed=2) == Demote(C, (3, 4))
    assert demotion(act, MOVE, t, landed=0) is None
    t.apply(Stored(D, 1, None, (1, 2, 3, 4, 9)))  # block 4 now has two children: 5 and 9
    assert demotion(act, MOVE, t) == Demote(C, (5,))
    assert demotion(act, MOVE, t, landed=2) is None  # 3 and 4 are shared: nothing of it
    for bad in (-1, 4, 1.0, True, "2"):
        with pytest.raises(InvalidInput, match="landed"):
            demotion(act, MOVE, t, landed=bad)  # type: ignore[arg-type]


def test_bad_input_is_refused() -> None:
    t = setup()
    with pytest.raises(UnknownWorker):
        pull_on_route(t, t.match(REQ), "w-cp2-g30", ONE)
    with pytest.raises(InvalidInput):
        pull_on_route(t, t.match(REQ), A, {"min_blocks": 1})  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidInput):
            PullConfig(min_blocks=bad)  # type: ignore[arg-type]
