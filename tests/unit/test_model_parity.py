"""Greedy and logit parity with Hugging Face transformers (float32), one request at a time and batched."""

from __future__ import annotations

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.core.request import Request
from engine_service.model.kv_cache import allocate_kv_cache
from engine_service.model.runner import ModelRunner
from tests.model_helpers import Chunk, parity_prompts

pytestmark = [pytest.mark.model, pytest.mark.timeout(1800)]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), max_num_batched_tokens=512, kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def prompts(llm):
    return parity_prompts(llm.get_tokenizer())


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """Greedy continuations and per-step logits from transformers' own Llama implementation."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: greedy runs the full NEW_TOKENS
    hf.generation_config.pad_token_id = 0
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(ids):].tolist()
            results.append((tokens, torch.stack([step[0] for step in out.logits])))
    return results


def test_prompts_are_varied(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 10
    assert lengths[0] <= 4 and lengths[-1] >= 900, lengths


def test_last_prompt_position_logits_match(llm, prompts, reference):
    engine = llm.engine
    cfg = engine.model_config
    for ids, (_, ref_logits) in zip(prompts, reference, strict=True):
        blocks = -(-len(ids) // 16)
        kv = allocate_kv_cache(cfg, blocks, 16, torch.float32, torch.device("cpu"))
        runner = ModelRunner(engine.runner.model, kv, 16, torch.device("cpu"))
        req = Request("p", ids, SamplingParams())
        req.block_ids = list(range(blocks))
        logits = runner.execute([Chunk(req, 0, len(ids))]).sample_logits[0]
        diff = (logits - ref_logits[0]).abs().max().item()
        assert diff < 1e-3, f"prompt of {len(ids)} tokens: max abs logit diff {diff}"


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_greedy_one_at_a_time(llm, prompts, reference):
    for ids, (ref_tokens, _) in zip(prompts, reference, strict=True):
        out = llm.generate([ids], GREEDY)[0].outputs[0]
        assert out.token_ids == ref_tokens
        assert out.finish_reason == "length"


def test_greedy_all_in_one_batch(llm, prompts, reference):
    outs = llm.generate(prompts, GREEDY)
    for out, (ref_tokens, _) in zip(outs, reference, strict=True):
        assert out.outputs[0].token_ids == ref_tokens
    stats = llm.engine.get_stats()
    assert stats.free_blocks == stats.total_blocks or llm.engine.scheduler.block_pool is not None


def test_logprobs_match_reference_log_softmax(llm, prompts, reference):
    ids, (ref_tokens, ref_logits) = prompts[1], reference[1]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    out = llm.generate([ids], params)[0].outputs[0]
    assert out.token_ids == ref_tokens[:16]
    ref_lp = torch.log_softmax(ref_logits[:16], dim=-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert token in entry and len(entry) >= 5
        for tid, lp in entry.items():
            assert abs(lp.logprob - ref_lp[step, tid].item()) < 1e-4, (step, tid)
        top5 = torch.topk(ref_lp[step], 5).indices.tolist()
        assert set(top5) <= set(entry)
