"""``simulate --help`` and ``size --help`` name --policies' default list. It was written into
the help as "[default: vertumnus, static, ...]" (typer's own default shown off, so that the
list could wrap at 80 columns), which rich reads as a markup tag and drops: the option showed
no default at all."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("cmd", ["simulate", "size"])
def test_policies_help_names_the_default_list(cmd: str) -> None:
    env = {**os.environ, "COLUMNS": "80", "TERMINAL_WIDTH": "80"}
    got = subprocess.run([sys.executable, "-m", "vertumnus", cmd, "--help"], env=env,
                         capture_output=True, text=True, check=True).stdout
    # The --policies entry: from its line up to the next option's.
    lines = got.splitlines()
    start = next(i for i, ln in enumerate(lines) if "--policies" in ln)
    end = next(i for i in range(start + 1, len(lines)) if "│ --" in lines[i])
    entry = " ".join(" ".join(ln.strip("│ ").split()) for ln in lines[start:end])
    for name in ("vertumnus", "static", "homo_cp2", "sglang", "vllm", "dynamo", "llmd"):
        assert name in entry, entry
    assert "default" in entry, entry
