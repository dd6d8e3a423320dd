"""The trie's holder bookkeeping (with its inlined fast paths) against the definition.

Random ``Stored`` / ``Removed`` event scripts for three workers over a fixed forest of block
hashes, including removals of interior blocks whose children the worker still has (the rare
path where a removal breaks held prefixes below it, and a later store re-links orphans). After
every event the trie must agree with the definitions of the module docstring: a worker holds z
iff every block on the root->z path is valid there; ReplicaCount counts holders per degree; a
worker's longest held prefix of a request is the longest fully valid leading run; the
multi-holder index lists exactly the nodes with two or more holders.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachemgr.events import Removed, Stored
from services.cachemgr.trie import ApplyOutcome, PrefixTrie

PARENT: dict[int, int | None] = {1: None, 2: 1, 3: 2, 4: 3, 5: 2, 6: 5, 7: None, 8: 7, 9: 8,
                                 10: 8, 11: 10}
WORKERS = {"a": 2, "b": 4, "c": 2}


def chain(h: int) -> tuple[int, ...]:
    out = []
    x: int | None = h
    while x is not None:
        out.append(x)
        x = PARENT[x]
    return tuple(reversed(out))


def _check(t: PrefixTrie, valid: dict[str, set[int]]) -> None:
    for h in PARENT:
        if h not in t:
            assert not any(h in v for v in valid.values())
            continue
        want = {w for w, v in valid.items() if all(x in v for x in chain(h))}
        assert set(t.holders(h)) == want, h
        for c in (2, 4):
            assert t.replica_count(h, c) == sum(1 for w in want if WORKERS[w] == c)
        m = t.match(chain(h))
        for w, v in valid.items():
            run = 0
            for x in chain(h):
                if x not in v:
                    break
                run += 1
            assert m.held(w) == run
    for w, v in valid.items():
        assert t.worker_blocks(w) == v
        assert t.held_nodes(w) == {h for h in v if all(x in v for x in chain(h))}
    assert {n.hash for n in t._multi} == {h for h in PARENT if h in t and len(t.holders(h)) >= 2}


events = st.lists(st.tuples(st.sampled_from(sorted(WORKERS)), st.booleans(),
                            st.sampled_from(sorted(PARENT)), st.integers(1, 4),
                            st.permutations(range(4))),
                  max_size=40)


@settings(max_examples=250, deadline=None)
@given(events)
def test_holders_match_the_definition(script) -> None:
    t = PrefixTrie([2, 4], block_size=4)
    for w, c in WORKERS.items():
        t.add_worker(w, c, 100)
    valid: dict[str, set[int]] = {w: set() for w in WORKERS}
    eid = dict.fromkeys(WORKERS, 0)
    for w, store, h, n, order in script:
        path = chain(h)
        if store:
            # Store the tail of the path after the worker's longest valid leading run, as a
            # worker that has that run cached would (its parent is then valid there).
            k = 0
            while k < len(path) and path[k] in valid[w]:
                k += 1
            new = path[k:k + n]
            if not new:
                continue
            eid[w] += 1
            ev = Stored(w, eid[w], path[k - 1] if k else None, new)
            assert t.apply(ev) is ApplyOutcome.APPLIED
            valid[w].update(new)
        else:
            # Remove up to n of the path's valid blocks, interior ones included, in a
            # scrambled order (a Removed event lists blocks in any order).
            have = [x for x in path if x in valid[w]][:n]
            if not have:
                continue
            hs = tuple(have[i] for i in order if i < len(have))
            eid[w] += 1
            assert t.apply(Removed(w, eid[w], hs)) is ApplyOutcome.APPLIED
            valid[w].difference_update(hs)
        _check(t, valid)


def test_has_pending_is_what_gates_lazy_reconcile_copies() -> None:
    """``has_pending`` (the simulator's cheap pre-check) is True exactly when the worker has
    pending blocks, and without them ``on_reuse`` never issues anything."""
    from services.cachemgr.reconcile import on_reuse

    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker("p", 4, 100)
    t.add_worker("q", 2, 100)
    assert t.apply(Stored("p", 1, None, (1, 2, 3, 4))) is ApplyOutcome.APPLIED
    assert t.apply(Stored("q", 1, None, (1, 2))) is ApplyOutcome.APPLIED
    assert not t.has_pending("p") and on_reuse(t, "p", (1, 2, 3, 4)) == ()
    t.reconcile_split("p", ("l", "r"), {"l": 100, "r": 100})
    for w in ("l", "r", "q"):
        assert t.has_pending(w) == bool(t.pending_blocks(w))
    assert t.has_pending("l") or t.has_pending("r")  # a split leaves every other page behind
    for w in ("l", "r", "q"):
        if not t.has_pending(w):
            assert on_reuse(t, w, (1, 2, 3, 4)) == ()
