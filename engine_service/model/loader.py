"""Build a model from a Hugging Face directory (config.json plus safetensors weights) or from a GGUF
file's metadata directory (``gguf_model``: the weights read from the file's blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine_service.model.architectures import ARCHITECTURES
from engine_service.model.config import ModelConfig
from engine_service.model.gguf_model import gguf_source, load_gguf_model
from engine_service.model.hugepages import move_to_hugepages
from engine_service.model.layers import RotaryEmbedding
from engine_service.model.llama import FUSED_PROJECTIONS, LlamaForCausalLM
from engine_service.model.prepacked import PREPACK_DTYPES, prepack_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (or 'auto' for the engine), got {name!r}")
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
               device: torch.device | str = "cpu", quantization: str | None = None,
               prepack: bool = True) -> LlamaForCausalLM:
    """Instantiate the architecture named by config.json (its class from
    ``engine_service.model.architectures``) and load its weights onto ``device``;
    ``quantization`` ("int8" | "int4") then swaps its linear layers for quantized ones. Otherwise a
    bfloat16/float16 model on CPU gets its linear weights prepacked for oneDNN
    (``engine_service.model.prepacked``; ``prepack=False`` keeps plain ``nn.Linear``, the reference)."""
    model_dir = Path(model_dir)
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    gguf = gguf_source(model_dir)
    if gguf is not None:  # a GGUF file's metadata directory: the weights are the file's blocks
        if quantization is not None:
            raise ValueError(f"{gguf.name} is a GGUF file: its blocks are its quantization, not {quantization!r}")
        model = load_gguf_model(gguf, dtype, device)
        if prepack and dtype in PREPACK_DTYPES:
            prepack_model(model)  # its float projections, if any (an F16/BF16 file's)
        move_to_hugepages(model)
        return model
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.architecture].model_class()(cfg)
    expected = {name for name, _ in model.named_parameters()}
    # checkpoint name -> (fused parameter name, part index) for the fused projections
    fused_parts: dict[str, tuple[str, int]] = {}
    for name in expected:
        for fused, parts in FUSED_PROJECTIONS.items():
            if f".{fused}." in name:
                for i, part in enumerate(parts):
                    fused_parts[name.replace(fused, part)] = (name, i)
    pending: dict[str, dict[int, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the config
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding is the output projection
                if name in fused_parts:
                    fused, index = fused_parts[name]
                    pending.setdefault(fused, {})[index] = f.get_tensor(name).to(dtype=dtype)
                    continue
                if name not in expected:
                    raise ValueError(f"unexpected weight {name!r} in {path.name}")
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    for fused, parts in pending.items():
        count = len(FUSED_PROJECTIONS[fused.split(".", 3)[3].rsplit(".", 1)[0]])
        if len(parts) == count:
            state[fused] = torch.cat([parts[i] for i in range(count)], dim=0).to(device)
    missing = expected - state.keys()
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {sorted(missing)[:5]}")
    model.load_state_dict(state, assign=True, strict=True)
    # Buffers were created on the meta device; rebuild them for real.
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    model.rotary.ensure_positions(min(cfg.context_length, 8192))
    model = model.requires_grad_(False).eval()
    if quantization is not None:
        from engine_service.model.quantization import quantize_model

        with torch.inference_mode():
            quantize_model(model, quantization)
    elif prepack and device.type == "cpu" and dtype in PREPACK_DTYPES:
        prepack_model(model)
    if device.type == "cpu":
        move_to_hugepages(model)  # a decode step streams every weight: huge pages halve it here
    return model
