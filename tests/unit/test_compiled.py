"""The compiled decode step (torch.compile, inductor) against the eager reference, in float32.

The file about compilation (others build a compiled engine only where the path they test needs
one). Its engines run the default model cut to its first four layers (``shallow_copy``): what
compiles, what it guards and what it must equal do not depend on the depth, while tracing and
lowering cost grows with it, which CI pays on a cold inductor cache. The compiled path must give
token-identical greedy output on the parity prompts, batched and alone (the batch >= 2 and
batch 1 graphs), and through preemption; recompilation must stay bounded (two graphs, both built at
engine start, whatever batch sizes and context lengths follow); ``enforce_eager`` must leave the
eager forward alone.
"""

from __future__ import annotations

import pytest

from engine_service import LLM, SamplingParams
from engine_service.model.compiled import compile_supported
from tests.model_helpers import parity_prompts, shallow_copy

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(1800)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def shallow_dir(model_dir, tmp_path_factory):
    return shallow_copy(model_dir, tmp_path_factory.mktemp("shallow"), layers=4)


@pytest.fixture(scope="module")
def reference(shallow_dir):
    # `make install` installs g++: a missing compiler is a set-up failure here, not a reason to skip
    why_not = compile_supported(__import__("torch").device("cpu"))
    assert why_not is None, f"torch.compile unavailable: {why_not}"
    eager = LLM(str(shallow_dir), dtype="float32", enforce_eager=True, max_num_batched_tokens=512,
                kv_cache_memory=128 << 20)
    assert eager.engine.path_named("compiled") is None and eager.engine.compile_warmup_seconds is None
    prompts = parity_prompts(eager.get_tokenizer())
    return prompts, [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compiled_greedy_identical_batched_and_alone(shallow_dir, reference):
    prompts, ref = reference
    before = unique_graphs()
    llm = LLM(str(shallow_dir), dtype="float32", enforce_eager=False, max_num_batched_tokens=512,
              kv_cache_memory=128 << 20)
    assert llm.engine.compile_warmup_seconds is not None and llm.engine.compile_warmup_seconds > 0
    built = unique_graphs() - before
    assert 1 <= built <= 2, built
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert batched == ref
    assert unique_graphs() - before == built, "a batch size or context length recompiled"
    for i in (0, 4, 9):  # batch 1: the shortest, two tokens, ~1,000 tokens
        assert llm.generate([prompts[i]], GREEDY)[0].outputs[0].token_ids == ref[i]
    # Seen on the loaded machine: batch 1 after batch >= 2 seemed to recompile (docs/performance.md).
    assert unique_graphs() - before == built, "batch 1 recompiled"


def test_compiled_greedy_identical_through_preemption(shallow_dir, reference):
    prompts, ref = reference
    short = [i for i, p in enumerate(prompts) if len(p) <= 40]
    tight = LLM(str(shallow_dir), dtype="float32", enforce_eager=False, block_size=4, num_blocks=40,
                max_num_batched_tokens=64, enable_prefix_caching=False)
    outs = tight.generate([prompts[i] for i in short], GREEDY)
    assert tight.engine.get_stats().preemptions > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in short]


def test_compiled_over_a_bfloat16_cache_is_its_eager_forward_through_preemption(shallow_dir, reference):
    """kv_cache_dtype: float32 activations over a bfloat16 cache, compiled and eager; preemption
    recomputes a request's prompt and output in prefill chunks, which read the rounded cache as the
    decode steps did, so the tokens stay the same."""
    prompts, _ = reference
    short = [prompts[i] for i, p in enumerate(prompts) if len(p) <= 40]
    eager = LLM(str(shallow_dir), dtype="float32", enforce_eager=True, kv_cache_dtype="bfloat16",
                kv_cache_memory=64 << 20)
    want = [o.outputs[0].token_ids for o in eager.generate(short, GREEDY)]
    del eager
    tight = LLM(str(shallow_dir), dtype="float32", enforce_eager=False, kv_cache_dtype="bfloat16", block_size=4,
                num_blocks=40, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert tight.engine.path_named("compiled") is not None
    assert tight.engine.runner.kv_caches[0][0].dtype == __import__("torch").bfloat16
    outs = tight.generate(short, GREEDY)
    assert tight.engine.get_stats().preemptions > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == want


def test_engines_sharing_a_compiled_graph_each_run_their_own_weights(shallow_dir):
    """Every engine's decode forward has the same code, so a second engine with the same shapes
    reuses the first one's graph (dynamo caches by code): the weights, caches and prepacked-weight
    handles must be graph inputs read from the engine's own modules, never constants of the first.
    bfloat16, so the prepacked oneDNN weights are in the graph. An engine whose layers are other
    modules (int4 products) with inputs of the same dtypes and shapes must get a graph of its own,
    and not take the other one's (the anchor bench runs these modes in one process: with every
    guard on the modules dropped, the second engine ran the first one's graph and failed)."""
    import gc

    prompts = ["The capital of France is", "def fibonacci(n):"]
    config = dict(dtype="bfloat16", enforce_eager=False, kv_cache_memory=64 << 20)
    first = LLM(str(shallow_dir), **config)
    assert first.engine.path_named("compiled") is not None
    want = [o.outputs[0].token_ids for o in first.generate(prompts, GREEDY)]
    del first
    gc.collect()  # the first engine's weights are gone: a graph still pointing at them would fail
    quantized = LLM(str(shallow_dir), quantization="int4", **config)
    assert quantized.engine.path_named("compiled") is not None
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in quantized.generate(prompts, GREEDY))
    del quantized
    gc.collect()
    second = LLM(str(shallow_dir), **config)
    assert second.engine.path_named("compiled") is not None, "the second engine fell back to eager"
    assert [o.outputs[0].token_ids for o in second.generate(prompts, GREEDY)] == want


def test_the_int4_operator_in_a_compiled_graph_is_the_eager_operator():
    """int4's decode products in the compiled graph are the native operator (sluice::q4_linear) the
    eager forward calls, bit for bit, around the ops a layer fuses (a norm before, SiLU after)."""
    import torch

    from engine_service.model.quantization import QuantizedLinear

    gen = torch.Generator().manual_seed(0)
    up = QuantizedLinear.from_float(torch.randn(960, 576, generator=gen) * 0.05, None, "int4", torch.bfloat16)
    down = QuantizedLinear.from_float(torch.randn(576, 960, generator=gen) * 0.05, None, "int4", torch.bfloat16)
    assert up.native_q4 and down.native_q4
    norm = torch.randn(576, generator=gen)

    def block(x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
        return down(torch.nn.functional.silu(up(h))) + x

    compiled = torch.compile(block, fullgraph=True)
    with torch.inference_mode():
        for rows in (1, 3):
            x = torch.randn(rows, 576, generator=gen)
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
            assert torch.equal(torch.compile(up, fullgraph=True)(h), up(h))
            got, want = compiled(x), block(x)
            assert (got - want).abs().max() <= 1e-2 * want.abs().max()  # the fused norm may round differently


def test_structure_key_tells_apart_what_a_graph_bakes_in_and_ignores_weights():
    """What tells the compiled step's engines apart instead of guards on the decoder's modules
    (``skip_weight_guards``, ``_per_structure``): equal for two models that differ only in their
    weights, different when a module's type, dtype or a plain value a traced forward bakes in (a
    size, a head count) differs anywhere, the last layer included."""
    import torch

    from engine_service.model.compiled import structure_key
    from engine_service.model.quantization import QuantizedLinear

    def stack(last_out: int = 32, last: torch.nn.Module | None = None) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32),
                                   last if last is not None else torch.nn.Linear(32, last_out))

    a, b = stack(), stack()
    assert not torch.equal(a[0].weight, b[0].weight)
    assert structure_key(a) == structure_key(b)
    assert structure_key(stack(last_out=48)) != structure_key(a)
    int4 = QuantizedLinear.from_float(torch.randn(32, 32), None, "int4", torch.float32)
    assert structure_key(stack(last=int4)) != structure_key(a)
    int4_bf16 = QuantizedLinear.from_float(torch.randn(32, 32), None, "int4", torch.bfloat16)
    assert structure_key(stack(last=int4_bf16)) != structure_key(stack(last=int4))  # a dtype differs
    a[2].some_flag = True  # a plain attribute a forward could branch on
    assert structure_key(a) != structure_key(b)
