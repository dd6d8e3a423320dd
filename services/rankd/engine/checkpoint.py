"""Load and save a model from a local Hugging Face-format directory.

A directory holds ``config.json`` (Qwen3 keys), one or more ``*.safetensors`` files with HF
Qwen3 parameter names (sharded checkpoints may add ``model.safetensors.index.json``; we read
every ``*.safetensors`` file, which covers both), and optionally ``tokenizer.json``.
Nothing is downloaded. Every defect is reported as :class:`CheckpointError` naming the
directory and the offending file/tensor, and nothing is half-loaded: the model is built and
filled only after every tensor was checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.errors import CheckpointError
from services.rankd.engine.model import Qwen3ForCausalLM

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def load_config(path: str | Path) -> Qwen3Config:
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"model directory {d} does not exist or is not a directory")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{d}: missing config.json")
    try:
        data: Any = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON: {exc}") from exc
    mt = data.get("model_type") if isinstance(data, dict) else None
    if mt not in (None, "qwen3", "qwen3_moe"):
        raise CheckpointError(f"{cfg_path}: model_type {mt!r} is not qwen3/qwen3_moe")
    try:
        return Qwen3Config.from_dict(data)
    except CheckpointError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from exc


def load_model(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Qwen3ForCausalLM:
    """Build the model of ``path`` and fill every parameter from its safetensors files.

    ``dtype`` defaults to the config's ``torch_dtype``. Raises :class:`CheckpointError` on a
    missing/invalid config, no safetensors file, an unreadable file, a missing, unexpected
    or misshaped tensor.
    """
    d = Path(path)
    cfg = load_config(d)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{f}: unreadable safetensors file: {exc}") from exc
        dup = tensors.keys() & part.keys()
        if dup:
            raise CheckpointError(f"{f}: tensors also present in another shard: {sorted(dup)[:3]}")
        tensors.update(part)

    with torch.device("meta"):
        skeleton = Qwen3ForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(k for k in expected if k not in tensors and k not in optional)
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{d}: missing tensors {missing[:5]}{more}")
    unexpected = sorted(k for k in tensors if k not in expected)
    if unexpected:
        raise CheckpointError(f"{d}: unexpected tensors {unexpected[:5]}")
    for k, t in tensors.items():
        if tuple(t.shape) != expected[k]:
            raise CheckpointError(
                f"{d}: tensor {k} has shape {tuple(t.shape)}, config implies {expected[k]}"
            )
        if not t.dtype.is_floating_point:
            raise CheckpointError(f"{d}: tensor {k} has non-float dtype {t.dtype}")

    target = dtype or _DTYPES.get(cfg.torch_dtype, torch.float32)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        sd = model.state_dict()
        for k, t in tensors.items():
            sd[k].copy_(t)
    return model.to(device=device, dtype=target).eval()


def save_model(model: Qwen3ForCausalLM, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (HF names) into ``path``."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = {v: k for k, v in _DTYPES.items()}.get(model.dtype, "float32")
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # HF omits the tied head; safetensors rejects shared storage
    save_file(sd, str(d / "model.safetensors"))


def load_tokenizer(path: str | Path) -> Any | None:
    """The ``tokenizers.Tokenizer`` of ``path/tokenizer.json``, or None when there is none."""
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # engine extra not installed
        raise CheckpointError(
            "tokenizer.json present but the 'tokenizers' package is missing"
        ) from exc
    try:
        return Tokenizer.from_file(str(f))
    except Exception as exc:  # tokenizers raises a bare Exception subclass on bad files
        raise CheckpointError(f"{f}: unreadable tokenizer: {exc}") from exc
