"""The built-in example behind ``vertumnus demo`` (pure cores only; deterministic)."""

from __future__ import annotations

from collections.abc import Callable

from services import calibration
from services.cachemgr.events import Stored
from services.cachemgr.pull import pull_on_route
from services.cachemgr.scan import ScanConfig
from services.cachemgr.trie import PrefixTrie
from services.controller.core import ControllerCore
from services.controller.lattice import Composition, Lattice
from services.controller.planner import ControllerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.registry import make_policy
from services.scheduler.view import ClusterView, RequestInfo, WorkerView
from shared.costmodel import DEFAULT_PROFILE
from shared.ids import BlockHash, RequestId, WorkerId

B = 512
PULL = calibration.PULL


def _blocks(*ids: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(i) for i in ids)


def run_demo(*, beta: float = 1.5, lam: float = 0.5, echo: Callable[[str], None] = print) -> None:
    prof = DEFAULT_PROFILE.with_kappa({2: 10.0, 4: 15.0})
    lattice = Lattice(8, (2, 4))
    comp = Composition.parse(lattice, "2CP2/1CP4")
    workers = [g.worker_id for g in comp.groups]
    echo(f"Pool: 8 GPUs as {comp.describe()} -> workers {', '.join(workers)}")
    echo(f"Cost model Ê_C(R,P) = d + aR + bP + (cR + αW)/C with {prof.coefficients}\n")

    # --- the prefix trie: worker caches report what they hold ------------------------------
    trie = PrefixTrie((2, 4), block_size=B)
    for w, g in zip(workers, comp.groups, strict=True):
        trie.add_worker(w, g.degree, capacity_blocks=1000 * g.degree)
    cp4 = WorkerId(next(w for w in workers if "cp4" in w))
    cp2a = WorkerId(next(w for w in workers if "cp2" in w))
    # A 16K-token document prefix (32 blocks) cached on the CP4 worker, a system prompt on a CP2.
    doc = _blocks(*range(100, 132))
    trie.apply(Stored(cp4, 1, None, doc))
    trie.apply(Stored(cp2a, 1, None, _blocks(1, 2, 3, 4)))

    # --- the scheduler: J for every candidate ----------------------------------------------
    view = ClusterView(tuple(WorkerView(w, g.degree) for w, g in
                             zip(workers, comp.groups, strict=True)), block_size=B)
    core = SchedulerCore(make_policy("vertumnus", profile=prof, beta=beta, lam=lam), view)
    requests = [
        ("q-short", 1_200, _blocks(1, 2)),  # short question on the shared system prompt
        ("doc-follow-up", 17_000, doc + _blocks(900, 901)),  # reuses the 16K document
        ("long-new", 60_000, _blocks(*range(2000, 2117))),  # 60K fresh tokens
        ("q-short-2", 900, _blocks(1)),
        # The document again while its CP4 holder is busy with the 60K prompt.
        ("doc-follow-up-2", 17_200, doc + _blocks(910, 911)),
    ]
    echo(f"== Placement (§5.3): J = q + β·s + λ·(C·s − C_min·Ê_Cmin), β={beta}, λ={lam}")
    for t, (rid, length, blocks) in enumerate(requests):
        m = trie.match(blocks)
        d = core.place(RequestInfo(RequestId(rid), length, blocks, float(t)), m.held_blocks,
                       float(t))
        echo(d.explain())
        trie.record_request(m, d.worker, d.degree, d.reused_blocks, d.preferred_degree,
                            length, prof.predict_fast)
        for a in pull_on_route(trie, m, d.worker, PULL):  # the cache manager, on this placement
            echo(f"  route-time pull: {len(a.blocks)} blocks of the prefix from {a.source} to "
                 f"{a.dest}, reused if they land before the request starts "
                 f"(services/cachemgr/pull.py)")
        echo("")

    # --- Algorithm 2: one scan -------------------------------------------------------------
    cfg = ScanConfig(theta_inter=0.05, theta_intra=0.5, theta_reclaim=0.2, decay=0.5,
                     max_actions_per_list=2)
    load = {w: core.load(WorkerId(w)).queue_delay(4.0) for w in workers}
    res = trie.scan(cfg, load)
    echo("== Prefix-cache scan (Algorithm 2, §7.2) with "
         f"θ_inter={cfg.theta_inter}, θ_intra={cfg.theta_intra}, θ_reclaim={cfg.theta_reclaim}")
    echo(f"  inter-degree candidates: {len(res.inter)}, intra-degree: {len(res.intra)}, "
         f"reclaim: {len(res.reclaim)}")
    for a in res.actions:
        echo(f"  action: {a.to_wire()}")
    if not res.actions:
        echo("  no action this scan")

    # --- the controller: windows of demand -> plan -----------------------------------------
    ctl = ControllerCore(comp, prof, ControllerConfig(window_s=20.0, persistence=2))
    echo("\n== Controller (§6.2): capacity Σκ = "
         f"{sum(prof.kappa_for(g.degree) for g in comp.groups):.1f} s per 20 s window")
    for k, demand in enumerate((40.0, 42.0, 44.0)):
        for i in range(10):
            ctl.assigned(k * 20.0 + i, demand / 10, 4_000, 2)
        for dec in ctl.tick((k + 1) * 20.0):
            echo(f"  window {dec.window.index}: D={dec.window.demand_s:.1f}s "
                 f"capacity={dec.capacity_s:.1f}s -> {dec.reason}")
            if dec.plan is not None:
                echo(f"  plan: {dec.plan.to_dict()}")
