"""Every supported architecture variant computes what transformers computes; others are refused."""

from __future__ import annotations

import json

import pytest
import torch

from engine_service.core.request import Request
from engine_service.core.sampling_params import SamplingParams
from engine_service.model.config import ModelConfig, UnsupportedModelError
from engine_service.model.kv_cache import allocate_kv_cache
from engine_service.model.loader import load_model
from engine_service.model.runner import ModelRunner
from tests.model_helpers import Chunk

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _tiny(kind: str):
    import transformers

    if kind == "llama3-rope":
        cfg = transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        return transformers.LlamaForCausalLM(cfg)
    if kind == "llama-untied-bias":
        cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=True)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "mistral":
        cfg = transformers.MistralConfig(**TINY, sliding_window=None)
        return transformers.MistralForCausalLM(cfg)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
        return transformers.Qwen2ForCausalLM(cfg)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["llama3-rope", "llama-untied-bias", "mistral", "qwen2"])
def test_tiny_model_logits_match_transformers(kind, tmp_path):
    torch.manual_seed(0)
    hf = _tiny(kind).eval()
    if kind in ("llama-untied-bias", "qwen2"):  # random biases, so a dropped bias would show
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    model = load_model(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    kv = allocate_kv_cache(cfg, 16, 16, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, 16, torch.device("cpu"))
    req = Request("r", ids, SamplingParams())
    req.block_ids = list(range(13))
    # Two chunks, so cached-prefix attention is exercised too; positions reach past the rope's
    # original context (64), where llama3 scaling matters.
    h1, _ = runner.forward_hidden([Chunk(req, 0, 120)])
    h2, _ = runner.forward_hidden([Chunk(req, 120, 80)])
    got = model.compute_logits(torch.cat([h1, h2]))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_dir(tmp_path)


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **TINY,
                               "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path / "nope")


def test_sliding_window_caps_the_served_context():
    cfg = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], **TINY,
                                 "max_position_embeddings": 32768, "sliding_window": 4096})
    assert cfg.context_length == 4096  # the window never binds, so full attention stays exact
    qwen = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], **TINY,
                                  "sliding_window": 64, "use_sliding_window": False})
    assert qwen.context_length == TINY["max_position_embeddings"]


def test_bad_dtype_and_tiny_kv_budget_are_clear_errors():
    from engine_service.model.kv_cache import num_blocks_for_budget
    from engine_service.model.loader import parse_dtype

    with pytest.raises(ValueError, match="dtype must be one of"):
        parse_dtype("int8")
    assert parse_dtype("bf16") == torch.bfloat16
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **TINY})
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(cfg, 16, torch.float32, torch.device("cpu"), budget_bytes=100)
