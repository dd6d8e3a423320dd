"""``up``'s start honours a Ctrl-C whose cancel a ``wait_for`` inside nats-py dropped.

On Python 3.11 ``asyncio.wait_for`` (inside every nats-py flush and request: the health
pings, the epoch-record reads) returns the reply and drops a cancel that lands in the loop
iteration in which the reply arrives (shared/tasks.py). ``run_up`` turns Ctrl-C / SIGTERM into
a cancel of its task; dropped during the start, the start went on to a healthy stack and the
replay, as if nothing had been pressed (a SIGTERM, often the only one before a SIGKILL, then
cost the report). A real nats-server; the test drops the cancel through a real ``wait_for``
whose reply and cancel land in one step, which a reply over the wire cannot time exactly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.client import Client

from vertumnus.live.stack import LiveStack, StackError, UpConfig


async def _swallowed_ctrl_c() -> None:
    """Leave the current task as nats-py's wait_for leaves it: cancelled (``cancelling()``
    1), with no CancelledError on its way."""
    me = asyncio.current_task()
    assert me is not None
    reply = asyncio.get_running_loop().create_future()

    def reply_and_ctrl_c() -> None:
        reply.set_result(None)  # the PONG / the KV reply arrives ...
        me.cancel()  # ... and run_up's signal handler runs in the same step

    asyncio.get_running_loop().call_soon(reply_and_ctrl_c)
    await asyncio.wait_for(reply, 5)
    assert me.cancelling() == 1


@pytest.mark.parametrize("wait", ["wait_healthy", "wait_epoch_record", "wait_pings"])
async def test_a_swallowed_ctrl_c_ends_the_start_s_waits(nc: Client, uniq: str, tmp_path: Path,
                                                          wait: str) -> None:
    # Nothing of this deployment runs: without the check each wait went on to its deadline
    # (a StackError; in a real start: on to a healthy stack and the replay).
    stack = LiveStack(UpConfig(prefix=uniq, health_timeout_wall_s=2.0), log_dir=tmp_path)
    stack.nc = nc
    coro = stack.wait_pings("vtm-nothing") if wait == "wait_pings" else getattr(stack, wait)()
    await _swallowed_ctrl_c()
    try:
        with pytest.raises(asyncio.CancelledError):
            await coro
    except StackError as exc:  # pragma: no cover - the failure this test is about
        pytest.fail(f"{wait} ignored the interrupt: {exc}")
    finally:
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
