"""Same request, same answer (docs/determinism.md), with the real default model: in every mode this
CPU runs, a request's token ids, greedy and seeded, are the same alone, batched with unrelated
requests, on a prefix-cache hit (whole and partial), with its prompt prefilled in chunks split at
several points, after preemption and recompute, and across engines (each scenario runs in an engine
of its own start). The multi-step and speculative modes must give their base mode's tokens.

A mode this machine cannot keep deterministic must say so at start (``deterministic=off (...)`` in
the start-up line); it is then skipped with that reason, never compared silently."""

from __future__ import annotations

import pytest

from engine_service import LLM, SamplingParams
from sluice.text.tokenizer import Tokenizer
from tests.model_helpers import LONG_TEXT

pytestmark = pytest.mark.model

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
# mode -> (its engine's keywords, the mode whose tokens it must give)
MODES = {
    "bfloat16": ({"dtype": "bfloat16"}, "bfloat16"),
    "float32": ({"dtype": "float32", "deterministic": True}, "float32"),  # opt-in (docs/determinism.md)
    "int8": ({"dtype": "float32", "quantization": "int8", "deterministic": True}, "int8"),  # opt-in
    "int4": ({"dtype": "float32", "quantization": "int4"}, "int4"),
    "gguf": ({"dtype": "float32", "model": "gguf"}, "gguf"),  # the default model's own file, as it is
    "bfloat16-multi-step": ({"dtype": "bfloat16", "num_scheduler_steps": 4}, "bfloat16"),
    "bfloat16-speculative": ({"dtype": "bfloat16", "speculative_config": SPEC}, "bfloat16"),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=6, ignore_eos=True, seed=1234)
BLOCK = 4


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    """Three prompts of 30-45 tokens (one repetitive, so that n-grams draft), and a fourth that shares
    the second's first 22 tokens (a partial prefix-cache hit, not on a block boundary)."""
    tok = Tokenizer.from_dir(model_dir)
    repeat = tok.encode("The three primary colours are red, yellow and blue. The three primary colours are")
    text = tok.encode(LONG_TEXT)
    code = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +")
    return [repeat, text[:41], code, text[:22] + text[100:117]]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _engines(model, keywords):
    """The mode's two engines: a tight one without a prefix cache (alone, chunk splits, preemption)
    and a roomy one with it (partial and whole cache hits, batched)."""
    tight = LLM(str(model), block_size=BLOCK, num_blocks=24, max_num_batched_tokens=64,
                enable_prefix_caching=False, **keywords)
    roomy = LLM(str(model), block_size=BLOCK, kv_cache_memory=16 << 20, max_num_batched_tokens=256,
                **keywords)
    return tight, roomy


_BASELINES: dict[tuple[str, str], list[list[int]]] = {}


@pytest.mark.parametrize("mode", list(MODES))
def test_same_request_same_answer(mode, model_dir, prompts, request):
    keywords, base = dict(MODES[mode][0]), MODES[mode][1]
    model = request.getfixturevalue("default_gguf") if keywords.pop("model", None) == "gguf" else model_dir
    tight, roomy = _engines(model, keywords)
    for engine in (tight, roomy):
        line = engine.engine.choices["deterministic"]
        if not engine.engine.deterministic:
            assert line.startswith("off ("), line  # said at start, with the reason
            pytest.skip(f"{mode} is not deterministic on this machine: {line}")
    wrong = []
    ids = [{"prompt_token_ids": p} for p in prompts]
    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        alone = [_tokens(tight.generate([p], params))[0] for p in ids]
        want = _BASELINES.setdefault((base, kind), alone)
        if alone != want:
            wrong.append(f"{kind}: alone, against {base} alone in another engine")
        # the second prompt's prefill in chunks of 7, 16 and 29 tokens (split at 7, 14, ..., 16, 32, 29)
        scheduler = tight.engine.scheduler
        for budget in (7, 16, 29):
            saved, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, budget
            try:
                if _tokens(tight.generate([ids[1]], params))[0] != want[1]:
                    wrong.append(f"{kind}: prompt 1 in chunks of {budget}")
            finally:
                scheduler.max_num_batched_tokens = saved
        # all four at once in 24 blocks of 4 tokens, each running on to 24 tokens (its first ones do
        # not depend on how many follow): some are preempted and recomputed
        before = tight.engine.get_stats().preemptions
        if [t[: len(w)] for t, w in zip(_tokens(tight.generate(ids, params.replace(max_tokens=24))), want,
                                         strict=True)] != want:
            wrong.append(f"{kind}: preempted")
        assert tight.engine.get_stats().preemptions > before, "24 blocks were meant to force preemption"
    # the roomy engine, its cache empty: the second prompt, then the fourth on a partial hit of
    # the second's blocks (its first 22 tokens shared: 20 cached, not the whole prompt)
    roomy.generate([ids[1]], GREEDY)
    out = roomy.generate([ids[3]], SEEDED)[0]
    assert 0 < out.num_cached_tokens < len(prompts[3])
    if out.outputs[0].token_ids != _BASELINES[(base, "seeded")][3]:
        wrong.append(f"seeded: prompt 3 on a partial hit of {out.num_cached_tokens} tokens")
    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        want = _BASELINES[(base, kind)]
        # batched with unrelated requests of other lengths and parameters; the prompts cached
        # above hit their blocks here
        others = [{"prompt_token_ids": prompts[0][::-1] * 2}, {"prompt_token_ids": prompts[2][5:]}]
        mixed = roomy.generate(ids + others, [params] * 4 + [SEEDED.replace(max_tokens=11),
                                                             GREEDY.replace(max_tokens=3)])
        if _tokens(mixed[:4]) != want:
            wrong.append(f"{kind}: batched")
        # every prompt whole from the cache
        hits = roomy.generate(ids, params)
        assert all(o.num_cached_tokens > 0 for o in hits)
        if _tokens(hits) != want:
            wrong.append(f"{kind}: whole prompts on cache hits")
    assert not wrong, f"{mode}: tokens differ from the request alone: {wrong}"
