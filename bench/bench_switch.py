"""Split / merge switch times of the torch world (prints figures; not a test).

    .venv/bin/python bench/bench_switch.py [world] [cycles]

A world of ``world`` rank processes (gloo, 1 thread each, tiny random model) cycles
C=world → world/2 → … → 1 → … → world ``cycles`` times with ``TorchWorld.switch`` (one
``RankEngine.switch`` per rank: same processes, no weight reload), running one small prefill on
the first worker after every switch (untimed, to show the geometry is usable). Reports the
leader's wall time per switch (command round trip over the pipes, incl. the new group's
barrier) and the slowest rank's own switch time (adopt + barrier), median and max.
"""

from __future__ import annotations

import statistics
import sys
import time

from services.rankd.torch_backend import TINY_MODEL
from services.rankd.torch_world import TorchWorld, WorldSpec

# The project's tiny random Qwen3 (TINY_MODEL), with a smaller vocabulary and context.
CFG = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": 512}


def main(world: int = 4, cycles: int = 10) -> None:
    degs = tuple(1 << i for i in range(world.bit_length()) if (1 << i) <= world)
    spec = WorldSpec(world, degs, (world,), model_config=CFG, block_size=16, pages_per_rank=64)
    down = sorted(degs, reverse=True)[1:]
    plan = down + sorted(degs)[1:]
    stats: dict[str, list[tuple[float, float]]] = {}
    t0 = time.perf_counter()
    with TorchWorld(spec) as w:
        start_s = time.perf_counter() - t0
        epoch, cur = 0, world
        for _ in range(cycles):
            for d in plan:
                epoch += 1
                t = time.perf_counter()
                reps = w.switch(range(world), epoch, d)
                wall = time.perf_counter() - t
                kind = f"{'split' if d < cur else 'merge'} {cur}->{d}"
                stats.setdefault(kind, []).append((wall, max(r.seconds for r in reps)))
                w.prefill(range(d), list(range(1, 40)))
                cur = d
        assert len(set(w.pids)) == world
    print(f"world={world} cycles={cycles} start-up (spawn, model, all groups) {start_s:.2f} s")
    for kind, v in stats.items():
        walls = [x[0] * 1e3 for x in v]
        ranks = [x[1] * 1e3 for x in v]
        print(
            f"{kind:>14}: leader wall median {statistics.median(walls):7.2f} ms "
            f"max {max(walls):7.2f} ms | slowest rank median {statistics.median(ranks):6.2f} ms "
            f"max {max(ranks):6.2f} ms (n={len(v)})"
        )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
