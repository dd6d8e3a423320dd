"""Idempotency keys: a client's ``request_id`` names one request, not whatever is sent under it.

The intake de-duplicates by ``Nats-Msg-Id`` = request id (``INTAKE_DUPLICATE_WINDOW_S``), so
a request id sent again within that window is answered with the first request's result. For
the *same* request that is the point (a retry after a cut-off connection is an idempotent
replay, computed once); for a *different* request under a reused id it would be a wrong answer
given as right. So the gateway remembers a digest of each accepted request's content per
client-given request id (in two layers, below) and refuses a reuse with other content: 409
Conflict, naming the id (``services.gateway.adapter.Conflict``).

Content (:func:`request_digest`): what decides the answer -- the prompt's token ids (after
tokenization, so a text prompt and its token ids are the same request) and ``max_tokens``.
Fields the gateway ignores (``model``, sampling parameters) are not content.

Two layers, one rule:

* **Shared** (:mod:`services.gateway.idempotency_kv`): a JetStream key-value bucket
  (``{PREFIX}_IDEMPOTENCY``, ``Subjects.idempotency_bucket``) holds one
  :class:`IdempotencyRecord` (the digest and the first acceptance's wall time) per client
  request id, key :func:`kv_key`, for the claim's TTL (the bucket's ``max_age``; "Window",
  below). The first claim of an id anywhere wins (an atomic ``create``); a later one reads
  the record and compares digests, and with the same content writes the record again (a
  compare-and-set on its revision), which starts its TTL again. Every gateway replica shares
  it, and it outlives a gateway restart (on file, like the intake: a server restart too).
* **Local** (:class:`Fingerprints`): this process's memory of the ids whose first claim was
  its own (or that it accepted while the bucket did not answer), a fast first check (a
  conflict found there costs no round trip) and the fallback while the bucket does not
  answer. An id another replica claimed first is not kept here: the bucket's record keeps
  its window, for every replica.

Limits:

* **Window.** The intake de-duplicates an id for its window (the intake stream's
  ``duplicate_window``, ``INTAKE_DUPLICATE_WINDOW_S`` unless made otherwise; the gateway reads
  it) from the *stored message*, and that may be stored well after the claim: the publish is
  tried again for up to ``nats_wait_s``, each try ending by ``publish_timeout_s``
  (``GatewaySettings.publish_bound_s``). So a claim lasts the window plus that bound
  (``services.gateway.idempotency_kv.claim_ttl_s``: the bucket's ``max_age``, and this
  memory's ``window_s``) from the *last* request that publishes under the id: every request
  restarts the claim's timer before its publish -- the bucket's in its claim (a replay's
  claim writes the record again, :meth:`SharedClaims.claim`), this memory's as the publish
  starts (:meth:`Fingerprints.restart`). A replay's publish may store its message anew (the
  first request's was never stored, or its window ended): the intake's window then runs from
  the replay, which a timer kept from the first claim would not cover. Past that the intake
  takes the id as a new request, and so does this check. Between the end of the intake's
  window and the end of the claim (the bound, or longer after a replay that was a duplicate),
  a reuse with other content may be refused (409) though the intake would take it as new:
  the price of never letting other content through to the first answer. What remains: the
  claim's own round trip (its record is stored before the publish starts) and the last try's
  way to the server, milliseconds usually; a publish that nats-py queued just before its
  connection dropped goes out when the connection is back, after that bound perhaps (the
  gateway's connection buffers no publish while disconnected -- ``pending_size=0``,
  :meth:`services.gateway.adapter.GatewayService.start` -- so this is only what was queued
  in the moment of the loss); a message re-sent after the server lost its store
  (``REPUBLISHED_HEADER``) starts a new window in the new stream that no claim covers.
* **Fail open.** A claim the bucket does not answer (timeout, no bucket, an unreadable
  record) is decided by the local memory alone and the request goes on, counted
  (``idempotency_store_failed``) and logged: refusing every request with a client id while
  the bucket has trouble would turn a lost safety check into an outage, and the local
  memory still catches a reuse at this replica. Only a reuse at *another* replica in that
  time is missed (as before the bucket existed). Such a claim is written to the bucket as
  soon as it answers again (``idempotency_shared_late``), for as long as this memory keeps
  it: else another replica would take the id as new once the bucket is back, and its
  publish, a duplicate at the intake, would answer other content with this request's
  token. Found claimed there with other content meanwhile (both requests ran), it is
  counted (``idempotency_split``) and logged.
  A claim whose key keeps changing under it (:class:`services.gateway.idempotency_kv.
  ClaimContended`: a lagging replica of a clustered bucket, a burst of replays) is not
  failed open: the bucket does work and holds someone's claim of the id, so the request is
  refused for now (503, ``idempotency_contended``) and the client's retry claims it again.
* **Release.** A claim whose intake publish was definitely refused (no stream answered, the
  stream refused the message on a check it makes before storing -- a 4xx answer --, or
  nothing could be sent: ``services.gateway.adapter.publish_refused``) is withdrawn, so a
  retry with other content is not refused for a request that never ran -- by the last
  request at this gateway that holds the claim (counted from its local claim on, so one
  still waiting for the bucket counts), and only when no request that held it here since
  may have stored a message under it. What they wrote of it goes: the bucket's record where
  one of them made it and no one else wrote it since (a delete conditional on its revision),
  then the local entry they made. A publish that failed in any other way (a timeout above
  all, a 5xx answer) may have been stored all the same: its claim is kept and expires with
  the window, and a retry with other content gets 409 until then. A replay at another
  replica rewrites the record, so a withdrawal after it finds another revision and leaves
  the claim alone, and one before it makes the replay claim the id anew. A withdrawal the
  bucket does not decide (``idempotency_release_failed``) keeps the local entry and is tried
  again once the bucket answers (``idempotency_withdrawn_late``), and the local entry then
  goes too unless a request under the id came here since; one whose record another replica
  wrote leaves the claim to expire (its publish may have been refused too: a 409 for a
  while, never a wrong answer).
* **Size.** At most ``max_keys`` digests in the local memory; past that the oldest is
  forgotten early (counted in :attr:`Fingerprints.evicted`); the shared bucket still has it.

Keys (:func:`kv_key`): KV keys allow only ``[-/_=.a-zA-Z0-9]``. A request id (schema:
``[a-z0-9][a-z0-9_-]*``, at most 128 characters) is its own key, readable in ``nats kv ls``;
any other string -- none passes the schema today; the encoding keeps the bucket safe should
the id rules widen -- is ``=`` + its UTF-8 bytes in base64url without padding. ``=`` never
occurs in a plain key nor in unpadded base64url, so no two ids share a key.

Only client-given ids are remembered: the gateway's own (``new_request_id``, 128 random bits)
cannot be reused by accident, and remembering them would only push the others out.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import re
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final, NewType

from pydantic import Field

from shared.schemas import Message, WallTime

RequestDigest = NewType("RequestDigest", bytes)
"""A request's content digest (:func:`request_digest`)."""

_DIGEST_VERSION: Final[bytes] = b"vtm-request-v1\x00"
"""Leads every digest, so a change of what counts as content changes every digest."""


def request_digest(tokens: Sequence[int], max_tokens: int) -> RequestDigest:
    """The digest of a request's content: its prompt token ids and ``max_tokens`` (BLAKE2b,
    128 bits). Token ids are non-negative and (after ``check_limits``) below 2**31, so a
    signed 64-bit array holds each exactly; packing them as machine words keeps a 128k-token
    prompt at one C-level pass."""
    h = hashlib.blake2b(_DIGEST_VERSION, digest_size=16)
    h.update(max_tokens.to_bytes(8, "little"))
    h.update(len(tokens).to_bytes(8, "little"))
    packed = array("q", tokens)
    if packed.itemsize != 8:  # pragma: no cover - 'q' is 8 bytes on every CPython platform
        raise RuntimeError("array('q') is not 64-bit here")
    h.update(packed.tobytes())
    return RequestDigest(h.digest())


_PLAIN_KEY_RE: Final[re.Pattern[str]] = re.compile(r"^[A-Za-z0-9_-]+$")
ENCODED_KEY_MARK: Final[str] = "="
"""Leads a key that is an encoded request id (:func:`kv_key`)."""


def kv_key(request_id: str) -> str:
    """The idempotency bucket's key of ``request_id`` (module docstring, "Keys"): the id
    itself when it is made of ``[A-Za-z0-9_-]`` alone, else :data:`ENCODED_KEY_MARK` and the
    base64url (no padding) of its UTF-8 bytes. Injective, and always a legal KV key."""
    if _PLAIN_KEY_RE.match(request_id):
        return request_id
    raw = request_id.encode("utf-8", "surrogatepass")  # any str, lone surrogates too
    return ENCODED_KEY_MARK + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


class IdempotencyRecord(Message):
    """The value under a request id's key in the idempotency bucket (JSON)."""

    digest: str = Field(pattern=r"^[0-9a-f]{32}$", description="request_digest, hex")
    accepted_s: WallTime = Field(description="the first claim, Unix seconds (for people)")


class Claim(enum.Enum):
    """The outcome of :meth:`Fingerprints.claim`."""

    NEW = "new"
    """No digest kept for the id: this request's is kept now."""
    SAME = "same"
    """The id was accepted with this very content: an idempotent replay."""
    CONFLICT = "conflict"
    """The id was accepted with other content: refuse (409)."""


class Fingerprints:
    """Request id → content digest, for ``window_s`` from its acceptance or the last
    :meth:`restart` (the gateway gives its claim TTL and restarts it as each request's publish
    starts, module docstring "Window"), at most ``max_keys`` of them (module docstring).
    ``clock``: monotonic seconds (injected in tests).

    NOTE: an ``OrderedDict`` in order of (re)start. Every entry lives the same ``window_s``,
    so the oldest is always first: expiry and the size bound both pop from the front, O(1)
    per entry, and a restart moves its entry to the end (``move_to_end``, O(1)), where its
    new expiry belongs. ``window_s`` may be changed (the gateway reads the intake's window
    from its stream): an entry keeps the expiry it was given, and one given a shorter window
    after a longer one waits behind it -- kept longer, never shorter."""

    def __init__(self, window_s: float, max_keys: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys!r}")
        self.window_s = window_s
        self.max_keys = max_keys
        self._clock = clock
        self._kept: OrderedDict[str, tuple[RequestDigest, float]] = OrderedDict()
        self.evicted = 0
        """Digests forgotten before their window ended (the size bound)."""

    def __len__(self) -> int:
        return len(self._kept)

    def claim(self, request_id: str, digest: RequestDigest) -> Claim:
        """Whether ``request_id`` may carry ``digest``; a NEW claim is kept (undo it with
        :meth:`release` if the request is not accepted after all)."""
        now = self._clock()
        self._expire(now)
        kept = self._kept.get(request_id)
        if kept is not None:
            return Claim.SAME if kept[0] == digest else Claim.CONFLICT
        self._add(request_id, digest, now)
        return Claim.NEW

    def restart(self, request_id: str, digest: RequestDigest, *, add: bool = False) -> bool:
        """Start ``request_id``'s window again from now, if it is kept with ``digest`` (moved to
        the end); ``add``: keep it (as :meth:`claim` would) if it is not kept at all. False:
        kept with another digest (left alone), or not kept and not ``add``."""
        now = self._clock()
        self._expire(now)
        kept = self._kept.get(request_id)
        if kept is None:
            if not add:
                return False
            self._add(request_id, digest, now)
            return True
        if kept[0] != digest:
            return False
        self._kept.move_to_end(request_id)
        self._kept[request_id] = (digest, now + self.window_s)
        return True

    def digest(self, request_id: str) -> RequestDigest | None:
        """The digest kept for ``request_id``, None when none is (expired ones are dropped
        first)."""
        self._expire(self._clock())
        kept = self._kept.get(request_id)
        return None if kept is None else kept[0]

    def expires_at(self, request_id: str) -> float | None:
        """When ``request_id``'s digest is forgotten (``clock`` seconds), None when none is kept
        (expired ones are dropped first)."""
        self._expire(self._clock())
        kept = self._kept.get(request_id)
        return None if kept is None else kept[1]

    def _add(self, request_id: str, digest: RequestDigest, now: float) -> None:
        while len(self._kept) >= self.max_keys:
            self._kept.popitem(last=False)
            self.evicted += 1
        self._kept[request_id] = (digest, now + self.window_s)

    def release(self, request_id: str, digest: RequestDigest) -> None:
        """Forget a NEW claim whose request was not accepted (its intake publish was definitely
        refused), so that a retry with other content is not refused for a request that never
        ran. Only the very digest claimed is forgotten."""
        kept = self._kept.get(request_id)
        if kept is not None and kept[0] == digest:
            del self._kept[request_id]

    def _expire(self, now: float) -> None:
        while self._kept:
            _, (_, until) = next(iter(self._kept.items()))
            if until > now:
                return
            self._kept.popitem(last=False)


__all__ = ["ENCODED_KEY_MARK", "Claim", "Fingerprints", "IdempotencyRecord", "RequestDigest",
           "kv_key", "request_digest"]
