"""Build a model from a Hugging Face directory: config.json plus safetensors weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine_service.model.config import ModelConfig
from engine_service.model.layers import RotaryEmbedding
from engine_service.model.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[key]


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_model(model_dir: str | Path, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Instantiate the architecture named by config.json and load its weights onto ``device``."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {name for name, _ in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the config
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding is the output projection
                if name not in expected:
                    raise ValueError(f"unexpected weight {name!r} in {path.name}")
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    missing = expected - state.keys()
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {sorted(missing)[:5]}")
    model.load_state_dict(state, assign=True, strict=True)
    # Buffers were created on the meta device; rebuild them for real.
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model.requires_grad_(False).eval()
