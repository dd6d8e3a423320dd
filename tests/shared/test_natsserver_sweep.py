"""The private directory (``$TMPDIR/vtm-nats-XXXX``) of an embedded nats-server whose owner
was killed by SIGKILL (``vertumnus up``, a test session) cannot be removed by that owner: the
next start sweeps it, once its owner and its server are both gone -- and never a directory
whose owner or server still runs, nor one without the owner record (someone else's, an older
release's, one being made).

Real processes throughout: owners are Python children that start a real ``nats-server``
under a private temporary root, and are killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shared.natsserver import OWNER_FILE, EmbeddedNats, sweep_stale_workdirs

REPO = Path(__file__).resolve().parents[2]
OWNER = """
import sys, tempfile, time
tempfile.tempdir = sys.argv[1]
from shared.natsserver import EmbeddedNats
srv = EmbeddedNats().start()
print(srv.store_dir.parent, srv.pid, flush=True)
time.sleep(600)
"""


class Owner:
    """A child process that started an embedded server under ``root`` and waits."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", OWNER, str(root)], cwd=REPO,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert len(line) == 2, "the owner did not start its server"
        self.workdir, self.server_pid = Path(line[0]), int(line[1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def kill_server(self) -> None:
        with_gone(self.server_pid)


def with_gone(pid: int) -> None:
    """SIGKILL ``pid`` (an orphan: its parent is dead) and wait, bounded, until it is no
    longer running (gone, or a zombie nobody reaps)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs after SIGKILL")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "tmp"
    path.mkdir()
    return path


def test_the_next_start_sweeps_what_a_sigkilled_owner_left(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead, alive = Owner(root), Owner(root)
    try:
        record = json.loads((dead.workdir / OWNER_FILE).read_text())
        assert record["owner"]["pid"] == dead.proc.pid
        assert record["server"]["pid"] == dead.server_pid

        dead.kill()  # SIGKILL: no clean-up ran
        assert dead.workdir.is_dir()
        # Its server outlived it (its own session): still in use, so kept.
        assert sweep_stale_workdirs(root) == [] and dead.workdir.is_dir()
        dead.kill_server()

        foreign = root / "vtm-nats-notours"  # no owner record: not known to be ours
        foreign.mkdir()
        mine = root / "vtm-nats-mine"  # a live owner (this process) without a server yet
        mine.mkdir()
        (mine / OWNER_FILE).write_text(json.dumps(
            {"kind": "vertumnus-embedded-nats", "owner": {"pid": os.getpid(), "start": None},
             "server": None}))

        monkeypatch.setattr(tempfile, "tempdir", str(root))
        with EmbeddedNats() as srv:  # the next start, in the default temporary directory
            own = srv.store_dir.parent
            assert own.parent == root and own.is_dir()
            assert not dead.workdir.exists()
            assert alive.workdir.is_dir() and foreign.is_dir() and mine.is_dir()
        assert not own.exists()  # a clean stop removes its own, as before
    finally:
        for owner in (dead, alive):
            owner.kill()
            owner.kill_server()
    # Both gone now: the other directory goes too; the ones not known to be ours stay.
    assert sweep_stale_workdirs(root) == [alive.workdir]
    assert sorted(p.name for p in root.iterdir()) == ["vtm-nats-mine", "vtm-nats-notours"]


def test_a_reused_pid_does_not_keep_a_directory(root: Path) -> None:
    """The record names each process by pid *and* start time: a pid now taken by another
    process (here, this one) is the recorded process gone."""
    stale = root / "vtm-nats-reused"
    stale.mkdir()
    (stale / OWNER_FILE).write_text(json.dumps(
        {"kind": "vertumnus-embedded-nats", "owner": {"pid": os.getpid(), "start": "1"},
         "server": {"pid": os.getpid(), "start": "1"}}))
    garbled = root / "vtm-nats-garbled"
    garbled.mkdir()
    (garbled / OWNER_FILE).write_text('{"kind": "vertumnus-embedded-nats", "own')
    assert sweep_stale_workdirs(root) == [stale]
    assert garbled.is_dir()
