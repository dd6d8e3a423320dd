"""``vertumnus tap``: print the messages on a subject, decoded by their ``Content-Type``.

The ``nats`` CLI is not installable on these machines (conventions.md), so this is how a
person reads the live system's traffic: JSON pretty-printed, msgpack decoded (bytes fields
summarised), anything else summarised as binary. Headers are shown (except the trace context
unless ``show_trace``); micro errors stand out. They are replies, on the requester's
``_INBOX.*`` subject, as the epoch records and worker states are JetStream KV writes on
``$KV.<PREFIX>_EPOCH.>`` / ``$KV.<PREFIX>_WORKERS.>``: a filter of ``vtm.>`` shows none of
them, ``>`` all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any, Final

import msgpack
import nats
from nats.aio.msg import Msg

from shared.ids import InvalidInput
from shared.logging import quiet_ssl_eof_warning
from shared.natsauth import env_nats_security_options
from shared.natsclient import connect
from shared.schemas import JSON, MSGPACK, content_type_of

PREVIEW_BYTES: Final[int] = 16
_TRACE_HEADERS: Final[frozenset[str]] = frozenset({"traceparent", "tracestate", "baggage"})


def _summarise_bytes(b: bytes) -> str:
    head = b[:PREVIEW_BYTES].hex(" ")
    return f"<{len(b)} bytes: {head}{' …' if len(b) > PREVIEW_BYTES else ''}>"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray)):
        return _summarise_bytes(bytes(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def render_payload(data: bytes, headers: dict[str, str] | None) -> tuple[str, str]:
    """(kind, text) of one payload: kind is 'json', 'msgpack', 'text', 'binary' or 'empty'."""
    if not data:
        return "empty", ""
    declared = headers is not None and any(k.lower() == "content-type" for k in headers)
    ctype = content_type_of(headers)
    if ctype == MSGPACK:
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
            return "msgpack", json.dumps(_jsonable(obj), indent=2, sort_keys=True)
        except (ValueError, TypeError, msgpack.UnpackException):
            return "binary", "undecodable msgpack " + _summarise_bytes(data)
    if ctype == JSON:
        try:
            return "json", json.dumps(json.loads(data), indent=2, sort_keys=True)
        except (ValueError, UnicodeDecodeError):
            if declared:
                return "binary", "invalid JSON " + _summarise_bytes(data)
    try:
        text = data.decode("utf-8")
        if text.isprintable() or all(c.isprintable() or c in "\r\n\t" for c in text):
            return "text", text
    except UnicodeDecodeError:
        pass
    return "binary", _summarise_bytes(data)


def format_message(msg: Msg, *, show_trace: bool = False, now: float | None = None) -> str:
    """One message as text: a header line, headers, the decoded body."""
    headers = dict(msg.headers or {})
    kind, body = render_payload(msg.data, headers)
    stamp = time.strftime("%H:%M:%S", time.localtime(now or time.time()))
    line = f"[{stamp}] {msg.subject}  ({kind}, {len(msg.data)} bytes"
    if msg.reply:
        line += f", reply {msg.reply}"
    line += ")"
    shown = {k: v for k, v in headers.items()
             if show_trace or k.lower() not in _TRACE_HEADERS}
    out = [line]
    if any(k.startswith("Nats-Service-Error") for k in shown):
        out.append(f"  ! micro error {shown.get('Nats-Service-Error-Code', '?')}: "
                   f"{shown.get('Nats-Service-Error', '')}")
    out += [f"  {k}: {v}" for k, v in sorted(shown.items())]
    if body:
        out += ["  " + ln for ln in body.splitlines()]
    return "\n".join(out)


async def connect_cli(url: str, name: str, *, timeout_s: float = 5.0) -> nats.NATS:
    """Connect a command-line tool to NATS, or raise ``OSError`` naming the URL.

    nats-py keeps retrying an unreachable server for minutes, printing a traceback each time
    (its default error callback); a tool should say at once that it cannot reach it. Errors
    after the connection was made (a server restart) are one line on stderr each.

    Credentials and TLS come from the same ``VTM_NATS_*`` variables as the services'
    (:mod:`shared.natsauth`), and only those (:func:`~shared.natsauth.env_nats_security_options`:
    a tool reads no other setting); a bad one raises ``OSError`` naming it."""
    quiet_ssl_eof_warning()
    try:
        secure = env_nats_security_options()
    except InvalidInput as exc:
        raise OSError(str(exc)) from None
    connected = False

    async def on_error(exc: Exception) -> None:
        if connected:
            print(f"nats: {exc!r}", file=sys.stderr)

    try:
        nc = await asyncio.wait_for(
            connect(url, name=name, connect_timeout=timeout_s, error_cb=on_error, **secure),
            timeout_s + 1.0)
    except TimeoutError:
        raise OSError(f"no server answered within {timeout_s:g} s") from None
    except (OSError, nats.errors.Error) as exc:
        raise OSError(repr(exc)) from None
    connected = True
    return nc


async def tap(url: str, subject: str, *, count: int | None = None,
              timeout_s: float | None = None, show_trace: bool = False,
              out: Callable[[str], None] = print, queue: str = "",
              connect_timeout_s: float = 5.0) -> int:
    """Subscribe and print until ``count`` messages, ``timeout_s`` or cancellation.

    Returns the number of messages printed. Raises ``BrokenPipeError`` once ``out`` does
    (the reader went away: ``tap | head``); the subscription ends then, not at its count.
    """
    nc = await connect_cli(url, "vertumnus-tap", timeout_s=connect_timeout_s)
    seen = 0
    done = asyncio.Event()
    closed: list[BrokenPipeError] = []

    async def on_msg(msg: Msg) -> None:
        nonlocal seen
        if (count is not None and seen >= count) or closed:
            return
        seen += 1
        try:
            out(format_message(msg, show_trace=show_trace))
        except BrokenPipeError as exc:  # nobody reads any more: nothing left to do
            closed.append(exc)
            done.set()
            return
        if count is not None and seen >= count:
            done.set()

    try:
        await nc.subscribe(subject, queue=queue, cb=on_msg)
        await nc.flush()
        out(f"# listening on {subject!r} at {url}")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await done.wait()
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
    if closed:
        raise closed[0]
    return seen


__all__ = ["format_message", "render_payload", "tap"]
