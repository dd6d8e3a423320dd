"""``up`` interrupted during its start-up before it followed any epoch record (here: in the
hardware profiling, before nats-server or the observer exist) reports its reconfigurations as
not followed (null in the JSON, "–" in the table), not 0: no composition was watched, so no
count is known. Once the observer follows the records (from nats-server's start on), a count
of 0 is a measured one and stays (tests/live_up/test_up_start_interrupt.py).

In-process: ``run_up`` is cancelled at its first suspension, the spawn of the profiling child
(a real child, which the cancellation kills), as a Ctrl-C there ends it."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

from rich.console import Console

from vertumnus.live.stack import UpConfig, run_up


def test_reconfigurations_are_not_followed_after_an_interrupt_before_the_observer(
        tmp_path: Path) -> None:
    cfg = UpConfig(gpus=4, degrees=(2,), max_requests=2, duration_s=10.0,
                   log_dir=tmp_path / "logs")
    out, err, path = io.StringIO(), io.StringIO(), tmp_path / "r.json"

    async def main() -> dict:
        task = asyncio.create_task(run_up(
            cfg, console=Console(file=out, width=300, color_system=None),
            err_console=Console(file=err, width=300, color_system=None), json_path=path,
            show_progress=False))
        await asyncio.sleep(0)  # run_up runs up to its first await: the profile's spawn
        task.cancel()
        return await task

    summary = asyncio.run(main())
    assert summary["interrupted_during"] == "start-up: profiling the modelled hardware"
    assert summary["reconfigurations"] is None and summary["reconfigurations_warmup"] is None
    assert json.loads(path.read_text())["reconfigurations"] is None
    text = out.getvalue()
    line = next(ln for ln in text.splitlines() if "reconfigurations" in ln)
    assert "– (not followed)" in line and " 0 " not in line, line
    # Said as an interrupted start-up, not as a replay without --nats.
    assert "composition: no epoch record yet (interrupted during start-up" in text, text
    assert "--nats" not in text, text
