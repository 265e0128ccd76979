"""Convert a llama-architecture GGUF file into a standard Hugging Face model directory.

Only numpy, ``gguf``, ``safetensors`` and ``tokenizers`` are needed (no torch). The weights are
dequantized with ``gguf.quants.dequantize`` and stored as float32, so they are bit-identical to
what transformers' own GGUF loader produces from the same file.

Two details make the result a correct Hugging Face checkpoint:

* llama.cpp stores the rows of the Q and K projections permuted for its rotary layout (it
  interleaves the two rotary halves of every head). For a weight of shape ``[n_heads * head_dim,
  in]`` the Hugging Face order comes back with ``reshape(n_heads, head_dim // 2, 2, in)``,
  ``swapaxes(1, 2)``, ``reshape(n_heads * head_dim, in)`` (K uses the KV head count).
* A model with tied embeddings has no ``output.weight``: the embedding is stored once as
  ``model.embed_tokens.weight`` and ``tie_word_embeddings`` is true in ``config.json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# llama.cpp token types
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


class GGUFFormatError(ValueError):
    """The file is not a GGUF this converter understands (corrupt, truncated or another architecture)."""


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K projection rows (works for weights and biases)."""
    rows = weight.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise GGUFFormatError(f"cannot un-permute a tensor of {rows} rows into {n_heads} heads")
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    return (
        weight.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest).copy()
    )


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise GGUFFormatError(f"unexpected tensor {gguf_name!r} in a llama GGUF")


def build_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFFormatError(f"unsupported GGUF architecture {arch!r} (only 'llama' is converted)")

    def req(key: str) -> Any:
        value = _field(reader, f"llama.{key}")
        if value is None:
            raise GGUFFormatError(f"GGUF metadata lacks llama.{key}")
        return value

    hidden = int(req("embedding_length"))
    n_heads = int(req("attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, "llama.rope.dimension_count", hidden // n_heads))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "attention_dropout": 0.0,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(req("feed_forward_length")),
        "max_position_embeddings": int(req("context_length")),
        "mlp_bias": False,
        "num_attention_heads": n_heads,
        "num_hidden_layers": int(req("block_count")),
        "num_key_value_heads": n_kv,
        "pretraining_tp": 1,
        "rms_norm_eps": _f32(req("attention.layer_norm_rms_epsilon")),
        "rope_scaling": None,
        "rope_theta": _f32(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": int(vocab),
    }


def convert_tensors(
    reader: Any, config: dict[str, Any], on_tensor: Callable[[str], None] | None = None
) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 (rows, cols) with Hugging Face names and row order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.array(tensor.data, dtype=np.float32)  # copies the read-only memory map
        else:
            array = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        # GGUF lists dims fastest-first; the logical (rows, cols) shape is the reverse.
        expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if array.size != int(np.prod(expected)):
            raise GGUFFormatError(f"tensor {tensor.name} has {array.size} values, expected shape {expected}")
        array = array.reshape(expected)
        if ".self_attn.q_proj." in name:
            array = unpermute_rows(array, n_heads)
        elif ".self_attn.k_proj." in name:
            array = unpermute_rows(array, n_kv)
        out[name] = array
        if on_tensor is not None:
            on_tensor(name)
    if "model.embed_tokens.weight" not in out:
        raise GGUFFormatError("GGUF has no token_embd.weight")
    return out


def build_tokenizer_json(reader: Any) -> str:
    """A byte-level BPE ``tokenizer.json`` equivalent to llama.cpp's ``gpt2``/``smollm`` tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    model_type = _field(reader, "tokenizer.ggml.model")
    if model_type != "gpt2":
        raise GGUFFormatError(f"unsupported GGUF tokenizer model {model_type!r} (only byte-level 'gpt2')")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFFormatError("GGUF vocabulary has duplicate tokens")
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")

    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            unk_token=None if unk_id is None else tokens[int(unk_id)],
        )
    )
    tok.normalizer = None
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        # llama.cpp's "smollm" pre-tokenizer: every digit alone, then GPT-2's split.
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    special = [
        AddedToken(t, special=True, normalized=False, single_word=False, lstrip=False, rstrip=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _TOKEN_USER_DEFINED
    ]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok.to_str(pretty=True)


def build_tokenizer_files(reader: Any, config: dict[str, Any]) -> dict[str, str]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` as texts."""
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)

    def token(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}")
        return None if idx is None else tokens[int(idx)]

    added_decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": kind == _TOKEN_CONTROL,
        }
        for i, (t, kind) in enumerate(zip(tokens, types, strict=False))
        if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    }
    specials = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    specials = {k: v for k, v in specials.items() if v is not None}
    additional = [t for t, kind in zip(tokens, types, strict=False) if kind == _TOKEN_CONTROL]
    tokenizer_config: dict[str, Any] = {
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": additional,
        **specials,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "vocab_size": len(tokens),
    }
    chat_template = _field(reader, "tokenizer.chat_template")
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    special_map = {**specials, "additional_special_tokens": additional}
    return {
        "tokenizer.json": build_tokenizer_json(reader),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps(special_map, indent=2, ensure_ascii=False) + "\n",
    }


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    out = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out


def write_hf_dir(
    gguf_path: Path,
    out_dir: Path,
    on_stage: Callable[[str], None] | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Convert ``gguf_path`` into the (existing, empty) directory ``out_dir``; return the config."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    def stage(msg: str) -> None:
        if on_stage is not None:
            on_stage(msg)

    stage(f"reading {gguf_path.name}")
    try:
        reader = GGUFReader(str(gguf_path), "r")
    except (ValueError, KeyError, IndexError, EOFError, TypeError) as exc:
        raise GGUFFormatError(f"not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    config = build_config(reader)
    stage("writing tokenizer files")
    files = build_tokenizer_files(reader, config)
    for name, text in files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out_dir / "generation_config.json").write_text(
        json.dumps(generation_config(config), indent=2) + "\n", encoding="utf-8"
    )
    stage(f"dequantizing {len(reader.tensors)} tensors")
    try:
        tensors = convert_tensors(reader, config, on_tensor)
    except (ValueError, IndexError) as exc:
        if isinstance(exc, GGUFFormatError):
            raise
        raise GGUFFormatError(f"corrupt tensor data ({type(exc).__name__}: {exc})") from exc
    stage("writing model.safetensors (float32)")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return config
