"""``up``'s start-up profile cancelled while its child is being spawned (a Ctrl-C in the
fork and the pipes' set-up) leaves no temporary directory behind: the child's ``TMPDIR``,
``OUT_DIR/tmp``, is removed once the child is gone, as after a cancellation later on
(vertumnus/live/startup_profile.py). It was made before the spawn and removed only by a
``finally`` that the spawn's own await was outside of.

A real child: the task is cancelled at its first suspension, the spawn's wait for the
child's pipes (asyncio.create_subprocess_exec), which then kills the child itself."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from vertumnus.live.stack import UpConfig
from vertumnus.live.startup_profile import profile_in_child


def test_a_cancel_during_the_spawn_leaves_no_tmp_dir(tmp_path: Path) -> None:
    cfg = UpConfig(gpus=4, degrees=(2,), max_requests=2)
    out = tmp_path / "prof"

    async def main() -> None:
        task = asyncio.create_task(profile_in_child("hardware", cfg, out))
        await asyncio.sleep(0)  # the task runs up to its first await: the spawn's
        assert (out / "tmp").is_dir()  # made before the spawn
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not (out / "tmp").exists()
