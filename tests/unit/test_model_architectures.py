"""Every supported architecture variant computes what transformers computes; others are refused.

Qwen3 (the registry's proof: one entry plus its per-head q/k norms) is also run end to end through
the engine on a tiny random model: greedy token-identical with transformers' own generate, one at a
time, batched, and preempted, on the eager and the compiled/native paths."""

from __future__ import annotations

import json

import pytest
import torch

from engine_service import LLM
from engine_service.core.request import Request
from engine_service.core.sampling_params import SamplingParams
from engine_service.model.architectures import ARCHITECTURES
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
    if kind == "qwen3":
        # head_dim is not hidden/heads in Qwen3's configs: keep it explicit, as they do
        cfg = transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
        return transformers.Qwen3ForCausalLM(cfg)
    raise AssertionError(kind)


def _randomize_norms(hf) -> None:
    """RMSNorm weights start at 1: random ones, so a dropped or misplaced norm shows."""
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.normal_(p, mean=1.0, std=0.5)


@pytest.mark.parametrize("kind", ["llama3-rope", "llama-untied-bias", "mistral", "qwen2", "qwen3"])
def test_tiny_model_logits_match_transformers(kind, tmp_path):
    torch.manual_seed(0)
    hf = _tiny(kind).eval()
    if kind in ("llama-untied-bias", "qwen2"):  # random biases, so a dropped bias would show
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.5)
    _randomize_norms(hf)
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
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as info:
        ModelConfig.from_dir(tmp_path)
    for known in ARCHITECTURES:  # the error lists what would have worked
        assert known in str(info.value)
    assert "Qwen3ForCausalLM" in ARCHITECTURES


def test_the_registry_maps_each_family_to_its_class_and_config():
    from engine_service.model.llama import LlamaForCausalLM
    from engine_service.model.qwen3 import Qwen3ForCausalLM

    qwen3 = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], **TINY, "head_dim": 32,
                                   "sliding_window": 64, "use_sliding_window": False})
    assert ARCHITECTURES[qwen3.architecture].model_class() is Qwen3ForCausalLM
    assert qwen3.head_dim == 32 and qwen3.sliding_window is None and not qwen3.attention_bias
    qwen2 = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], **TINY})
    assert ARCHITECTURES[qwen2.architecture].model_class() is LlamaForCausalLM
    assert qwen2.attention_bias and not qwen2.o_proj_bias
    llama = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **TINY, "attention_bias": True})
    assert llama.attention_bias and llama.o_proj_bias


# ---------------------------------------------------------------- Qwen3 through the engine

def _byte_tokenizer_json() -> str:
    """A 256-token byte-level tokenizer (no merges): the engine needs a tokenizer.json beside the
    tiny model; prompts are given as token ids."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


QWEN3_NEW_TOKENS = 20


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A random-weight Qwen3 directory, six prompts and transformers' greedy continuations."""
    torch.manual_seed(0)
    hf = _tiny("qwen3").eval()
    _randomize_norms(hf)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    hf.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(_byte_tokenizer_json())
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 30, 41, 9, 25)]
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    reference = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=QWEN3_NEW_TOKENS, do_sample=False)
            reference.append(out[0, len(ids):].tolist())
    return path, prompts, reference


@pytest.mark.slow  # generates with transformers for the reference; compiles in one case
@pytest.mark.parametrize("fast", [False, True], ids=["eager-torch", "compiled-native"])
def test_qwen3_greedy_matches_transformers_alone_batched_and_preempted(tiny_qwen3, fast):
    path, prompts, reference = tiny_qwen3
    greedy = SamplingParams(temperature=0.0, max_tokens=QWEN3_NEW_TOKENS, ignore_eos=True)
    paths = dict(enforce_eager=not fast, attention_backend="native" if fast else "torch", dtype="float32")
    llm = LLM(str(path), max_num_batched_tokens=128, kv_cache_memory=16 << 20, **paths)
    if fast:  # the fast paths apply to the new architecture (they fall back only where they cannot run)
        assert llm.engine.path_named("compiled") is not None and llm.engine.runner.decode_kernel is not None
    for ids, ref in zip(prompts, reference, strict=True):
        assert llm.generate([ids], greedy)[0].outputs[0].token_ids == ref
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference
    # 16 blocks of 4 tokens cannot hold six requests of up to 61 tokens: the scheduler must preempt.
    tight = LLM(str(path), block_size=4, num_blocks=16, max_num_batched_tokens=32,
                enable_prefix_caching=False, **paths)
    outs = tight.generate(prompts, greedy)
    assert tight.engine.get_stats().preemptions > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_qwen3_bfloat16_prepacks_and_follows_float32(tiny_qwen3):
    """On CPU a bfloat16 Qwen3 gets the prepacked linears like any Llama-family model; its logits
    stay within bfloat16's rounding of float32's."""
    from engine_service.model.prepacked import PrepackedLinear, prepack_unavailable

    path, prompts, _ = tiny_qwen3
    why_not = prepack_unavailable(torch.bfloat16, torch.device("cpu"))
    model = load_model(path, dtype="bfloat16")
    linears = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    assert bool(linears) == (why_not is None), why_not
    reference = load_model(path, dtype="float32")
    cfg = ModelConfig.from_dir(path)
    ids = prompts[3]
    logits = []
    for m, dtype in ((reference, torch.float32), (model, torch.bfloat16)):
        kv = allocate_kv_cache(cfg, 16, 16, dtype, torch.device("cpu"))
        runner = ModelRunner(m, kv, 16, torch.device("cpu"))
        req = Request("r", ids, SamplingParams())
        req.block_ids = list(range(3))
        logits.append(runner.execute([Chunk(req, 0, len(ids))]).sample_logits[0])
    torch.testing.assert_close(logits[1], logits[0], atol=0.1, rtol=0.05)


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


# ---------------------------------------------------------------- every family on the native step

@pytest.mark.slow  # builds the native step
@pytest.mark.parametrize("kind", ["llama-untied-bias", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", [{"dtype": "bfloat16"}, {"dtype": "float32", "quantization": "int4"}],
                         ids=["bfloat16", "int4"])
def test_every_registered_family_takes_the_native_decode_step(kind, mode, tmp_path, monkeypatch):
    """The native decode step computes each family's attention (Qwen2's q/k/v biases, Llama's
    biases with attention_bias, Qwen3's per-head q/k norms): a tiny random model of each, with
    random biases and norms, takes it where the CPU runs it, and its greedy tokens are the eager
    reference's, alone and batched."""
    from engine_service.model.native_decode import native_decode_unavailable
    from engine_service.model.prepacked import gemv_max_rows

    if mode["dtype"] == "bfloat16" and gemv_max_rows() == 0:
        pytest.skip("this CPU has no AVX512-BF16: no bfloat16 native step")
    if mode.get("quantization") == "int4" and not torch.ops.sluice.q4_supported():
        pytest.skip("this CPU has no AVX512-VNNI: no int4 native step")
    torch.manual_seed(0)
    hf = _tiny(kind).eval()
    for name, p in hf.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.5)
    _randomize_norms(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "tokenizer.json").write_text(_byte_tokenizer_json())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 30, 41)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    monkeypatch.delenv("SLUICE_ENFORCE_EAGER", raising=False)  # CPU's default: eager with the native step
    native = LLM(str(tmp_path), kv_cache_memory=8 << 20, **mode)
    why = native_decode_unavailable(native.engine.runner.model, native.engine.runner.kv_caches)
    assert why is None and native.engine.decode_mode == "native step"
    reference = LLM(str(tmp_path), enforce_eager=True, kv_cache_memory=8 << 20, **mode)
    assert reference.engine.decode_mode == "eager"
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
    assert [o.outputs[0].token_ids for o in native.generate(prompts, greedy)] == want
    assert native.generate([prompts[2]], greedy)[0].outputs[0].token_ids == want[2]
