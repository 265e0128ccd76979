"""Serving a GGUF file as it is (engine_service.model.gguf_model): the default model's file loads with
every weight exactly the file's (no rounding), its metadata gives the same configuration and tokenizer
as the Hugging Face conversion, the engine serves it, and a bad file is refused naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors import safe_open

from engine_service.model.gguf_convert import GGUFFormatError
from engine_service.model.gguf_model import (
    ConcatLinear,
    gguf_source,
    load_gguf_model,
    metadata_dir,
    open_gguf,
)
from engine_service.model.quantization import QuantizedLinear, dequantize_q4, native_q4_available
from tests.unit.test_gguf_blocks import _random_blocks

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- the default model's file
@pytest.mark.model
def test_the_metadata_directory_matches_the_hugging_face_conversion(default_gguf: Path, model_dir: Path,
                                                                    tmp_path: Path):
    meta = metadata_dir(default_gguf, root=tmp_path)
    assert meta.name == default_gguf.stem  # the served model's name
    assert gguf_source(meta) == default_gguf.resolve()
    assert not any(meta.glob("*.safetensors"))  # the weights stay in the file
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert json.loads((meta / name).read_text()) == json.loads((model_dir / name).read_text()), name
    assert (meta / "tokenizer.json").read_text() == (model_dir / "tokenizer.json").read_text()
    assert metadata_dir(default_gguf, root=tmp_path) == meta  # kept while the file is unchanged


@pytest.mark.model
def test_every_weight_is_the_files_own(default_gguf: Path, model_dir: Path):
    model = load_gguf_model(default_gguf, torch.float32, CPU)
    ref = safe_open(str(model_dir / "model.safetensors"), "pt")  # gguf's own dequantization, float32
    assert torch.equal(model.model.embed_tokens.weight, ref.get_tensor("model.embed_tokens.weight"))
    for i, layer in enumerate(model.model.layers):
        for fused, parts in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
            module = layer.get_submodule(fused)
            assert isinstance(module, QuantizedLinear) and module.native_q4 == native_q4_available()
            names = [f"model.layers.{i}.{fused.split('.')[0]}.{p}_proj.weight" for p in parts]
            want = torch.cat([ref.get_tensor(n) for n in names])
            got = dequantize_q4(module.codes, module.scales_zeros, torch.float32)[: want.shape[0]]
            assert torch.equal(got, want), f"layer {i} {fused}"
        assert torch.equal(dequantize_q4(layer.mlp.down_proj.codes, layer.mlp.down_proj.scales_zeros, torch.float32),
                           ref.get_tensor(f"model.layers.{i}.mlp.down_proj.weight"))
    head = model.lm_head  # tied: the embedding's own Q8_0 blocks
    assert torch.equal(head.dense_weight().float()[: head.out_features], ref.get_tensor("model.embed_tokens.weight"))


@pytest.mark.model
def test_the_engine_serves_the_file_and_refuses_a_second_quantization(default_gguf: Path, monkeypatch):
    from engine_service import LLM, SamplingParams

    monkeypatch.delenv("SLUICE_ENFORCE_EAGER", raising=False)  # the CPU's default engine (the suite pins eager)
    llm = LLM(str(default_gguf))
    engine = llm.engine
    assert engine.model_name == default_gguf.stem
    assert engine.deterministic, engine.choices  # integer kernels: the default holds
    assert "GGUF" in engine.choices["quantization"]
    assert engine.decode_path.name == "native step"
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    alone = llm.generate("The capital of France is", greedy)[0].outputs[0]
    assert alone.text.startswith(" Paris"), alone.text
    batched = llm.generate(["The capital of France is", "def fibonacci(n):", "Once upon a time"], greedy)
    assert batched[0].outputs[0].token_ids == alone.token_ids
    # the file's Q8_0 head runs inside the native step: several greedy steps in one call, the same tokens
    steps = LLM(str(default_gguf), num_scheduler_steps=4)
    assert steps.engine.decode_path.capabilities().multi_step_max_rows > 1
    assert [o.outputs[0].token_ids for o in steps.generate(["The capital of France is", "def fibonacci(n):",
                                                             "Once upon a time"], greedy)] == \
        [o.outputs[0].token_ids for o in batched]
    with pytest.raises(ValueError, match="GGUF file.*--quantization int4"):
        LLM(str(default_gguf), quantization="int4")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path):
    from engine_service.engine import resolve_model_dir

    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a model")
    with pytest.raises(FileNotFoundError, match="not a GGUF file"):
        resolve_model_dir(bogus)


@pytest.mark.model
def test_a_truncated_file_is_refused_before_loading(default_gguf: Path, tmp_path: Path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_gguf.read_bytes()[: 40 << 20])
    with pytest.raises(GGUFFormatError, match="not a readable GGUF file"):
        open_gguf(cut)


# --------------------------------------------------------------------------- small files of every type
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 256, 4, 2, 64, 512, 96


def _write(path: Path, types: dict[str, str], *, arch: str = "llama", shapes: dict[str, tuple[int, int]] | None = None
           ) -> dict[str, np.ndarray]:
    """A one-layer llama GGUF with each projection of the given type; returns the float32 weights
    gguf's dequantization gives for each tensor (by GGUF name)."""
    from gguf.quants import dequantize

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    rng = np.random.default_rng(0)
    want = {
        "token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,), "blk.0.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN), "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM), "blk.0.ffn_gate.weight": (INTER, HIDDEN),
        "blk.0.ffn_up.weight": (INTER, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, INTER),
    }
    want.update(shapes or {})
    floats = {}
    for name, shape in want.items():
        kind = types.get(name, "F32")
        if len(shape) == 1:
            data = (1.0 + 0.1 * rng.normal(size=shape)).astype(np.float32)
            writer.add_tensor(name, data)
            floats[name] = data
            continue
        if kind in ("Q4_K", "Q6_K"):
            raw = _random_blocks(kind, shape[0], shape[1], seed=len(floats))
        elif kind == "F32":
            raw = rng.normal(0, 0.05, size=shape).astype(np.float32)
        elif kind == "F16":
            raw = rng.normal(0, 0.05, size=shape).astype(np.float16)
        else:
            raw = quantize(rng.normal(0, 0.05, size=shape).astype(np.float32), GGMLQuantizationType[kind])
        if raw.dtype == np.uint8:
            writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])
            floats[name] = dequantize(raw, GGMLQuantizationType[kind]).reshape(shape).astype(np.float32)
        else:
            writer.add_tensor(name, raw)
            floats[name] = raw.astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return floats


MIXED = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_0", "blk.0.attn_v.weight": "Q6_K",
         "blk.0.attn_output.weight": "F16", "blk.0.ffn_gate.weight": "Q4_1", "blk.0.ffn_up.weight": "Q4_K",
         "blk.0.ffn_down.weight": "Q8_0", "token_embd.weight": "Q8_0"}


def test_every_served_type_multiplies_as_its_dequantized_weights(tmp_path: Path):
    from engine_service.model.gguf_convert import unpermute_rows

    path = tmp_path / "mixed.gguf"
    floats = _write(path, MIXED)
    model = load_gguf_model(path, torch.float32, CPU)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, ConcatLinear)  # Q4_K and Q4_0 beside a Q6_K: three products
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    refs = {
        "self_attn.qkv_proj": np.concatenate([unpermute_rows(floats["blk.0.attn_q.weight"], HEADS),
                                              unpermute_rows(floats["blk.0.attn_k.weight"], KV_HEADS),
                                              floats["blk.0.attn_v.weight"]]),
        "self_attn.o_proj": floats["blk.0.attn_output.weight"],
        "mlp.gate_up_proj": np.concatenate([floats["blk.0.ffn_gate.weight"], floats["blk.0.ffn_up.weight"]]),
        "mlp.down_proj": floats["blk.0.ffn_down.weight"],
    }
    for name, ref in refs.items():
        module = layer.get_submodule(name)
        w = torch.from_numpy(ref)
        xin = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1))
        want = xin.double() @ w.double().t()
        # the int8 rounding of the activations per 32 inputs bounds the error (test_q4_gemv's bound)
        bound = (w.double().abs() @ (xin.abs().amax(-1) / 127.0 / 2).double().expand(w.shape[1], 5)).t() + 1e-4
        assert ((module(xin).double() - want).abs() <= bound).all(), name
    head = model.lm_head
    want = x.double() @ torch.from_numpy(floats["token_embd.weight"]).double().t()
    assert (head(x).double() - want).abs().max() < 0.05 * want.abs().max()
    assert torch.equal(model.model.embed_tokens.weight, torch.from_numpy(floats["token_embd.weight"]))


@pytest.mark.parametrize(("change", "message"), [
    ({"types": {"blk.0.ffn_up.weight": "Q5_0"}}, r"blk.0.ffn_up.weight has type Q5_0; served types"),
    ({"shapes": {"blk.0.attn_k.weight": (64, HIDDEN)}}, r"blk.0.attn_k.weight has shape \[64, 256\], expected \[128, 256\]"),
    ({"arch": "qwen2"}, r"unsupported GGUF architecture 'qwen2'"),
])
def test_a_bad_file_is_refused_naming_the_tensor(tmp_path: Path, change, message):
    path = tmp_path / "bad.gguf"
    _write(path, change.get("types", {}), arch=change.get("arch", "llama"), shapes=change.get("shapes"))
    with pytest.raises(GGUFFormatError, match=message):
        open_gguf(path)
    with pytest.raises(GGUFFormatError, match=message):
        load_gguf_model(path, torch.float32, CPU)


def test_a_gguf_file_is_served_on_cpu_only(tmp_path: Path):
    path = tmp_path / "tiny.gguf"
    _write(path, {})
    with pytest.raises(GGUFFormatError, match="served on CPU"):
        load_gguf_model(path, torch.float32, torch.device("cuda"))
