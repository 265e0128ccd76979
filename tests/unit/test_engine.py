"""The engine with the real model: batching, preemption and the prefix cache never change a
request's output; seeds reproduce; n > 1 shares the prompt; stopping rules and the door."""

from __future__ import annotations

import pytest

from engine_service import LLM, SamplingParams
from engine_service.core.scheduler import RequestRejected

pytestmark = pytest.mark.model

PROMPTS = [
    "The three primary colours are",
    "Write a short poem about autumn leaves falling in the park.",
    "In computer science, a hash table is",
    "def quicksort(items):",
    "The French Revolution began in",
    "Water boils at",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, ignore_eos=True, seed=1234)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory=128 << 20, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt run by itself, greedy and seeded."""
    return {
        "greedy": [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS],
        "seeded": [llm.generate([p], SEEDED)[0].outputs[0].token_ids for p in PROMPTS],
    }


def test_full_batch_equals_alone(llm, alone):
    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        outs = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == alone[kind], kind
    for out in outs:  # per-request timings come back with the result
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_preempted_and_recomputed_equals_alone(model_dir, alone):
    # 12 blocks of 4 tokens cannot hold six requests of ~35 tokens: the scheduler must preempt.
    tight = LLM(str(model_dir), block_size=4, num_blocks=24, max_num_batched_tokens=64, enable_prefix_caching=False)
    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        before = tight.engine.get_stats().preemptions
        outs = tight.generate(PROMPTS, params)
        assert tight.engine.get_stats().preemptions > before, "the pool was meant to force preemption"
        assert [o.outputs[0].token_ids for o in outs] == alone[kind], kind
    stats = tight.engine.get_stats()
    assert stats.free_blocks == stats.total_blocks


def test_prefix_cache_hit_gives_same_output(llm):
    long_prefix = "Here is a long shared system preamble that many requests repeat verbatim. " * 8
    prompt = long_prefix + "Question: what colour is the sky?"
    first = llm.generate([prompt], GREEDY)[0]
    hits_before = llm.engine.scheduler.stats.prefix_cache_hits
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens >= 64
    assert llm.engine.scheduler.stats.prefix_cache_hits > hits_before
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_seed_reproducible_across_fresh_engines(model_dir, alone):
    fresh = LLM(str(model_dir), kv_cache_memory=64 << 20)
    assert fresh.generate([PROMPTS[1]], SEEDED)[0].outputs[0].token_ids == alone["seeded"][1]
    other_seed = SEEDED.replace(seed=99)
    assert fresh.generate([PROMPTS[1]], other_seed)[0].outputs[0].token_ids != alone["seeded"][1]


def test_n_copies_share_the_prompt_blocks(llm):
    prompt = "A shared prompt long enough to fill several KV blocks of sixteen tokens each, " * 4
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    sched = llm.engine.scheduler
    forwarded_before = sched.stats.forwarded_tokens
    out = llm.generate([prompt], params)[0]
    forwarded = sched.stats.forwarded_tokens - forwarded_before
    prompt_len = len(out.prompt_token_ids)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "different seeds per copy"
    # Computed once (plus at most one partial block and the last token per copy), not three times.
    assert forwarded < 2 * prompt_len + 3 * 8, (forwarded, prompt_len)


def test_stop_strings_and_token_stops(llm):
    base = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0]
    assert base.finish_reason == "length"
    stop_at = base.text[4:7]
    out = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop_at]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    assert out.outputs[0].text == base.text[: base.text.index(stop_at)]
    token = base.token_ids[3]
    out = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[token]))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == token
    assert completion.token_ids == base.token_ids[: base.token_ids.index(token) + 1]
    assert llm.engine.get_stats().running == 0


def test_eos_and_min_tokens(llm):
    chat = [{"role": "user", "content": "Say only the word yes."}]
    free = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=64))[0].outputs[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] in llm.engine.eos_token_ids
    forced = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=64, min_tokens=len(free.token_ids) + 5))
    tokens = forced[0].outputs[0].token_ids
    assert len(tokens) >= len(free.token_ids) + 5
    assert not set(tokens[: len(free.token_ids) + 4]) & set(llm.engine.eos_token_ids)


def test_prompt_logprobs(llm, model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The quick brown fox jumps over the lazy dog"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert ids[pos] in entry
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4


def test_door_refuses_with_the_limit(model_dir):
    small = LLM(str(model_dir), max_model_len=64, kv_cache_memory=16 << 20)
    with pytest.raises(RequestRejected) as err:
        small.generate([list(range(100, 160))], SamplingParams(max_tokens=10))
    assert err.value.code == "context_length_exceeded" and "64" in str(err.value)
    assert not small.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="temperature"):
        small.generate(["hi"], SamplingParams(temperature=-1.0))


def test_bfloat16_is_selectable(model_dir, llm):
    bf16 = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=32 << 20)
    import torch

    assert bf16.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert next(bf16.engine.runner.model.parameters()).dtype == torch.bfloat16
    prompt = "The capital of France is"
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    got = bf16.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    # bfloat16 rounds differently, but a confident first token survives it.
    assert got.token_ids[0] == want.token_ids[0] and got.text.strip().startswith("Paris")


def test_an_unknown_attention_backend_is_refused_before_the_model_loads(model_dir, monkeypatch):
    import engine_service.engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the knob was checked")

    monkeypatch.setattr(engine_service.engine, "load_model", no_load)
    with pytest.raises(ValueError, match="attention_backend must be one of auto, native, torch, not 'cuda'"):
        LLM(str(model_dir), dtype="float32", attention_backend="cuda")
