"""``vertumnus profile --backend torch`` measures the engine rankd serves with: the model, block
size, device, dtype and threads of its ``VTM_TORCH_*`` settings (``TorchSettings``, the
environment rankd reads), with ``--model-path``, ``--block-size``, ``--device`` and ``--dtype``
winning over them; a bad value is a clean refusal (exit 2 naming the option or variable) before
anything is measured. ``measure`` is stubbed: no rank process starts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from cli_support import _refused  # noqa: E402

from services.rankd.engine import profiling  # noqa: E402
from services.rankd.torch_backend import TINY_MODEL  # noqa: E402
from shared.costmodel import Profile  # noqa: E402
from vertumnus.cli import app  # noqa: E402

CUSTOM = {**TINY_MODEL, "hidden_size": 32, "num_hidden_layers": 1, "vocab_size": 300}


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Stub ``measure`` (records its arguments, returns plausible timings) and the plot; and
    clear any ``VTM_TORCH_*`` variable of the calling environment."""
    for k in list(os.environ):
        if k.startswith("VTM_TORCH_"):
            monkeypatch.delenv(k)
    calls: list[dict[str, Any]] = []

    def fake_measure(degrees, lengths, prefixes, repeats, **kw):  # type: ignore[no-untyped-def]
        calls.append({"degrees": tuple(degrees), "lengths": tuple(lengths),
                      "prefixes": tuple(prefixes), "repeats": repeats, **kw})
        rows = [{"degree": c, "r": r, "p": p, "repeat": k, "prefix_reused": p,
                 "seconds": 1e-3 + 2e-5 * r / c + 1e-8 * r * (r + p) / c + 1e-6 * k,
                 "per_rank_s": []}
                for c in degrees for p in prefixes for r in lengths for k in range(repeats)]
        return rows, {c: 0.01 for c in degrees}

    monkeypatch.setattr(profiling, "measure", fake_measure)
    monkeypatch.setattr(profiling, "plot_fits", lambda fits, samples, path: Path(path))
    return calls


def _profile(runner, out: Path, *args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["profile", "--backend", "torch", "--degrees", "1,2",
                               "--out", str(out), *args])


def _checkpoint(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY_MODEL, "model_type": "qwen3"}))
    return d


def test_by_default_it_profiles_rankds_default_engine(runner, tmp_path, seen) -> None:
    res = _profile(runner, tmp_path / "o")
    assert res.exit_code == 0, res.output
    (call,) = seen
    # TorchSettings' defaults: the tiny random model rankd runs, 16-token pages, CPU.
    assert call["model_config"] == TINY_MODEL and call["model_path"] is None
    assert (call["block_size"], call["device"], call["dtype"], call["threads"]) == (
        16, "cpu", "float32", 1)
    assert call["prefixes"] == profiling.DEFAULT_PREFIXES
    report = json.loads((tmp_path / "o" / "profile_report.json").read_text())
    assert report["model_config"] == TINY_MODEL and report["dtype"] == "float32"
    assert Profile.load(tmp_path / "o" / "profile.json").block_size == 16


def test_it_follows_the_vtm_torch_settings(runner, tmp_path, seen, monkeypatch) -> None:
    monkeypatch.setenv("VTM_TORCH_MODEL_JSON", json.dumps(CUSTOM))
    monkeypatch.setenv("VTM_TORCH_BLOCK_SIZE", "512")
    monkeypatch.setenv("VTM_TORCH_DTYPE", "float64")
    monkeypatch.setenv("VTM_TORCH_THREADS", "2")
    res = _profile(runner, tmp_path / "o")
    assert res.exit_code == 0, res.output
    (call,) = seen
    assert call["model_config"] == CUSTOM and call["model_path"] is None
    assert (call["block_size"], call["dtype"], call["threads"]) == (512, "float64", 2)
    # The prefix grid is cut to whole blocks (128 is no multiple of 512).
    assert call["prefixes"] == (0, 512)
    report = json.loads((tmp_path / "o" / "profile_report.json").read_text())
    assert report["block_size"] == 512 and report["model_config"] == CUSTOM
    assert "2 threads/rank" in report["hardware"]
    assert Profile.load(tmp_path / "o" / "profile.json").block_size == 512


def test_cuda_from_the_environment(runner, tmp_path, seen, monkeypatch) -> None:
    import torch

    monkeypatch.setenv("VTM_TORCH_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    res = _profile(runner, tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert seen[0]["device"] == "cuda" and seen[0]["degrees"] == (1, 2)


def test_the_flags_win_over_the_environment(runner, tmp_path, seen, monkeypatch) -> None:
    ckpt = _checkpoint(tmp_path)
    monkeypatch.setenv("VTM_TORCH_MODEL_JSON", json.dumps(CUSTOM))
    monkeypatch.setenv("VTM_TORCH_BLOCK_SIZE", "512")
    monkeypatch.setenv("VTM_TORCH_DEVICE", "cuda")  # no GPU needed: --device cpu wins
    monkeypatch.setenv("VTM_TORCH_DTYPE", "float16")
    res = _profile(runner, tmp_path / "o", "--model-path", str(ckpt), "--block-size", "32",
                   "--device", "cpu", "--dtype", "bfloat16")
    assert res.exit_code == 0, res.output
    (call,) = seen
    assert call["model_path"] == str(ckpt) and call["model_config"] is None
    assert (call["block_size"], call["device"], call["dtype"]) == (32, "cpu", "bfloat16")
    assert all(p % 32 == 0 for p in call["prefixes"])


@pytest.mark.parametrize(("env", "args", "needles"), [
    ({}, ["--model-path", "/nonexistent/ckpt"], ["--model-path", "/nonexistent/ckpt"]),
    ({"VTM_TORCH_MODEL_PATH": "/nonexistent/ckpt"}, [],
     ["VTM_TORCH_MODEL_PATH", "/nonexistent/ckpt"]),
    ({"VTM_TORCH_MODEL_JSON": "{not json"}, [], ["VTM_TORCH_MODEL_JSON", "not valid JSON"]),
    ({"VTM_TORCH_MODEL_JSON": "[1, 2]"}, [], ["VTM_TORCH_MODEL_JSON"]),
    ({"VTM_TORCH_MODEL_JSON": '{"hidden_size": "big"}'}, [], ["VTM_TORCH_MODEL_JSON"]),
    ({"VTM_TORCH_DEVICE": "cuda"}, [], ["VTM_TORCH_DEVICE", "CUDA"]),
    ({}, ["--device", "cuda"], ["--device", "CUDA"]),
    ({"VTM_TORCH_DEVICE": "tpu"}, [], ["VTM_TORCH_DEVICE", "'tpu'"]),
    ({}, ["--device", "gpu"], ["--device", "'gpu'"]),
    ({"VTM_TORCH_BLOCK_SIZE": "abc"}, [], ["VTM_TORCH_BLOCK_SIZE"]),
    ({"VTM_TORCH_BLOCK_SIZE": "0"}, [], ["VTM_TORCH_BLOCK_SIZE"]),
    ({}, ["--block-size", "0"], ["--block-size", "0"]),
    ({"VTM_TORCH_DTYPE": "float8"}, [], ["VTM_TORCH_DTYPE", "float8"]),
    ({}, ["--dtype", "int8"], ["--dtype", "int8"]),
])
def test_a_bad_engine_setting_exits_2_naming_it(runner, tmp_path, seen, monkeypatch, env,
                                                args, needles) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _refused(_profile(runner, tmp_path / "o", *args), *needles)
    assert seen == []
    assert not (tmp_path / "o" / "profile.json").exists()


def test_the_engine_flags_are_the_torch_backends(runner, tmp_path, seen) -> None:
    res = runner.invoke(app, ["profile", "--backend", "sim", "--block-size", "32",
                              "--out", str(tmp_path / "o")])
    _refused(res, "--block-size", "--backend torch")
    assert seen == []
