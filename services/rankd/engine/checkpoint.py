"""Load and save a model from a local Hugging Face-format directory.

A directory holds ``config.json`` (Qwen3 keys), one or more ``*.safetensors`` files with HF
Qwen3 parameter names (sharded checkpoints may add ``model.safetensors.index.json``; we read
every ``*.safetensors`` file, which covers both), and optionally ``tokenizer.json``.
Nothing is downloaded. Every defect is reported as :class:`CheckpointError` naming the
directory and the offending file/tensor, and nothing is half-loaded: the model is built and
filled only after every tensor was checked.

The tensors a config implies (:func:`expected_tensors`) and the checks of what a directory
holds against them (:func:`check_tensors`) are one code path for :func:`load_model` (on the
loaded tensors) and :func:`check_checkpoint` (on the safetensors headers alone, no tensor
data read: ``vertumnus up``'s checks before it starts anything), so the two cannot disagree
about what a checkpoint must hold.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
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


class TensorInfo(NamedTuple):
    """What the checks need of one tensor of a checkpoint: its shape, its dtype's name (as
    the file or torch names it) and whether that is a floating-point one (the loader casts
    weights to the model's dtype; an integer tensor is no weight)."""

    shape: tuple[int, ...]
    dtype: str
    floating: bool


def expected_tensors(cfg: Qwen3Config) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """The shape of every tensor (HF name) a checkpoint of ``cfg`` holds, from the model the
    loader fills (built on the meta device: no memory), and the names it may leave out (the
    tied ``lm_head.weight``)."""
    with torch.device("meta"):
        skeleton = Qwen3ForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    optional = frozenset({"lm_head.weight"} if cfg.tie_word_embeddings else ())
    return expected, optional


def check_tensors(d: Path, cfg: Qwen3Config, found: Mapping[str, TensorInfo]) -> None:
    """Raise :class:`CheckpointError` naming the directory ``d`` unless ``found`` (every tensor
    of its safetensors files) is what ``cfg`` implies (:func:`expected_tensors`): none
    missing (but an optional one), none unexpected, each of its shape and a floating-point
    dtype. The message names the tensor, its shape and the one the config implies."""
    expected, optional = expected_tensors(cfg)
    missing = sorted(k for k in expected if k not in found and k not in optional)
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{d}: missing tensors {missing[:5]}{more}")
    unexpected = sorted(k for k in found if k not in expected)
    if unexpected:
        raise CheckpointError(f"{d}: unexpected tensors {unexpected[:5]}")
    for k, t in found.items():
        if t.shape != expected[k]:
            raise CheckpointError(
                f"{d}: tensor {k} has shape {t.shape}, config implies {expected[k]}"
            )
        if not t.floating:
            raise CheckpointError(f"{d}: tensor {k} has non-float dtype {t.dtype}")


def _safetensors_files(d: Path) -> list[Path]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors file")
    return files


def _add_shard(into: dict[str, Any], f: Path, part: Mapping[str, Any]) -> None:
    dup = into.keys() & part.keys()
    if dup:
        raise CheckpointError(f"{f}: tensors also present in another shard: {sorted(dup)[:3]}")
    into.update(part)


def _floating(st_dtype: str) -> bool:
    """Whether a safetensors header's dtype (``F32``, ``BF16``, ``F8_E4M3``, ``I64``, ...) is a
    floating-point one, as ``torch.dtype.is_floating_point`` has it for the loaded tensor."""
    return st_dtype == "BF16" or st_dtype.startswith("F")


def check_checkpoint(path: str | Path) -> Qwen3Config:
    """Check the model directory ``path`` as :func:`load_model` would, reading no tensor data:
    its config, and every tensor's name, shape and dtype from the safetensors files' headers
    (:func:`check_tensors`). Returns the config. Raises :class:`CheckpointError` as
    :func:`load_model` does for the same defects (an unreadable file or header included).

    It reads each file's header (kilobytes), not its weights (gigabytes): what ``vertumnus up
    --model-path`` checks before it starts anything."""
    d = Path(path)
    cfg = load_config(d)
    found: dict[str, TensorInfo] = {}
    for f in _safetensors_files(d):
        part: dict[str, TensorInfo]
        try:
            # framework "numpy": the header is read and checked; nothing is converted.
            with safe_open(str(f), framework="numpy") as st:
                part = {}
                for k in st.keys():
                    sl = st.get_slice(k)
                    part[k] = TensorInfo(
                        tuple(sl.get_shape()), sl.get_dtype(), _floating(sl.get_dtype())
                    )
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{f}: unreadable safetensors file: {exc}") from exc
        _add_shard(found, f, part)
    check_tensors(d, cfg, found)
    return cfg


def load_model(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Qwen3ForCausalLM:
    """Build the model of ``path`` and fill every parameter from its safetensors files.

    ``dtype`` defaults to the config's ``torch_dtype``. Raises :class:`CheckpointError` on a
    missing/invalid config, no safetensors file, an unreadable file, a missing, unexpected
    or misshaped tensor (:func:`check_tensors`, as :func:`check_checkpoint` checks before).
    """
    d = Path(path)
    cfg = load_config(d)
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(d):
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{f}: unreadable safetensors file: {exc}") from exc
        _add_shard(tensors, f, part)
    found = {
        k: TensorInfo(tuple(t.shape), str(t.dtype), t.dtype.is_floating_point)
        for k, t in tensors.items()
    }
    check_tensors(d, cfg, found)

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
