"""Serve a GGUF file as it is: ``--model FILE.gguf``.

The file's metadata gives the configuration, the tokenizer and the chat template (the same
conversion ``sluice model prepare`` uses, ``gguf_convert``); they are written once into a small
directory under the cache (``metadata_dir``), keyed by the file's path, size and modification time,
so that the engine's tokenizer and model card read them as they read a Hugging Face directory. The
weights stay in the file: each projection's blocks are decoded into the native kernels' codes and
scales (``gguf_blocks``), never dequantized and quantized again: Q4_0, Q4_1 and Q4_K run the int4
kernel (``QuantizedLinear.from_q4``), Q8_0 and Q6_K the int8 block kernel (``Q8Linear``), F32, F16 and
BF16 a dense product. A tied output projection reads the embedding's own blocks.

Everything is checked before memory is committed (``open_gguf``): a truncated file, an unknown
tensor type or architecture, a tensor missing, unexpected or of the wrong shape is refused naming
the tensor and what was expected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine_service.model.gguf_blocks import (
    SUPPORTED_TYPES,
    BlockWeight,
    GGUFTensorError,
    concat_rows,
    decode,
)
from engine_service.model.gguf_convert import (
    GGUFFormatError,
    build_config,
    build_tokenizer_files,
    generation_config,
    hf_tensor_name,
    unpermute_rows,
)

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SOURCE_FILE = "gguf-source.json"  # in a metadata directory: which file holds the weights
METADATA_FORMAT = 1
_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass
class GGUFModelFile:
    """An opened, checked GGUF: its reader (a memory map), its Hugging Face configuration, and each
    tensor by its Hugging Face name with its type name and logical [rows, cols] shape."""

    path: Path
    reader: Any
    config: dict[str, Any]
    tensors: dict[str, Any] = field(default_factory=dict)
    types: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        """e.g. ``Q4_1 x210, F32 x61, Q8_0 x1``"""
        return ", ".join(f"{t} x{n}" for t, n in self.types.most_common())


def _expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden),
                                          "model.norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden), p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden), p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
        if cfg["attention_bias"]:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
    return shapes


def open_gguf(path: str | Path) -> GGUFModelFile:
    """Open and check ``path``: readable, a llama architecture, every tensor expected, of a served
    type and of the shape its metadata implies. Raises ``GGUFFormatError`` naming what is wrong."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(str(path), "r")
    except (ValueError, KeyError, IndexError, EOFError, TypeError, OSError) as exc:
        raise GGUFFormatError(f"{path.name} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    config = build_config(reader)
    expected = _expected_shapes(config)
    model = GGUFModelFile(path, reader, config)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        kind = tensor.tensor_type.name
        if name not in expected:
            raise GGUFFormatError(f"tensor {tensor.name} is not part of a {config['num_hidden_layers']}-layer "
                                  "llama model")
        if kind not in SUPPORTED_TYPES:
            raise GGUFFormatError(f"tensor {tensor.name} has type {kind}; served types: {', '.join(SUPPORTED_TYPES)}")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if shape != expected[name]:
            raise GGUFFormatError(f"tensor {tensor.name} has shape {list(shape)}, expected {list(expected[name])} "
                                  "from the file's metadata")
        model.tensors[name] = tensor
        model.types[kind] += 1
    missing = sorted(set(expected) - set(model.tensors))
    if missing:
        raise GGUFFormatError(f"the file has no tensor for {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                                             if len(missing) > 1 else ""))
    return model


# --------------------------------------------------------------------------- the metadata directory
def metadata_dir(path: str | Path, root: Path | None = None) -> Path:
    """The directory of ``path``'s configuration and tokenizer files (no weights), written on first
    use under ``$SLUICE_CACHE_DIR/gguf`` and kept while the file is unchanged. Its name is the file's
    stem (the served model's name)."""
    from sluice.paths import cache_dir

    path = Path(path).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{METADATA_FORMAT}".encode()).hexdigest()[:16]
    out = (root or cache_dir() / "gguf") / key / path.stem
    if (out / SOURCE_FILE).is_file():
        return out
    model = open_gguf(path)
    files = build_tokenizer_files(model.reader, model.config)
    files["config.json"] = json.dumps(model.config, indent=2) + "\n"
    files["generation_config.json"] = json.dumps(generation_config(model.config), indent=2) + "\n"
    files[SOURCE_FILE] = json.dumps({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    for name, text in files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    try:
        os.rename(tmp, out)
    except OSError:  # another process wrote it first: theirs is the same
        for child in tmp.iterdir():
            child.unlink()
        tmp.rmdir()
    return out


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a metadata directory stands for, or None for a Hugging Face directory."""
    marker = Path(model_dir) / SOURCE_FILE
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["path"])


# --------------------------------------------------------------------------- the weights
def _weight(model: GGUFModelFile, name: str) -> BlockWeight:
    tensor = model.tensors[name]
    rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
    try:
        weight = decode(tensor.data, tensor.tensor_type.name, rows, cols)
    except (GGUFTensorError, ValueError) as exc:
        raise GGUFFormatError(f"tensor {tensor.name}: {exc}") from exc
    # llama.cpp stores Q and K rows in its rotary order (gguf_convert.unpermute_rows)
    if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
        heads = model.config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
        order = unpermute_rows(np.arange(rows)[:, None], heads)[:, 0]
        weight = weight.take_rows(torch.from_numpy(order))
    return weight


def _dense(model: GGUFModelFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A tensor the model keeps as floats (the embedding table, norms, biases), exact in float32."""
    tensor = model.tensors[name]
    if len(tensor.shape) > 1:
        return _weight(model, name).dequantized().to(dtype)
    values = decode(tensor.data, tensor.tensor_type.name, 1, int(tensor.n_elements)).dequantized()[0]
    if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
        heads = model.config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
        values = torch.from_numpy(unpermute_rows(values.numpy()[:, None], heads)[:, 0])
    return values.to(dtype)


def _parameter(model: GGUFModelFile, name: str, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(_dense(model, name, dtype), requires_grad=False)


class ConcatLinear(nn.Module):
    """A fused projection whose parts are of different families (a Q4_K file's Q6_K value
    projection beside Q4_K queries and keys): each part its own product, the outputs side by side."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _module(weight: BlockWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """The product for one weight, reading its codes in place where a native kernel takes them."""
    from engine_service.model.quantization import QuantizedLinear, native_q4_available

    if weight.family == "q4" and native_q4_available():
        return QuantizedLinear.from_q4(weight.codes, weight.scales, weight.mins, bias, kernel_dtype=dtype)
    if weight.family == "q8":
        from engine_service.model.q8_blocks import Q8Linear

        return Q8Linear.from_codes(weight.codes, weight.scales, bias, kernel_dtype=dtype)
    linear = nn.Linear(weight.cols, weight.rows, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.dequantized().to(dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def load_gguf_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model of a GGUF file on CPU, its projections reading the file's blocks (module docstring)."""
    from engine_service.model.architectures import ARCHITECTURES
    from engine_service.model.config import ModelConfig
    from engine_service.model.layers import RotaryEmbedding

    if device.type != "cpu":
        raise GGUFFormatError("a GGUF file is served on CPU (its block kernels are CPU kernels)")
    started = time.perf_counter()
    model_file = open_gguf(path)
    cfg = ModelConfig.from_dict(model_file.config)
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.architecture].model_class()(cfg)
    model.model.embed_tokens.weight = _parameter(model_file, "model.embed_tokens.weight", dtype)
    model.model.norm.weight = _parameter(model_file, "model.norm.weight", dtype)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        layer.input_layernorm.weight = _parameter(model_file, p + "input_layernorm.weight", dtype)
        layer.post_attention_layernorm.weight = _parameter(model_file, p + "post_attention_layernorm.weight", dtype)
        for fused, parts in _PROJECTIONS.items():
            weights = [_weight(model_file, f"{p}{part}.weight") for part in parts]
            biases = [f"{p}{part}.bias" for part in parts]
            bias = (torch.cat([_dense(model_file, b, dtype) for b in biases])
                    if all(b in model_file.tensors for b in biases) else None)
            whole = concat_rows(weights)
            if whole is not None:
                module = _module(whole, bias, dtype)
            else:
                split = [None] * len(weights) if bias is None else list(bias.split([w.rows for w in weights]))
                module = ConcatLinear([_module(w, b, dtype) for w, b in zip(weights, split, strict=True)])
            parent, _, attr = fused.rpartition(".")
            setattr(layer.get_submodule(parent), attr, module)
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    model.lm_head = _module(_weight(model_file, head_name), None, dtype)
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    model.rotary.ensure_positions(min(cfg.context_length, 8192))
    leftover = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise GGUFFormatError(f"no weights for {leftover[0]}")
    model = model.requires_grad_(False).eval()
    kinds = Counter(type(m).__name__ for m in model.modules()
                    if isinstance(m, nn.Linear) or type(m).__name__ in ("QuantizedLinear", "Q8Linear"))
    logger.info("loaded %s as it is (%s): %s in %.1fs", model_file.path.name, model_file.summary(),
                ", ".join(f"{n} {k}" for k, n in kinds.most_common()), time.perf_counter() - started)
    return model
