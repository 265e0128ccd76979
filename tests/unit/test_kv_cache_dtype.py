"""``kv_cache_dtype``: a KV cache narrower than the model's dtype (vLLM's knob).

What must hold: the cache holds the narrower dtype and twice the tokens in the same bytes, and
every attention path (a prefill chunk from position 0, a later chunk that reads the cache, the
torch and native decode attentions, the native decode step) attends to the K/V as the cache holds
them, so that a prompt's tokens do not depend on how it was chunked."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from engine_service import LLM, SamplingParams
from engine_service.model.attention import AttentionMetadata, PrefillSequence, paged_attention
from engine_service.model.kv_cache import bytes_per_block, kv_cache_dtype, num_blocks_for_budget
from tests.model_helpers import LONG_TEXT

BLOCK = 8
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _prefill_chunk(q, k, v, caches, start: int, table: torch.Tensor) -> torch.Tensor:
    """Positions start..start+len(q) of one sequence as one prefill chunk through paged_attention."""
    n = q.shape[0]
    positions = torch.arange(start, start + n)
    slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
    context = start + n
    mask = None if start == 0 else torch.arange(context)[None, :] <= positions[:, None]
    seq = PrefillSequence(query_start=0, query_len=n, context_len=context,
                          block_table=table[: -(-context // BLOCK)], mask=mask)
    meta = AttentionMetadata(slot_mapping=slots, prefills=[seq], decode_token_index=None, decode_block_tables=None)
    return paged_attention(q, k, v, caches[0], caches[1], meta, HEAD_DIM**-0.5)


def _causal(q, k, v) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                         scale=HEAD_DIM**-0.5, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_prompt_attends_to_the_cached_values_however_it_is_chunked(cache_dtype):
    torch.manual_seed(0)
    tokens = 40
    q = torch.randn(tokens, HEADS, HEAD_DIM)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM) * 3
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM)
    table = torch.tensor([5, 2, 7, 0, 3, 6])  # scattered blocks

    def caches():
        shape = (8, BLOCK, KV_HEADS, HEAD_DIM)
        return torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)

    whole = _prefill_chunk(q, k, v, caches(), 0, table)
    chunked_caches = caches()
    first = _prefill_chunk(q[:24], k[:24], v[:24], chunked_caches, 0, table)
    second = _prefill_chunk(q[24:], k[24:], v[24:], chunked_caches, 24, table)  # reads the first chunk's cache
    chunked = torch.cat([first, second])
    as_cached = _causal(q, k.to(cache_dtype).float(), v.to(cache_dtype).float())
    assert (whole - as_cached).abs().max() < 1e-5
    assert (chunked - whole).abs().max() < 1e-5
    if cache_dtype != torch.float32:  # the rounding is large enough to tell the two apart
        assert (_causal(q, k, v) - as_cached).abs().max() > 1e-3


def test_the_knob_names_itself_when_wrong():
    assert kv_cache_dtype("auto", torch.float32) == torch.float32
    assert kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_cache_dtype(torch.float16, torch.float32) == torch.float16
    for bad in ("fp8", "int8", "", None):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
            kv_cache_dtype(bad, torch.float32)


@pytest.mark.model
def test_an_engine_refuses_a_bad_kv_cache_dtype_before_loading(model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype.*'fp8'"):
        LLM(str(model_dir), dtype="float32", kv_cache_dtype="fp8")


def _greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


PROMPTS = [LONG_TEXT + "\nIn one sentence, the printing press", "def fibonacci(n):\n", "1, 2, 3, 5, 8, 13,"]


@pytest.mark.model
def test_a_float32_model_over_a_bfloat16_cache(model_dir):
    """Twice the blocks in the same bytes; the same greedy tokens whether the long prompt is
    prefilled in one chunk or in chunks of 32 tokens (which read the first chunks' cache), and
    through the torch or the native decode attention."""
    budget = 32 << 20
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=budget,
              attention_backend="torch")
    engine = llm.engine
    assert engine.dtype == torch.float32 and engine.kv_cache_dtype == torch.bfloat16
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in engine.runner.kv_caches)
    cfg = engine.model_config
    assert engine.scheduler.block_pool.num_total_blocks == num_blocks_for_budget(
        cfg, 16, torch.bfloat16, engine.device, budget)
    assert 2 * bytes_per_block(cfg, 16, torch.bfloat16) == bytes_per_block(cfg, 16, torch.float32)
    assert engine.scheduler.block_pool.num_total_blocks == budget // bytes_per_block(cfg, 16, torch.bfloat16)
    want = _greedy(llm, PROMPTS)
    del llm, engine

    chunked = LLM(str(model_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=budget,
                  attention_backend="torch", max_num_batched_tokens=32, enable_prefix_caching=False)
    assert _greedy(chunked, PROMPTS) == want
    del chunked
    native = LLM(str(model_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=budget,
                 attention_backend="native")
    assert native.engine.attention_backend == "native"
    assert _greedy(native, PROMPTS) == want


@pytest.mark.model
def test_a_float16_cache_reads_the_same_through_the_native_and_torch_attention(model_dir):
    """float16 keeps more of each value than bfloat16 in the same bytes; the native attention reads
    it (widened exactly) and gives the torch path's greedy tokens."""
    config = dict(dtype="float32", kv_cache_dtype="float16", kv_cache_memory=32 << 20)
    native = LLM(str(model_dir), **config)
    assert native.engine.attention_backend == "native"
    assert native.engine.runner.kv_caches[0][0].dtype == torch.float16
    got = _greedy(native, PROMPTS)
    del native
    assert _greedy(LLM(str(model_dir), attention_backend="torch", **config), PROMPTS) == got
