"""Speculative decoding with the real model: greedy output is token-identical to decoding without
it, over prompts whose drafts are accepted (input-grounded, repetitive) and prompts where they are
not; a stop string or a stop token inside accepted drafts ends the request where plain decoding
does; seeded sampling gives the same tokens (penalties and logprobs per position); preemption mid-
speculation changes nothing."""

from __future__ import annotations

import pytest

from engine_service import LLM, SamplingParams

pytestmark = pytest.mark.model

CODE = """def area(width, height):
    result = width * height
    return result
"""
PROMPTS = [
    f"Repeat this code exactly, renaming area to rect_area:\n\n{CODE}\n",
    "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "Water boils at",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)


# No prefix cache: a prompt run again is prefilled the same way (a cached prefix changes the
# prefill's arithmetic, and this code prompt has a near-tie early on that rounding can flip).
@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(str(model_dir), kv_cache_memory=64 << 20, max_num_batched_tokens=256, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def spec(model_dir):
    return LLM(str(model_dir), kv_cache_memory=64 << 20, max_num_batched_tokens=256, enable_prefix_caching=False,
               speculative_config=SPEC)


def test_the_engine_resolves_the_back_off_from_its_decode_paths_capabilities(spec, model_dir):
    """backoff "auto": off where the decode path takes k + 1 rows at one row's cost
    (DecodeCapabilities.one_pass_rows), on elsewhere; "off" asked for stays off."""
    engine = spec.engine
    caps = engine.scheduler.config.decode
    rows = SPEC["num_speculative_tokens"] + 1
    want = "off" if rows <= caps.one_pass_rows and rows < caps.fast_step_max_rows else "on"
    assert engine.speculative_config.backoff == engine.scheduler.speculative_config.backoff == want
    eager = LLM(str(model_dir), kv_cache_memory=16 << 20, enforce_eager=True, speculative_config=SPEC)
    assert eager.engine.scheduler.config.decode.one_pass_rows == 1
    assert eager.engine.speculative_config.backoff == "on"
    forced = LLM(str(model_dir), kv_cache_memory=16 << 20, enforce_eager=True, speculative_config={**SPEC, "backoff": "off"})
    assert forced.engine.speculative_config.backoff == "off"


@pytest.fixture(scope="module")
def plain_greedy(plain):
    return [o.outputs[0] for o in plain.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def code_alone(plain):
    """The code prompt by itself (a batch's other prefills may round a near-tie differently)."""
    return plain.generate([PROMPTS[0]], GREEDY)[0].outputs[0]


def test_greedy_is_token_identical_and_drafts_are_accepted(spec, plain_greedy):
    stats = spec.engine.scheduler.spec_stats
    before = stats.num_accepted_tokens
    outs = [o.outputs[0] for o in spec.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_greedy]
    assert [o.text for o in outs] == [o.text for o in plain_greedy]
    assert stats.num_accepted_tokens - before >= 10, stats  # the grounded prompts' drafts were kept
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and some were rejected
    assert spec.engine.get_stats().free_blocks == spec.engine.get_stats().total_blocks


def test_stop_string_and_stop_token_inside_drafts_end_where_plain_decoding_does(spec, plain, code_alone):
    ref = code_alone  # the code prompt: long accepted drafts
    tok = spec.get_tokenizer()
    text = tok.decode(ref.token_ids[:18])
    stop = text[-6:]  # ends inside the output
    # a stop token that first appears after min_tokens (masked before it, it would change the text)
    late = next(t for t in ref.token_ids[11:18] if t not in ref.token_ids[:11])
    cases = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[ref.token_ids[12]]),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[late], min_tokens=11),
    ]
    for params in cases:
        want = plain.generate([PROMPTS[0]], params)[0].outputs[0]
        got = spec.generate([PROMPTS[0]], params)[0].outputs[0]
        assert len(want.token_ids) < 20  # the stop did end it early
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason)


def test_max_tokens_inside_a_draft_stops_exactly(spec, code_alone):
    for n in (1, 2, 5, 11):
        out = spec.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == code_alone.token_ids[:n]
        assert out.outputs[0].finish_reason == "length"


def test_seeded_sampling_with_penalties_and_logprobs_is_reproducible_and_unchanged(spec, plain):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=77, max_tokens=16, ignore_eos=True,
                            repetition_penalty=1.1, logprobs=2)
    want = [o.outputs[0] for o in plain.generate(PROMPTS[:3], params)]
    got = [o.outputs[0] for o in spec.generate(PROMPTS[:3], params)]
    again = [o.outputs[0] for o in spec.generate(PROMPTS[:3], params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want] == [o.token_ids for o in again]
    for g, w in zip(got, want, strict=True):
        assert len(g.logprobs) == len(g.token_ids)
        for gd, wd, t in zip(g.logprobs, w.logprobs, g.token_ids, strict=True):
            assert gd.keys() == wd.keys() and t in gd
            assert gd[t].logprob == pytest.approx(wd[t].logprob, abs=1e-4)


def test_preemption_mid_speculation_changes_nothing(model_dir, plain_greedy):
    tight = LLM(str(model_dir), block_size=4, num_blocks=30, max_num_batched_tokens=64,
                enable_prefix_caching=False, speculative_config=SPEC)
    outs = tight.generate(PROMPTS, GREEDY)
    stats = tight.engine.get_stats()
    assert stats.preemptions > 0, "the pool was meant to force preemption"
    assert tight.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in plain_greedy]
    assert stats.free_blocks == stats.total_blocks


# `sluice bench spec`'s random workload: random-token prompts, all at once, k = 6 (the bench's
# default config). This small model's greedy text on random prompts turns repetitive within a few
# tokens, so drafts are taken and partly rejected from the first steps on, in steps that verify
# several requests' drafts beside plain decodes.
SPEC6 = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _random_prompts(vocab: int, n: int = 4, length: int = 64, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)  # the bench's prompts (sluice_bench/spec.py)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]} for _ in range(n)]


def _record_rows(llm) -> dict:
    """Wrap the engine's runner: every sampled logits row, keyed by (request's prompt, position of
    the token it predicts); a draft chunk's rows are each draft's position."""
    rows: dict = {}
    runner = llm.engine.runner
    execute = runner.execute

    def recording(chunks):
        out = execute(chunks)
        counts = out.sample_counts or [1] * len(out.sample_requests)
        r = 0
        for req, count in zip(out.sample_requests, counts, strict=True):
            for j in range(count):
                rows[(tuple(req.prompt_token_ids), req.num_tokens + j)] = out.sample_logits[r + j].clone()
            r += count
        return out

    runner.execute = recording
    return rows


def test_random_prompts_batched_with_k6_match_plain_decoding_row_by_row(model_dir, plain):
    """Greedy outputs token-identical, and every verified row's logits (a draft position computed
    beside other requests' decodes and drafts) those of plain decoding at that position, to
    float32 rounding: a wrong slot, context length, block table or row mapping moves them by far
    more (the top-2 margins here are ~0.1)."""
    spec = LLM(str(model_dir), kv_cache_memory=64 << 20, max_num_batched_tokens=256, speculative_config=SPEC6)
    prompts = _random_prompts(plain.engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain_rows, spec_rows = _record_rows(plain), _record_rows(spec)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    finally:
        del plain.engine.runner.execute  # the module's engine: its own method again
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens >= 20, stats.as_dict()  # drafts were taken and kept
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and some rejected
    assert got == want
    common_keys = spec_rows.keys() & plain_rows.keys()
    assert len(common_keys) == len(prompts) * params.max_tokens  # every position was sampled on both
    worst = max((spec_rows[k] - plain_rows[k]).abs().max().item() for k in common_keys)
    assert worst < 1e-3, worst
    assert spec.engine.get_stats().free_blocks == spec.engine.get_stats().total_blocks
