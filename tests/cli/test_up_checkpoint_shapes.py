"""``up --backend torch --model-path DIR`` checks the checkpoint's tensors before anything
starts: every tensor the config implies, of its shape and a float dtype, read from the
safetensors headers alone (no weight loaded). A checkpoint with a misshaped tensor used to
pass ``up``'s checks (a config.json and a safetensors file were all they asked for) and fail
only where the rank processes loaded it, after the start-up.

The table of expected tensors and the checks are the loader's own
(``services.rankd.engine.checkpoint``: ``expected_tensors``, ``check_tensors``), so the
header check and a load say the same of every checkpoint; tested here defect by defect.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_support import Started, _refused
from typer.testing import CliRunner

from vertumnus.cli import app

torch = pytest.importorskip("torch")  # the checkpoint checks are the engine's own

from safetensors.torch import load_file, save_file  # noqa: E402

from services.rankd.engine import checkpoint  # noqa: E402
from services.rankd.engine.checkpoint import (  # noqa: E402
    check_checkpoint,
    load_model,
    save_model,
)
from services.rankd.engine.config import Qwen3Config  # noqa: E402
from services.rankd.engine.errors import CheckpointError  # noqa: E402
from services.rankd.engine.model import Qwen3ForCausalLM  # noqa: E402

CFG = Qwen3Config(max_position_embeddings=64)
Q = "model.layers.0.self_attn.q_proj.weight"
SHORT = ["--duration", "10", "--max-requests", "2"]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    save_model(Qwen3ForCausalLM.random(CFG), d)
    return d


def _rewrite(d: Path, change: dict[str, Any], drop: tuple[str, ...] = ()) -> None:
    f = d / "model.safetensors"
    sd = {k: v for k, v in load_file(str(f)).items() if k not in drop}
    save_file(sd | change, str(f))


def _up(d: Path) -> Any:
    return CliRunner().invoke(app, ["up", *SHORT, "--backend", "torch", "--model-path", str(d)])


def test_a_misshaped_tensor_is_refused_before_the_start(model_dir: Path,
                                                        tripwire: list[dict[str, Any]]) -> None:
    expected = tuple(load_file(str(model_dir / "model.safetensors"))[Q].shape)
    _rewrite(model_dir, {Q: torch.zeros(3, 5)})
    _refused(_up(model_dir), "--model-path:", str(model_dir), f"tensor {Q} has shape (3, 5)",
             f"config implies {expected}")
    assert tripwire == []


def test_a_good_checkpoint_passes_without_loading_a_weight(
        model_dir: Path, tripwire: list[dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check reads headers: the loader's ``load_file`` (which reads every weight) is never
    called on the way to the start."""
    def no_load(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a weight file was loaded by up's checks")

    monkeypatch.setattr(checkpoint, "load_file", no_load)
    res = _up(model_dir)
    assert isinstance(res.exception, Started), res.output
    assert tripwire[-1]["args"][0].model_path == model_dir.resolve()


# (name, tensors to add or replace, tensors to drop, what the message says)
DEFECTS: list[tuple[str, dict[str, Any], tuple[str, ...], str]] = [
    ("misshaped", {Q: torch.zeros(64, 3)}, (), f"tensor {Q} has shape (64, 3)"),
    ("missing", {}, ("model.layers.1.self_attn.k_norm.weight",), "missing tensors"),
    ("unexpected", {"model.extra.weight": torch.zeros(1)}, (), "unexpected tensors"),
    ("integer", {Q: torch.zeros(64, 64, dtype=torch.int64)}, (), "non-float dtype"),
]


@pytest.mark.parametrize(("name", "change", "drop", "said"), DEFECTS, ids=[d[0] for d in DEFECTS])
def test_the_header_check_and_the_load_agree(model_dir: Path, name: str, change: dict,
                                             drop: tuple[str, ...], said: str) -> None:
    _rewrite(model_dir, change, drop)
    with pytest.raises(CheckpointError) as by_header:
        check_checkpoint(model_dir)
    with pytest.raises(CheckpointError) as by_load:
        load_model(model_dir)
    assert said in str(by_header.value)
    if name == "integer":  # the dtype as each names it: the file's I64, torch's int64
        assert str(by_header.value).endswith("non-float dtype I64")
        assert str(by_load.value).endswith("non-float dtype torch.int64")
    else:
        assert str(by_header.value) == str(by_load.value)


def test_shards_split_a_checkpoint_and_a_tensor_in_two_is_refused(model_dir: Path) -> None:
    f = model_dir / "model.safetensors"
    sd = load_file(str(f))
    names = sorted(sd)
    f.unlink()
    save_file({k: sd[k] for k in names[:5]}, str(model_dir / "a.safetensors"))
    save_file({k: sd[k] for k in names[5:]}, str(model_dir / "b.safetensors"))
    assert check_checkpoint(model_dir) == CFG
    save_file({k: sd[k] for k in names[4:]}, str(model_dir / "b.safetensors"))
    with pytest.raises(CheckpointError, match="also present in another shard"):
        check_checkpoint(model_dir)


def test_an_unreadable_file_and_a_tied_head(tmp_path: Path) -> None:
    tied = Qwen3Config(max_position_embeddings=64, tie_word_embeddings=True)
    d = tmp_path / "tied"
    save_model(Qwen3ForCausalLM.random(tied), d)  # no lm_head.weight in the file
    assert check_checkpoint(d) == tied
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        check_checkpoint(d)
    # A header promising more data than the file holds (a cut download).
    cut = tmp_path / "cut"
    save_model(Qwen3ForCausalLM.random(CFG), cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        check_checkpoint(cut)
    assert json.loads((cut / "config.json").read_text())["model_type"] == "qwen3"
