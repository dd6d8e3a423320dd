"""The gateway's idempotency-key memory (services/gateway/idempotency.py), a pure core: a
request id names one request content for the intake's de-duplication window, bounded in size;
the shared bucket's keys and records; which failed publishes withdraw a claim, and how long a
claim lasts. The live behaviour (409 over HTTP and NATS, across
gateway replicas and restarts) is in tests/live_sched."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError
from nats.js.kv import VALID_KEY_RE

from services.gateway.adapter import publish_refused
from services.gateway.idempotency import (
    ENCODED_KEY_MARK,
    Claim,
    Fingerprints,
    IdempotencyRecord,
    kv_key,
    request_digest,
)
from services.gateway.idempotency_kv import claim_ttl_s
from services.gateway.settings import GatewaySettings
from shared.schemas import Id, SchemaError, from_json, to_json
from shared.service import INTAKE_DUPLICATE_WINDOW_S


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


# -- the shared bucket's keys and records -------------------------------------------------------


def _legal_kv_key(key: str) -> bool:
    # nats-py's own rule (nats.js.kv._is_key_valid): no empty key, no leading or trailing dot.
    return bool(key) and key[0] != "." and key[-1] != "." and bool(VALID_KEY_RE.match(key))


@pytest.mark.parametrize("rid", ["key-1", "r" + "0" * 127, "a_b-c", "0"])
def test_a_request_id_is_its_own_key(rid: str) -> None:
    """Every id the schema admits is readable as it is in the bucket."""
    from pydantic import TypeAdapter

    TypeAdapter(Id).validate_python(rid)
    assert kv_key(rid) == rid


@pytest.mark.parametrize("rid", ["a b", "ü/*>", ".x.", "a.b", "=YWJj", "$kv", "", "\ud800"])
def test_any_other_string_is_encoded_to_a_legal_key(rid: str) -> None:
    key = kv_key(rid)
    assert key.startswith(ENCODED_KEY_MARK) and _legal_kv_key(key), key


@given(st.text(max_size=40), st.text(max_size=40))
def test_keys_are_legal_and_never_shared(a: str, b: str) -> None:
    assert _legal_kv_key(kv_key(a))
    assert (kv_key(a) == kv_key(b)) == (a == b)


def test_a_record_round_trips_and_refuses_what_is_none() -> None:
    rec = IdempotencyRecord(digest=request_digest([1, 2], 1).hex(), accepted_s=1.5e9)
    assert from_json(IdempotencyRecord, to_json(rec)) == rec
    for bad in (b"", b"{}", b'{"digest": "xyz", "accepted_s": 1}', b"\x00"):
        with pytest.raises(SchemaError):
            from_json(IdempotencyRecord, bad)


# -- when a claim is withdrawn, and how long it lasts -------------------------------------------


@pytest.mark.parametrize("exc", [
    NoStreamResponseError(),  # nats-py's "no responders" of a JetStream publish
    nats.errors.NoRespondersError(),
    APIError(code=400, err_code=10054, description="message size exceeds maximum allowed"),
    ServiceUnavailableError(code=503, err_code=10008, description="JetStream unavailable"),
])
def test_a_definite_refusal_withdraws_the_claim(exc: BaseException) -> None:
    assert publish_refused(exc)


@pytest.mark.parametrize("exc", [
    nats.errors.TimeoutError(),  # the message may be stored, the ack lost or late
    TimeoutError(),
    nats.errors.ConnectionClosedError(),
    nats.errors.ConnectionDrainingError(),
    asyncio.CancelledError(),
    RuntimeError("unforeseen"),
])
def test_an_indeterminate_failure_keeps_the_claim(exc: BaseException) -> None:
    assert not publish_refused(exc)


def test_a_claim_outlasts_the_window_by_the_publish_bound() -> None:
    """The intake's window runs from the stored message, up to nats_wait_s +
    publish_timeout_s after the claim."""
    s = GatewaySettings(nats_wait_s=7.0, publish_timeout_s=3.0, http_port=None)
    assert s.publish_bound_s == 10.0
    assert claim_ttl_s(s.publish_bound_s) == INTAKE_DUPLICATE_WINDOW_S + 10.0 == 130.0
    assert claim_ttl_s(0.5, window_s=60.0) == 60.5
