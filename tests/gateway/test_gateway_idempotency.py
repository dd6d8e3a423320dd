"""The gateway's idempotency-key memory (services/gateway/idempotency.py), a pure core: a
request id names one request content for the intake's de-duplication window, bounded in size.
The live behaviour (409 over HTTP and NATS) is in tests/live_sched."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.idempotency import Claim, Fingerprints, request_digest


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_same_content_is_a_replay_and_other_content_a_conflict() -> None:
    fp = Fingerprints(120.0, 10, Clock())
    a = request_digest([1, 2, 3], 1)
    assert fp.claim("r1", a) is Claim.NEW
    assert fp.claim("r1", a) is Claim.SAME
    assert fp.claim("r1", request_digest([1, 2, 4], 1)) is Claim.CONFLICT
    assert fp.claim("r1", request_digest([1, 2, 3], 2)) is Claim.CONFLICT  # max_tokens
    assert fp.claim("r1", a) is Claim.SAME  # a conflict changes nothing
    assert fp.claim("r2", request_digest([9], 1)) is Claim.NEW
    assert len(fp) == 2


def test_content_is_tokens_and_max_tokens_only() -> None:
    assert request_digest([1, 2, 3], 1) == request_digest([1, 2, 3], 1)
    assert request_digest([1, 2, 3], 1) != request_digest([1, 2], 1)
    assert request_digest([1, 2, 3], 1) != request_digest([3, 2, 1], 1)
    assert request_digest([0], 1) != request_digest([0, 0], 1)
    assert request_digest([2**31 - 1], 1) != request_digest([2**31 - 2], 1)


def test_a_digest_is_kept_for_the_window_from_its_first_acceptance() -> None:
    clock = Clock()
    fp = Fingerprints(120.0, 10, clock)
    a, b = request_digest([1], 1), request_digest([2], 1)
    assert fp.claim("r1", a) is Claim.NEW
    clock.now += 119.0
    assert fp.claim("r1", a) is Claim.SAME  # a replay does not extend the window
    assert fp.claim("r1", b) is Claim.CONFLICT
    clock.now += 1.0
    # The intake takes the id as a new request now: so does the check.
    assert fp.claim("r1", b) is Claim.NEW
    assert len(fp) == 1


def test_past_the_size_bound_the_oldest_is_forgotten_first() -> None:
    fp = Fingerprints(120.0, 3, Clock())
    for i in range(5):
        assert fp.claim(f"r{i}", request_digest([i], 1)) is Claim.NEW
    assert len(fp) == 3 and fp.evicted == 2
    assert fp.claim("r0", request_digest([99], 1)) is Claim.NEW  # forgotten: not detected
    assert fp.claim("r4", request_digest([99], 1)) is Claim.CONFLICT  # kept


def test_release_forgets_only_the_claim_made() -> None:
    fp = Fingerprints(120.0, 10, Clock())
    a, b = request_digest([1], 1), request_digest([2], 1)
    fp.claim("r1", a)
    fp.release("r1", b)  # not the digest kept: nothing happens
    assert fp.claim("r1", b) is Claim.CONFLICT
    fp.release("r1", a)
    assert fp.claim("r1", b) is Claim.NEW
    fp.release("never", a)


@pytest.mark.parametrize(("window", "keys"), [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_bad_bounds_are_refused(window: float, keys: int) -> None:
    with pytest.raises(ValueError):
        Fingerprints(window, keys)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.floats(0, 50)),
                max_size=60))
def test_never_more_than_the_bound_and_never_a_wrong_verdict(
        ops: list[tuple[int, int, float]]) -> None:
    """Whatever the order of claims and clock steps: at most ``max_keys`` kept, a conflict only
    against a digest accepted within the window, a replay only of the same digest."""
    clock = Clock()
    fp = Fingerprints(60.0, 4, clock)
    accepted: dict[str, tuple[bytes, float]] = {}
    for key, content, step in ops:
        clock.now += step
        rid, digest = f"r{key}", request_digest([content], 1)
        verdict = fp.claim(rid, digest)
        kept = accepted.get(rid)
        live = kept is not None and clock.now < kept[1] + 60.0
        if verdict is Claim.NEW:
            accepted[rid] = (digest, clock.now)
        else:
            assert live and kept is not None
            assert (verdict is Claim.SAME) == (kept[0] == digest)
        assert len(fp) <= 4
