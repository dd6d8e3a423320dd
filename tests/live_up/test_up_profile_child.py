"""``up``'s start-up profile runs in a child process (vertumnus/live/startup_profile.py): its
result comes back to ``up``, and a profile that fails ends the run with one line naming why
(:class:`~vertumnus.live.stack.StackError`: exit 1 from the CLI), before anything started.
In the thread it used to run in, such a failure left ``run_up`` as a traceback."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from vertumnus.live.stack import StackError, UpConfig, run_up
from vertumnus.live.startup_profile import LOG_FILE, RESULT_FILE, profile_in_child


def test_the_profile_child_returns_the_fitted_profile(tmp_path: Path) -> None:
    cfg = UpConfig(gpus=4, degrees=(2,), max_requests=2)
    path, report = asyncio.run(profile_in_child("hardware", cfg, tmp_path / "prof"))
    assert path == tmp_path / "prof" / "profile.json" and path.is_file()
    assert report == json.loads((tmp_path / "prof" / "profile_report.json").read_text())
    assert report["degrees"] == [1, 2] and report["kappa"].keys() == {"1", "2"}
    assert (tmp_path / "prof" / RESULT_FILE).is_file()
    assert not (tmp_path / "prof" / "tmp").exists()  # its TMPDIR is removed


def test_a_failed_profile_ends_the_run_with_its_reason(tmp_path: Path) -> None:
    hw = tmp_path / "hw.toml"
    hw.write_text('gpu = "H200"\n')
    cfg = UpConfig(gpus=4, degrees=(2,), hardware=hw, log_dir=tmp_path / "logs",
                   max_requests=2)
    hw.unlink()  # gone between the checks and the profile: the profile's own error
    quiet = Console(file=io.StringIO())
    with pytest.raises(StackError, match=r"the hardware profile: .*hw\.toml"):
        asyncio.run(run_up(cfg, console=quiet, err_console=quiet, show_progress=False))
    assert "Traceback" not in (tmp_path / "logs" / "hardware-profile" / LOG_FILE).read_text()
    assert not (tmp_path / "logs" / "pids.json").exists()  # nothing was started
