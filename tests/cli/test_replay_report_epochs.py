"""The live report's composition line says whether the epoch records were followed: a
``replay`` without ``--nats`` cannot see them, and used to report "no epoch record observed
(no controller running?)" while a controller was running."""

from __future__ import annotations

import io

from rich.console import Console

from vertumnus.live.replay import ReplayRecord
from vertumnus.live.report import LiveReport


def rendered(report: LiveReport) -> str:
    out = io.StringIO()
    report.render(Console(file=out, width=200, color_system=None))
    return out.getvalue()


def one_request() -> list[ReplayRecord]:
    return [ReplayRecord("r1", 0.0, 1000, 200, ttft_s=0.05, intake_wait_s=0.001,
                         queue_wait_s=0.01, prefill_s=0.03, kv_transfer_s=0.004,
                         first_decode_s=0.0, prefix_tokens=0, worker_id="w-cp2-g0")]


def test_a_replay_that_did_not_follow_the_records_says_so() -> None:
    text = rendered(LiveReport(one_request(), 0.1, followed_epochs=False))
    assert "composition: not followed (give --nats URL" in text
    assert "no controller running" not in text


def test_followed_records_with_none_seen_still_suggest_no_controller() -> None:
    text = rendered(LiveReport(one_request(), 0.1))
    assert "composition: no epoch record observed (no controller running?)" in text
