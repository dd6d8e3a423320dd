"""A finished run's prefix trie is released by ``run_deployment`` (not by a ``__del__``).

The trie used to unlink its ~55k nodes in ``PrefixTrie.__del__`` (so that reference counting,
not the cyclic collector, frees them: 1.06x end to end); a Ctrl-C during that loop was printed
as "Exception ignored in: PrefixTrie.__del__" and swallowed, and the run went on. The release
is explicit now, in ordinary code at the end of each run; the results stay the same.
"""

from __future__ import annotations

import gc

import pytest

import sim.experiments as experiments
from services.controller.lattice import Composition, Lattice
from sim.experiments import Deployment, ExperimentSpec, run_deployment
from sim.simulator import Simulator

SPEC = ExperimentSpec(gpus=8, degrees=(2, 4), seed=0)


class _Kept(Simulator):
    """A simulator that keeps itself where the test can see it."""

    made: list[Simulator] = []

    def __init__(self, *a: object, **k: object) -> None:
        super().__init__(*a, **k)  # type: ignore[arg-type]
        _Kept.made.append(self)


def test_run_deployment_releases_the_finished_runs_trie(
        profile, steady_workload, monkeypatch: pytest.MonkeyPatch) -> None:
    comp = Composition.uniform(Lattice(8, (2, 4)), 2)
    dep = Deployment("vertumnus", "vertumnus", comp, adaptive=True, cache_manager=True)
    want = run_deployment(steady_workload, dep, profile, SPEC)
    _Kept.made.clear()
    monkeypatch.setattr(experiments, "Simulator", _Kept)
    got = run_deployment(steady_workload, dep, profile, SPEC)
    (sim,) = _Kept.made
    assert len(sim.trie) == 0 and sim.trie.workers() == ()  # released: nothing left in it
    # The release comes after the result is made: the run's figures are untouched.
    assert [(r.request_id, r.ttft_s, r.reused_tokens, r.worker) for r in got.records] == \
        [(r.request_id, r.ttft_s, r.reused_tokens, r.worker) for r in want.records]
    assert got.replications == want.replications and got.reclamations == want.reclamations


def test_no_collection_traverses_the_finished_trie_before_its_release(
        profile, steady_workload, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cyclic collector stays paused from the run to the trie's release. Its first pass
    after the run's pause takes every container the run allocated and kept: starting at the
    release's first allocation, it traversed all of the finished trie's nodes (with their
    holder sets, child dicts and count lists) just before the release freed them (0.06-0.07 s
    after a 2.5 s run of the conversation trace x2). Counted with ``gc.callbacks``: no
    collection starts while the finished trie still holds nodes; the collector's state is
    restored afterwards (paused before: still paused)."""
    comp = Composition.uniform(Lattice(8, (2, 4)), 2)
    dep = Deployment("vertumnus", "vertumnus", comp, adaptive=True, cache_manager=True)
    _Kept.made.clear()
    monkeypatch.setattr(experiments, "Simulator", _Kept)
    seen: list[int] = []  # nodes of the finished trie at each collection's start

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and _Kept.made and _Kept.made[0].trie._nodes:
            seen.append(len(_Kept.made[0].trie._nodes))

    was = gc.isenabled()
    gc.enable()
    gc.callbacks.append(on_collection)
    try:
        run_deployment(steady_workload, dep, profile, SPEC)
        assert gc.isenabled()
        gc.disable()
        run_deployment(steady_workload, dep, profile, SPEC)
        assert not gc.isenabled()
    finally:
        gc.callbacks.remove(on_collection)
        if was:
            gc.enable()
        else:
            gc.disable()
    assert seen == []
