"""Model configuration with the keys of Hugging Face Qwen3 / Qwen3-MoE ``config.json``.

Only the keys the architecture needs are fields; unknown keys of a real config.json are kept in
``extra`` (and written back) so a round trip loses nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from services.rankd.engine.errors import CheckpointError


@dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 decoder hyper-parameters (HF key names).

    MoE: a layer i uses the top-k MoE MLP iff ``num_experts > 0``, ``i not in mlp_only_layers``
    and ``(i + 1) % decoder_sparse_step == 0`` (HF Qwen3-MoE rule); otherwise a dense SwiGLU.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "qwen3"
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # MoE (qwen3_moe); num_experts == 0 means dense everywhere.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        for k in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{k} must be a positive integer, got {v!r}")
        if not problems and self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if not problems and self.head_dim % 2:
            problems.append("head_dim must be even (RoPE rotates pairs)")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts):
            problems.append("num_experts_per_tok must be in [1, num_experts]")
        if not (self.rope_theta > 0):
            problems.append(f"rope_theta must be > 0, got {self.rope_theta!r}")
        # Loaded silently, either would give other logits than the reference model's: this
        # engine has plain RoPE and full causal attention only.
        if self.extra.get("rope_scaling"):
            problems.append(f"rope_scaling {self.extra['rope_scaling']!r} is not supported "
                            "(plain RoPE only; positions would differ from the reference)")
        if self.extra.get("use_sliding_window"):
            problems.append("use_sliding_window is not supported (full causal attention only)")
        if problems:
            raise CheckpointError("invalid Qwen3 config: " + "; ".join(problems))

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Qwen3Config:
        """Build from a parsed config.json; unknown keys go to ``extra``."""
        if not isinstance(data, dict):
            raise CheckpointError(f"config.json must hold an object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        if "head_dim" not in data and "hidden_size" in data and "num_attention_heads" in data:
            kwargs["head_dim"] = int(data["hidden_size"]) // int(data["num_attention_heads"])
        if "num_key_value_heads" not in data and "num_attention_heads" in data:
            kwargs["num_key_value_heads"] = data["num_attention_heads"]
        if "mlp_only_layers" in kwargs:
            kwargs["mlp_only_layers"] = tuple(kwargs["mlp_only_layers"] or ())
        try:
            return cls(**kwargs, extra=extra)
        except TypeError as exc:
            raise CheckpointError(f"invalid Qwen3 config: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["architectures"] = ["Qwen3MoeForCausalLM" if self.num_experts else "Qwen3ForCausalLM"]
        if self.num_experts and self.model_type == "qwen3":
            d["model_type"] = "qwen3_moe"
        return {**self.extra, **d}
