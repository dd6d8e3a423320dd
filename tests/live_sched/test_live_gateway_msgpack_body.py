"""The gateway's NATS endpoint answers a body that is no msgpack, sent as msgpack, with a 400
saying what it took the body for -- not "not valid JSON", which sends the client looking
for JSON it never sent. Real nats-server, real gateway."""

from __future__ import annotations

import pytest
from live_sched_support import Services
from nats.aio.client import Client

from shared.schemas import MSGPACK, FirstToken
from shared.service import RemoteError, call
from shared.subjects import Subjects


@pytest.mark.parametrize("raw", [b"\xc1", b"\x93\x01"], ids=["never-used-byte", "truncated"])
async def test_a_bad_msgpack_body_is_said_to_be_no_msgpack(live: Services, nc: Client,
                                                           uniq: str, raw: bytes) -> None:
    await live.gateway()
    subject = Subjects(uniq).gateway_completions()
    with pytest.raises(RemoteError) as err:
        await call(nc, subject, raw, FirstToken, timeout_s=10,
                   headers={"Content-Type": MSGPACK})
    assert err.value.code == 400, err.value
    assert "msgpack" in err.value.description and "JSON" not in err.value.description, \
        err.value.description
