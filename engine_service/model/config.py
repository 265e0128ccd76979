"""ModelConfig: the parts of a Hugging Face ``config.json`` the runtime needs, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine_service.model.architectures import ARCHITECTURES, UnsupportedModelError, resolve_architecture

__all__ = ["ARCHITECTURES", "ModelConfig", "UnsupportedModelError"]
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projection biases (Qwen2 always; Llama when configured)
    o_proj_bias: bool  # output projection bias (Llama's attention_bias covers it; Qwen2 has none)
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        arch = resolve_architecture(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers >= 5 writes "rope_parameters" (theta included); older configs write
        # "rope_theta" and "rope_scaling" separately.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_scaling = cfg.get("rope_scaling") or rope_params or None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("unsupported configuration mlp_bias=true: Sluice's MLP has no biases")
        if rope_scaling:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"unsupported rope_scaling type {rope_type!r}: Sluice supports {sorted(SUPPORTED_ROPE_TYPES)}"
                )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # Read the Llama way, then the family's differences (engine_service.model.architectures).
        fields = dict(
            architecture=arch.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling or None,
            sliding_window=cfg.get("sliding_window"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        fields.update(arch.config_differences(cfg))
        sliding = fields["sliding_window"]
        fields["sliding_window"] = int(sliding) if sliding else None
        return cls(**fields)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory: no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @property
    def context_length(self) -> int:
        """The longest sequence the runtime serves: a sliding window (which this runtime does not
        implement) caps it, so the window never binds and attention stays exact."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings
