"""The service processes read their command line and settings before they connect anywhere:
``--help`` prints the usage (exit 0), an unknown argument or an unusable setting exits 2 naming
it (its ``VTM_*`` variable and flag), with no traceback -- instead of waiting for NATS forever.

Real processes as an operator starts them (``vertumnus <service>``), each under a timeout so
that a regression (a service that starts and retries NATS) fails instead of hanging; the NATS
URL they would use points nowhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.servicemain import SettingProblem, check_nats_url, seed_check
from shared.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[2]
NOWHERE = {"VTM_NATS_URL": "nats://127.0.0.1:9"}
SERVICES = ("gateway", "scheduler", "controller", "cachemgr", "rankd")


def _run(args: list[str], env: dict[str, str] | None = None,
         timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vertumnus", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **NOWHERE, **(env or {})})


@pytest.mark.parametrize("service", SERVICES)
def test_help_prints_the_usage_and_the_settings(service: str) -> None:
    proc = _run([service, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and "VTM_NATS_URL" in proc.stdout
    assert "Traceback" not in proc.stderr


BAD: list[tuple[list[str], list[str]]] = [
    (["rankd", "--bogus-flag"], ["unrecognized arguments: --bogus-flag"]),
    (["rankd", "--gpus", "-1"], ["unrecognized arguments: --gpus -1"]),
    (["gateway", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["gateway", "--nats-url", "http://127.0.0.1:4222"],
     ["VTM_NATS_URL (--nats-url)", "'http://127.0.0.1:4222' is not a NATS server URL",
      "nats://"]),
    (["cachemgr", "--nats-url", "nats://127.0.0.1:99999"],
     ["VTM_NATS_URL (--nats-url)", "no valid port"]),
    (["scheduler", "--nats-url", "ws://127.0.0.1:1,nats://127.0.0.1:2"],
     ["VTM_NATS_URL", "mixes websocket"]),
    (["controller", "--initial", "bogus"],
     ["VTM_INITIAL_COMPOSITION (--initial)", "'bogus'"]),
    (["controller", "--gpus", "8", "--initial", "3CP4"],
     ["VTM_INITIAL_COMPOSITION (--initial)", "3CP4"]),
    (["scheduler", "--seed", "-1"], ["VTM_SEED (--seed)", "must be an integer >= 0", "-1"]),
    (["gateway", "--tokenizer", "/nonexistent"],
     ["VTM_TOKENIZER_PATH (--tokenizer)", "'/nonexistent'", "no such file"]),
]


@pytest.mark.parametrize(("args", "needles"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_argument_or_setting_exits_2_before_connecting(args: list[str],
                                                             needles: list[str]) -> None:
    proc = _run(args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_a_bad_nats_url_in_the_environment_names_the_variable() -> None:
    proc = _run(["rankd"], env={"VTM_NATS_URL": "localhost:70000"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "VTM_NATS_URL: 'nats://localhost:70000' has no valid port" in proc.stderr


def test_a_tokenizer_file_the_gateway_cannot_load_exits_2(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    junk = tmp_path / "tokenizer.json"
    junk.write_text("{junk\n")
    proc = _run(["gateway", "--tokenizer", str(junk)])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "cannot start: VTM_TOKENIZER_PATH" in proc.stderr and str(junk) in proc.stderr
    proc = _run(["gateway", "--tokenizer", str(tmp_path)])
    assert proc.returncode == 2 and "not a regular file" in proc.stderr


def test_nats_url_check_takes_every_scheme_and_hides_passwords() -> None:
    ok = "nats://a:4222,tls://b:4222,nats://user:pw@c:1"
    check_nats_url(ServiceSettings(nats_url=ok))
    check_nats_url(ServiceSettings(nats_url="ws://a:80,wss://b"))
    with pytest.raises(SettingProblem) as exc:
        check_nats_url(ServiceSettings(nats_url="nats://user:secret@h:99999"))
    assert "secret" not in str(exc.value) and exc.value.fields == ("nats_url",)
    with pytest.raises(SettingProblem, match="not a NATS server URL"):
        check_nats_url(ServiceSettings(nats_url="http://h:4222"))
    # Without a scheme, as nats-py reads it: nats://host[:port] (compose's host is "nats").
    check_nats_url(ServiceSettings(nats_url="nats,127.0.0.1:4222"))
    for odd in ("nats://user:p/w@h:99999", "nats://u:a@b@h:99999"):
        with pytest.raises(SettingProblem) as exc:
            check_nats_url(ServiceSettings(nats_url=odd))
        assert "p/w" not in str(exc.value) and "a@b" not in str(exc.value), str(exc.value)
    with pytest.raises(SettingProblem, match="no server URL"):
        check_nats_url(ServiceSettings(nats_url=" , "))


def test_seed_check_refuses_a_negative_seed() -> None:
    from services.scheduler.service import SchedulerSettings

    seed_check("seed")(SchedulerSettings(seed=0))
    with pytest.raises(SettingProblem, match=">= 0"):
        seed_check("seed")(SchedulerSettings(seed=-1))


def test_the_rank_daemon_mains_take_an_explicit_argv(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``main(argv)``: ``[]`` runs (whatever this process's own sys.argv), anything but
    ``--help`` is refused -- in the service module's main and in ``vertumnus rankd``'s."""
    from services.rankd import main as rankd_main
    from vertumnus.live import rankd_sim

    ran: list[object] = []
    monkeypatch.setattr(rankd_main, "run_service", lambda settings, serve: ran.append(settings))
    monkeypatch.setenv("VTM_NATS_URL", NOWHERE["VTM_NATS_URL"])
    for main in (rankd_main.main, rankd_sim.main):
        main([])
        with pytest.raises(SystemExit) as exc:
            main(["--gpus", "-1"])
        assert exc.value.code == 2
        assert "unrecognized arguments: --gpus -1" in capsys.readouterr().err
    assert len(ran) == 2 and isinstance(ran[1], rankd_sim.SimRankdSettings)
