"""A service process's event loop (shared/servicemain.py ``quiet_cancelled_leftovers``): a
future dropped holding a cancellation is not reported as an error (nats-py's drain leaves one
when a stop gives the drain up), while any other exception a future or task drops still is."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from shared.servicemain import quiet_cancelled_leftovers


def _drop_future_with(exc: BaseException) -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fut.set_exception(exc)
    del fut
    gc.collect()


@pytest.mark.parametrize("handler", [None, quiet_cancelled_leftovers])
async def test_a_dropped_cancellation_is_not_reported_as_an_error(
        caplog: pytest.LogCaptureFixture, handler: object) -> None:
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(handler)  # type: ignore[arg-type]
    try:
        child = asyncio.ensure_future(asyncio.sleep(3600))
        gathered = asyncio.gather(child)
        await asyncio.sleep(0)
        # What nats-py's drain leaves when its wait is cancelled: the child cancelled, the
        # gather holding a CancelledError that nothing retrieves.
        gathered.cancel()
        with pytest.raises(asyncio.CancelledError):
            await child
        assert gathered.done() and not gathered.cancelled()
        with caplog.at_level(logging.DEBUG, logger="asyncio"):
            del gathered
            gc.collect()
        reported = [r for r in caplog.records
                    if r.name == "asyncio" and "never retrieved" in r.getMessage()]
        # asyncio's own handler reports it (so the test sees the case it is about); ours not.
        assert len(reported) == (1 if handler is None else 0)
    finally:
        loop.set_exception_handler(None)


async def test_any_other_dropped_exception_is_still_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(quiet_cancelled_leftovers)
    try:
        with caplog.at_level(logging.DEBUG, logger="asyncio"):
            _drop_future_with(RuntimeError("lost"))
        reported = [r for r in caplog.records
                    if r.name == "asyncio" and "never retrieved" in r.getMessage()]
        assert len(reported) == 1 and reported[0].exc_info is not None
        assert isinstance(reported[0].exc_info[1], RuntimeError)
    finally:
        loop.set_exception_handler(None)
