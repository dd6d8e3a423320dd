"""Raw NATS protocol frames that no client library writes: a message with a malformed header
block, written on a socket of the test's own to a real nats-server. (A unique module name for
``--import-mode=importlib``; tests/conftest.py makes it importable.
Shared by the tests of every folder that sends such frames.)"""

from __future__ import annotations

import asyncio

from shared.natsserver import EmbeddedNats

WAIT_S = 15.0  # bound on the server's answer (a liveness bound, never a speed check)

BAD_BLOCK = b"XXXX\r\n\r\n"
"""A header block nats-py cannot read (no ``NATS/1.0`` line: IndexError in its parser);
``shared.natsclient.Client`` delivers the message marked ``Vtm-Malformed-Headers``."""


def hpub(subject: bytes, block: bytes, payload: bytes = b"", reply: bytes = b"") -> bytes:
    """An ``HPUB`` of ``payload`` with the header block ``block`` as it is."""
    head = b"HPUB " + subject + (b" " + reply if reply else b"")
    return head + b" %d %d\r\n" % (len(block), len(block) + len(payload)) + block + payload \
        + b"\r\n"


async def send_raw(server: EmbeddedNats, frames: bytes) -> None:
    """Write protocol ``frames`` on a raw connection of their own and wait for the PONG of a
    PING sent after them: the server has taken (and routed) every one."""
    host, port = server.url.split("//", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)  # INFO
        writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n'
                     + frames + b"PING\r\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)
        assert line == b"PONG\r\n", line  # no -ERR: the server took the frames
    finally:
        writer.close()
        await writer.wait_closed()
