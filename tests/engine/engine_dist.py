"""Spawn a real gloo world on 127.0.0.1 and run one function on every rank.

Each rank runs ``fn(rank, world_size, *args)`` with one intra-op thread (the test machine has
few cores) and returns a picklable value; failures come back as tracebacks. The join timeout is
a hang guard (a rank stuck in a collective after another failed), not a speed assertion.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HANG_GUARD_S = 600.0
POLL_S = 1.0
"""How often the parent looks for ranks that exited without a result."""


def _entry(fn: Callable[..., Any], rank: int, world: int, store: str, q: Any, args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        res = fn(rank, world, *args)
        q.put((rank, True, res))
    except BaseException:  # report everything, including assertion errors, to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn`` on ``world`` spawned gloo ranks; returns the per-rank results, rank order."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, store, q, args)) for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + HANG_GUARD_S
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, ok, res = q.get(timeout=POLL_S)
            except queue.Empty:
                # A rank that died before reporting (e.g. its body could not be unpickled:
                # a function defined in a test module, which --import-mode=importlib names
                # so that a child cannot import it) will never report: stop waiting.
                if any(p.exitcode is not None for i, p in enumerate(procs)
                       if i not in results):
                    try:  # what it put just before exiting may still be in the pipe
                        rank, ok, res = q.get(timeout=POLL_S)
                    except queue.Empty:
                        break
                    results[rank] = (ok, res)
                continue
            results[rank] = (ok, res)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{res}" for r, (ok, res) in sorted(results.items()) if not ok]
    missing = [r for r in range(world) if r not in results]
    if errors or missing:
        raise AssertionError(
            "\n".join(errors) + (f"\nno result from ranks {missing}" if missing else "")
        )
    return [results[r][1] for r in range(world)]
