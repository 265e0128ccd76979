"""The engine on CUDA: parity with transformers, paging, and the fast path (in-place decode
attention, compiled decode step) against the eager reference, in float32."""

from __future__ import annotations

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.core.request import Request
from engine_service.model.attention import (
    AttentionMetadata,
    decode_attention_inplace,
    decode_attention_reference,
)
from engine_service.model.kv_cache import allocate_kv_cache
from engine_service.model.runner import ModelRunner
from tests.model_helpers import Chunk, parity_prompts

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def eager(model_dir):
    return LLM(str(model_dir), device="cuda", dtype="float32", enforce_eager=True,
               max_num_batched_tokens=512, kv_cache_memory=512 << 20)


@pytest.fixture(scope="module")
def prompts(eager):
    return parity_prompts(eager.get_tokenizer())


@pytest.fixture(scope="module")
def hf_reference(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(CUDA).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = []
    with torch.inference_mode():
        for ids in prompts:
            seq = hf.generate(torch.tensor([ids], device=CUDA), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(seq[0, len(ids):].tolist())
    return out


def test_greedy_parity_with_transformers_alone_and_batched(eager, prompts, hf_reference):
    assert eager.engine.device.type == "cuda"
    batched = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    agree = sum(a == b for a, b in zip(batched, hf_reference, strict=True))
    # GPU kernels differ in summation order from transformers'; a near-tie may flip late tokens.
    assert agree >= len(prompts) - 1, f"{agree}/{len(prompts)} prompts token-identical"
    for i in (0, 5):
        assert eager.generate([prompts[i]], GREEDY)[0].outputs[0].token_ids == batched[i]


def test_paging_random_block_tables_match_contiguous(eager, prompts):
    model = eager.engine.runner.model
    cfg = eager.engine.model_config
    ids = prompts[5][:200]
    n_blocks = -(-len(ids) // 4)

    def logits(blocks):
        kv = allocate_kv_cache(cfg, 128, 4, torch.float32, CUDA)
        for k, v in kv:
            k.normal_()
            v.normal_()
        runner = ModelRunner(model, kv, 4, CUDA)
        req = Request("r", ids, SamplingParams())
        req.block_ids = list(blocks)
        hidden, _ = runner.forward_hidden([Chunk(req, 0, len(ids) - 1)])
        hidden, _ = runner.forward_hidden([Chunk(req, len(ids) - 1, 1)])  # a decode through the table
        return model.compute_logits(hidden)

    contiguous = logits(range(n_blocks))
    scattered = logits(torch.randperm(128)[:n_blocks].tolist())
    torch.testing.assert_close(scattered, contiguous, atol=5e-4, rtol=0)


def test_inplace_decode_attention_matches_reference_on_cuda():
    gen = torch.Generator(device=CUDA).manual_seed(0)
    k_cache = torch.randn(64, 16, 3, 64, device=CUDA, generator=gen)
    v_cache = torch.randn(64, 16, 3, 64, device=CUDA, generator=gen)
    lens = torch.tensor([1, 16, 17, 100], device=CUDA)
    tables = torch.randperm(64, device=CUDA)[:28].view(4, 7)
    q = torch.randn(4, 9, 64, device=CUDA, generator=gen)
    meta = AttentionMetadata(slot_mapping=lens, prefills=[], decode_token_index=None,
                             decode_block_tables=tables, decode_context_lens=lens)
    torch.testing.assert_close(decode_attention_inplace(q, k_cache, v_cache, tables, lens, 0.125),
                               decode_attention_reference(q, k_cache, v_cache, meta, 0.125),
                               atol=1e-5, rtol=1e-4)


def test_compiled_decode_is_token_identical_to_eager(model_dir, eager, prompts):
    from engine_service.model.compiled import compile_supported

    why_not = compile_supported(CUDA)
    if why_not:
        pytest.skip(f"torch.compile unavailable: {why_not}")
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    compiled = LLM(str(model_dir), device="cuda", dtype="float32", enforce_eager=False, cuda_graphs=False,
                   max_num_batched_tokens=512, kv_cache_memory=512 << 20)
    assert compiled.engine.compile_warmup_seconds is not None and not compiled.engine.cuda_graphs
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, GREEDY)] == ref
    assert compiled.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids == ref[0]


def test_cuda_graphs_are_token_identical_to_eager(model_dir, eager, prompts):
    """Decode steps replayed from CUDA graphs (the default on CUDA without --enforce-eager):
    batched, alone, and in batches that shrink as requests end at different lengths (a bucket's
    rows padded over), the same greedy tokens as the eager forward."""
    graphed = LLM(str(model_dir), device="cuda", dtype="float32", enforce_eager=False,
                  max_num_batched_tokens=512, kv_cache_memory=512 << 20)
    engine = graphed.engine
    assert engine.cuda_graphs and engine.decode_mode == "cuda graphs"
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, GREEDY)] == ref
    shrinking = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS - 6 * (i % 5), ignore_eos=True)
                 for i in range(len(prompts))]
    outs = graphed.generate(prompts, shrinking)
    assert [o.outputs[0].token_ids for o in outs] == [r[: p.max_tokens] for r, p in zip(ref, shrinking, strict=True)]
    for i in (0, 9):
        assert graphed.generate([prompts[i]], GREEDY)[0].outputs[0].token_ids == ref[i]
    captured = engine.path_named("cuda graphs").graphed.graphs
    assert (1, 1) in captured, "the smallest bucket is captured at engine start"
    assert len({batch for batch, _ in captured}) >= 3, sorted(captured)  # the shrinking batches' buckets


def test_a_bfloat16_cache_under_float32_is_the_same_through_cuda_graphs(model_dir, prompts):
    """kv_cache_dtype=bfloat16 under a float32 model: the graphs' cache writes and attention read
    the rounded values as the eager forward does, so their greedy tokens are the eager engine's."""
    config = dict(device="cuda", dtype="float32", kv_cache_dtype="bfloat16", max_num_batched_tokens=512,
                  kv_cache_memory=256 << 20)
    eager = LLM(str(model_dir), enforce_eager=True, **config)
    assert eager.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    del eager
    graphed = LLM(str(model_dir), enforce_eager=False, **config)
    assert graphed.engine.decode_mode == "cuda graphs"
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, GREEDY)] == ref
