"""A service's start-up flushes, bounded by a setting (``connect_timeout_s``) -- nats.micro's own
included -- and named when unanswered.

Contract:

* :func:`flush_within` is ``nc.flush(timeout=timeout_s)`` whose timeout raises
  :class:`StartUpFlushTimeout`: a ``nats.errors.FlushTimeoutError`` still (so a start-up that
  meets it counts as one whose server was lost: :func:`shared.service.lost_server`), whose text
  names the server that did not answer (no user or password), the step and the bound.
* :class:`BoundedStartService` is nats.micro's ``Service`` whose ``start`` -- its
  PING/INFO/STATS subscriptions, then a flush -- flushes by :func:`flush_within`; anything else
  is nats.micro's. A start that fails (its flush unanswered, or cancelled) has made
  subscriptions already: its caller takes them back (``shared.service``).

Why: nats.micro's ``Service.start`` (nats-py 2.16; ``add_service`` calls it) flushes with
``flush()``'s default timeout, 10 s, and takes no timeout: a server frozen there held a
service's start-up 10 s whatever its settings said, while its other start-up round trips
were bounded by ``connect_timeout_s``.

NOTE: nats.micro keeps the connection a ``Service`` uses only privately (``_client``, nats-py
2.16); during ``start`` it is a view of that connection whose ``flush`` is bounded. Should a
nats-py lack it, the start is nats.micro's own, unbounded: nothing is lost that
``add_service`` would have had.
"""

from __future__ import annotations

from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.micro.service import Service, ServiceConfig

__all__ = ["BoundedStartService", "StartUpFlushTimeout", "flush_within", "server_shown"]


class StartUpFlushTimeout(nats.errors.FlushTimeoutError):
    """A start-up's flush not answered within its bound; its text says by which server, at
    which step, and the bound (``nats.errors.FlushTimeoutError``'s own says only ``nats:
    flush timeout``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


def server_shown(nc: Client) -> str:
    """The server ``nc`` is connected to, fit for a message: ``scheme://host:port``, without
    the user and password a URL may carry; ``its NATS server`` when not connected."""
    url = nc.connected_url
    if url is None:
        return "its NATS server"
    return f"{url.scheme}://{url.netloc.rpartition('@')[2]}"


async def flush_within(nc: Client, timeout_s: float, *, step: str,
                       setting: str = "connect_timeout_s") -> None:
    """Flush ``nc`` -- a PING after what was sent before it; returns once its PONG came --
    for at most ``timeout_s`` (the value of ``setting``); raises :class:`StartUpFlushTimeout`,
    naming the server, ``step`` and the bound, when no PONG came by then, and what nats-py's
    flush raises otherwise (a connection closed, ...)."""
    try:
        await nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # int in the stubs
    except StartUpFlushTimeout:
        raise
    except nats.errors.FlushTimeoutError as exc:
        raise StartUpFlushTimeout(
            f"nats: flush timeout: {server_shown(nc)} did not answer the start-up's flush "
            f"({step}) within {setting} = {timeout_s:g} s") from exc


class _FlushBounded:
    """``nc`` as nats.micro's ``Service.start`` uses it (subscribe, flush), except that its
    ``flush`` is :func:`flush_within` ``timeout_s`` (a shorter timeout asked for is kept)."""

    def __init__(self, nc: Client, timeout_s: float, step: str) -> None:
        self._nc = nc
        self._timeout_s = timeout_s
        self._step = step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nc, name)

    async def flush(self, timeout: float | None = None) -> None:
        bound = self._timeout_s if timeout is None else min(timeout, self._timeout_s)
        await flush_within(self._nc, bound, step=self._step)


class BoundedStartService(Service):
    """nats.micro's ``Service`` whose :meth:`start` flushes within ``flush_timeout_s`` (module
    doc). Made, then started, by its caller -- not by ``add_service``, which returns nothing
    to take back when the start fails."""

    def __init__(self, client: Client, config: ServiceConfig, *,
                 flush_timeout_s: float) -> None:
        super().__init__(client, config)
        self.flush_timeout_s = flush_timeout_s

    async def start(self) -> None:
        """nats.micro's start: subscribe PING/INFO/STATS (each for all services, this name,
        this id), then flush -- within ``flush_timeout_s``, raising
        :class:`StartUpFlushTimeout` past it. The subscriptions made stay on a failure (see
        ``self._subscriptions``): the caller takes them back."""
        nc = getattr(self, "_client", None)
        if nc is None:  # a nats-py without it: nats.micro's own start (module doc)
            await super().start()
            return
        self._client = _FlushBounded(nc, self.flush_timeout_s,
                                     "adding the micro service")  # type: ignore[assignment]
        try:
            await super().start()
        finally:
            self._client = nc
