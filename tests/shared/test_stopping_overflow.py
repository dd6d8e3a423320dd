"""shared/stopping.py with a stop bound too large for the interpreter's fault handler (whose
clock overflows near 1e10 s): a stop signal still sets the stop event, arms the deadline the
event loop can keep, and raises nothing in the signal callback. Settings refuse such a bound
(tests/shared/test_settings_values.py); this is the stopping module's own robustness, run in
a fresh process, as bound_stops marks the whole process a service process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A process bounded by a huge stop timeout that handles the stop signals and sends itself
# SIGTERM; the loop's exception handler records what a callback raised (asyncio would only
# log it). It prints whether the stop event was set, what callbacks raised, and whether a
# second arm_stop_deadline found the deadline armed already (it then returns False).
PROCESS = """
import asyncio, os, signal, sys
from contextlib import AsyncExitStack
from shared.stopping import arm_stop_deadline, bound_stops, handle_stop_signals

bound_stops(float(sys.argv[1]))
raised = []

async def main():
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: raised.append(repr(ctx.get("exception"))))
    stop = asyncio.Event()
    async with AsyncExitStack() as stack:
        handle_stop_signals(stack, stop)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 60)
        await asyncio.sleep(0)
        print("> stop set:", stop.is_set(), flush=True)
        print("> raised:", raised, flush=True)
        print("> armed again:", arm_stop_deadline(), flush=True)
    print("> done", flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("timeout_s", ["1e300", "1e12"])
def test_a_stop_bound_the_fault_handler_cannot_take_raises_nothing_on_a_signal(
        timeout_s: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PROCESS, timeout_s], cwd=REPO, text=True,
                          capture_output=True, timeout=60,
                          env={**os.environ, "VTM_LOG__FORMAT": "console"})
    assert proc.returncode == 0, proc.stderr
    # (structlog, not configured here, logs to stdout; the test's lines start with "> ".)
    lines = [x[2:] for x in proc.stdout.splitlines() if x.startswith("> ")]
    assert lines == ["stop set: True", "raised: []", "armed again: False", "done"], (
        proc.stdout, proc.stderr)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "Exception in callback" not in out, out
    assert "no hard stop deadline" in out, out


ARM = """
import asyncio, sys
from shared.stopping import arm_stop_deadline, bound_stops

bound_stops(float(sys.argv[1]))

async def main():
    print("> armed:", arm_stop_deadline(), flush=True)

asyncio.run(main())
"""


def test_arming_a_huge_deadline_returns_armed() -> None:
    proc = subprocess.run([sys.executable, "-c", ARM, "1e300"], cwd=REPO, text=True,
                          capture_output=True, timeout=60,
                          env={**os.environ, "VTM_LOG__FORMAT": "console"})
    assert proc.returncode == 0, proc.stderr
    assert [x for x in proc.stdout.splitlines() if x.startswith("> ")] == ["> armed: True"], (
        proc.stdout, proc.stderr)


@pytest.mark.parametrize("timeout_s", [float("inf"), float("-inf")])
def test_bound_stops_refuses_a_bound_that_is_not_finite(timeout_s: float) -> None:
    from shared.stopping import bound_stops

    with pytest.raises(ValueError, match="timeout_s must be > 0 and finite"):
        bound_stops(timeout_s)
