"""A rank daemon on the torch backend checks every ``VTM_TORCH_*`` value before it spawns a
rank: a bad one exits 2 with a line naming the variable, the value and what is allowed, and
nothing starts (no rank process, no NATS connection, no decode model).

Before, only ``VTM_TORCH_HANDOFF`` failed that early, and as a pydantic traceback (exit 1);
the other values failed later and worse: a dtype torch does not know, a model config the
model cannot be built from or a checkpoint path that is no checkpoint inside every spawned
rank (a child's traceback, reported as a broken world), a degree list that does not parse as
a ValueError or ZeroDivisionError traceback of the daemon, a degree list without the worker's
own degree as an InvalidInput traceback, a seed torch cannot take in the ranks.

Through the function ``python -m services.rankd.main`` calls (:func:`main`), with the world's
spawn stubbed to fail loudly, and through both real commands in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from services.rankd import main as rankd_main  # noqa: E402
from services.rankd import torch_world  # noqa: E402

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[2]
NOWHERE = "nats://127.0.0.1:9"  # never reached: the daemon exits before it connects


class Spawned(Exception):
    """Raised by the stubbed world start: the daemon got as far as spawning ranks."""


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``VTM_*`` variable of the outer environment removed, NATS pointing nowhere, the
    torch backend chosen, and a world that raises :class:`Spawned` instead of starting."""
    for name in list(os.environ):
        if name.upper().startswith("VTM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("VTM_NATS_URL", NOWHERE)
    monkeypatch.setenv("VTM_BACKEND", "torch")

    def spawn(self: Any) -> Any:
        raise Spawned(self.spec)

    monkeypatch.setattr(torch_world.TorchWorld, "start", spawn)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``torch.cuda`` answering as a machine with ``cuda[0]`` GPUs (0: no CUDA at all)."""
    import torch

    count = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count[0] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count[0])
    return count


def _refused(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """Run the daemon's main; assert it exits 2 naming every needle, with no traceback."""
    with pytest.raises(SystemExit) as info:
        rankd_main.main([])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "invalid settings" in err and "Traceback" not in err, err
    missing = [n for n in needles if n not in err]
    assert not missing, f"{missing} not in {err!r}"
    return err


BAD: list[tuple[dict[str, str], list[str]]] = [
    ({"VTM_TORCH_DTYPE": "int4"}, ["VTM_TORCH_DTYPE", "'int4'", "float32", "bfloat16"]),
    ({"VTM_TORCH_DTYPE": "Float16"}, ["VTM_TORCH_DTYPE", "'Float16'", "float16"]),
    ({"VTM_TORCH_DEGREES": "1,two"}, ["VTM_TORCH_DEGREES", "'1,two'", "powers of two"]),
    ({"VTM_TORCH_DEGREES": "0,1"}, ["VTM_TORCH_DEGREES", "'0,1'", "powers of two"]),
    ({"VTM_TORCH_DEGREES": "1,3"}, ["VTM_TORCH_DEGREES", "'1,3'", "powers of two"]),
    ({"VTM_TORCH_DEGREES": "1", "VTM_WORKER_ID": "w-cp2-g0"},
     ["VTM_TORCH_DEGREES", "'1'", "w-cp2-g0", "degree 2"]),
    ({"VTM_TORCH_BLOCK_SIZE": "0"}, ["VTM_TORCH_BLOCK_SIZE", "'0'",
                                      "greater than or equal to 1"]),
    ({"VTM_TORCH_BLOCK_SIZE": "abc"}, ["VTM_TORCH_BLOCK_SIZE", "'abc'", "integer"]),
    ({"VTM_TORCH_PAGES_PER_RANK": "0"}, ["VTM_TORCH_PAGES_PER_RANK", "'0'",
                                          "greater than or equal to 1"]),
    ({"VTM_TORCH_THREADS": "0"}, ["VTM_TORCH_THREADS", "'0'",
                                   "greater than or equal to 1"]),
    ({"VTM_TORCH_SEED": "x"}, ["VTM_TORCH_SEED", "'x'", "integer"]),
    ({"VTM_TORCH_SEED": str(2**64)}, ["VTM_TORCH_SEED", str(2**64), str(-(2**63))]),
    ({"VTM_TORCH_MODEL_JSON": "{not json"}, ["VTM_TORCH_MODEL_JSON", "not valid JSON"]),
    ({"VTM_TORCH_MODEL_JSON": "[1, 2]"}, ["VTM_TORCH_MODEL_JSON", "JSON object", "list"]),
    ({"VTM_TORCH_MODEL_JSON": '{"hidden_size": "big"}'},
     ["VTM_TORCH_MODEL_JSON", "hidden_size", "'big'"]),
    ({"VTM_TORCH_MODEL_JSON": '{"intermediate_size": -1}'},
     ["VTM_TORCH_MODEL_JSON", "negative dimension -1"]),
    ({"VTM_TORCH_MODEL_PATH": "/nonexistent/ckpt"},
     ["VTM_TORCH_MODEL_PATH", "/nonexistent/ckpt", "checkpoint directory"]),
    ({"VTM_TORCH_DEVICE": "tpu"}, ["VTM_TORCH_DEVICE", "'tpu'", "'cpu' or 'cuda'"]),
    ({"VTM_TORCH_HANDOFF": "lcoal"}, ["VTM_TORCH_HANDOFF", "'lcoal'", "'nats' or 'local'"]),
    ({"VTM_TORCH_EMBEDDED_DECODE": "maybe"}, ["VTM_TORCH_EMBEDDED_DECODE", "'maybe'", "bool"]),
    ({"VTM_TORCH_DECODE_TIMEOUT_S": "0"}, ["VTM_TORCH_DECODE_TIMEOUT_S", "'0'",
                                            "greater than 0"]),
    ({"VTM_TORCH_DECODE_TIMEOUT_S": "inf"}, ["VTM_TORCH_DECODE_TIMEOUT_S", "'inf'",
                                              "finite number"]),
    ({"VTM_TORCH_DECODE_TIMEOUT_S": "nan"}, ["VTM_TORCH_DECODE_TIMEOUT_S", "'nan'",
                                              "finite number"]),
]


@pytest.mark.parametrize(("env", "needles"), BAD, ids=[
    "-".join(f"{k.removeprefix('VTM_').lower()}={v}"[:40] for k, v in env.items())
    for env, _ in BAD])
@pytest.mark.parametrize("mode", ["worker", "host"])
def test_a_bad_value_exits_2_before_any_rank_spawns(
        no_spawn: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        env: dict[str, str], needles: list[str], mode: str) -> None:
    if mode == "host":
        monkeypatch.setenv("VTM_HOST_GPUS", "0-1")
        if "VTM_WORKER_ID" in env:  # the host's initial workers carry the degree instead
            env = {**env, "VTM_INITIAL_WORKERS": env.pop("VTM_WORKER_ID")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _refused(capsys, *needles)


def test_a_tp_worker_exits_2(no_spawn: None, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the world was spawned (and left running) before the backend refused TP."""
    monkeypatch.setenv("VTM_KIND", "tp")
    _refused(capsys, "VTM_KIND", "'tp'", "CP workers only")


@pytest.mark.parametrize(("worker", "present", "needles"), [
    ("w-cp1-g0", 0, ["VTM_TORCH_DEVICE", "cuda", "no CUDA device"]),
    ("w-cp2-g2", 2, ["VTM_TORCH_DEVICE", "cuda", "GPUs 2-3", "device_count() is 2"]),
])
def test_cuda_without_the_workers_gpus_exits_2(
        no_spawn: None, cuda: list[int], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], worker: str, present: int,
        needles: list[str]) -> None:
    cuda[0] = present
    monkeypatch.setenv("VTM_TORCH_DEVICE", "cuda")
    monkeypatch.setenv("VTM_WORKER_ID", worker)
    _refused(capsys, *needles)


def test_every_bad_value_is_named_at_once(
        no_spawn: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An operator fixes them in one go, not one restart per variable -- a value pydantic
    refused included (its field is then checked no further, the others are)."""
    monkeypatch.setenv("VTM_TORCH_BLOCK_SIZE", "0")
    monkeypatch.setenv("VTM_TORCH_DTYPE", "int4")
    monkeypatch.setenv("VTM_TORCH_DEGREES", "1,6")
    monkeypatch.setenv("VTM_TORCH_MODEL_JSON", "{")
    err = _refused(capsys, "VTM_TORCH_BLOCK_SIZE", "VTM_TORCH_DTYPE", "VTM_TORCH_DEGREES",
                   "VTM_TORCH_MODEL_JSON")
    assert len([ln for ln in err.splitlines() if ln.startswith("  VTM_TORCH_")]) == 4, err


def test_a_sim_daemon_reads_no_torch_setting(no_spawn: None, monkeypatch: pytest.MonkeyPatch,
                                             ) -> None:
    """``VTM_BACKEND=sim`` runs no engine: a torch value it never uses is not its to refuse
    (one environment may serve a torch and a sim daemon)."""
    from services.rankd.torch_spec import torch_problems

    monkeypatch.setenv("VTM_BACKEND", "sim")
    monkeypatch.setenv("VTM_TORCH_DTYPE", "int4")
    assert torch_problems(rankd_main.parse_settings([])) == []


def test_a_childs_overrides_win_over_this_environment(
        no_spawn: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a launcher (``vertumnus up``) checks for the rank daemon it starts: its own
    ``VTM_TORCH_*`` values over the environment the daemon inherits."""
    from services.rankd.torch_spec import torch_problems

    monkeypatch.setenv("VTM_TORCH_DTYPE", "int4")
    settings = rankd_main.parse_settings([])
    assert torch_problems(settings, {"VTM_TORCH_DTYPE": "float64"}) == []
    monkeypatch.delenv("VTM_TORCH_DTYPE")
    (problem,) = torch_problems(settings, {"VTM_TORCH_BLOCK_SIZE": "0", "VTM_OTHER": "x"})
    assert problem.startswith("VTM_TORCH_BLOCK_SIZE='0'"), problem


@pytest.mark.parametrize("env", [
    {},
    {"VTM_WORKER_ID": "w-cp4-g0"},
    {"VTM_HOST_GPUS": "0-7", "VTM_INITIAL_WORKERS": "w-cp4-g0,w-cp2-g4,w-cp1-g7"},
    {"VTM_HOST_GPUS": "0-2", "VTM_TORCH_DEGREES": "1,2,4"},  # 2 and 4 ignored: no divisor
    {"VTM_TORCH_DTYPE": "bfloat16", "VTM_TORCH_HANDOFF": "local", "VTM_TORCH_DEGREES": ""},
    {"VTM_TORCH_MODEL_JSON": json.dumps({"vocab_size": 64, "hidden_size": 32,
                                         "num_attention_heads": 2})},
    {"VTM_TORCH_MODEL_PATH": "/nonexistent", "VTM_TORCH_MODEL_JSON": "ignored: a path wins"},
], ids=["defaults", "cp4", "host", "host-of-3", "local-bf16", "model-json", "path-wins"])
def test_good_settings_pass_to_the_spawn(no_spawn: None, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path, env: dict[str, str]) -> None:
    """The check refuses nothing the pool starts with: the daemon gets to the spawn."""
    from services.rankd.engine.config import Qwen3Config
    from services.rankd.engine.model import Qwen3ForCausalLM
    from services.rankd.torch_spec import torch_problems

    if env.get("VTM_TORCH_MODEL_PATH"):
        from services.rankd.engine.checkpoint import save_model

        save_model(Qwen3ForCausalLM.random(Qwen3Config(), 0), tmp_path / "ckpt")
        env = {**env, "VTM_TORCH_MODEL_PATH": str(tmp_path / "ckpt")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("services.rankd.torch_backend._decode_model", lambda *a: "model")
    settings = rankd_main.parse_settings([])
    assert torch_problems(settings) == []
    with pytest.raises(Spawned):
        rankd_main.make_backend(settings) if settings.host_range is None else _host(settings)


def _host(settings: Any) -> None:
    from services.rankd.torch_backend import TorchPool

    TorchPool.start(settings.host_range, initial_workers=settings.initial_worker_ids)


@pytest.mark.parametrize("command", [
    ["-m", "services.rankd.main"],
    ["-m", "vertumnus", "rankd"],
], ids=["service-module", "vertumnus-rankd"])
def test_the_real_commands_exit_2_naming_the_variable(command: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("VTM_")}
    env.update(VTM_NATS_URL=NOWHERE, VTM_BACKEND="torch", VTM_TORCH_DTYPE="int4",
               VTM_TORCH_DEGREES="1,2,x")
    proc = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "VTM_TORCH_DTYPE" in proc.stderr and "'int4'" in proc.stderr
    assert "VTM_TORCH_DEGREES" in proc.stderr and "'1,2,x'" in proc.stderr
