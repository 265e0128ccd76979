"""The fast paths against the eager reference, without compiling anything (compiled: test_compiled.py).

* ``decode_attention_inplace`` (what the compiled decode step runs without the native kernel) and
  the native kernel (``engine_service.model.native``, the default on CPU) equal the reference gather
  + SDPA on random paged caches, and, inside the model, give token-identical greedy output in
  float32 on the parity prompts: alone, batched and through preemption.
* The fused q/k/v and gate/up projections are the checkpoint's tensors, concatenated.
* The vectorised step layout (positions, slots, block tables) equals a per-request computation.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from engine_service import LLM, SamplingParams
from engine_service.core.request import Request
from engine_service.core.scheduler import ScheduledChunk
from engine_service.model.attention import (
    AttentionMetadata,
    decode_attention_inplace,
    decode_attention_reference,
)
from engine_service.model.native import load_paged_decode_attention
from engine_service.model.runner import ModelRunner
from tests.model_helpers import Chunk, parity_prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _random_paged_case(heads: int, kv_heads: int, block_size: int, dtype: torch.dtype = torch.float32,
                       head_dim: int = 32):
    gen = torch.Generator().manual_seed(heads * 100 + block_size)
    # lengths: one token, block-aligned, one either side, a longer one, and contexts the native
    # kernel cuts into several partitions (64 tokens up to 256, 128 beyond), ending mid-partition
    # and on a partition's edge
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 3 * block_size, 7 * block_size + 3,
            200, 256, 300, 640]
    batch = len(lens)
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    width = max(-(-n // block_size) for n in lens) + 1  # one padding column more than needed
    tables = torch.zeros(batch, width, dtype=torch.long)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    for row, n in enumerate(lens):
        for col in range(-(-n // block_size)):
            tables[row, col] = perm.pop()
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long), prefills=[],
                             decode_token_index=None, decode_block_tables=tables,
                             decode_context_lens=torch.tensor(lens))
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("heads,kv_heads,block_size", [(9, 3, 16), (4, 4, 4), (8, 2, 8)])
def test_inplace_decode_attention_matches_reference(heads, kv_heads, block_size):
    q, k_cache, v_cache, meta = _random_paged_case(heads, kv_heads, block_size)
    ref = decode_attention_reference(q, k_cache, v_cache, meta, 0.3)
    got = decode_attention_inplace(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.3)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


# head sizes: multiples of 16 take the AVX-512 path (the outputs of up to three query heads of a kv
# head in registers; 64 is the default model's): a bfloat16 K of whole 32s under a bfloat16 q as
# VDPBF16PS with 16 scores summed across lanes at once (where the CPU has it; under a float32 q,
# below, transposed so that a token is a lane), a float32 K (and bfloat16 of 48) with 16 scores
# summed across lanes at once; 24 the portable loops (float16: its own exact widening); blocks of 32
# split a run in two; groups of 1 to 6 query heads a kv head take every split in threes
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim", [
    (9, 3, 16, 32), (4, 4, 4, 32), (8, 2, 8, 32), (6, 1, 16, 32), (9, 3, 16, 64), (4, 2, 32, 64),
    (10, 2, 16, 64), (4, 2, 16, 128), (4, 2, 16, 48), (9, 3, 16, 24), (4, 2, 8, 24)])
def test_native_decode_attention_matches_reference(heads, kv_heads, block_size, head_dim, dtype):
    kernel = load_paged_decode_attention()  # gcc is part of the test set-up: a build failure fails here
    q, k_cache, v_cache, meta = _random_paged_case(heads, kv_heads, block_size, dtype, head_dim)
    ref = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    got = kernel.op(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.3)
    assert got.dtype == dtype and got.shape == q.shape
    # float32 accumulation in both: the only difference is the order of the sums
    atol = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]  # the output's rounding
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=1e-5)
    # the kernel is the operator the compiled step calls, and takes strided inputs too
    assert kernel.op is torch.ops.sluice.paged_decode_attention
    wide_q = torch.cat([q, q], dim=-1)[..., : q.shape[-1]]  # a view with a row stride of 2 heads
    wide_tables = torch.cat([meta.decode_block_tables] * 2, dim=1)[:, : meta.decode_block_tables.shape[1]]
    assert not wide_q.is_contiguous() and not wide_tables.is_contiguous()
    strided = torch.ops.sluice.paged_decode_attention(wide_q, k_cache, v_cache, wide_tables,
                                                      meta.decode_context_lens[::1], 0.3)
    assert torch.equal(strided, got)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_native_decode_attention_keeps_a_float32_query_over_a_bfloat16_cache(head_dim):
    """kv_cache_dtype=bfloat16 under a float32 model: q is not a bfloat16, so its scores take the
    transposed FMA path and keep q's float32 bits. VDPBF16PS, which a bfloat16 model's q takes
    (the bfloat16 cases above), would round q to bfloat16 and miss this tolerance by far."""
    kernel = load_paged_decode_attention()
    q, k_cache, v_cache, meta = _random_paged_case(9, 3, 16, torch.float32, head_dim)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    assert not torch.equal(q, q.bfloat16().float())
    ref = decode_attention_reference(q, k_cache.float(), v_cache.float(), meta, 0.3)
    got = kernel.op(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=5e-6, rtol=1e-5)  # float32 sums in another order


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_decode_attention_softmax_holds_for_scores_in_the_thousands(dtype):
    """Each partition's softmax subtracts the partition's largest score (vector code, its tail
    masked): scores of thousands, whose exponentials overflow float32 by far, still give the
    reference's output, for every context length of the case (tails of 1 to 15 scores)."""
    kernel = load_paged_decode_attention()
    q, k_cache, v_cache, meta = _random_paged_case(9, 3, 16, dtype, 64)
    q = (q.float() * 40).to(dtype)  # scores ~ 0.3 * 40 * 8 * N(0, 1): hundreds to thousands
    ref = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    got = kernel.op(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.3)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), ref, atol=2e-5 if dtype == torch.float32 else 2e-2, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [24, 64])
def test_native_decode_attention_reads_float16_subnormals_under_a_float32_query(head_dim):
    """kv_cache_dtype=float16 under a float32 model: values below float16's smallest normal
    (6.1e-5) are stored as subnormals, and both the portable widening (head size 24) and
    vcvtph2ps (64) must read them exactly."""
    kernel = load_paged_decode_attention()
    q, k_cache, v_cache, meta = _random_paged_case(9, 3, 16, torch.float32, head_dim)
    k_cache, v_cache = (k_cache * 2e-5).half(), (v_cache * 2e-5).half()
    assert (k_cache.abs() < 6.1e-5).float().mean() > 0.9  # mostly subnormal
    q = q * 3e4
    ref = decode_attention_reference(q, k_cache.float(), v_cache.float(), meta, 0.3)
    got = kernel.op(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got * 1e5, ref * 1e5, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_decode_attention_is_batch_and_thread_invariant(dtype, head_dim):
    """A sequence's partitions depend on its context length only: its output is bitwise the same
    alone or batched, on one thread or several (the engine's tokens must not depend on who else
    is decoding in the step)."""
    kernel = load_paged_decode_attention()
    q, k_cache, v_cache, meta = _random_paged_case(9, 3, 16, dtype, head_dim)
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single_thread = kernel.op(q, k_cache, v_cache, tables, lens, 0.3)
        torch.set_num_threads(max(threads, 2))
        batched = kernel.op(q, k_cache, v_cache, tables, lens, 0.3)
        assert torch.equal(batched, single_thread)
        for b in range(q.shape[0]):
            alone = kernel.op(q[b : b + 1], k_cache, v_cache, tables[b : b + 1], lens[b : b + 1], 0.3)
            assert torch.equal(alone[0], batched[b]), b
    finally:
        torch.set_num_threads(threads)


def _chunk_scores_switch():
    import ctypes

    from engine_service.model.native import native_library

    lib = native_library()
    switch, passes = lib.paged_decode_attention_set_chunk_scores, lib.paged_decode_attention_chunk_passes
    switch.restype, switch.argtypes = ctypes.c_int, [ctypes.c_int]
    passes.restype, passes.argtypes = ctypes.c_int64, []
    return switch, passes


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads,block_size", [(9, 3, 16), (10, 2, 32), (4, 4, 16)])
@pytest.mark.parametrize("context", [1, 15, 16, 80, 300])
def test_a_draft_chunks_rows_stay_their_own(heads, kv_heads, block_size, context):
    """A draft chunk: one sequence's rows at consecutive positions over one block table, as a
    verifying step lays them out (bfloat16, heads of 64, q a bfloat16 model's). Where the CPU has
    AMX the chunk's scores come from tiles, all of its rows at once (``chunk_passes`` counts them;
    a group of 5 query heads takes at most 6 rows a chunk, so its seventh row is a lone row). Each
    row's output is the reference's, and bitwise the same in a chunk of any length from two rows,
    beside another sequence, and on one to three threads; with the chunk scores switched off each
    row is its lone row's, bit for bit."""
    from sluice.cpuinfo import cpuinfo_field

    kernel = load_paged_decode_attention()
    switch, passes = _chunk_scores_switch()
    gen = torch.Generator().manual_seed(context)
    rows, head_dim = 7, 64
    blocks = -(-(context + rows) // block_size) + 3
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    perm = torch.randperm(blocks, generator=gen)
    width = -(-(context + rows - 1) // block_size)
    tables = perm[:width].repeat(rows, 1)  # every row the chunk's whole table
    lens = torch.arange(context, context + rows)
    q = torch.randn(rows, heads, head_dim, generator=gen).bfloat16().float()
    meta = AttentionMetadata(slot_mapping=torch.zeros(rows, dtype=torch.long), prefills=[], decode_token_index=None,
                             decode_block_tables=tables, decode_context_lens=lens)
    ref = decode_attention_reference(q, k_cache.float(), v_cache.float(), meta, 0.125)
    threads = torch.get_num_threads()
    before = passes()
    try:
        torch.set_num_threads(2)
        got = kernel.op(q, k_cache, v_cache, tables, lens, 0.125)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)  # float32 sums, bfloat16 inputs
        tiles = {"amx_tile", "amx_bf16"} <= set((cpuinfo_field("flags") or "").split())
        assert (passes() > before) == tiles, (passes(), before)
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(kernel.op(q, k_cache, v_cache, tables, lens, 0.125), got)
        torch.set_num_threads(2)
        for m in range(2, rows):
            part = kernel.op(q[:m], k_cache, v_cache, tables[:m], lens[:m], 0.125)
            assert torch.equal(part, got[:m]), m
        other = torch.cat([tables[:1].flip(1), tables[:1]], dim=1)[:, :width]  # another sequence's blocks
        beside = kernel.op(torch.cat([q[:1] * 2, q]), k_cache, v_cache, torch.cat([other, tables]),
                           torch.cat([lens[-1:], lens]), 0.125)
        assert torch.equal(beside[1:], got)
        assert switch(0) == 0
        off = kernel.op(q, k_cache, v_cache, tables, lens, 0.125)
        for r in range(rows):
            alone = kernel.op(q[r : r + 1], k_cache, v_cache, tables[r : r + 1], lens[r : r + 1], 0.125)
            assert torch.equal(off[r], alone[0]), r
        torch.testing.assert_close(off, got, atol=1e-4, rtol=1e-4)
    finally:
        switch(1)
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_native_decode_attention_refuses_what_it_cannot_run():
    kernel = load_paged_decode_attention()
    q, k_cache, v_cache, meta = _random_paged_case(9, 3, 16)
    assert kernel.supports(torch.float32, 9, 3, 64) and kernel.supports(torch.bfloat16, 32, 8, 128)
    assert kernel.supports(torch.float16, 9, 3, 64) and not kernel.supports(torch.float64, 9, 3, 64)
    assert not kernel.supports(torch.float32, 9, 3, 512)
    assert not kernel.supports(torch.float32, 129, 3, 64) and not kernel.supports(torch.float32, 9, 2, 64)

    # the operator (what the forward calls) refuses what it cannot run or what would make it read
    # memory it was not given, with the reason, not a crash
    op = kernel.op
    wide = torch.randn(q.shape[0], 43 * 3, q.shape[2])  # 129 query heads: over the kernel's limit
    with pytest.raises(RuntimeError, match="no kernel for 129 heads over 3 kv heads of size 32"):
        op(wide, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.3)
    with pytest.raises(RuntimeError, match="no kernel for 8 heads over 3 kv heads"):
        op(q[:, :8], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.3)
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    with pytest.raises(RuntimeError, match="longer than its block table"):
        op(q, k_cache, v_cache, tables[:, :1], lens, 0.3)
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(q, k_cache, v_cache, tables + k_cache.shape[0], lens, 0.3)
    with pytest.raises(RuntimeError, match="int64"):
        op(q, k_cache, v_cache, tables.int(), lens, 0.3)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 only"):
        op(q, k_cache.double(), v_cache.double(), tables, lens, 0.3)
    with pytest.raises(RuntimeError, match="head size"):
        op(q[..., :16], k_cache, v_cache, tables, lens, 0.3)
    with pytest.raises(RuntimeError, match="differ"):
        op(q, k_cache, v_cache[:-1], tables, lens, 0.3)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), tables, lens, 0.3)


@pytest.mark.model
def test_fused_projections_are_the_checkpoint_tensors(model_dir):
    llm_model = LLM(str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory=8 << 20).engine.runner.model
    layer = llm_model.model.layers[3]
    path = sorted(model_dir.glob("*.safetensors"))[0]
    with safe_open(str(path), framework="pt") as f:
        get = lambda name: f.get_tensor(f"model.layers.3.{name}.weight")  # noqa: E731
        qkv = torch.cat([get("self_attn.q_proj"), get("self_attn.k_proj"), get("self_attn.v_proj")])
        gate_up = torch.cat([get("mlp.gate_proj"), get("mlp.up_proj")])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)


class _Model:
    """Just what ModelRunner.prepare touches of the model."""

    class rotary:  # noqa: N801
        @staticmethod
        def ensure_positions(n: int) -> None:
            pass


def test_prepare_layout_equals_per_request_computation():
    rng = random.Random(0)
    bs = 16
    runner = ModelRunner(_Model(), [(torch.zeros(1), torch.zeros(1))], bs, torch.device("cpu"))
    chunks, free = [], list(range(100_000))
    rng.shuffle(free)
    for i in range(256):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 300))]
        req = Request(f"r{i}", prompt, SamplingParams())
        if i % 5 == 0:  # a prefill chunk, fresh or continued
            start = rng.choice([0, rng.randrange(len(prompt))])
            n = len(prompt) - start
        else:  # a decode
            start, n = len(prompt) - 1, 1
        req.block_ids = [free.pop() for _ in range(-(-len(prompt) // bs))]
        chunks.append(Chunk(req, start, n))
    ids, positions, meta, sample_rows = runner.prepare(chunks)

    exp_ids, exp_pos, exp_slots, decode_rows, offset = [], [], [], [], 0
    for c in chunks:
        for p in range(c.start, c.start + c.num_tokens):
            exp_ids.append(c.request.all_token_ids[p])
            exp_pos.append(p)
            exp_slots.append(c.request.block_ids[p // bs] * bs + p % bs)
        if c.num_tokens == 1:
            decode_rows.append(offset)
        offset += c.num_tokens
    assert ids.tolist() == exp_ids
    assert positions.tolist() == exp_pos
    assert meta.slot_mapping.tolist() == exp_slots
    assert meta.decode_token_index.tolist() == decode_rows
    decodes = [c for c in chunks if c.num_tokens == 1]
    assert meta.decode_context_lens.tolist() == [c.start + 1 for c in decodes]
    for row, c in zip(meta.decode_block_tables.tolist(), decodes, strict=True):
        nb = -(-(c.start + 1) // bs)
        assert row[:nb] == c.request.block_ids[:nb] and not any(row[nb:])
    prefills = [c for c in chunks if c.num_tokens > 1]
    assert [p.query_len for p in meta.prefills] == [c.num_tokens for c in prefills]
    assert [(p.mask is None) for p in meta.prefills] == [c.start == 0 for c in prefills]
    ends = np.cumsum([c.num_tokens for c in chunks]) - 1
    assert sample_rows == ends.tolist()  # every chunk reaches the end of its tokens here


@pytest.mark.parametrize("drafting", [False, True])
@pytest.mark.parametrize("min_width", [1, 2])
def test_a_few_decodes_are_laid_out_as_the_general_path_lays_them(monkeypatch, min_width, drafting):
    """``_prepare_decodes`` (up to FEW_DECODES one-token decodes, some with drafts: a row per
    position) builds the tensors the numpy path builds: ids, positions, slots, padded block tables,
    lengths and the sampled rows."""
    import engine_service.model.runner as runner_module

    rng = random.Random(min_width)
    bs = 16
    runner = ModelRunner(_Model(), [(torch.zeros(1), torch.zeros(1))], bs, torch.device("cpu"))
    runner.min_decode_width = min_width
    free = list(range(10_000))
    rng.shuffle(free)
    taken: list = []
    few = runner_module.FEW_DECODES
    monkeypatch.setattr(runner, "_prepare_decodes", lambda c: taken.append(c) or ModelRunner._prepare_decodes(runner, c))
    for n in range(1, runner_module.FEW_DECODES + 1):
        chunks = []
        for i in range(n):  # contexts of one token, a block's edge either side, and longer
            prompt = [rng.randrange(1000) for _ in range(rng.choice([1, bs - 1, bs, bs + 1, rng.randint(2, 200)]))]
            req = Request(f"r{i}", prompt, SamplingParams())
            drafts = [rng.randrange(1000) for _ in range(rng.choice([0, 1, 2, 6]) if drafting else 0)]
            req.block_ids = [free.pop() for _ in range(-(-(len(prompt) + len(drafts)) // bs))]
            chunks.append(ScheduledChunk(req, len(prompt) - 1, 1 + len(drafts), draft_token_ids=drafts or None))
        taken.clear()
        fast = runner.prepare(chunks)
        assert taken == [chunks]  # the step took the fast path
        monkeypatch.setattr(runner_module, "FEW_DECODES", 0)  # the general path
        general = runner.prepare(chunks)
        monkeypatch.setattr(runner_module, "FEW_DECODES", few)
        for got, want in [(fast[0], general[0]), (fast[1], general[1]), (fast[2].slot_mapping, general[2].slot_mapping),
                          (fast[2].decode_block_tables, general[2].decode_block_tables),
                          (fast[2].decode_context_lens, general[2].decode_context_lens)]:
            assert got.dtype == want.dtype == torch.long and torch.equal(got, want)
        assert fast[2].prefills == general[2].prefills == [] and fast[2].decode_token_index is None
        assert fast[2].decode_kernel is general[2].decode_kernel
        assert fast[3] == general[3] == list(range(sum(c.num_tokens for c in chunks)))


@pytest.fixture(scope="module")
def reference_llm(model_dir):
    return LLM(str(model_dir), dtype="float32", enforce_eager=True, attention_backend="torch",
               max_num_batched_tokens=512, kv_cache_memory=128 << 20)


@pytest.fixture(scope="module")
def prompts(reference_llm):
    return parity_prompts(reference_llm.get_tokenizer())


@pytest.fixture(scope="module")
def reference_tokens(reference_llm, prompts):
    """Greedy tokens of the eager reference path (batched; test_model_parity shows that batched,
    alone and transformers agree on this path)."""
    return [o.outputs[0].token_ids for o in reference_llm.generate(prompts, GREEDY)]


def _inplace(llm: LLM) -> LLM:
    llm.engine.runner.decode_kernel = decode_attention_inplace
    return llm


@pytest.mark.model
@pytest.mark.timeout(1800)
def test_inplace_decode_greedy_identical_alone_and_batched(model_dir, prompts, reference_tokens):
    llm = _inplace(LLM(str(model_dir), dtype="float32", enforce_eager=True, attention_backend="torch",
                       max_num_batched_tokens=512, kv_cache_memory=128 << 20))
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert batched == reference_tokens
    for i in (0, 4, 9):  # shortest, two tokens, ~1,000 tokens
        assert llm.generate([prompts[i]], GREEDY)[0].outputs[0].token_ids == reference_tokens[i]


@pytest.mark.model
@pytest.mark.timeout(1800)
def test_inplace_decode_greedy_identical_through_preemption(model_dir, prompts, reference_tokens):
    short = [i for i, p in enumerate(prompts) if len(p) <= 40]
    assert len(short) >= 4
    tight = _inplace(LLM(str(model_dir), dtype="float32", enforce_eager=True, attention_backend="torch",
                         block_size=4, num_blocks=40, max_num_batched_tokens=64, enable_prefix_caching=False))
    outs = tight.generate([prompts[i] for i in short], GREEDY)
    assert tight.engine.get_stats().preemptions > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == [reference_tokens[i] for i in short]


@pytest.mark.model
def test_native_decode_greedy_identical_alone_batched_and_through_preemption(model_dir, prompts, reference_tokens):
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, attention_backend="native",
              max_num_batched_tokens=512, kv_cache_memory=128 << 20)
    assert llm.engine.attention_backend == "native" and llm.engine.runner.decode_kernel is not None
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert batched == reference_tokens
    for i in (0, 4, 9):  # shortest, two tokens, ~1,000 tokens
        assert llm.generate([prompts[i]], GREEDY)[0].outputs[0].token_ids == reference_tokens[i]
    short = [i for i, p in enumerate(prompts) if len(p) <= 40]
    tight = LLM(str(model_dir), dtype="float32", enforce_eager=True, attention_backend="native",
                block_size=4, num_blocks=40, max_num_batched_tokens=64, enable_prefix_caching=False)
    outs = tight.generate([prompts[i] for i in short], GREEDY)
    assert tight.engine.get_stats().preemptions > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == [reference_tokens[i] for i in short]


def test_native_kernel_unavailable_falls_back_or_refuses(monkeypatch, tmp_path):
    """No compiler: ``auto`` runs the torch attention (logged), ``native`` refuses with the reason."""
    import engine_service.model.native as native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(native.NativeKernelError, match="no-such-compiler"):
        native.load_paged_decode_attention()
    assert native.paged_decode_attention_kernel(torch.device("cpu")) is None
    assert native.paged_decode_attention_kernel(torch.device("meta")) is None


def _graphed(runner, max_batch: int, max_model_len: int):
    """The runner's steps through the CUDA-graph path over its eager forward, its padded steps run
    eagerly (no capture on a CPU); returns the path's ``GraphedDecode``."""
    from engine_service.model.decode_paths.cuda_graphs import CudaGraphsPath

    path = CudaGraphsPath(runner.path_setup(max_batch=max_batch, max_model_len=max_model_len), runner.path,
                          capture=False)
    runner.use(path)
    return path.graphed


def _shrinking(prompts: list[list[int]]) -> list[SamplingParams]:
    """Greedy, ending at 16, 13, 10, 7 and 4 tokens in turn: batches that shrink step by step, so
    rows a larger step filled are stale in the next step's bucket and must be padded over."""
    return [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS - 3 * (i % 5), ignore_eos=True)
            for i in range(len(prompts))]


@pytest.mark.model
def test_cuda_graph_buckets_padded_steps_are_greedy_identical(model_dir, prompts, reference_tokens, monkeypatch):
    """The CUDA-graph step's inputs (engine_service.model.cuda_graphs): a step copied into its
    bucket's static rows and padded with scratch-slot decodes, run here eagerly (no capture on a
    CPU). Same greedy tokens as the reference, alone and in shrinking batches: no padded row
    writes a request's cache or leaks into a real row."""
    from engine_service.model.cuda_graphs import GraphedDecode

    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, attention_backend="torch",
              max_num_batched_tokens=512, kv_cache_memory=128 << 20)
    runner, engine = llm.engine.runner, llm.engine
    graphed = _graphed(runner, engine.config.max_num_seqs, engine.max_model_len)
    assert graphed.batch_sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graphed.bucket(3, 5) == (4, 8) and graphed.bucket(1, 1) == (1, 1)
    assert graphed.bucket(257, 1) is None  # more rows than the largest bucket
    assert graphed.bucket(256, 65) is None  # 256 x 128 blocks of 16: past MAX_GRAPH_POSITIONS
    steps: list[tuple[int, tuple[int, int] | None]] = []
    original = GraphedDecode.__call__

    def recording(self, input_ids, positions, meta):
        rows, bucket = input_ids.shape[0], self.bucket(*meta.decode_block_tables.shape)
        steps.append((rows, bucket))
        hidden = original(self, input_ids, positions, meta)
        if bucket is not None:  # rows a larger step left behind now decode one token in the scratch slot
            assert bool((self.slot_mapping[rows : bucket[0]] == self.scratch_slot).all())
            assert bool((self.context_lens[rows : bucket[0]] == 1).all())
            assert bool((self.block_tables[rows : bucket[0], 0] == self.scratch_block).all())
        return hidden

    monkeypatch.setattr(GraphedDecode, "__call__", recording)
    params = _shrinking(prompts)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [ref[: p.max_tokens] for ref, p in
                                                       zip(reference_tokens, params, strict=True)]
    assert any(bucket is not None and rows < bucket[0] for rows, bucket in steps), steps
    assert {rows for rows, _ in steps} >= {8, 6, 4, 2}, "the batch was meant to shrink"
    for i in (0, 9):
        assert llm.generate([prompts[i]], GREEDY)[0].outputs[0].token_ids == reference_tokens[i]


@pytest.mark.model
def test_a_failed_cuda_graph_capture_falls_back_to_the_eager_forward(model_dir, prompts, reference_tokens,
                                                                    monkeypatch):
    """A capture that raises (a kernel that cannot be captured) is logged, and that step and every
    later one run the eager forward: the same tokens, no exception reaching the engine."""
    from engine_service.model.cuda_graphs import GraphedDecode

    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, attention_backend="torch",
              max_num_batched_tokens=512, kv_cache_memory=128 << 20)
    runner = llm.engine.runner
    graphed = _graphed(runner, 8, llm.engine.max_model_len)
    graphed.capture = True  # as on a GPU, with a capture that fails
    attempts = []

    def failing_capture(self, batch, width):
        attempts.append((batch, width))
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedDecode, "_capture", failing_capture)
    assert graphed.warm_up() == 0.0 and "not permitted" in graphed.failed
    outs = llm.generate(prompts[:3], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens[:3]
    assert attempts == [(1, 1)], "after one failure no step tries to capture again"
