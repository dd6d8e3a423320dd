"""The shared side of idempotency keys: claims of client request ids in a JetStream key-value
bucket that every gateway replica uses (the rule and its limits: :mod:`services.gateway.
idempotency`).

One claim (:meth:`SharedClaims.claim`): ``create`` the id's key (:func:`kv_key`) with this
request's :class:`IdempotencyRecord` -- atomic on the server, so of any number of gateways
claiming one id at once exactly one gets :attr:`Claim.NEW` -- and, where the key exists
already, ``get`` it and compare digests: :attr:`Claim.CONFLICT` (409), or, the same content,
``update`` the record with itself at the revision read (compare-and-set) -- :attr:`Claim.SAME`
(an idempotent replay), the record's age (its TTL) started again, as the replay's publish may
store its message anew and the intake's window then runs from there
(:mod:`services.gateway.idempotency`, "Window"). A key that expires or is withdrawn between
the steps is claimed again; one rewritten meanwhile by another replay of the same content is a
replay all the same (that rewrite restarted the record's age). The bucket's ``max_age`` is
:func:`claim_ttl_s`: the intake's de-duplication window plus the longest the intake publish
may go on after the claim, so a record goes only once the intake would take its id as a new
request (a delete marker goes the same way). A bucket found with a shorter ``max_age`` (made
by an older gateway, or one with shorter publish timeouts) has it raised
(:func:`idempotency_kv`); a longer one is kept, since it is what another replica may need (a
claim kept longer than needed costs only a 409 that could have been a new request).

A withdrawal (:meth:`SharedClaims.release`) deletes the record only at the revision the claim
wrote: a record that expired and was claimed again since, or that a replay wrote again, is
someone else's.

Every failure of the bucket -- no answer within ``timeout_s``, no bucket, a record that is
none -- is one :class:`StoreFailed`; the gateway decides what that means (it fails open). A
claim whose key keeps changing under it is :class:`ClaimContended` (a StoreFailed too): the
bucket works and holds someone's claim, so the gateway refuses the request for now (503)
rather than fail open.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.client import KV_STREAM_TEMPLATE
from nats.js.errors import (
    APIError,
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from services.gateway.idempotency import Claim, IdempotencyRecord, RequestDigest, kv_key
from shared.schemas import SchemaError, from_json, to_json
from shared.service import INTAKE_DUPLICATE_WINDOW_S
from shared.subjects import Subjects

CLAIM_TRIES: Final[int] = 5
"""Create-get-update rounds of one claim before it counts as contended (:class:`ClaimContended`):
a round is lost only when the key went (expired, withdrawn) between its steps -- or, on
clustered JetStream, when the read of a key the create found went to a replica that has not
seen it yet. (A replay whose rewrite meets another replay's of the same content has its
answer: SAME.) One server all but always decides in the second round; the pauses between
rounds (:data:`CLAIM_BACKOFF_S`) give a lagging replica time to catch up."""
CLAIM_BACKOFF_S: Final[float] = 0.02
"""The pause after the first lost round of a claim; doubled after each further one, each
drawn at random between half and all of it (so claims that collide do not collide again in
step): 0.3 s at most over :data:`CLAIM_TRIES` rounds, well inside the claim's bound."""
UPDATE_TRIES: Final[int] = 3
"""Rounds of reading the bucket's ``max_age`` and raising it (:func:`idempotency_kv`): another
gateway may write a lower raise over this one's; the next round raises it again."""
WRONG_LAST_SEQUENCE: Final[int] = 10071
"""JetStream API error code of a conditional write whose expected revision is not the last."""
STREAM_NOT_FOUND: Final[int] = 10059
STREAM_NAME_IN_USE: Final[int] = 10058
"""JetStream API error code of a stream created under a name in use with another config."""
MAX_AGE_SLACK_S: Final[float] = 1e-6
"""What a ``max_age`` may be short of the wanted TTL and still count as it: the server keeps
nanoseconds, and seconds -> nanoseconds -> seconds need not give back the same float."""


_log = structlog.get_logger("vertumnus.gateway.idempotency")


class StoreFailed(Exception):
    """The idempotency bucket did not decide a claim or a withdrawal. ``bucket_missing``: it
    does not exist (deleted, or lost with the server's store): making it again helps."""

    def __init__(self, message: str, *, bucket_missing: bool = False) -> None:
        super().__init__(message)
        self.bucket_missing = bucket_missing


class ClaimContended(StoreFailed):
    """The bucket answered the rounds of a claim, but each found the key and then did not
    (:data:`CLAIM_TRIES` rounds, or those before the claim's time ran out). Unlike the bucket
    not answering, this says the id IS claimed -- a record was there each round -- so letting
    the request through on this gateway's memory alone (fail open) could let other content
    through to its answer: the gateway answers 503 instead, and the client's retry claims it
    again."""


@dataclass(frozen=True, slots=True)
class SharedClaim:
    """The outcome of one :meth:`SharedClaims.claim`."""

    claim: Claim
    revision: int | None = None
    """NEW / SAME: the revision of the record written (the new record; the first claim's
    record written again), for :meth:`SharedClaims.release`. None for a SAME whose rewrite
    another write of the same content beat (it restarted the record's age instead): nothing
    of the record is this claim's to withdraw."""
    first: IdempotencyRecord | None = None
    """SAME / CONFLICT: the record found (the first claim's)."""
    prior: int | None = None
    """SAME: the revision the record written replaced (whose it was decides whose the new one
    is: the gateway's ``_Claimants``)."""


@dataclass(slots=True)
class _Rounds:
    """What one claim's rounds met so far (:meth:`SharedClaims.claim`)."""

    lost: int = 0
    """Rounds lost to a key that a create found and a read then did not."""


def claim_ttl_s(publish_bound_s: float, window_s: float = INTAKE_DUPLICATE_WINDOW_S) -> float:
    """How long a claim is kept (the bucket's ``max_age``): the intake's de-duplication
    ``window_s`` -- which runs from the stored intake message, not from the claim -- plus
    ``publish_bound_s``, the longest the intake publish may go on after the claim
    (``GatewaySettings.publish_bound_s``: its tries for ``nats_wait_s``, each ending by
    ``publish_timeout_s``). Without that, a message stored late (a publish tried again while
    the broker restarts) would still be de-duplicated by the intake after its claim expired,
    and a reuse of its id with other content in that gap would get the first answer."""
    return window_s + publish_bound_s


async def idempotency_kv(js: JetStreamContext, subjects: Subjects, *, ttl_s: float,
                         log: Any = None) -> KeyValue:
    """The idempotency bucket, made where missing (:func:`open_idempotency_kv`, without
    saying whether this call made it)."""
    kv, _ = await open_idempotency_kv(js, subjects, ttl_s=ttl_s, log=log)
    return kv


async def open_idempotency_kv(js: JetStreamContext, subjects: Subjects, *, ttl_s: float,
                              log: Any = None) -> tuple[KeyValue, bool]:
    """The idempotency bucket, made where missing (on file, one revision per key, TTL =
    ``ttl_s``, :func:`claim_ttl_s`), and whether this call created it: False where it was
    there already, or made at the same moment by another gateway with another TTL. (One
    made at the same moment with the same config counts as created by each: the server
    answers both creations alike.) An existing bucket whose ``max_age`` is shorter than
    ``ttl_s`` has it raised to ``ttl_s``; a longer (or no) ``max_age`` is left as it is: it may
    be another replica's need (module docstring). Raised, it is read again: two gateways with
    different needs that raise it at once may leave the lower of the two raised values, so the
    one that needs more raises it again (:data:`UPDATE_TRIES` rounds).

    A raise the server refuses or does not answer (no permission for ``STREAM.UPDATE``, say)
    is logged as a warning through ``log`` (structlog; a module logger by default) and the
    bucket is used as it is: claims shorter than the intake's window plus the publish's bound
    are the weaker check of before, not a reason to stop the gateway. Raises what making or
    reading the bucket raises."""
    bucket = subjects.idempotency_bucket()
    created = False
    try:
        # shared.service.ensure_key_value, but knowing which of its two steps answered.
        kv = await js.key_value(bucket)
    except BucketNotFoundError:
        try:
            kv = await js.create_key_value(
                bucket=bucket, history=1, ttl=ttl_s,
                description="vertumnus gateways' idempotency keys (client request id -> "
                            "content digest)")
            created = True
        except BadRequestError as exc:
            if exc.err_code != STREAM_NAME_IN_USE:
                raise
            kv = await js.key_value(bucket)  # made at once by a gateway with another TTL
    stream_name = KV_STREAM_TEMPLATE.format(bucket=bucket)
    for round_ in range(UPDATE_TRIES):
        try:
            stream = await js.stream_info(stream_name)
        except (nats.errors.Error, TimeoutError):
            if round_ == 0:
                raise
            break  # raised already; reading it back is a check of a race, not a need
        max_age = stream.config.max_age
        if not max_age or max_age + MAX_AGE_SLACK_S >= ttl_s:  # 0 or None: kept for ever
            break
        try:
            await js.update_stream(stream.config.evolve(max_age=ttl_s))
        except (nats.errors.Error, TimeoutError) as exc:
            (log or _log).warning(
                "idempotency bucket's max_age not raised; its claims may end before the "
                "intake's window plus the publish's bound",
                bucket=bucket, max_age_s=max_age, wanted_s=ttl_s,
                error=f"{type(exc).__name__}: {exc}")
            break
    return kv, created


def _missing(exc: BaseException) -> bool:
    return isinstance(exc, NoStreamResponseError | nats.errors.NoRespondersError) or (
        isinstance(exc, NotFoundError) and not isinstance(exc, KeyNotFoundError)
        and exc.err_code == STREAM_NOT_FOUND)


class SharedClaims:
    """Claims and withdrawals of request ids in the idempotency bucket ``kv`` (module
    docstring); each call is bounded by ``timeout_s``. ``clock``: wall seconds, stamped on a
    record for people to read (nothing compares it)."""

    def __init__(self, kv: KeyValue, timeout_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._kv = kv
        self.timeout_s = timeout_s
        self._clock = clock

    async def claim(self, request_id: str, digest: RequestDigest) -> SharedClaim:
        """Claim ``request_id`` for ``digest``; raises :class:`StoreFailed`, or
        :class:`ClaimContended` when rounds were lost to a key that the create found and the
        read then did not (a lagging replica, an id withdrawn and claimed over and over):
        all of them, or some before the claim's time ran out."""
        rounds = _Rounds()
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._claim(kv_key(request_id), digest, rounds)
        except (nats.errors.Error, TimeoutError) as exc:
            if rounds.lost and isinstance(exc, TimeoutError):
                raise ClaimContended(f"claim not decided in {self.timeout_s:g} s, after "
                                     f"{rounds.lost} rounds lost to a key that kept "
                                     "changing") from exc
            raise StoreFailed(f"claim not decided: {type(exc).__name__}: {exc}",
                              bucket_missing=_missing(exc)) from exc

    async def _claim(self, key: str, digest: RequestDigest, rounds: _Rounds) -> SharedClaim:
        mine = digest.hex()
        value = to_json(IdempotencyRecord(digest=mine, accepted_s=self._clock()))
        for round_ in range(CLAIM_TRIES):
            if round_:  # the last round was lost: let the key settle first (CLAIM_BACKOFF_S)
                pause = CLAIM_BACKOFF_S * (1 << (round_ - 1))
                await asyncio.sleep(random.uniform(pause / 2, pause))
            try:
                return SharedClaim(Claim.NEW, revision=await self._kv.create(key, value))
            except KeyWrongLastSequenceError:
                pass  # the key holds a record: the first claim's
            except KeyNotFoundError:
                # nats-py's create looks the key up after a refused create; expired in
                # between (or a replica that has not seen it): claim it again rather than
                # fail open.
                rounds.lost += 1
                continue
            entry = await self._read(key)
            if entry is None:
                rounds.lost += 1
                continue  # gone since the create (expired, withdrawn): claim it again
            first = entry[0]
            if first.digest != mine:
                return SharedClaim(Claim.CONFLICT, first=first)
            # A replay: the record written again as it is, at the revision read, so that its
            # age starts again (module docstring).
            try:
                revision = await self._kv.update(key, entry[1], last=entry[2])
            except KeyWrongLastSequenceError:
                pass
            else:
                return SharedClaim(Claim.SAME, revision=revision, first=first,
                                   prior=entry[2])
            # Written since the read. Most often by another replay of this very content (a
            # burst of retries, here or at other replicas): that write started the record's
            # age again after this claim began, which is all this claim's own write was for
            # -- a replay, not written by it (no revision: nothing of it to withdraw). Else a
            # withdrawal or an expiry (claim it again) or another content's claim after one.
            again = await self._read(key)
            if again is None:
                rounds.lost += 1
                continue
            if again[0].digest != mine:
                return SharedClaim(Claim.CONFLICT, first=again[0])
            return SharedClaim(Claim.SAME, first=again[0])
        raise ClaimContended(f"key {key!r} kept changing over {CLAIM_TRIES} claims")

    async def _read(self, key: str) -> tuple[IdempotencyRecord, bytes, int] | None:
        """The record under ``key``, its bytes and its revision; None: no key (or a delete
        marker). Raises :class:`StoreFailed` for a value that is no record."""
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        raw = entry.value or b""
        try:
            return from_json(IdempotencyRecord, raw), raw, entry.revision
        except SchemaError as exc:
            raise StoreFailed(f"the record of key {key!r} is no IdempotencyRecord: "
                              f"{exc}") from exc

    async def release(self, request_id: str, revision: int) -> bool:
        """Withdraw the claim that wrote ``revision`` of ``request_id``'s key. True: withdrawn,
        or the key holds no record any more (expired, withdrawn, or lost with a bucket made
        again since): nothing in the bucket claims the id. False: the key holds a later
        record (a replay wrote it again, or it expired and the id was claimed again), left
        alone. Raises :class:`StoreFailed`."""
        key = kv_key(request_id)
        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    await self._kv.delete(key, last=revision)
                except APIError as exc:
                    if exc.err_code != WRONG_LAST_SEQUENCE:
                        raise
                    # Not the record this claim wrote: a later one, or none at all (a bucket
                    # lost and made again has no revision ``revision``). Only a record holds
                    # the id; without one the withdrawal has nothing left to do.
                    return await self._read(key) is None
        except (nats.errors.Error, TimeoutError) as exc:
            raise StoreFailed(f"claim not withdrawn: {type(exc).__name__}: {exc}",
                              bucket_missing=_missing(exc)) from exc
        return True


__all__ = ["CLAIM_BACKOFF_S", "CLAIM_TRIES", "UPDATE_TRIES", "ClaimContended", "SharedClaim",
           "SharedClaims", "StoreFailed", "claim_ttl_s", "idempotency_kv"]
