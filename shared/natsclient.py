"""The NATS client every vertumnus connection is made with: nats-py's, minus ways to break it.

Contract:

* :class:`Client` is ``nats.aio.client.Client`` with these changes, the first three keeping
  its read loop alive where nats-py's would end; anything else is nats-py's:

  - a PONG whose waiter is done already (a flush given up) is consumed without touching that
    waiter, so the read loop goes on and the next PONG reaches the next flush;
  - a message whose header block is malformed (not ``NATS/1.0``-led, or one nats-py's parser
    raises on) is delivered with :data:`MALFORMED_HEADERS` as its only header, in place of
    what could not be read; a micro endpoint of :mod:`shared.service` answers such a request
    400;
  - a message whose subject or reply subject is not UTF-8 is dropped (nats-py could build no
    message of it; a reply subject it cannot spell could not be answered anyway);
  - a PING (a ``flush()``'s, or a periodic one) is queued behind the commands queued before
    it, so ``flush()`` ends only after the server has read them -- a subscription just made
    is in place for every other connection once it returns.
* :func:`connect` is ``nats.connect`` for it: same arguments, a connected :class:`Client`.
  Every connection the project opens itself is made by it (a service's, a rank host's, the
  torch KV hand-off's and decode role's, ``vertumnus up``'s, ``tap``'s); a plain client handed
  in by an embedding program is still guarded where the project cancels a flush itself
  (:func:`shared.service.shield_pongs`).

Why (PONG): nats-py answers a PONG by ``set_result`` on its oldest waiter without looking
whether it is done. ``flush(timeout=...)`` timing out (nats-py's own ``FlushTimeoutError``
path cancels the waiter and leaves it queued) or a cancelled drain leaves a cancelled waiter
there; the PONG that comes later raises ``InvalidStateError`` in the client's read loop,
which ends with a log line only. The connection then still looks connected but hands
nothing on -- no message, no ack, no reply -- until its pings go stale (minutes, by default).

Why (messages): nats-py parses a message in its read loop, and an exception there ends that
loop with a log line only, as above: the connection looks connected but never reads again
(for a service: deaf, every request in flight lost, until its pings go stale). Any client of
the server can send such a message -- ``HPUB`` with the 8-byte header block
``XXXX\\r\\n\\r\\n`` (IndexError), a reply subject of bytes that are not UTF-8
(UnicodeDecodeError) -- to any subject a service listens on, and JetStream stores it as it
came: a stream holding one breaks each consumer it is delivered to, again at every
redelivery. A marker, not a drop, for the headers: the message itself (its reply subject, a
JetStream delivery's ack subject) is sound, so a request can be refused and a delivery acked
or terminated, not left to come again.

Why (PING): nats-py writes a PING straight to the socket, ahead of commands still queued for
its flusher task, so ``subscribe(); flush()`` could return before the server had the
subscription: another connection's request right after found no responders (25 of 2,000
tries on an idle machine; none of 3,000 with the PING queued).

This overrides private methods and reads a private list (nats-py 2.16 has them, no public
hook). Should a nats-py lack the list, the PONG override falls back to the inherited
behaviour; should it no longer call a method overridden here, that override is merely
unused: nothing is lost that a plain client would have.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableSequence
from typing import Any, Final

import nats.aio.client

MALFORMED_HEADERS: Final[str] = "Vtm-Malformed-Headers"
"""The one header of a message whose header block could not be read (:class:`Client`); its
value says what was wrong. A message carrying it from a sender (forged) is as bad as one
given it here, and is treated alike."""

_HEADER_LINE: Final[bytes] = b"NATS/1.0"
_PING: Final[bytes] = b"PING\r\n"


class Client(nats.aio.client.Client):
    """``nats.aio.client.Client`` whose read loop survives a flush given up and a malformed
    message (module doc)."""

    async def _process_pong(self) -> None:
        """A PONG answers the oldest PING outstanding. When that PING's waiter is done already
        (cancelled: its flush timed out or was cancelled), a fresh future takes its place
        before nats-py's own handling, which then resolves that one: the PONG is consumed,
        and nats-py's bookkeeping (``_pongs_received``, ``_pings_outstanding``, whatever a
        later version adds) is done as it always is. Waiters are not skipped beyond the
        oldest: each PONG answers its own PING, so a waiting flush is never resolved by the
        PONG of an earlier PING (which would end it before the server read what it flushes).
        """
        pongs = getattr(self, "_pongs", None)  # private: nats-py's PONG waiters, oldest first
        if isinstance(pongs, MutableSequence) and pongs:
            oldest = pongs[0]
            if isinstance(oldest, asyncio.Future) and oldest.done():
                pongs[0] = asyncio.get_running_loop().create_future()
        await super()._process_pong()

    async def _send_ping(self, future: asyncio.Future[Any] | None = None) -> None:
        """A PING queued behind every command queued before it, not written ahead of them.

        nats-py writes a PING straight to the socket while the commands before it (a SUB
        just made, a PUB) may still wait in its queue for the flusher task, so a ``flush()``
        could end before the server had read them: after ``subscribe(); flush()`` another
        connection's request still found no responders about one time in 80 on an idle
        machine, more often on a loaded one (module doc). Queued, the PING goes out after
        them and its PONG comes after the server read them, which is what ``flush()``
        promises. The client's periodic PINGs go the same way, so PINGs reach the wire in the
        order their waiters were queued and each PONG answers its own PING's waiter."""
        pongs = getattr(self, "_pongs", None)  # private, as in _process_pong
        if not isinstance(pongs, MutableSequence) or not hasattr(self, "_send_command"):
            await super()._send_ping(future)
            return
        if future is None:
            future = asyncio.get_running_loop().create_future()
        pongs.append(future)
        await self._send_command(_PING)
        await self._flush_pending()

    async def _process_headers(self, headers: Any) -> dict[str, str] | None:
        """nats-py's parse of a message's header block, except that a block it cannot read
        -- not led by ``NATS/1.0`` (nats-py reads past its first 8 bytes unchecked and
        indexes the rest: IndexError on ``XXXX\\r\\n\\r\\n``), or any exception of its parser
        (a status line that is not UTF-8, ...) -- gives ``{MALFORMED_HEADERS: why}`` instead
        of ending the read loop (module doc)."""
        if headers and bytes(headers[:len(_HEADER_LINE)]) != _HEADER_LINE:
            return {MALFORMED_HEADERS: "no NATS/1.0 header line"}
        try:
            return await super()._process_headers(headers)
        except Exception as exc:  # any: raised here, it would end the read loop
            return {MALFORMED_HEADERS: f"unreadable header block ({type(exc).__name__})"}

    def _build_message(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                       headers: dict[str, str] | None) -> Any:
        """nats-py's message, or None -- which nats-py's ``_process_msg`` drops -- when the
        subject or reply subject is not UTF-8 (nats-py's decode would end the read loop)."""
        try:
            return super()._build_message(sid, subject, reply, data, headers)
        except UnicodeDecodeError:
            return None


async def connect(servers: str | list[str], **options: Any) -> Client:
    """``nats.connect`` with :class:`Client`: connect to ``servers`` with nats-py's
    ``Client.connect`` keyword ``options`` and return the connected client; raises what
    nats-py's connect raises."""
    nc = Client()
    await nc.connect(servers, **options)
    return nc
