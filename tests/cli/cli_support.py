"""Helpers of the CLI tests (imported by name: tests/cli/conftest.py puts this folder on
sys.path, as --import-mode=importlib does not)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import Result

SIM = ["simulate", "--gpus", "8", "--policies", "vertumnus", "--max-requests", "30"]
"""A small simulate run: the options a bad-input case adds its own to."""


class Started(AssertionError):
    """``up`` got past its checks: it would have started its run (the ``tripwire`` fixture,
    conftest.py)."""


def _refused(res: Result, *words: str) -> str:
    """Assert a clean refusal: exit 2, an ``error:`` line holding every one of ``words``, no
    traceback. Returns the output with its white space collapsed."""
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    assert "error:" in text, text
    for w in words:
        assert w in text, (w, text)
    return text


def one_request_trace(tmp_path: Path) -> Path:
    """A Mooncake trace of one request (no arrival span: no rate can be asked of it)."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1,
                                "hash_ids": [1, 2, 3, 4]}) + "\n")
    return path
