"""The shared side of idempotency keys: claims of client request ids in a JetStream key-value
bucket that every gateway replica uses (the rule and its limits: :mod:`services.gateway.
idempotency`).

One claim (:meth:`SharedClaims.claim`): ``create`` the id's key (:func:`kv_key`) with this
request's :class:`IdempotencyRecord` -- atomic on the server, so of any number of gateways
claiming one id at once exactly one gets :attr:`Claim.NEW` -- and, where the key exists
already, ``get`` it and compare digests: :attr:`Claim.SAME` (an idempotent replay) or
:attr:`Claim.CONFLICT` (409). A key that expires or is withdrawn between the two is claimed
again. The bucket's ``max_age`` is the intake's de-duplication window, so a record goes when
the intake would take its id as a new request (a delete marker goes the same way).

A withdrawal (:meth:`SharedClaims.release`) deletes the record only at the revision the claim
wrote: a record that expired and was claimed again since is someone else's.

Every failure of the bucket -- no answer within ``timeout_s``, no bucket, a record that is
none -- is one :class:`StoreFailed`; the gateway decides what that means (it fails open).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import (
    APIError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from services.gateway.idempotency import Claim, IdempotencyRecord, RequestDigest, kv_key
from shared.schemas import SchemaError, from_json, to_json
from shared.service import INTAKE_DUPLICATE_WINDOW_S, ensure_key_value
from shared.subjects import Subjects

CLAIM_TRIES: Final[int] = 3
"""Create-then-get rounds of one claim before it counts as failed: a round is lost only when
the key went (expired, withdrawn) between the create and the get, so a second is all but
certain to decide."""
WRONG_LAST_SEQUENCE: Final[int] = 10071
"""JetStream API error code of a conditional write whose expected revision is not the last."""
STREAM_NOT_FOUND: Final[int] = 10059


class StoreFailed(Exception):
    """The idempotency bucket did not decide a claim or a withdrawal. ``bucket_missing``: it
    does not exist (deleted, or lost with the server's store): making it again helps."""

    def __init__(self, message: str, *, bucket_missing: bool = False) -> None:
        super().__init__(message)
        self.bucket_missing = bucket_missing


@dataclass(frozen=True, slots=True)
class SharedClaim:
    """The outcome of one :meth:`SharedClaims.claim`."""

    claim: Claim
    revision: int | None = None
    """NEW: the revision of the record written (for :meth:`SharedClaims.release`)."""
    first: IdempotencyRecord | None = None
    """SAME / CONFLICT: the record found (the first claim's)."""


async def idempotency_kv(js: JetStreamContext, subjects: Subjects, *,
                         window_s: float = INTAKE_DUPLICATE_WINDOW_S) -> KeyValue:
    """The idempotency bucket, made where missing (on file, one revision per key, TTL =
    ``window_s``); an existing bucket is used as it is."""
    return await ensure_key_value(js, subjects.idempotency_bucket(), ttl_s=window_s,
                                  description="vertumnus gateways' idempotency keys "
                                              "(client request id -> content digest)")


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
        """Claim ``request_id`` for ``digest``; raises :class:`StoreFailed`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._claim(kv_key(request_id), digest)
        except (nats.errors.Error, TimeoutError) as exc:
            raise StoreFailed(f"claim not decided: {type(exc).__name__}: {exc}",
                              bucket_missing=_missing(exc)) from exc

    async def _claim(self, key: str, digest: RequestDigest) -> SharedClaim:
        mine = digest.hex()
        value = to_json(IdempotencyRecord(digest=mine, accepted_s=self._clock()))
        for _ in range(CLAIM_TRIES):
            try:
                return SharedClaim(Claim.NEW, revision=await self._kv.create(key, value))
            except KeyWrongLastSequenceError:
                pass  # the key holds a record: the first claim's
            except KeyNotFoundError:
                # nats-py's create looks the key up after a refused create; expired in
                # between: claim it again rather than fail open.
                continue
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                continue  # gone since the create (expired, withdrawn): claim it again
            try:
                first = from_json(IdempotencyRecord, entry.value or b"")
            except SchemaError as exc:
                raise StoreFailed(f"the record of key {key!r} is no IdempotencyRecord: "
                                  f"{exc}") from exc
            return SharedClaim(Claim.SAME if first.digest == mine else Claim.CONFLICT,
                               first=first)
        raise StoreFailed(f"key {key!r} kept changing over {CLAIM_TRIES} claims")

    async def release(self, request_id: str, revision: int) -> bool:
        """Withdraw the claim that wrote ``revision`` of ``request_id``'s key. False: the key
        holds a later record (this one expired and the id was claimed again), left alone.
        Raises :class:`StoreFailed`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._kv.delete(kv_key(request_id), last=revision)
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return False
            raise StoreFailed(f"claim not withdrawn: {type(exc).__name__}: {exc}",
                              bucket_missing=_missing(exc)) from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise StoreFailed(f"claim not withdrawn: {type(exc).__name__}: {exc}",
                              bucket_missing=_missing(exc)) from exc
        return True


__all__ = ["CLAIM_TRIES", "SharedClaim", "SharedClaims", "StoreFailed", "idempotency_kv"]
