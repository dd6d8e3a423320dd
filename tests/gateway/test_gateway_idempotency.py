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
from nats.js.errors import (
    APIError,
    BadRequestError,
    NoStreamResponseError,
    ServerError,
    ServiceUnavailableError,
)
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


def test_a_restart_starts_the_window_again_from_now() -> None:
    """Every publish under an id restarts its window (the intake's runs from the stored
    message, and a replay's may be stored anew): the entry moves to the end, so expiry stays
    in order, and the size bound then forgets the others first."""
    clock = Clock()
    fp = Fingerprints(120.0, 2, clock)
    a, b, c = request_digest([1], 1), request_digest([2], 1), request_digest([3], 1)
    assert fp.claim("r1", a) is Claim.NEW
    clock.now += 10.0
    assert fp.claim("r2", a) is Claim.NEW
    clock.now += 100.0
    assert fp.restart("r1", a)  # a replay at t=110 publishes: r1 is the youngest now
    assert fp.expires_at("r1") == clock.now + 120.0
    clock.now += 15.0  # t=125: past r1's first window, within its restarted one
    assert fp.claim("r1", b) is Claim.CONFLICT
    assert fp.claim("r3", c) is Claim.NEW  # the size bound forgets r2 (oldest), not r1
    assert fp.expires_at("r2") is None and fp.evicted == 1
    assert fp.claim("r1", b) is Claim.CONFLICT
    clock.now += 105.0  # t=230 = 110 + 120
    assert fp.claim("r1", b) is Claim.NEW


def test_a_restart_changes_nothing_of_other_content_and_adds_only_when_asked() -> None:
    clock = Clock()
    fp = Fingerprints(120.0, 10, clock)
    a, b = request_digest([1], 1), request_digest([2], 1)
    assert fp.claim("r1", a) is Claim.NEW
    until = fp.expires_at("r1")
    clock.now += 50.0
    assert not fp.restart("r1", b)  # other content: left alone
    assert fp.expires_at("r1") == until
    assert not fp.restart("r2", a)  # not kept: nothing kept
    assert fp.expires_at("r2") is None
    assert fp.restart("r2", a, add=True)  # kept now (the bucket did not answer, say)
    assert fp.claim("r2", b) is Claim.CONFLICT


def test_entries_given_a_shorter_window_later_live_longer_never_shorter() -> None:
    """The gateway reads the intake's window from its stream and may change ``window_s``:
    an entry keeps the expiry it was given."""
    clock = Clock()
    fp = Fingerprints(120.0, 10, clock)
    a = request_digest([1], 1)
    assert fp.claim("r1", a) is Claim.NEW
    fp.window_s = 5.0
    assert fp.claim("r2", a) is Claim.NEW
    clock.now += 6.0
    assert fp.claim("r1", request_digest([2], 1)) is Claim.CONFLICT  # its 120 s
    assert fp.claim("r2", a) is Claim.SAME  # behind r1: kept longer than its 5 s


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


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.floats(0, 50),
                          st.sampled_from(["claim", "restart", "add"])),
                max_size=60))
def test_never_more_than_the_bound_and_never_a_wrong_verdict(
        ops: list[tuple[int, int, float, str]]) -> None:
    """Whatever the order of claims, restarts and clock steps: at most ``max_keys`` kept, a
    conflict only against a digest accepted or restarted within the window, a replay only of
    the same digest, and an entry never forgotten before its window from its last (re)start
    unless the size bound pushed it out."""
    clock = Clock()
    fp = Fingerprints(60.0, 4, clock)
    accepted: dict[str, tuple[bytes, float]] = {}
    for key, content, step, op in ops:
        clock.now += step
        rid, digest = f"r{key}", request_digest([content], 1)
        kept = accepted.get(rid)
        live = kept is not None and clock.now < kept[1] + 60.0
        evicted = fp.evicted
        if op == "claim":
            verdict = fp.claim(rid, digest)
            if verdict is Claim.NEW:
                accepted[rid] = (digest, clock.now)
                assert not live or fp.evicted > 0  # forgotten early only by the bound
            else:
                assert live and kept is not None
                assert (verdict is Claim.SAME) == (kept[0] == digest)
        else:
            held = fp.expires_at(rid) is not None
            restarted = fp.restart(rid, digest, add=op == "add")
            if restarted:
                accepted[rid] = (digest, clock.now)
                assert fp.expires_at(rid) == clock.now + 60.0
            else:
                assert op == "restart" or (held and kept is not None and kept[0] != digest)
        assert len(fp) <= 4
        assert fp.evicted >= evicted


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
    nats.errors.OutboundBufferLimitError(),  # not connected, nothing queued: never sent
    # Checks the stream makes before it stores (4xx):
    BadRequestError(code=400, err_code=10054, description="message size exceeds maximum "
                                                         "allowed"),
    BadRequestError(code=400, err_code=10071, description="wrong last sequence: 7"),
    BadRequestError(code=400, err_code=10070, description="wrong last msg ID: x"),
    APIError(code=429, err_code=10167, description="too many requests"),
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
    # 5xx: the server's trouble, which may come after a (replicated) write.
    ServiceUnavailableError(code=503, err_code=10008, description="JetStream system "
                                                                  "temporarily unavailable"),
    ServiceUnavailableError(code=503, err_code=10077, description="maximum messages "
                                                                  "exceeded"),
    ServerError(code=500, err_code=10049, description="insufficient resources"),
    APIError(code=None, err_code=None, description="no code"),
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
