"""``vertumnus up``'s start-up profiling in a child process of its own, so that an interrupt
ends it at once.

``up`` fits the services' cost model before it starts anything (:func:`~vertumnus.live.stack.
hardware_profile` on the sim backend, about 2 s; :func:`~vertumnus.live.stack.engine_profile`
on the torch engine, about 15 s, with gloo rank processes of its own). It used to run them in
a thread (``asyncio.to_thread``). A thread cannot be stopped: after a Ctrl-C the report came
at once, but ``asyncio.run``'s shutdown and the interpreter's exit then waited for the thread
to finish its profile, and a daemon thread would not do either, as the torch profile's rank
processes, blocked on their leader's pipes, would hold up multiprocessing's exit handler or
outlive the process. A child process is stopped by one signal: it runs in a session of its
own (a Ctrl-C at the terminal reaches only ``up``), so its process group holds it and
every process it spawned (the rank processes share their leader's group), and
:func:`profile_in_child` SIGKILLs that whole group when it is cancelled. Like ``up``'s other
children it asks for SIGTERM when ``up`` dies (``PR_SET_PDEATHSIG``,
:func:`vertumnus.live.procs.die_with_parent`), so even a SIGKILLed ``up`` leaves no profile
running.

The child: ``python -m vertumnus.live.startup_profile KIND OUT_DIR``, KIND ``hardware`` or
``engine``, the run's :class:`~vertumnus.live.stack.UpConfig` pickled on its stdin (only
:func:`profile_in_child`, its parent, starts it: the pickle is ours). It writes the
profiler's files into OUT_DIR and, on success, :data:`RESULT_FILE` (the profile's path and
its report) last; its output goes to :data:`LOG_FILE` there; an expected failure ends it
with one line ``error: ...`` and exit status 1. Its ``TMPDIR`` is ``OUT_DIR/tmp`` (the torch
world's rendezvous store), removed once the child is gone, so a killed profile leaves no
temporary directory behind either.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import pickle
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from vertumnus.live.procs import die_with_parent

if TYPE_CHECKING:
    from vertumnus.live.stack import UpConfig

MODULE: Final[str] = "vertumnus.live.startup_profile"
"""This module, as the child runs it (``python -m``; ``__name__`` is ``__main__`` there)."""
ProfileKind = Literal["hardware", "engine"]
KINDS: Final[tuple[ProfileKind, ...]] = ("hardware", "engine")
RESULT_FILE: Final[str] = "up-profile-result.json"
"""Written by the child last, on success: ``{"profile": PATH, "report": {...}}``."""
LOG_FILE: Final[str] = "profile.log"
"""The child's stdout and stderr."""
ENGINE_MODULES: Final[tuple[str, ...]] = ("services.rankd.engine.profiling", "torch",
                                          "safetensors")
"""What the engine profile imports that only the ``engine`` extra installs."""
KILL_WAIT_S: Final[float] = 5.0
"""Bound on reaping the child after its SIGKILL (a kill cannot be refused; this only keeps a
process stuck in the kernel from holding up the interrupted run's report)."""
_ERROR_PREFIX: Final[str] = "error: "


class ProfileFailed(RuntimeError):
    """The profiling child failed: the message is its ``error:`` line, or its exit status and
    the tail of its log."""


def engine_extra_error(missing: str) -> str:
    """The line for ``--backend torch`` on an install without the ``engine`` extra."""
    return (f"--backend torch needs the 'engine' extra ({missing} missing): "
            "pip install -e '.[engine]'")


def missing_engine_module() -> str | None:
    """The first of :data:`ENGINE_MODULES` that cannot be imported here, or None (looked up,
    not imported: torch takes seconds to import)."""
    for name in ENGINE_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):  # a parent package missing, a broken entry
            return name
    return None


async def profile_in_child(kind: ProfileKind, config: UpConfig, out_dir: Path
                           ) -> tuple[Path, dict[str, Any]]:
    """Run the ``kind`` profile of ``config`` in a child process (module docstring) writing
    into ``out_dir``; returns the profile's path and its report.

    Cancelled (``up``'s Ctrl-C or SIGTERM), it SIGKILLs the child's process group -- the
    profile and any process it started -- reaps the child (at most :data:`KILL_WAIT_S`) and
    re-raises the cancellation: nothing of the profile is left running and nothing waits
    for it. Raises :class:`ProfileFailed` when the child fails (its ``error:`` line, else its
    exit status and log tail), and, for ``engine`` on an install without the engine extra,
    before any child starts (:func:`engine_extra_error`)."""
    if kind not in KINDS:
        raise ValueError(f"profile kind must be one of {KINDS}, got {kind!r}")
    if kind == "engine":
        missing = missing_engine_module()
        if missing is not None:
            raise ProfileFailed(engine_extra_error(missing))
    payload = pickle.dumps(config)  # before the child: a config that cannot go starts none
    out = Path(out_dir)
    tmp = out / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).unlink(missing_ok=True)  # a result of an earlier run is not this one's
    log_path = out / LOG_FILE
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    try:
        # In the try: a cancellation during the spawn (asyncio then kills the child itself)
        # must remove the child's TMPDIR too.
        with open(log_path, "wb") as log:
            # NOTE: forked from the loop's (the main) thread: the parent-death signal follows
            # the thread that forked (vertumnus.live.procs).
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", MODULE, kind, str(out),
                stdin=asyncio.subprocess.PIPE, stdout=log, stderr=asyncio.subprocess.STDOUT,
                env=env, start_new_session=True, preexec_fn=die_with_parent)
        try:
            await proc.communicate(payload)
        except BaseException:  # the interrupt's cancellation (or any error here): stop it now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: pid = group id
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), KILL_WAIT_S)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0:
        raise ProfileFailed(_failure(kind, proc.returncode, log_path))
    result = json.loads((out / RESULT_FILE).read_text())
    return Path(result["profile"]), result["report"]


def _failure(kind: ProfileKind, status: int | None, log_path: Path) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        text = ""
    said = [ln[len(_ERROR_PREFIX):] for ln in text.splitlines() if ln.startswith(_ERROR_PREFIX)]
    if said:
        return said[-1]
    return (f"the {kind} profile failed (exit status {status}); log {log_path}:\n"
            f"{text[-2000:] or '(empty)'}")


def main(argv: Sequence[str] | None = None) -> int:
    """The child (module docstring). Returns its exit status: 0 done, 1 failed (an
    ``error:`` line for an expected failure, else a traceback), 2 a wrong command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in KINDS:
        print(f"usage: python -m {MODULE} {{{'|'.join(KINDS)}}} OUT_DIR "
              "(an UpConfig pickled on stdin; started by `vertumnus up` only)", file=sys.stderr)
        return 2
    kind, out = args[0], Path(args[1])
    config = pickle.load(sys.stdin.buffer)
    from shared.files import write_text_atomic
    from shared.ids import InvalidInput
    from vertumnus.live.stack import engine_profile, hardware_profile

    try:
        path, report = (engine_profile if kind == "engine" else hardware_profile)(config, out)
    except ModuleNotFoundError as exc:  # an engine module beyond ENGINE_MODULES
        print(f"{_ERROR_PREFIX}{engine_extra_error(exc.name or str(exc))}", flush=True)
        return 1
    except InvalidInput as exc:
        print(f"{_ERROR_PREFIX}the {kind} profile: {exc}", flush=True)
        return 1
    write_text_atomic(out / RESULT_FILE, json.dumps({"profile": str(path), "report": report},
                                                    default=str))
    return 0


__all__ = ["KINDS", "LOG_FILE", "RESULT_FILE", "ProfileFailed", "ProfileKind",
           "engine_extra_error", "missing_engine_module", "profile_in_child"]


if __name__ == "__main__":
    sys.exit(main())
