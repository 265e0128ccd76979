"""The native decode step (``engine_service.model.native_decode``, ``kernels/decode_stack.c``) against
the eager forward it replaces, on the default model quantized to int4.

The products and the attention are the same kernels in both, so what is checked is the work between
them (norms, rotary, cache writes, SiLU, residuals, the order of the layers): the hidden states must
agree to rounding. Not bit for bit: sums run in another order than torch's, and int4's int8
activation rounding can turn a last-bit difference into a step of one activation quantum, so the
bound is relative (a wrong rotary, norm or cache slot is off by the size of the values themselves).
Each row must also be independent of the batch, bit for bit."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.model.native_decode import NativeDecode, native_decode_unavailable
from tests.model_helpers import LONG_TEXT

pytestmark = pytest.mark.model

BLOCK = 16


@pytest.fixture(scope="module")
def llm(model_dir):
    from engine_service.model.native import native_ops_unavailable

    why = native_ops_unavailable()
    assert why is None, f"the native operators must build on this machine (gcc, g++): {why}"
    if not torch.ops.sluice.q4_supported():
        pytest.skip("this CPU has no AVX512-VNNI: no native int4 products, so no native decode step")
    # eager, so that the runner's own forward is the reference
    return LLM(str(model_dir), dtype="float32", quantization="int4", enforce_eager=True, block_size=BLOCK,
               kv_cache_memory=96 << 20)


def _chunk(tokens: list[int], blocks: list[int], start: int, num: int, drafts: list[int] | None = None):
    request = SimpleNamespace(all_token_ids=tokens, block_ids=blocks)
    return SimpleNamespace(request=request, start=start, num_tokens=num, samples=True, draft_token_ids=drafts)


def _sequences(llm, lengths: list[int], seed: int = 0):
    """Prompts of ``lengths`` tokens of English text (each from its own offset, so that the next
    token is often a clear choice), prefilled by the eager forward into blocks of their own."""
    runner = llm.engine.runner
    text = llm.get_tokenizer().encode(LONG_TEXT * 4)
    seqs, next_block = [], 1
    for i, n in enumerate(lengths):
        start = (seed * 13 + i * 7) % 200
        tokens = text[start:start + n + 8]  # room for a few decodes
        need = -(-(n + 8) // BLOCK)
        seqs.append((tokens, list(range(next_block, next_block + need))))
        next_block += need
    runner.forward_hidden([_chunk(t, b, 0, n) for (t, b), n in zip(seqs, lengths, strict=True)])
    return seqs


def _step(llm, chunks, native: NativeDecode | None) -> torch.Tensor:
    """The sampled rows' hidden states of a step: the engine's eager forward (its fixtures are
    eager, asked for), or ``native``'s call."""
    runner = llm.engine.runner
    if native is None:
        hidden, rows = runner.forward_hidden(chunks)
        return hidden[rows]
    input_ids, positions, meta, rows = runner.prepare(chunks)
    return native(input_ids, positions, meta)[rows]


def _distance(got: torch.Tensor, want: torch.Tensor) -> float:
    """The rows' mean relative distance."""
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).mean())


def _noise_floor(llm, chunks, want: torch.Tensor) -> float:
    """How far the eager step itself moves when its input embeddings move by one part in 2^23 (a
    last-bit change): int4's int8 activation rounding turns such a change into a step of a whole
    activation quantum here and there, and 30 layers spread it (a few percent on this model)."""
    weight = llm.engine.runner.model.model.embed_tokens.weight
    saved = weight.detach().clone()
    distances = []
    try:
        for factor in (1 + 2**-23, 1 - 2**-23):
            with torch.no_grad():
                weight.mul_(factor)
            distances.append(_distance(_step(llm, chunks, None), want))
            with torch.no_grad():
                weight.copy_(saved)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    return max(distances)


@pytest.fixture(scope="module")
def llm_bf16_cache(llm, model_dir):
    """The same int4 model over a bfloat16 KV cache (``kv_cache_dtype``): the step rounds what it
    writes to the cache and attends with the bfloat16 attention kernel, under float32 activations."""
    return LLM(str(model_dir), dtype="float32", quantization="int4", enforce_eager=True, block_size=BLOCK,
               kv_cache_memory=48 << 20, kv_cache_dtype="bfloat16")


@pytest.fixture(scope="module")
def llm_f16_cache(llm, model_dir):
    """... and over a float16 one: the step writes with its own float -> half conversion."""
    return LLM(str(model_dir), dtype="float32", quantization="int4", enforce_eager=True, block_size=BLOCK,
               kv_cache_memory=48 << 20, kv_cache_dtype="float16")


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16"])
def test_a_decode_step_is_the_eager_forward_and_each_row_is_its_own(cache, request):
    llm = request.getfixturevalue({"float32": "llm", "bfloat16": "llm_bf16_cache", "float16": "llm_f16_cache"}[cache])
    runner = llm.engine.runner
    assert runner.kv_caches[0][0].dtype == getattr(torch, cache)
    native = NativeDecode(runner.model, runner.kv_caches)
    lengths = [5, 9, 16, 17, 31, 40, 64, 65, 100, 130, 200, 260]  # block edges, past the attention's partitions
    seqs = _sequences(llm, lengths)
    chunks = [_chunk(t, b, n, 1) for (t, b), n in zip(seqs, lengths, strict=True)]
    want = _step(llm, chunks, None)
    got = _step(llm, chunks, native)
    assert got.shape == want.shape and got.dtype == torch.float32
    noise = _noise_floor(llm, chunks, want)
    assert _distance(got, want) < 2 * noise, (_distance(got, want), noise)
    # what a wrong position would give is well outside that: the test can tell
    shifted = [_chunk(t, b, n + 1, 1) for (t, b), n in zip(seqs, lengths, strict=True)]
    off_by_one = _step(llm, shifted, None)
    assert _distance(off_by_one, want) > 2 * noise
    _step(llm, chunks, None)  # the slots the shifted step wrote are outside the contexts: nothing to undo
    # the same logits' choice where the eager forward has a clear one
    logits_got, logits_want = runner.model.compute_logits(got), runner.model.compute_logits(want)
    top2 = logits_want.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 1.0
    assert clear.sum() >= 4, int(clear.sum())
    assert torch.equal(logits_got.argmax(-1)[clear], logits_want.argmax(-1)[clear])
    # a row alone is bitwise that row in the batch
    for i in (0, 5, 11):
        assert torch.equal(_step(llm, [chunks[i]], native)[0], got[i])


def _verifying_step(llm, seed: int):
    """A verifying step beside a plain decode: a request that knows 31 tokens (its prompt and one
    sampled) forwards its last token and two drafts as three rows, another request one row. Returns
    the request's tokens and blocks, the chunks, and the eager and native steps' hidden states."""
    runner = llm.engine.runner
    native = NativeDecode(runner.model, runner.kv_caches)
    (tokens, blocks), (other, other_blocks) = _sequences(llm, [30, 17], seed=seed)
    chunks = [_chunk(tokens[:31], blocks, 30, 3, drafts=tokens[31:33]), _chunk(other, other_blocks, 17, 1)]
    want = _step(llm, chunks, None)
    got = _step(llm, chunks, native)
    assert got.shape == (4, runner.model.config.hidden_size) and got.dtype == want.dtype
    return native, tokens, blocks, chunks, want, got


def test_draft_chunks_attend_to_their_own_new_tokens(llm):
    """A verifying step: a request's last token and two drafts as three decode rows, each attending
    to the cache slots the rows before it wrote in the same call."""
    native, tokens, blocks, chunks, want, got = _verifying_step(llm, seed=1)
    assert _distance(got, want) < 2 * _noise_floor(llm, chunks, want)
    # each draft row is the row a plain decode of that token gives (the same rows, one by one)
    for j in range(3):
        alone = _step(llm, [_chunk(tokens, blocks, 30 + j, 1)], native)
        assert torch.equal(alone[0], got[j])


@pytest.fixture(scope="module")
def gguf(default_gguf):
    """The default model's own GGUF file (Q4_1 layers, a tied Q8_0 head): the step's int4 layers
    with the head in q8_gemv's blocks."""
    from engine_service.model.quantization import native_q4_available

    if not native_q4_available():
        pytest.skip("this CPU has no AVX512-VNNI: no native int4 products, so no native decode step")
    return LLM(str(default_gguf), enforce_eager=True, block_size=BLOCK, kv_cache_memory=48 << 20)


def _kind_llm(kind: str, request):
    return request.getfixturevalue({"int4": "llm", "bfloat16": "bf16", "gguf": "gguf"}[kind])


@pytest.fixture(scope="module")
def bf16(model_dir):
    from engine_service.model.prepacked import PrepackedLinear

    plain = LLM(str(model_dir), dtype="bfloat16", enforce_eager=True, block_size=BLOCK, kv_cache_memory=48 << 20)
    head = plain.engine.runner.model.model.layers[0].mlp.down_proj
    if not (isinstance(head, PrepackedLinear) and head.gemv):
        pytest.skip("this CPU has no AVX512-BF16: bfloat16 products stay oneDNN's, so no native decode step")
    return plain


def test_cpus_default_eager_keeps_the_native_step_and_eager_asked_for_is_the_reference(bf16, model_dir,
                                                                                     monkeypatch, caplog):
    """CPU's default eager (no flag, no $SLUICE_ENFORCE_EAGER) skips torch.compile's long warm-up,
    not the native step: a bfloat16 engine's decode steps, a batch of 20 included (16 without AMX
    tiles), are native calls. Eager asked for (the bf16 fixture) is the reference, with no native
    step; so is the torch attention asked for. A native step that fails to start leaves the engine
    eager, the failure logged."""
    from engine_service.model.prepacked import gemv_max_rows

    monkeypatch.delenv("SLUICE_ENFORCE_EAGER", raising=False)
    assert bf16.engine.enforce_eager and not bf16.engine.native_decode and bf16.engine.decode_mode == "eager"
    llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=16 << 20)
    engine = llm.engine
    assert engine.enforce_eager and engine.native_decode and engine.decode_mode == "native step"
    assert engine.decode_path.fallback.name == "eager"  # its larger steps and prefill chunks
    native = engine.decode_path.native
    rows = []
    fn = native._fn
    native._fn = lambda *args: rows.append(args[10]) or fn(*args)  # the step's row count
    batch = min(20, gemv_max_rows())
    prompts = [f"Count from {i} to {i + 9}:" for i in range(batch)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * batch
    assert batch in rows  # the batch's decode steps went native
    del llm, engine, native
    with caplog.at_level("INFO", logger="engine_service.engine"):
        reference = LLM(str(model_dir), dtype="bfloat16", attention_backend="torch", kv_cache_memory=16 << 20)
    assert not reference.engine.native_decode and reference.engine.decode_mode == "eager"
    assert "decode path native step: not used (the torch attention was asked for" in caplog.text
    del reference

    def broken(self, slot):
        raise RuntimeError("no native step today")

    monkeypatch.setattr(NativeDecode, "warm_up", broken)
    with caplog.at_level("ERROR", logger="engine_service.model.decode_paths"):
        fallback = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=16 << 20)
    assert "the native step path failed to start; passing it over" in caplog.text
    assert not fallback.engine.native_decode and fallback.engine.path_named("native step") is None
    assert fallback.engine.decode_mode == "eager"
    out = fallback.generate(["Count from 1 to 5:"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_bfloat16_stream_is_the_eager_forward(bf16):
    """bfloat16 weights prepacked for the native kernel: one stream's decode step, rounded to
    bfloat16 where the eager forward rounds. The products are the same kernel, so most rows agree
    bit for bit and the rest to a few bfloat16 ulps; the eager forward's next token is kept."""
    from engine_service.model.prepacked import gemv_max_rows

    runner = bf16.engine.runner
    native = NativeDecode(runner.model, runner.kv_caches)
    assert native.max_rows == gemv_max_rows() + 1  # the rows the products' native kernel takes
    lengths = [5, 40, 130, 260]
    for (tokens, blocks), n in zip(_sequences(bf16, lengths, seed=3), lengths, strict=True):
        chunk = [_chunk(tokens, blocks, n, 1)]
        want = _step(bf16, chunk, None)
        got = _step(bf16, chunk, native)
        assert got.dtype == torch.bfloat16
        assert _distance(got.float(), want.float()) < 2e-2
        assert int(runner.model.compute_logits(got).argmax()) == int(runner.model.compute_logits(want).argmax())


def test_a_bfloat16_verifying_step_and_batch_are_the_eager_forward(bf16):
    """Several bfloat16 rows (AMX tiles, or VDPBF16PS on groups of rows): a request's token and two
    drafts beside another request, near the eager forward (oneDNN's batch products); each row
    bitwise the same row in another batch of two or more, and near what a one-row step gives."""
    from engine_service.model.prepacked import gemv_max_rows

    assert gemv_max_rows() >= 4
    runner = bf16.engine.runner
    native, tokens, blocks, chunks, want, got = _verifying_step(bf16, seed=4)
    assert got.dtype == torch.bfloat16
    assert _distance(got.float(), want.float()) < 2e-2
    logits_got, logits_want = runner.model.compute_logits(got), runner.model.compute_logits(want)
    assert torch.equal(logits_got.argmax(-1), logits_want.argmax(-1))
    # the verifying rows without the other request: bitwise the same rows
    assert torch.equal(_step(bf16, chunks[:1], native), got[:3])
    # each draft row near a plain one-row decode of that token (the one-row kernel rounds a few
    # outputs in ten thousand apart from the tiles)
    for j in range(3):
        alone = _step(bf16, [_chunk(tokens, blocks, 30 + j, 1)], native)
        assert _distance(alone.float(), got[j : j + 1].float()) < 2e-2


@pytest.mark.parametrize("kind", ["int4", "bfloat16", "gguf"])
def test_the_logits_come_out_of_the_same_call_bit_for_bit(kind, request):
    """With ``logits=True`` the step ends in the model's output projection: the logits equal
    ``compute_logits`` of the hidden states the step returns without it, bit for bit (the same
    product kernel; bfloat16 rounds them to bfloat16 as the head's own product does), for one row
    and for a verifying step beside another request."""
    llm = _kind_llm(kind, request)
    runner = llm.engine.runner
    native = NativeDecode(runner.model, runner.kv_caches)
    assert native.fuses_head
    (tokens, blocks), (other, other_blocks) = _sequences(llm, [30, 17], seed=5)
    for chunks in ([_chunk(other, other_blocks, 17, 1)],
                   [_chunk(tokens[:31], blocks, 30, 3, drafts=tokens[31:33]), _chunk(other, other_blocks, 17, 1)]):
        input_ids, positions, meta, _ = runner.prepare(chunks)
        hidden = native(input_ids, positions, meta)
        greedy = torch.full((input_ids.shape[0],), -1, dtype=torch.long)
        logits = native(input_ids, positions, meta, logits=True, argmax=greedy)
        want = runner.model.compute_logits(hidden)
        assert logits.dtype == want.dtype == torch.float32 and logits.shape == want.shape
        assert torch.equal(logits, want)
        assert torch.equal(greedy, want.argmax(dim=1))
    with pytest.raises(ValueError, match="argmax"):
        native(input_ids, positions, meta, argmax=greedy)  # no logits to take it of
    if kind == "gguf":  # the int8-block head's layout is checked before the step runs
        group = native._stack.head.extra
        native._stack.head.extra = 48  # neither Q8_0's 32 nor Q6_K's 16
        try:
            with pytest.raises(RuntimeError, match="out of range"):
                native(input_ids, positions, meta, logits=True)
        finally:
            native._stack.head.extra = group
        assert torch.equal(native(input_ids, positions, meta, logits=True), want)


def test_a_kept_scratch_leaves_every_row_as_a_fresh_buffer_gives_it(bf16, model_dir):
    """A step's scratch from ``decode_stack_set_keep_scratch``'s size up (32 MB by default: a big
    model's step at many threads) stays with the calling thread from one call to the next
    (decode_stack.c, step_scratch). Kept for every size and filled with 0xff bytes before each use,
    it gives a big step, a smaller one after it (the buffer as the big one left it) and a middling
    one the logits that steps with a fresh buffer each give them, bit for bit: nothing reads scratch
    it did not write."""
    from engine_service.model.native import native_library
    from engine_service.model.prepacked import gemv_max_rows

    llm = LLM(str(model_dir), dtype="bfloat16", enforce_eager=True, block_size=BLOCK, kv_cache_memory=160 << 20)
    runner = llm.engine.runner
    native = NativeDecode(runner.model, runner.kv_caches)
    most = gemv_max_rows()
    sizes = [most, most // 4 + 1, 3 * most // 4]  # 64, 17, 48 with AMX tiles; 16, 5, 12 without
    lengths = [5 + (i * 7) % 40 for i in range(most)]
    seqs = _sequences(llm, lengths, seed=11)
    chunks = [_chunk(tokens, blocks, n, 1) for (tokens, blocks), n in zip(seqs, lengths, strict=True)]

    def logits(rows: int) -> torch.Tensor:
        input_ids, positions, meta, _ = runner.prepare(chunks[:rows])
        return native(input_ids, positions, meta, logits=True)

    keep = native_library().decode_stack_set_keep_scratch
    keep.restype, keep.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int]
    default, threads = keep(-1, -1), torch.get_num_threads()
    # two threads at least (an earlier test may have left one): one thread runs the step without
    # the one-region path, which is the one that takes the kept scratch
    torch.set_num_threads(max(2, threads))
    try:
        keep(1 << 62, 0)  # never kept: a fresh buffer each call
        fresh = [logits(n) for n in sizes]
        keep(0, 1)  # always kept, poisoned before each use
        kept = [logits(n) for n in sizes]
    finally:
        keep(default, 0)
        torch.set_num_threads(threads)
    assert default == 32 << 20
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh, strict=True))
    assert torch.equal(kept[1], kept[0][: sizes[1]]) and torch.equal(kept[2], kept[0][: sizes[2]])
    assert len({tuple(row.argmax(dim=-1).tolist()) for row in kept[0].split(4)}) > 1  # not one row over and over


@pytest.mark.parametrize("kind", ["int4", "bfloat16", "gguf"])
def test_greedy_steps_are_single_steps_bit_for_bit(kind, request):
    """``greedy_steps`` (``num_scheduler_steps``): five decode steps of two rows in one call give
    the tokens and the last logits that five single calls give, each fed the argmax of the one
    before, bit for bit; a call it cannot take is refused."""
    llm = _kind_llm(kind, request)
    runner = llm.engine.runner
    native = NativeDecode(runner.model, runner.kv_caches)
    seqs = _sequences(llm, [30, 17], seed=3)
    starts, steps = [30, 17], 5
    positions = torch.tensor([[p + j for p in starts] for j in range(steps)], dtype=torch.long)
    slots = torch.tensor([[blocks[(p + j) // BLOCK] * BLOCK + (p + j) % BLOCK for (_, blocks), p in zip(seqs, starts, strict=True)]
                          for j in range(steps)], dtype=torch.long)
    width = max(len(blocks) for _, blocks in seqs)
    tables = torch.tensor([blocks + [0] * (width - len(blocks)) for _, blocks in seqs], dtype=torch.long)
    ids = torch.tensor([tokens[p] for (tokens, _), p in zip(seqs, starts, strict=True)], dtype=torch.long)
    got, last = native.greedy_steps(ids, positions, slots, tables, positions + 1)
    assert got.shape == (steps, 2) and last.shape == (2, native.vocab_out)
    inputs = [list(tokens[: p + 1]) for (tokens, _), p in zip(seqs, starts, strict=True)]
    for j in range(steps):
        chunks = [_chunk(inputs[r], seqs[r][1], starts[r] + j, 1) for r in range(2)]
        input_ids, pos, meta, _ = runner.prepare(chunks)
        greedy = torch.empty(2, dtype=torch.long)
        logits = native(input_ids, pos, meta, logits=True, argmax=greedy)
        assert torch.equal(greedy, got[j]), j
        for r in range(2):
            inputs[r].append(int(greedy[r]))
    assert torch.equal(logits, last)
    with pytest.raises(ValueError, match=r"\[steps, rows\]"):
        native.greedy_steps(ids, positions[0], slots[0], tables, positions[0] + 1)
    with pytest.raises(ValueError, match="one id and block table per row"):
        native.greedy_steps(ids[:1], positions, slots, tables, positions + 1)
    with pytest.raises(RuntimeError, match="out of range"):
        native.greedy_steps(torch.tensor([native.vocab_out + 7, 1]), positions, slots, tables, positions + 1)
    with pytest.raises(RuntimeError, match="out of range"):  # no steps at all
        native.greedy_steps(ids, positions[:0], slots[:0], tables, positions[:0] + 1)


@pytest.mark.parametrize("kind", ["int4", "bfloat16", "gguf"])
def test_a_step_in_one_parallel_region_is_the_same_step_bit_for_bit(kind, request):
    """A stack runs its layers inside one parallel region, every thread doing the work between the
    products and attentions on its own copy (int4: quantizing each product's input too; a bfloat16
    step of several rows shares its SiLU out instead; ``decode_stack_set_one_region``): its logits and argmax equal those of the step that forks and
    joins the thread team for each product and each attention, bit for bit, for one row and for a
    verifying step of several rows beside another request, with every thread count from one to
    three (one thread takes the plain path); and the same whether the team meets at its own barrier
    or at libgomp's (``decode_stack_set_own_barrier``)."""
    import ctypes

    from engine_service.model.native import native_library

    llm = _kind_llm(kind, request)
    set_regions = native_library().decode_stack_set_one_region
    set_barrier = native_library().decode_stack_set_own_barrier
    for fn in (set_regions, set_barrier):
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    runner = llm.engine.runner
    native = NativeDecode(runner.model, runner.kv_caches)
    (tokens, blocks), (other, other_blocks) = _sequences(llm, [40, 23], seed=9)
    threads = torch.get_num_threads()
    try:
        for chunks in ([_chunk(other, other_blocks, 23, 1)],
                       [_chunk(tokens[:41], blocks, 40, 4, drafts=tokens[41:44]), _chunk(other, other_blocks, 23, 1)]):
            input_ids, positions, meta, _ = runner.prepare(chunks)
            got = {}
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                for regions, own in ((0, 1), (1, 1), (1, 0)):
                    assert set_regions(regions) == regions and set_barrier(own) == own
                    greedy = torch.empty(input_ids.shape[0], dtype=torch.long)
                    got[n, regions, own] = (native(input_ids, positions, meta, logits=True, argmax=greedy), greedy)
            want, want_greedy = got[1, 0, 1]
            for logits, greedy in got.values():
                assert torch.equal(logits, want) and torch.equal(greedy, want_greedy)
    finally:
        set_regions(1)
        set_barrier(1)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["int4", "bfloat16"])
def test_the_next_layers_kv_fetched_ahead_changes_no_number(kind, request):
    """One row whose context a team shares out (past 64 tokens), int4 and bfloat16: where the products
    fetch the next layer's K/V a few lines at a time and attention's tasks are each thread's own run
    (``decode_stack_set_kv_ahead``, ``kernels/kv_ahead.h``), the logits and argmax are those of the
    same step without, and of the step that forks per product, bit for bit, with one to three
    threads, after prompts of 97, 129 and 300 tokens (contexts of 98, 130 and 301: two tasks of 49,
    four of 33 and 31, four of 76 and 73). Before each call the new token's cache slot holds other
    values in every layer, so each configuration must write it itself before anyone attends over it
    (with the lists, each thread rotates its own q and the thread whose tasks hold that token writes
    its K/V). The lists are made there (the kernel's count), and not for two rows at once."""
    import ctypes

    from engine_service.model.native import native_library

    llm = request.getfixturevalue("llm" if kind == "int4" else "bf16")
    library = native_library()
    set_regions, set_ahead = library.decode_stack_set_one_region, library.decode_stack_set_kv_ahead
    set_prefetch = library.q4_gemv_set_prefetch if kind == "int4" else library.packed_gemv_set_prefetch
    for fn in (set_regions, set_ahead, set_prefetch):
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    lists = library.decode_stack_kv_ahead_lists
    lists.restype, lists.argtypes = ctypes.c_int64, []
    runner = llm.engine.runner
    native = NativeDecode(runner.model, runner.kv_caches)
    lengths = [97, 129, 300]
    seqs = _sequences(llm, lengths, seed=3)
    threads, lines = torch.get_num_threads(), set_ahead(-1)
    set_prefetch(0)  # the one-row loop that drains the lists (AMD's default), on any CPU
    try:
        for (tokens, blocks), n in zip(seqs, lengths, strict=True):
            input_ids, positions, meta, _ = runner.prepare([_chunk(tokens, blocks, n, 1)])
            slot = int(meta.slot_mapping[0])
            got = {}
            for team in (1, 2, 3):
                torch.set_num_threads(team)
                for regions, ahead in ((0, 0), (1, 0), (1, 8)):
                    assert set_regions(regions) == regions and set_ahead(ahead) == ahead
                    for cache in (c for layer in runner.kv_caches for c in layer):
                        cache.view(-1, *cache.shape[-2:])[slot] = 3.0
                    made = lists()
                    greedy = torch.empty(1, dtype=torch.long)
                    got[team, regions, ahead] = (native(input_ids, positions, meta, logits=True, argmax=greedy),
                                                 greedy)
                    # a list a layer after the first, where a team of two or more shares the step
                    assert lists() - made == (runner.model.config.num_hidden_layers - 1
                                              if team > 1 and regions and ahead else 0)
            want, want_greedy = got[1, 0, 0]
            for logits, greedy in got.values():
                assert torch.equal(logits, want) and torch.equal(greedy, want_greedy)
        # two rows: attention's tasks stay shared out one at a time, and no list is made
        (tokens, blocks), (other, other_blocks) = seqs[2], seqs[1]
        torch.set_num_threads(2)
        set_ahead(8)
        made = lists()
        native(*runner.prepare([_chunk(tokens, blocks, 300, 1), _chunk(other, other_blocks, 129, 1)])[:3],
               logits=True)
        assert lists() == made
    finally:
        set_regions(1)
        set_ahead(lines)
        set_prefetch(-1)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["int4", "bfloat16"])
def test_draft_rows_that_skip_their_prefetches_give_the_same_numbers(kind, request):
    """A verifying step (a request's last token and five drafts at context 300, as six rows, beside
    another request's one row): the rows after a draft chunk's first skip attention's prefetches
    (``paged_decode_attention_set_follower_fetch(0)``, the default), and the logits are those of
    every row prefetching, bit for bit, on one and two threads. The other request's row, whose
    blocks are its own, is not taken for a follower."""
    import ctypes

    from engine_service.model.native import native_library

    llm = request.getfixturevalue("llm" if kind == "int4" else "bf16")
    set_fetch = native_library().paged_decode_attention_set_follower_fetch
    set_fetch.restype, set_fetch.argtypes = ctypes.c_int, [ctypes.c_int]
    runner = llm.engine.runner
    native = NativeDecode(runner.model, runner.kv_caches)
    (tokens, blocks), (other, other_blocks) = _sequences(llm, [300, 129], seed=5)
    inputs = runner.prepare([_chunk(tokens[:301], blocks, 300, 6, drafts=tokens[301:306]),
                             _chunk(other, other_blocks, 129, 1)])[:3]
    assert inputs[0].shape[0] == 7
    threads = torch.get_num_threads()
    try:
        for team in (1, 2):
            torch.set_num_threads(team)
            got = {}
            for fetch in (1, 0):
                assert set_fetch(fetch) == fetch
                got[fetch] = native(*inputs, logits=True)
            assert torch.equal(got[0], got[1])
            assert torch.isfinite(got[0]).all()
    finally:
        set_fetch(0)
        torch.set_num_threads(threads)


def test_the_steps_float16_conversion_is_torchs():
    """The step writes a float16 cache (kv_cache_dtype) with a conversion of its own: bit for bit
    torch's, over normals of every magnitude, subnormals, ties, the edges of the range, infinities
    and NaN."""
    import ctypes

    from engine_service.model.native import native_library

    convert = native_library().stack_f32_to_f16
    convert.restype, convert.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([
        torch.randn(20000, generator=gen) * torch.logspace(-9, 5, 20000),
        torch.rand(20000, generator=gen) * 2**-14,  # subnormal range
        torch.arange(0, 2048, dtype=torch.float32) * 2**-25,  # every tie between subnormals
        (torch.arange(1024, 2048, dtype=torch.float32) + 0.5) * 2**-10,  # ties between normals in [1, 2)
        torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, 2**-24, 2**-25, 2**-25 * 1.0001,
                      2**-14, 2**-14 * (1 - 2**-12), float("inf"), float("-inf")]),
    ]).float()
    out = torch.empty(values.numel(), dtype=torch.int16)
    convert(values.data_ptr(), out.data_ptr(), values.numel())
    assert torch.equal(out, values.half().view(torch.int16))
    nan = torch.tensor([float("nan")])
    convert(nan.data_ptr(), out.data_ptr(), 1)
    assert torch.isnan(out[:1].view(torch.float16)).all()


def test_the_steps_argmax_picks_as_torch_does():
    """``stack_argmax``, the argmax the native step takes of its logits, against torch's on ties
    (bfloat16 logits tie often), NaN, infinities and a row of -inf."""
    import ctypes

    from engine_service.model.native import native_library

    fn = native_library().stack_argmax
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int64]
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(49152, generator=g).to(torch.bfloat16).float() for _ in range(4)]
    tied = torch.zeros(1000)
    tied[[17, 400, 999]] = 3.0
    nan = torch.randn(1000, generator=g)
    nan[[300, 600]] = float("nan")
    inf = torch.randn(1000, generator=g)
    inf[[5, 700]] = float("inf")
    rows += [tied, nan, inf, torch.full((33,), float("-inf")), torch.tensor([1.0])]
    for row in rows:
        assert fn(row.data_ptr(), row.numel()) == row.argmax().item()
    assert fn(tied.data_ptr(), 0) == -1


def test_models_it_cannot_run_are_named():
    class NotLlama(torch.nn.Module):
        pass

    assert "NotLlama is not the Llama decoder" in native_decode_unavailable(NotLlama(), [])


def test_an_unquantized_model_has_no_native_step(model_dir):
    plain = LLM(str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory=16 << 20)
    why = native_decode_unavailable(plain.engine.runner.model, plain.engine.runner.kv_caches)
    assert why.startswith("the projections are neither int4")
    with pytest.raises(ValueError, match="no native decode step"):
        NativeDecode(plain.engine.runner.model, plain.engine.runner.kv_caches)


def test_the_step_refuses_what_it_cannot_read(llm):
    runner = llm.engine.runner
    native = NativeDecode(runner.model, runner.kv_caches)
    tokens, blocks = _sequences(llm, [8], seed=2)[0]
    _, positions, meta, _ = runner.prepare([_chunk(tokens, blocks, 8, 1)])
    with pytest.raises(RuntimeError, match="out of range"):
        native(torch.tensor([runner.model.config.vocab_size + 5]), positions, meta)  # a token id past the table
    with pytest.raises(ValueError, match="int64"):
        native(torch.tensor([1], dtype=torch.int32), positions, meta)


def test_an_engine_decodes_through_it(model_dir, monkeypatch):
    """enforce_eager=False on an int4 model: every decode step takes the native call, the output is
    sensible, and a prompt decodes to the same tokens alone and in a batch (the native rows do not
    depend on the batch; the compiled step's batch-1 and batch-2+ graphs could not promise it). Its
    tokens are not compared with the eager engine's: at int4's near-ties a last-bit difference picks
    either candidate (test_a_decode_step_is_the_eager_forward_and_each_row_is_its_own bounds the
    difference itself). The native step does not depend on inductor: here torch.compile is made
    unavailable (which also spares the test its warm-up), and the engine still decodes natively."""
    import engine_service.model.decode_paths.compiled as compiled_path

    monkeypatch.setattr(compiled_path, "compile_supported", lambda device: "no compiler (the test says)")
    engine = LLM(str(model_dir), dtype="float32", quantization="int4", enforce_eager=False, block_size=BLOCK,
                 kv_cache_memory=32 << 20)
    assert engine.engine.native_decode and engine.engine.decode_mode == "native step"
    assert engine.engine.path_named("compiled") is None
    calls: list[int] = []
    logits_calls: list[bool] = []
    engine.engine.decode_path.native = _Counting(engine.engine.decode_path.native, calls, logits_calls)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    alone = engine.generate(prompts[0], params)[0].outputs[0]
    assert calls == [1] * (params.max_tokens - 1)  # every step after the prefill, one row each
    assert all(logits_calls)  # each with its logits from the same call
    assert alone.text.startswith(" Paris")
    calls.clear()
    batched = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert calls and max(calls) == 3
    assert batched[0] == alone.token_ids
    for prompt, tokens in zip(prompts[1:], batched[1:], strict=True):
        assert engine.generate(prompt, params)[0].outputs[0].token_ids == tokens


def test_an_engine_resolves_the_back_off_from_its_native_step(llm, model_dir, monkeypatch):
    """speculative_config backoff "auto" on engines with a native step: int4's verifying rows each
    cost their own integer products, so the back-off stays on; bfloat16's k + 1 rows share each
    weight load (one pass of the products' rows), so it is off; the scheduler's drafters get the
    resolved setting. A bfloat16 engine then speculates through its multi-row native step."""
    import engine_service.model.decode_paths.compiled as compiled_path
    from engine_service.model.prepacked import gemv_max_rows
    from sluice_bench.modes import describe_engine

    monkeypatch.setattr(compiled_path, "compile_supported", lambda device: "no compiler (the test says)")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    engines = {"int4": LLM(str(model_dir), dtype="float32", quantization="int4", enforce_eager=False,
                           block_size=BLOCK, kv_cache_memory=32 << 20, speculative_config=spec)}
    if gemv_max_rows() > spec["num_speculative_tokens"]:  # bfloat16's native step takes k + 1 rows
        engines["bfloat16"] = LLM(str(model_dir), dtype="bfloat16", enforce_eager=False, block_size=BLOCK,
                                  kv_cache_memory=32 << 20, speculative_config=spec)
    for engine in (e.engine for e in engines.values()):
        assert engine.decode_mode == "native step" and ", native step, " in describe_engine(engine)
        caps = engine.scheduler.config.decode
        resolved = "off" if caps.one_pass_rows >= spec["num_speculative_tokens"] + 1 else "on"
        assert resolved == ("on" if engine.quantization == "int4" else "off")
        assert engine.speculative_config.backoff == engine.scheduler.speculative_config.backoff == resolved
    if "bfloat16" in engines:
        llm = engines["bfloat16"]
        calls: list[int] = []
        llm.engine.decode_path.native = _Counting(llm.engine.decode_path.native, calls)
        text = "one two three four five six seven eight nine ten " * 3
        out = llm.generate(f"Repeat: {text}\n{text}", SamplingParams(temperature=0.0, max_tokens=24,
                                                                   ignore_eos=True))[0].outputs[0]
        stats = llm.engine.scheduler.spec_stats
        assert len(out.token_ids) == 24 and stats.num_accepted_tokens > 0
        assert max(calls) > 1  # verifying steps of several rows took the native call


def test_a_verifying_step_takes_the_native_steps_argmax(model_dir, monkeypatch):
    """An int4 engine speculating greedily: each verifying step's rows take the argmax the native
    call computed with their logits (the sampler is handed it, one per row), and the tokens are
    those of decoding without drafts (int4's native rows do not depend on the batch)."""
    import engine_service.model.decode_paths.compiled as compiled_path

    monkeypatch.setattr(compiled_path, "compile_supported", lambda device: "no compiler (the test says)")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2,
            "backoff": "off"}
    # no prefix cache: the second run prefills the prompt as the first did (a cache hit would compute
    # its last token on another path, which this engine, not deterministic, may round apart)
    llm = LLM(str(model_dir), dtype="float32", quantization="int4", enforce_eager=False, block_size=BLOCK,
              kv_cache_memory=32 << 20, speculative_config=spec, enable_prefix_caching=False)
    engine = llm.engine
    handed: list[tuple[int, int | None]] = []  # rows, argmax tokens handed
    sampler = engine.sampler

    def spy(logits, rows, **kwargs):
        argmax = kwargs.get("argmax")
        handed.append((len(rows), None if argmax is None else len(argmax)))
        return sampler(logits, rows, **kwargs)

    monkeypatch.setattr(engine, "sampler", spy)
    text = "alpha beta gamma delta epsilon zeta eta theta " * 3
    prompt, params = f"Repeat: {text}\n{text}", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    drafted = llm.generate(prompt, params)[0].outputs[0].token_ids
    verifying = [(rows, argmax) for rows, argmax in handed if rows > 1]
    assert verifying and all(argmax == rows for rows, argmax in verifying), handed
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    engine.scheduler.speculative_config = None  # requests added now decode without drafts
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == drafted


class _Counting:
    def __init__(self, native: NativeDecode, calls: list, logits_calls: list | None = None) -> None:
        self.native, self.calls, self.logits_calls = native, calls, logits_calls
        self.fuses_head, self.max_rows = native.fuses_head, native.max_rows

    def runs(self, rows: int) -> bool:
        return self.native.runs(rows)

    def __call__(self, *args, **kwargs):
        self.calls.append(args[0].shape[0])
        if self.logits_calls is not None:
            self.logits_calls.append(bool(kwargs.get("logits")))
        return self.native(*args, **kwargs)


_BARRIER_CHECK = """
import ctypes, sys
from engine_service.model.native import native_library
check = native_library().stack_team_barrier_check
check.restype, check.argtypes = ctypes.c_int64, [ctypes.c_int, ctypes.c_int64]
print(check(int(sys.argv[1]), int(sys.argv[2])))
"""


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_the_steps_barrier_holds_every_thread_until_all_arrive(threads):
    """The step's threads meet at a barrier of their own (``team_barrier.h``), not libgomp's: in
    ``stack_team_barrier_check`` each thread stores the round, meets the others, and reads every
    thread's store back, for thousands of rounds; at the first meeting of each round a thread that
    waits fetches lines meanwhile, as a product's barrier fetches the next product's. Three and four
    threads on this machine's two cores preempt each other, so waits outlast the spin and sleep on
    the futex until the last thread wakes them. In a child process, so that a lost wake-up fails the
    test instead of hanging it."""
    import subprocess
    import sys

    rounds = 20000 if threads <= 2 else 3000
    done = subprocess.run([sys.executable, "-c", _BARRIER_CHECK, str(threads), str(rounds)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0"


def test_the_barrier_check_refuses_what_it_cannot_run():
    import ctypes

    from engine_service.model.native import native_library

    check = native_library().stack_team_barrier_check
    check.restype, check.argtypes = ctypes.c_int64, [ctypes.c_int, ctypes.c_int64]
    assert check(1, 10) == 0
    assert check(0, 10) == check(65, 10) == check(2, 0) == -1
