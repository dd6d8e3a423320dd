"""What a failed JetStream publish says: whether it stored nothing, and whether trying again
within seconds may succeed. One classification for every publisher of the project's streams:
the gateway's intake publish (services/gateway/adapter.py) and a rank daemon's hand-back of a
request to intake (services/rankd/service.py). Pure: exceptions in, booleans out.
"""

from __future__ import annotations

from typing import Final

import nats.errors
from nats.js.errors import APIError, NoStreamResponseError


def publish_refused(exc: BaseException) -> bool:
    """Whether a failed JetStream publish definitely stored nothing, so that its request id's
    claim may be withdrawn:

    * no responders (``NoStreamResponseError``, nats-py's form of ``NoRespondersError`` for a
      JetStream publish): the server found no stream (nor anything else) listening on the
      subject, so the message went nowhere;
    * nothing sent: ``OutboundBufferLimitError``, raised by nats-py before it queues a publish
      while its connection is down (the gateway's buffers nothing then:
      :meth:`services.gateway.adapter.GatewayService.start`);
    * an ``APIError`` answer below 500: the stream refused the message on a check it makes
      before storing (too large, a failed expectation of sequence or message id, a bad
      request).

    Everything else is indeterminate: a timeout (the message may be stored, only the ack
    lost or late), a connection closed (perhaps after the request went out), a cancel, a 5xx
    answer -- "JetStream temporarily unavailable", a store that failed: in a cluster the write
    may have been replicated before the leader failed it; a full stream ("maximum messages
    exceeded", a check before storing) shares its code 10077 with store failures and is
    counted with them -- anything unforeseen, and, for simplicity, a connection draining as
    the gateway stops (nothing sent then, but the claim may as well expire). The claim is
    then kept (it expires with the window): a client that retries with other content is
    refused (409) for a while, but withdrawing a claim whose message landed would let other
    content under the id through to the first request's answer -- a wrong answer given as
    right."""
    if isinstance(exc, NoStreamResponseError | nats.errors.NoRespondersError
                  | nats.errors.OutboundBufferLimitError):
        return True
    return isinstance(exc, APIError) and exc.code is not None and exc.code < 500


STREAM_STORE_FAILED: Final[int] = 10077
"""JetStream API error code (answered with 503) of a message the stream did not store: a
store that failed, or a full stream that discards new messages ("maximum messages exceeded",
"maximum bytes exceeded")."""
LASTING_5XX: Final[frozenset[int]] = frozenset({
    STREAM_STORE_FAILED,
    10023,  # "insufficient resources": the server's JetStream limits are reached
    10039,  # "JetStream not enabled for account"
    10076,  # "JetStream not enabled"
})
"""JetStream API error codes answered with a 5xx that a retry within seconds does not
change: they fail a request at once (:func:`publish_transient`)."""


def publish_transient(exc: APIError) -> bool:
    """Whether a JetStream ``APIError`` answer to a publish may go away within seconds, so
    that the gateway's intake publish tries again (up to ``nats_wait_s``; a rank daemon's
    hand-back, up to its redirect deadline): a 5xx
    answer -- "JetStream system temporarily unavailable" (10008) during a leader election
    or while JetStream recovers its store, a server error -- except a store that failed or a
    full stream (:data:`STREAM_STORE_FAILED`) and the other lasting conditions of
    :data:`LASTING_5XX` (resources exhausted, JetStream off), which stay for longer than a
    request waits.
    An answer below 500 is final (the stream refused the message on a check it makes before
    storing: the same message fails it again), and so is one without a code. Whether the
    message may be stored is :func:`publish_refused`'s question, not this one's."""
    return exc.code is not None and exc.code >= 500 and exc.err_code not in LASTING_5XX


__all__ = ["LASTING_5XX", "STREAM_STORE_FAILED", "publish_refused", "publish_transient"]
