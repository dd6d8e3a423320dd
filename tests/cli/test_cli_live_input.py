"""Bad input to ``up``, ``replay`` and ``tap`` exits 2 with one line naming the option and the
problem, before anything starts: no stack, no replay, no NATS connection, no output written.

The commands run in this process (typer's runner) with their starting points replaced by a
tripwire: a check that regressed fails the test at once instead of starting a stack (or
waiting for a server). A few run as real processes, to see that no traceback reaches the
terminal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shared.costmodel import DEFAULT_PROFILE
from shared.ids import InvalidInput
from vertumnus.cli import app

REPO = Path(__file__).resolve().parents[2]
GATEWAY = ("--gateway", "http://127.0.0.1:9")



class Started(AssertionError):
    """A command got past its checks: it would have started a stack, a replay or a tap."""


@pytest.fixture
def tripwire(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace what ``up``, ``replay`` and ``tap`` start with a recorder that raises
    :class:`Started`; returns the calls (keyword arguments) it saw."""
    import vertumnus.cmd_live as cmd_live
    import vertumnus.live.stack as stack
    import vertumnus.live.tap as tap

    calls: list[dict[str, Any]] = []

    def started(*args: Any, **kwargs: Any) -> Any:
        calls.append({"args": args, **kwargs})
        raise Started("the command started its work")

    async def started_async(*args: Any, **kwargs: Any) -> Any:
        return started(*args, **kwargs)

    monkeypatch.setattr(stack, "run_up", started_async)
    monkeypatch.setattr(cmd_live, "_replay_main", started_async)
    monkeypatch.setattr(tap, "tap", started_async)
    return calls


def _refused(args: Sequence[str], *needles: str) -> str:
    """Run the CLI in-process on ``args``: it must exit 2 before starting, its output naming
    every one of ``needles``."""
    res = CliRunner().invoke(app, list(args))
    assert not isinstance(res.exception, Started), f"{args} started: {res.output}"
    assert res.exit_code == 2, (args, res.output, res.exception)
    assert isinstance(res.exception, SystemExit), res.exception  # no other exception
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in res.output, (args, res.output)
    return res.output


@pytest.fixture
def afile(tmp_path: Path) -> Path:
    path = tmp_path / "afile"
    path.write_text("not a directory\n")
    return path


@pytest.fixture
def garbled(tmp_path: Path) -> Path:
    path = tmp_path / "garb.jsonl"
    path.write_text("garbage\n")
    return path


# -- up -------------------------------------------------------------------------------------


UP_CASES: list[tuple[list[str], list[str]]] = [
    (["--seed", "-1"], ["--seed must be an integer >= 0, got -1"]),
    (["--nats-port", "99999"], ["--nats-port", "99999"]),
    (["--nats-port", "0"], ["--nats-port"]),
    (["--http-port", "-5"], ["--http-port", "-5"]),
    (["--http-port", "70000"], ["--http-port"]),
    (["--stop-timeout", "-1"], ["--stop-timeout must be finite and > 0"]),
    (["--stop-timeout", "nan"], ["--stop-timeout"]),
    (["--health-timeout", "0"], ["--health-timeout must be finite and > 0"]),
    (["--health-timeout", "-1"], ["--health-timeout"]),
    (["--prefix", ""], ["--prefix", "non-empty"]),
    (["--prefix", "a b"], ["--prefix", "'a b'"]),
    (["--prefix", "vtm.>"], ["--prefix"]),
    (["--model-path", "/nonexistent"], ["--model-path", "--backend torch"]),
    (["--backend", "torch", "--model-path", "/nonexistent"],
     ["--model-path /nonexistent: not a directory"]),
    (["--max-requests", "-1"], ["--max-requests must be an integer >= 0 (0: all), got -1"]),
    (["--degrees", "2,2"], ["--degrees repeats 2"]),
    (["--degrees", "3"], ["--degrees"]),
    (["--profile", "/nonexistent"], ["--profile", "no such file"]),
    (["--workload", "/nonexistent"], ["--workload", "'/nonexistent'", "existing file"]),
    (["--rate", "-1"], ["--rate must be finite and > 0, got -1"]),
    (["--rate", "inf"], ["--rate"]),
    (["--duration", "0"], ["--duration must be finite and > 0, got 0"]),
    (["--time-scale", "nan"], ["--time-scale"]),
]


@pytest.mark.parametrize(("args", "needles"), UP_CASES,
                         ids=[repr(" ".join(a)) for a, _ in UP_CASES])
def test_up_refuses_a_bad_option_before_starting(args: list[str], needles: list[str],
                                                 tripwire: list[dict[str, Any]]) -> None:
    _refused(["up", *args], *needles)
    assert tripwire == []


def test_up_checks_its_files_and_output_paths_before_starting(
        tmp_path: Path, afile: Path, garbled: Path, tripwire: list[dict[str, Any]]) -> None:
    _refused(["up", "--profile", str(tmp_path)], "--profile", "is a directory")
    # A sim pool's controller needs κ of each degree; a torch pool's profile has none.
    no_kappa = tmp_path / "no-kappa.json"
    DEFAULT_PROFILE.with_kappa({2: 10.0}).save(no_kappa)
    _refused(["up", "--profile", str(no_kappa), "--degrees", "2,4"], "--profile", "kappa", "4")
    _refused(["up", "--workload", str(tmp_path)], "--workload", "directory")
    _refused(["up", "--workload", str(garbled)], "--workload", "garb.jsonl:1", "not valid JSON")
    _refused(["up", "--log-dir", str(afile)], f"--log-dir {afile}", "not a directory")
    _refused(["up", "--json", str(tmp_path)], f"--json {tmp_path}", "is a directory")
    _refused(["up", "--json", str(afile / "x.json")], "--json", "not a directory")
    # A bad option after a good output path: the path is not created before the refusal.
    _refused(["up", "--json", str(tmp_path / "new" / "r.json"), "--seed", "-1"], "--seed")
    assert not (tmp_path / "new").exists()
    assert tripwire == []


def test_up_with_good_options_gets_to_its_start(tmp_path: Path,
                                                tripwire: list[dict[str, Any]]) -> None:
    """Valid options pass: run_up gets the requests loaded up front, the output paths ready;
    --max-requests 0 is every request, N the first N."""
    log_dir, out = tmp_path / "logs", tmp_path / "out" / "r.json"
    res = CliRunner().invoke(app, ["up", "--log-dir", str(log_dir), "--json", str(out),
                                   "--duration", "30", "--max-requests", "0"])
    assert isinstance(res.exception, Started), res.output
    every = tripwire[-1]["requests"]
    assert len(every) > 5 and log_dir.is_dir() and out.parent.is_dir()
    assert tripwire[-1]["json_path"] == out
    res = CliRunner().invoke(app, ["up", "--duration", "30", "--max-requests", "3"])
    assert isinstance(res.exception, Started), res.output
    assert [r.request_id for r in tripwire[-1]["requests"]] == \
        [r.request_id for r in every[:3]]


# -- replay ---------------------------------------------------------------------------------


REPLAY_CASES: list[tuple[list[str], list[str]]] = [
    (["--trace", "/nonexistent"], ["--trace", "'/nonexistent'", "existing file"]),
    (["--rate", "-1"], ["--rate must be a finite number of requests/s > 0, got -1"]),
    (["--rate", "nan"], ["--rate"]),
    (["--duration", "0"], ["--duration must be a finite number > 0, got 0"]),
    (["--duration", "-1"], ["--duration", "-1"]),
    (["--time-scale", "0"], ["--time-scale"]),
    (["--rate-scale", "inf"], ["--rate-scale"]),
    (["--seed", "-1"], ["--seed must be an integer >= 0, got -1"]),
    (["--max-requests", "-1"], ["--max-requests must be an integer >= 0 (0: all), got -1"]),
    (["--max-requests", "-3"], ["--max-requests", "-3"]),
    (["--nats", "nats://127.0.0.1:9", "--prefix", "a b"], ["--prefix", "'a b'"]),
]


@pytest.mark.parametrize(("args", "needles"), REPLAY_CASES,
                         ids=[repr(" ".join(a)) for a, _ in REPLAY_CASES])
def test_replay_refuses_a_bad_option_before_sending(args: list[str], needles: list[str],
                                                    tripwire: list[dict[str, Any]]) -> None:
    _refused(["replay", *GATEWAY, *args], *needles)
    assert tripwire == []


def test_replay_checks_its_trace_and_json_before_sending(
        tmp_path: Path, afile: Path, garbled: Path, tripwire: list[dict[str, Any]]) -> None:
    _refused(["replay", *GATEWAY, "--trace", str(tmp_path)], "--trace", "directory")
    _refused(["replay", *GATEWAY, "--trace", str(garbled)], "--trace", "garb.jsonl:1",
             "not valid JSON")
    _refused(["replay", *GATEWAY, "--json", str(tmp_path)], f"--json {tmp_path}",
             "is a directory")
    _refused(["replay", *GATEWAY, "--json", str(afile / "x.json")], "--json",
             "not a directory")
    assert tripwire == []


def test_replay_max_requests_counts_from_the_start(tripwire: list[dict[str, Any]]) -> None:
    """0 (the default) replays every request, N the first N -- never a slice from the end."""
    lengths = []
    for n in ("0", "2"):
        res = CliRunner().invoke(app, ["replay", *GATEWAY, "--duration", "30",
                                       "--max-requests", n])
        assert isinstance(res.exception, Started), res.output
        lengths.append(len(tripwire[-1]["args"][1]))
    assert lengths[0] > 2 and lengths[1] == 2


def test_load_requests_takes_no_negative_count() -> None:
    from vertumnus.live.replay import workload_requests
    from vertumnus.live.stack import load_requests

    _, every = load_requests("synthetic", duration_s=30, rate=None, seed=0, max_requests=None,
                             default_rate=2.0)
    _, zero = load_requests("synthetic", duration_s=30, rate=None, seed=0, max_requests=0,
                            default_rate=2.0)
    assert len(every) == len(zero) > 2
    with pytest.raises(InvalidInput, match="max_requests must be >= 0"):
        load_requests("synthetic", duration_s=30, rate=None, seed=0, max_requests=-1,
                      default_rate=2.0)
    with pytest.raises(ValueError, match="max_requests must be >= 0"):
        workload_requests(every, -1)  # type: ignore[arg-type]
    assert len(workload_requests(every, 0)) == len(every)  # type: ignore[arg-type]


def test_load_requests_reads_a_synthetic_workload_file(tmp_path) -> None:
    """`up` / `replay --trace my.toml`: the generator with that file's parameters, cut to the
    run's duration like a trace; a bad file is the loader's InvalidInput naming the key."""
    from vertumnus.live.stack import load_requests

    f = tmp_path / "agent.toml"
    f.write_text("rate = 3.0\nphases = []\nlong_share = 0.0\n")
    wl, reqs = load_requests(str(f), duration_s=30, rate=None, seed=0, max_requests=None,
                             default_rate=2.0)
    assert wl.name == "agent" and wl.metadata["config"]["rate"] == 3.0
    assert reqs and all(r.arrival_s < 30 for r in reqs)
    assert all(r.input_len < 32_768 for r in reqs)
    f.write_text("rate = 0\n")
    with pytest.raises(InvalidInput, match="agent.toml: rate must be > 0"):
        load_requests(str(f), duration_s=30, rate=None, seed=0, max_requests=None,
                      default_rate=2.0)


def test_the_line_of_a_replay_in_which_no_request_completed() -> None:
    """What replay says as it exits 1 (tests/live_up/test_up_replay.py runs one): the count
    and the error, or the commonest of several, on one line."""
    from vertumnus.cmd_live import _none_completed

    one = {"requests": 2, "completed": 0, "errors": {"HTTP 503: no\nworker": 2}}
    assert _none_completed(one) == "no request completed: all 2 requests failed with: HTTP " \
        "503: no worker"
    two = {"requests": 3, "completed": 0, "errors": {"a": 1, "b": 2}}
    assert _none_completed(two) == ("no request completed: all 3 requests failed (2 kinds of "
                                    "error in the report; the commonest, 2x: b)")
    assert _none_completed({"requests": 0, "completed": 0, "errors": {}}) == \
        "no request completed: the workload had no request to send"


def test_up_and_replay_end_by_one_rule() -> None:
    """The exit status after the report (up and replay alike): interrupted 130; a service
    down for good, or no request completed, 1 with a line; else 0. ``up --serve`` replays
    nothing itself, so nothing completed is no failure there (before, up exited 0 when
    every request failed)."""
    from vertumnus.cmd_live import run_verdict

    failed = {"requests": 2, "completed": 0, "errors": {"HTTP 503": 2}}
    assert run_verdict(failed) == (1, "no request completed: all 2 requests failed with: "
                                      "HTTP 503")
    assert run_verdict(failed, serving=True) == (0, None)
    assert run_verdict({**failed, "interrupted": True}) == (130, None)
    code, line = run_verdict({"requests": 2, "completed": 2, "services_down": ["cachemgr"]})
    assert code == 1 and line is not None and line.startswith("cachemgr exited for good")
    assert run_verdict({"requests": 2, "completed": 1, "errors": {"x": 1}}) == (0, None)


# -- tap ------------------------------------------------------------------------------------


TAP_CASES: list[tuple[list[str], list[str]]] = [
    ([""], ["SUBJECT", "non-empty"]),
    (["a b"], ["SUBJECT", "'a b'"]),
    (["vtm..x"], ["SUBJECT", "'vtm..x'"]),
    (["vtm.>.x"], ["SUBJECT", "'vtm.>.x'"]),
    (["vtm.a*"], ["SUBJECT", "whole tokens"]),
    (["--timeout", "nan", "--count", "1"], ["--timeout must be a finite number", "nan"]),
    (["--timeout", "-1"], ["--timeout", "-1"]),
    (["--timeout", "0"], ["--timeout"]),
    (["--count", "-1"], ["--count must be an integer >= 1", "-1"]),
    (["--count", "0"], ["--count", "0"]),
]


@pytest.mark.parametrize(("args", "needles"), TAP_CASES,
                         ids=[repr(" ".join(a)) for a, _ in TAP_CASES])
def test_tap_refuses_a_bad_subject_or_limit_before_connecting(
        args: list[str], needles: list[str], tripwire: list[dict[str, Any]]) -> None:
    _refused(["tap", *args, "--nats", "nats://127.0.0.1:9"], *needles)
    assert tripwire == []


@pytest.mark.parametrize("subject", ["vtm.>", "vtm.*.x", ">", "vtm.worker.assign.w-cp2-g0",
                                     "$KV.VTM_WORKERS.>", "_INBOX.>"])
def test_tap_takes_wildcard_subjects(subject: str, tripwire: list[dict[str, Any]]) -> None:
    res = CliRunner().invoke(app, ["tap", subject, "--count", "1", "--timeout", "0.5",
                                   "--nats", "nats://127.0.0.1:9"])
    assert isinstance(res.exception, Started), res.output
    assert tripwire[-1]["args"][1] == subject


BAD_NATS_URLS: list[tuple[str, str]] = [
    ("nats://:notaport", "'nats://:notaport' has no valid port (1..65535)"),
    ("nats://127.0.0.1:99999", "'nats://127.0.0.1:99999' has no valid port"),
    ("nats://", "'nats://' is not a NATS server URL"),
    ("http://127.0.0.1:4222", "'http://127.0.0.1:4222' is not a NATS server URL"),
    ("nats://user:secret@:bad", "'nats://***@:bad' has no valid port"),  # no password shown
    # No scheme: refused as such, not tried as a host name and reported as a server that
    # cannot be reached (a service's VTM_NATS_URL still reads `nats:4222` as nats://).
    ("bad", "'bad' is not a NATS server URL: it needs a scheme"),
    ("localhost:4222", "'localhost:4222' is not a NATS server URL: it needs a scheme"),
    ("127.0.0.1:notaport", "'127.0.0.1:notaport' is not a NATS server URL"),
    ("user:secret@127.0.0.1:4222", "'***@127.0.0.1:4222' is not a NATS server URL"),
]


@pytest.mark.parametrize(("url", "problem"), BAD_NATS_URLS, ids=[u for u, _ in BAD_NATS_URLS])
@pytest.mark.parametrize("command", [["tap", "--timeout", "1"], ["status", "--timeout", "1"],
                                     ["replay", *GATEWAY]], ids=["tap", "status", "replay"])
def test_a_malformed_nats_url_is_a_usage_error_of_tap_as_of_status(
        command: list[str], url: str, problem: str) -> None:
    """A --nats that is no NATS server URL is bad input: exit 2 with one line naming the
    option and the problem, before connecting, from tap as from status (and replay, before
    it asks the gateway). Before, tap exited 1 ("cannot reach NATS", the unreachable
    server's answer) where status exited 2 with that same line."""
    text = _refused([*command, "--nats", url], f"error: --nats: {problem}")
    assert text.strip().count("\n") == 0 and "secret" not in text, text


# -- real processes: one line, no traceback ---------------------------------------------------


@pytest.mark.parametrize("args", [
    ["replay", *GATEWAY, "--trace", "/nonexistent"],
    ["up", "--seed", "-1"],
    ["tap", "vtm..x", "--nats", "nats://127.0.0.1:9", "--timeout", "1"],
    ["tap", "--nats", "nats://:notaport", "--timeout", "1"],
], ids=["replay-trace", "up-seed", "tap-subject", "tap-nats-url"])
def test_a_refusal_reaches_the_terminal_as_one_line(args: list[str]) -> None:
    # A timeout, not a hang, if a regression let the command start.
    proc = subprocess.run([sys.executable, "-m", "vertumnus", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
