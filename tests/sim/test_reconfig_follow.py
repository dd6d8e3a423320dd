"""``sim.presets.windows_to_follow``: how many windows the composition takes to follow a phase
of the reconfiguration preset -- past the starting composition in the phase's direction, or
moved that way from where it stood at the change (pure, no simulation). The direction is
counted in workers: more for a short phase, fewer for a long one, on any degree set."""

from __future__ import annotations

import pytest

from shared.ids import InvalidInput
from sim.presets import RECONFIG_PHASES, windows_to_follow
from sim.workloads.synthetic import Phase

W = 20.0
BOUNDS = [(0.0, 300.0), (300.0, 600.0), (600.0, 900.0), (900.0, 1200.0), (1200.0, 1500.0)]
START = {2: 12, 4: 4}  # 12CP2/4CP4, the preset's start


def split(t: float, g: int = 0) -> dict[str, object]:
    return {"kind": "split", "decided_s": t, "sources": [f"w-cp4-g{g}"],
            "targets": [f"w-cp2-g{g}", f"w-cp2-g{g + 2}"]}


def merge(t: float, g: int = 0) -> dict[str, object]:
    return {"kind": "merge", "decided_s": t, "sources": [f"w-cp2-g{g}", f"w-cp2-g{g + 2}"],
            "targets": [f"w-cp4-g{g}"]}


def follow(reconfs: list[dict[str, object]]) -> list[int | None]:
    return windows_to_follow(BOUNDS, RECONFIG_PHASES, reconfs, START, W)


def test_each_phase_followed_by_its_operation() -> None:
    # S2 short (split 40 s in: 2 windows), S3 long (merge 20 s in: 1), S4, S5 likewise.
    ops = [split(340.0), merge(620.0), split(905.0), merge(1239.0)]
    assert follow(ops) == [2, 1, 1, 2]


def test_a_pool_split_before_the_short_phase_follows_it_at_once() -> None:
    # A burst split the pool 40 s into S1: at S2 it already has more CP2 workers than the
    # start. The first-reaction metric would count the S3 merge (16 windows) for S2.
    ops = [split(40.0), merge(620.0), split(940.0), merge(1220.0)]
    assert follow(ops) == [0, 1, 2, 1]


def test_a_pool_that_never_moves_follows_no_phase() -> None:
    assert follow([]) == [None, None, None, None]


def test_a_move_back_towards_the_start_follows() -> None:
    # S3 merged twice (10CP2/5CP4, past the start): S4's first split, back to the start's 12
    # CP2 workers, is its move towards concurrency; S5 is past the start already.
    ops = [split(340.0), merge(620.0), merge(680.0, g=4), split(920.0), split(960.0, g=8),
           merge(1220.0), merge(1240.0, g=4)]
    assert follow(ops) == [2, 1, 1, 1]
    # Without S4's splits the pool stays past the start on the long side: S5 at once.
    assert follow(ops[:3]) == [2, 1, None, 0]


def test_a_move_the_wrong_way_does_not_count() -> None:
    # A merge in a short phase leaves fewer CP2 workers: still not followed; the later
    # split back to the start is not enough either (it needs more than the start).
    ops = [merge(320.0), split(360.0)]
    assert follow(ops)[0] is None
    assert follow([merge(320.0), split(360.0), split(380.0, g=8)])[0] == 4


def test_a_decision_at_the_change_counts_as_the_composition_there() -> None:
    assert follow([split(300.0)])[0] == 0
    # ... and a late one (after the phase's end) does not count for it.
    assert follow([split(600.0)])[0] is None


def test_phases_without_a_side() -> None:
    phases = (Phase(300.0, 1.0, 0.05), Phase(300.0, 2.0, 0.05), Phase(300.0, 1.0, None))
    assert windows_to_follow(BOUNDS[:3], phases, [split(310.0)], START, W) == [None, None]


def test_order_of_the_operations_does_not_matter() -> None:
    ops = [split(340.0), merge(620.0), split(905.0), merge(1239.0)]
    assert follow(list(reversed(ops))) == follow(ops)


def test_three_degrees_count_workers_not_the_smallest_degree() -> None:
    # 12CP2/2CP4/1CP8 on 40 GPUs (15 workers). S2: the CP8 splits into two CP4 workers (a
    # 16th worker, no CP2 among them): that follows the short phase. S3: two CP4 merge into
    # a CP8, 10 s in (back to 15: fewer than at the change, so followed in its first window);
    # two CP2 merge too (14). S4 then never splits (None), and S5 starts past the start (0).
    start = {2: 12, 4: 2, 8: 1}
    ops = [{"kind": "split", "decided_s": 350.0, "sources": ["w-cp8-g0"],
            "targets": ["w-cp4-g0", "w-cp4-g4"]},
           {"kind": "merge", "decided_s": 610.0, "sources": ["w-cp4-g0", "w-cp4-g4"],
            "targets": ["w-cp8-g0"]},
           {"kind": "merge", "decided_s": 650.0, "sources": ["w-cp2-g8", "w-cp2-g10"],
            "targets": ["w-cp4-g8"]}]
    assert windows_to_follow(BOUNDS, RECONFIG_PHASES, ops, start, W) == [3, 1, None, 0]


def test_two_degrees_give_the_same_answer_counted_either_way() -> None:
    # On a fixed number of GPUs with degrees {2, 4}, workers = GPUs/4 + CP2 workers/2: the
    # answers the preset gave when it counted CP2 workers are unchanged (checked on the
    # scenarios above, against that count done here by hand).
    def by_cp2(ops: list[dict[str, object]]) -> list[int | None]:
        done = sorted(ops, key=lambda o: float(o["decided_s"]))  # type: ignore[arg-type]

        def n2(t: float) -> int:
            n = START[2]
            for o in done:
                if float(o["decided_s"]) <= t:  # type: ignore[arg-type]
                    n += 2 if o["kind"] == "split" else -2
            return n

        out: list[int | None] = []
        for i in range(1, len(BOUNDS)):
            a, b = BOUNDS[i]
            more = RECONFIG_PHASES[i].long_share < RECONFIG_PHASES[i - 1].long_share
            n1 = n2(a + 1e-9)
            bar = min(START[2], n1) if more else max(START[2], n1)
            if (n1 > bar) if more else (n1 < bar):
                out.append(0)
                continue
            got = None
            for o in done:
                t = float(o["decided_s"])  # type: ignore[arg-type]
                if a + 1e-9 < t < b and ((n2(t) > bar) if more else (n2(t) < bar)):
                    got = -int(-(t - a) // W)
                    break
            out.append(got)
        return out

    for ops in ([split(340.0), merge(620.0), split(905.0), merge(1239.0)],
                [split(40.0), merge(620.0), split(940.0), merge(1220.0)],
                [merge(320.0), split(360.0), split(380.0, g=8)],
                [split(340.0), merge(620.0), merge(680.0, g=4), split(920.0), split(960.0, g=8),
                 merge(1220.0), merge(1240.0, g=4)]):
        assert follow(ops) == by_cp2(ops), ops


@pytest.mark.parametrize("window", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_window_refused(window: float) -> None:
    with pytest.raises(InvalidInput, match="window_s"):
        windows_to_follow(BOUNDS, RECONFIG_PHASES, [], START, window)


def test_bad_input_refused() -> None:
    with pytest.raises(InvalidInput, match="no workers"):
        windows_to_follow(BOUNDS, RECONFIG_PHASES, [], {}, W)
    with pytest.raises(InvalidInput, match="lattice worker id"):
        windows_to_follow(BOUNDS, RECONFIG_PHASES,
                          [{"decided_s": 310.0, "sources": ["x"], "targets": []}], START, W)
