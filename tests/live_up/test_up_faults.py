"""Fault injection of ``vertumnus up``: a child killed and started again with real processes
(:class:`ChildSet`), and the timing task (:func:`run_crash`) that does it during the replay.
The end-to-end run with a real stack is in test_up_run.py."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import pytest
from live_up_support import alive, wait_until

from vertumnus.live.faults import CrashPlan, FaultEvent, run_crash
from vertumnus.live.procs import ChildFailed, ChildSet, ChildSpec
from vertumnus.live.stack import MAX_RESTARTS, LiveStack, UpConfig

_SLEEP = "import time; print('started', flush=True); time.sleep(60)"


def _spec(name: str) -> ChildSpec:
    return ChildSpec(name, [sys.executable, "-c", _SLEEP])


def test_kill_then_restart_gives_one_live_new_child_in_its_place(tmp_path: Path) -> None:
    children = ChildSet(tmp_path, stop_timeout_s=5.0)
    try:
        first = children.start(_spec("first"))
        victim = children.start(_spec("victim"))
        last = children.start(_spec("last"))
        wait_until(lambda: (tmp_path / "victim.log").read_text().count("started") == 1,
                   "the victim to start")

        status = children.kill(victim)
        assert status == -9  # SIGKILL: a crash, not a shutdown
        assert not alive(victim.pid)
        assert [c.name for c in children.children] == ["first", "last"]
        children.check()  # the killed child is not reported as one that died

        new = children.restart(victim)
        assert new.pid != victim.pid and alive(new.pid)
        assert new.spec is victim.spec
        # One entry for it, in its old place of the stop order (reverse start order).
        assert [c.name for c in children.children] == ["first", "victim", "last"]
        assert children.find("victim") is new and children.pids == [first.pid, new.pid, last.pid]
        # Its log continues in the same file.
        wait_until(lambda: (tmp_path / "victim.log").read_text().count("started") == 2,
                   "the restarted child to log")
        with pytest.raises(ValueError, match="restarted already"):
            children.restart(victim)  # its place is taken
        with pytest.raises(ValueError, match="not a child of this set"):
            children.kill(victim)

        codes = children.stop()
        assert codes == {"first": -15, "victim": -15, "last": -15}  # the new one, by SIGTERM
        assert not any(alive(p) for p in (first.pid, new.pid, last.pid))
    finally:
        children.stop(timeout_s=1.0)


def test_supervision_restarts_an_exited_child_a_bounded_number_of_times(tmp_path: Path) -> None:
    """LiveStack.restart_exited: a child that exits (here at once, status 75: a rank host
    asking for a restart) is started again from its spec, at most MAX_RESTARTS times; then it
    stays exited and check() reports it. A running child is left alone."""
    stack = LiveStack(UpConfig(gpus=4), log_dir=tmp_path)
    try:
        keeps = stack.children.start(_spec("keeps"))
        quits = stack.children.start(
            ChildSpec("quits", [sys.executable, "-c", "raise SystemExit(75)"]))
        seen = [quits.pid]
        for _ in range(MAX_RESTARTS):
            wait_until(lambda: stack.children.find("quits").proc.poll() is not None,
                       "the child to exit")
            assert stack.exited_for_good() == []  # not while it is still restarted
            [(name, old, status, new)] = stack.restart_exited()
            assert (name, old, status) == ("quits", seen[-1], 75) and new not in seen
            seen.append(new)
        wait_until(lambda: stack.children.find("quits").proc.poll() is not None, "last exit")
        assert stack.restart_exited() == []  # past the limit: left exited
        # ... and reported once as exited for good (up says so and exits 1 after its report).
        assert stack.exited_for_good() == [("quits", seen[-1], 75)]
        assert stack.exited_for_good() == []
        with pytest.raises(ChildFailed, match="quits"):
            stack.children.check()
        assert stack.children.find("keeps") is keeps and alive(keeps.pid)
    finally:
        stack.children.stop(timeout_s=1.0)


def test_restart_of_a_running_child_kills_it_first(tmp_path: Path) -> None:
    children = ChildSet(tmp_path, stop_timeout_s=5.0)
    try:
        old = children.start(_spec("only"))
        new = children.restart(old)
        assert not alive(old.pid) and alive(new.pid)
        assert children.children == [new]
    finally:
        children.stop(timeout_s=1.0)


def test_crash_kills_then_restarts_and_records_both() -> None:
    calls: list[str] = []
    events: list[FaultEvent] = []
    seen: list[FaultEvent] = []

    def kill() -> tuple[int, int | None]:
        calls.append("kill")
        return 11, -9

    def restart() -> int:
        calls.append("restart")
        return 12

    asyncio.run(run_crash(CrashPlan(0.05, 0.05), kill=kill, restart=restart, events=events,
                          on_event=seen.append))
    assert calls == ["kill", "restart"] and seen == events
    kill_ev, restart_ev = events
    assert (kill_ev.action, kill_ev.pid, kill_ev.status) == ("kill", 11, -9)
    assert (restart_ev.action, restart_ev.pid) == ("restart", 12)
    # Never early: at or after the planned moments, on the replay's clock (the event loop may
    # wake a timer up to its clock resolution early: 1 ms of slack).
    assert kill_ev.at_s >= 0.05 - 1e-3 and restart_ev.at_s >= kill_ev.at_s + 0.05 - 1e-3
    assert kill_ev.as_dict() == {"action": "kill", "service": "rankd",
                                 "at_s": round(kill_ev.at_s, 3), "pid": 11, "status": -9}
    assert "status" not in restart_ev.as_dict()


def test_crash_without_restart_and_a_crash_not_yet_due() -> None:
    calls: list[str] = []

    def kill() -> tuple[int, int | None]:
        calls.append("kill")
        return 11, -9

    def restart() -> int:
        calls.append("restart")
        return 12

    async def main() -> list[FaultEvent]:
        events: list[FaultEvent] = []
        await run_crash(CrashPlan(0.0), kill=kill, restart=restart, events=events)
        assert [e.action for e in events] == ["kill"]
        # Cancelled before it is due (the replay ended): nothing happens, nothing is listed.
        late: list[FaultEvent] = []
        task = asyncio.create_task(run_crash(CrashPlan(60.0, 1.0), kill=kill, restart=restart,
                                             events=late))
        await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return late

    assert asyncio.run(main()) == []
    assert calls == ["kill"]


_ON_TERM = """
import signal, sys, time
log, name, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
def note(what):
    with open(log, "a") as fh:
        fh.write(f"{name} {what}\\n")
def term(*_):
    note("term")
    time.sleep(linger)
    note("exit")
    sys.exit(0)
signal.signal(signal.SIGTERM, term if linger >= 0 else signal.SIG_IGN)
note("ready")
time.sleep(60)
"""


def _staged(log: Path, name: str, stage: int, linger: float) -> ChildSpec:
    """A child that notes its SIGTERM and its exit ``linger`` s later in ``log`` (a negative
    linger: it ignores SIGTERM)."""
    return ChildSpec(name, [sys.executable, "-c", _ON_TERM, str(log), name, str(linger)],
                     stop_stage=stage)


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_stop_goes_stage_by_stage(tmp_path: Path) -> None:
    """The gateway's stage is stopped, and waited for, before the control plane's, and that
    before the rank daemons' (as up sets them: vertumnus/live/stack.py STOP_STAGES), whatever
    the start order. Before, every child got its SIGTERM at once."""
    log = tmp_path / "order.log"
    children = ChildSet(tmp_path, stop_timeout_s=20.0)
    try:
        for spec in (_staged(log, "rankd", 2, 0.0), _staged(log, "gateway", 0, 0.3),
                     _staged(log, "scheduler", 1, 0.3), _staged(log, "cachemgr", 1, 0.0)):
            children.start(spec)
        wait_until(lambda: len(_lines(log)) == 4, "every child to be ready")
        codes = children.stop()
        assert set(codes.values()) == {0}, codes
        order = [ln for ln in _lines(log) if not ln.endswith("ready")]
        assert order[:2] == ["gateway term", "gateway exit"]
        assert set(order[2:6]) == {"scheduler term", "scheduler exit", "cachemgr term",
                                   "cachemgr exit"}
        assert order[6:] == ["rankd term", "rankd exit"]
    finally:
        children.stop(timeout_s=1.0)


def test_a_stage_that_ignores_sigterm_is_killed_at_its_share_of_the_bound(
        tmp_path: Path) -> None:
    """A gateway that ignores SIGTERM is SIGKILLed at half the bound (two stages), and the
    rank daemons then still get their SIGTERM and stop gracefully."""
    log = tmp_path / "order.log"
    children = ChildSet(tmp_path, stop_timeout_s=20.0)
    try:
        children.start(_staged(log, "rankd", 2, 0.0))
        children.start(_staged(log, "gateway", 0, -1.0))
        wait_until(lambda: len(_lines(log)) == 2, "every child to be ready")
        codes = children.stop(timeout_s=2.0)
        assert codes == {"rankd": 0, "gateway": -9}
        assert [ln for ln in _lines(log) if not ln.endswith("ready")] == [
            "rankd term", "rankd exit"]
    finally:
        children.stop(timeout_s=1.0)
