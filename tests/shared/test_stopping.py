"""shared/stopping.py: a service process's graceful stop is bounded in time, and a process
told its parent's pid stops once that parent is gone -- real processes and real signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.settings import ServiceSettings
from shared.stopping import (
    HARD_GRACE_S,
    STOP_TIMEOUT_EXIT,
    arm_stop_deadline,
    bound_stops,
    pending_tasks,
    watch_parent,
)

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # bound on correctness waits only; nothing asserts on speed

# A service process in miniature: run_service (as every service main) around a serve
# coroutine that handles the stop signals and, by mode, stops cleanly, hangs in its cleanup
# or blocks its event loop once stopping.
SERVICE = """
import asyncio, sys, time
from contextlib import AsyncExitStack
from shared.servicemain import run_service
from shared.settings import ServiceSettings
from shared.stopping import handle_stop_signals

MODE = sys.argv[1]

async def stuck_cleanup():
    await asyncio.create_task(asyncio.Event().wait(), name="stuck-cleanup")

async def serve(settings):
    stop = asyncio.Event()
    async with AsyncExitStack() as stack:
        handle_stop_signals(stack, stop)
        if MODE == "hang":
            stack.push_async_callback(stuck_cleanup)
        print("ready", flush=True)
        await stop.wait()
        if MODE == "block":
            time.sleep(3600)
    print("stopped", flush=True)

run_service(ServiceSettings(), serve)
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "VTM_LOG__FORMAT": "console", "VTM_TELEMETRY__EXPORTER": "none",
            **extra}


def _start(mode: str, **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVICE, mode], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(**env))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=WAIT_S)
    return proc


def test_a_clean_stop_exits_0_without_the_deadline() -> None:
    # A deadline far beyond any clean stop, however slow the machine: a deadline that fires
    # regardless (armed at 0, or not waiting for its timeout) still shows as exit 70 and
    # "overran"; the test never races a short deadline.
    proc = _start("clean", VTM_STOP_TIMEOUT_S="60")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert "stopped" in out
    assert "overran" not in err


def test_a_stop_hanging_in_its_cleanup_is_ended_naming_what_it_waits_for() -> None:
    proc = _start("hang", VTM_STOP_TIMEOUT_S="1")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == STOP_TIMEOUT_EXIT, err
    assert "graceful stop overran its deadline" in err
    assert "stuck-cleanup" in err  # the pending task, by name
    assert "stopped" not in out


def test_a_stop_blocking_the_event_loop_is_ended_by_the_fault_handler() -> None:
    proc = _start("block", VTM_STOP_TIMEOUT_S="0.5")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S + HARD_GRACE_S)
    assert proc.returncode == 1, err
    # faulthandler's dump: every thread's stack, the main one stuck in serve's sleep.
    assert "Timeout (0:00:05" in err and "in serve" in err, err


def test_a_process_whose_parent_dies_stops_gracefully(tmp_path: Path) -> None:
    # A parent that starts the service with VTM_PARENT_PID (and no parent-death signal), waits
    # for it to be ready, then dies by SIGKILL.
    out, log = tmp_path / "service.out", tmp_path / "service.log"
    parent = f"""
import os, signal, subprocess, sys, time
with open({str(out)!r}, "w") as o, open({str(log)!r}, "w") as e:
    child = subprocess.Popen([sys.executable, "-c", {SERVICE!r}, "clean"], cwd={str(REPO)!r},
                             stdout=o, stderr=e, env={{**os.environ,
                                                      "VTM_PARENT_PID": str(os.getpid())}})
deadline = time.monotonic() + {WAIT_S}
while "ready" not in open({str(out)!r}).read() and time.monotonic() < deadline:
    time.sleep(0.05)
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", parent], cwd=REPO, text=True,
                          capture_output=True, timeout=2 * WAIT_S, env=_env(VTM_LOG__FORMAT="json"))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = int(proc.stdout.strip())
    _wait_until(lambda: not _alive(pid), f"the orphaned service {pid} to stop")
    assert out.read_text().split() == ["ready", "stopped"], log.read_text()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(e["event"] == "parent process gone; stopping" for e in events)
    assert any(e["event"] == "stop signal received" and e["signal"] == "SIGTERM"
               for e in events)


def test_watch_parent_calls_back_once_the_parent_is_not_the_given_one() -> None:
    gone = threading.Event()
    # Not our parent from the start: the first check already calls back.
    thread = watch_parent(os.getppid() + 1 if os.getppid() > 1 else 2, poll_s=0.01,
                          on_gone=gone.set)
    assert gone.wait(WAIT_S)
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_watch_parent_keeps_watching_while_the_parent_lives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The watcher's getppid counts its polls, answering the parent until told it is gone:
    # the test waits for a number of polls, not for a time.
    import shared.stopping as stopping

    parent = os.getppid()
    polls = 0
    parent_gone = False
    calls: list[int] = []
    cond = threading.Condition()

    def counting_getppid() -> int:
        nonlocal polls
        with cond:
            polls += 1
            cond.notify_all()
            return parent + 1 if parent_gone else parent

    def on_gone() -> None:
        with cond:
            calls.append(polls)
            cond.notify_all()

    monkeypatch.setattr(stopping.os, "getppid", counting_getppid)
    thread = watch_parent(parent, poll_s=0.001, on_gone=on_gone)
    with cond:
        # Stop waiting early if the watcher calls back: that is the failure under test.
        assert cond.wait_for(lambda: polls >= 50 or calls, timeout=WAIT_S)
        assert calls == [], f"called back after {calls[0]} polls of a living parent"
        assert thread.is_alive()
        parent_gone = True  # and now the parent goes: the watcher calls back once and ends
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert len(calls) == 1 and calls[0] > 50


@pytest.mark.parametrize("pid", [0, -3])
def test_watch_parent_refuses_a_pid_that_is_no_process(pid: int) -> None:
    with pytest.raises(ValueError, match="parent_pid must be > 0"):
        watch_parent(pid)


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan")])
def test_bound_stops_refuses_a_timeout_that_is_no_bound(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        bound_stops(timeout_s)


async def test_in_a_process_without_a_bound_a_stop_arms_nothing() -> None:
    # The test process never called bound_stops: services run inside it are never ended.
    assert arm_stop_deadline() is False


async def test_pending_tasks_names_each_task_and_where_it_waits() -> None:
    task = asyncio.create_task(asyncio.Event().wait(), name="waiting-one")
    await asyncio.sleep(0)
    try:
        lines = pending_tasks()
        (line,) = [x for x in lines if x.startswith("waiting-one: ")]
        assert " at " in line and "locks.py" in line  # Event.wait's frame
        assert not any(x.startswith("Task-") and "test_pending_tasks" in x for x in lines)
    finally:
        task.cancel()


@pytest.mark.parametrize(("field", "value"), [("stop_timeout_s", "0"),
                                              ("stop_timeout_s", "inf"),
                                              ("parent_pid", "0")])
def test_settings_refuse_an_unusable_stop_setting(field: str, value: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"VTM_{field.upper()}", value)
    with pytest.raises(ValueError, match=field):
        ServiceSettings()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
