"""Acceptance (a): 200 requests at a steady rate through the gateway's HTTP API of the real
stack (every service its own process) all complete exactly once.

Checked on both sides: every id gets exactly one HTTP answer, 200, naming that id and not
flagged as a duplicate; and on the wire, ``{prefix}.result.*`` carries exactly one FirstToken
per id (a token, no error) and none for ids never sent. The executions also respect the
geometry (each worker in its epoch's composition, no two overlapping GPU groups busy at once).
"""

from __future__ import annotations

from pathlib import Path

from live_accept_support import (
    EpochLog,
    ResultTap,
    answered_once_ok,
    connect,
    exactly_once_problems,
    fire_steady,
    geometry_violations,
    running_stack,
    small_config,
    wait_until,
)

N = 200
RATE = 40.0  # req/s: 5 s of steady load


async def test_200_requests_complete_exactly_once(tmp_path: Path) -> None:
    async with running_stack(small_config(), tmp_path / "logs") as stack:
        nc = await connect(stack)
        tap = await ResultTap(nc, stack.subjects).start()
        epochs = await EpochLog(nc, stack.subjects).start()
        try:
            ids = [f"acc-a-{i:04d}" for i in range(N)]
            assert stack.gateway_url is not None
            answers = await fire_steady(stack.gateway_url, ids, RATE)
            problems = answered_once_ok(ids, answers)
            assert not problems, problems[:10]
            # Every answer was produced by a FirstToken; let the tap see all of them, then a
            # little longer so a late duplicate would show.
            await wait_until(lambda: tap.ok_ids() >= set(ids), "every FirstToken on the wire")
            await nc.flush()
            problems = exactly_once_problems(ids, tap)
            assert not problems, problems[:10]
            assert tap.malformed == 0
            # The HTTP answer is the wire's FirstToken (same worker and epoch).
            by_id = tap.by_id()
            for rid in ids:
                vtm = answers[rid][0].body["vtm"]
                ft = by_id[rid][0]
                assert (vtm["worker_id"], vtm["epoch"]) == (ft.worker_id, ft.epoch), rid
            bad = geometry_violations(tap.results, epochs.records)
            assert not bad, bad[:10]
        finally:
            await epochs.stop()
            await tap.stop()
            await nc.drain()
