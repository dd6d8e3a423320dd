"""The NATS client every vertumnus connection is made with: nats-py's, minus one way to break it.

Contract:

* :class:`Client` is ``nats.aio.client.Client`` with one change: a PONG whose waiter is done
  already (a flush given up) is consumed without touching that waiter, so the read loop goes
  on and the next PONG reaches the next flush. Anything else is nats-py's.
* :func:`connect` is ``nats.connect`` for it: same arguments, a connected :class:`Client`.
  Every connection the project opens itself is made by it (a service's, a rank host's, the
  torch KV hand-off's and decode role's, ``vertumnus up``'s, ``tap``'s); a plain client handed
  in by an embedding program is still guarded where the project cancels a flush itself
  (:func:`shared.service.shield_pongs`).

Why: nats-py answers a PONG by ``set_result`` on its oldest waiter without looking whether it
is done. ``flush(timeout=...)`` timing out (nats-py's own ``FlushTimeoutError`` path cancels
the waiter and leaves it queued) or a cancelled drain leaves a cancelled waiter there; the
PONG that comes later raises ``InvalidStateError`` in the client's read loop, which ends with
a log line only. The connection then still looks connected but hands nothing on -- no
message, no ack, no reply -- until its pings go stale (minutes, by default).

This overrides a private method and reads a private list (nats-py >=2.9,<3 have both and no
public hook). Should a nats-py lack either, the override falls back to the inherited
behaviour: nothing is lost that a plain client would have.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableSequence
from typing import Any

import nats.aio.client


class Client(nats.aio.client.Client):
    """``nats.aio.client.Client`` whose connection survives a flush given up (module doc)."""

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


async def connect(servers: str | list[str], **options: Any) -> Client:
    """``nats.connect`` with :class:`Client`: connect to ``servers`` with nats-py's
    ``Client.connect`` keyword ``options`` and return the connected client; raises what
    nats-py's connect raises."""
    nc = Client()
    await nc.connect(servers, **options)
    return nc
