"""A stop's grace (``stop_grace_s``, 10 s by default) within the process's own stop deadline
(``stop_timeout_s``): a gateway process whose deadline is shorter than the grace -- as every
gateway ``vertumnus up`` starts is (its share of ``--stop-timeout``: about 2.3 s by default) --
still answers a request in flight 503 "stopping" and exits 0.

Found by a review of session 68's stop grace: the grace was taken whole, so the deadline
(shared/stopping.py) ended the process first -- exit 70, and a NATS completion in flight, which
a stop had answered 503 at once before the grace, got no answer at all: its caller waited out
its own timeout. WAIT_S is a hang guard only, no speed check."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

from nats.aio.client import Client

from services.gateway.grace import STOP_GRACE_S
from shared.natsserver import EmbeddedNats
from shared.service import ERROR_CODE_HEADER, ERROR_HEADER, STOPPING_DESCRIPTION, until_served
from shared.stopping import STOP_TIMEOUT_EXIT
from shared.subjects import Subjects

WAIT_S = 60.0  # hang guard, never a speed check
STOP_TIMEOUT_S = 6.0  # the process's stop deadline: below the default grace (10 s)
assert STOP_TIMEOUT_S < STOP_GRACE_S


def completion(rid: str) -> bytes:
    return json.dumps({"prompt_tokens": list(range(9)), "request_id": rid}).encode()


async def test_a_stop_deadline_shorter_than_the_grace_still_answers_503_and_exits_0(
        nats_server: EmbeddedNats, nc: Client, uniq: str) -> None:
    subjects = Subjects(uniq)
    intake = await nc.subscribe(subjects.intake_requests())  # the request reached intake
    env = {**os.environ, "VTM_NATS_URL": nats_server.url, "VTM_SUBJECT_PREFIX": uniq,
           "VTM_HTTP_PORT": "0", "VTM_RESULT_TIMEOUT_S": "600",
           "VTM_STOP_TIMEOUT_S": f"{STOP_TIMEOUT_S:g}", "VTM_LOG__FORMAT": "json"}
    env.pop("VTM_STOP_GRACE_S", None)  # the default grace, as `vertumnus up` leaves it
    proc = subprocess.Popen([sys.executable, "-m", "services.gateway.main"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await until_served(nc, subjects.gateway_completions(), timeout_s=WAIT_S)
        # No scheduler: the completion waits for its first token until the stop.
        answer = asyncio.create_task(nc.request(subjects.gateway_completions(),
                                                completion("deadline-1"), timeout=WAIT_S))
        await intake.next_msg(timeout=WAIT_S)
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, WAIT_S)
        err = proc.stderr.read().decode() if proc.stderr else ""
        # Before the fix: 70, the deadline ended the stop inside the grace.
        assert rc == 0, (rc, STOP_TIMEOUT_EXIT, err[-3000:])
        msg = await answer
        headers = msg.headers or {}
        assert headers.get(ERROR_CODE_HEADER) == "503", headers
        assert headers.get(ERROR_HEADER) == STOPPING_DESCRIPTION, headers
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        await intake.unsubscribe()


def test_the_grace_takes_at_most_its_share_of_the_stop_time_left() -> None:
    """No deadline armed (a service inside another program): the grace whole; else at most
    the share of the time left, none once the deadline has passed."""
    from services.gateway.grace import affordable_grace

    assert affordable_grace(10.0, None) == 10.0
    assert affordable_grace(10.0, 100.0) == 10.0
    assert 0 < affordable_grace(10.0, 2.0) < 2.0
    assert affordable_grace(0.0, 2.0) == 0.0
    assert affordable_grace(10.0, 0.0) == 0.0
    assert affordable_grace(10.0, -1.0) == 0.0
