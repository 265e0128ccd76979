"""Paging is invisible: block tables, chunk boundaries and block-aligned lengths never change logits."""

from __future__ import annotations

import pytest
import torch

from engine_service.core.request import Request
from engine_service.core.sampling_params import SamplingParams
from engine_service.model.config import ModelConfig
from engine_service.model.kv_cache import allocate_kv_cache
from engine_service.model.loader import load_model
from engine_service.model.runner import ModelRunner
from sluice.text.tokenizer import Tokenizer
from tests.model_helpers import Chunk

pytestmark = pytest.mark.model
BLOCK = 4
ATOL = 5e-4  # different chunkings change GEMM shapes: float32 noise is ~6e-5 here


@pytest.fixture(scope="module")
def setup(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    return cfg, model, tok


def make_runner(setup, num_blocks=64):
    cfg, model, _ = setup
    kv = allocate_kv_cache(cfg, num_blocks, BLOCK, torch.float32, torch.device("cpu"))
    return ModelRunner(model, kv, BLOCK, torch.device("cpu"))


def request(tokens, blocks):
    req = Request("r", list(tokens), SamplingParams(max_tokens=8))
    req.block_ids = list(blocks)
    return req


def all_position_logits(runner, chunks):
    hidden, _ = runner.forward_hidden(chunks)
    return runner.model.compute_logits(hidden)


def test_random_block_tables_match_contiguous(setup):
    _, _, tok = setup
    tokens = tok.encode("Paged attention keeps each sequence in fixed-size blocks scattered over the pool.")
    n_blocks = -(-len(tokens) // BLOCK)
    contiguous = all_position_logits(make_runner(setup), [Chunk(request(tokens, range(n_blocks)), 0, len(tokens))])
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        blocks = torch.randperm(64, generator=gen)[:n_blocks].tolist()
        runner = make_runner(setup)
        # Garbage in unused blocks must not leak into attention.
        for k, v in runner.kv_caches:
            k.normal_(generator=gen)
            v.normal_(generator=gen)
        got = all_position_logits(runner, [Chunk(request(tokens, blocks), 0, len(tokens))])
        torch.testing.assert_close(got, contiguous, atol=ATOL, rtol=0)


def test_every_chunked_prefill_split_point(setup):
    _, _, tok = setup
    tokens = tok.encode("Chunked prefill splits a long prompt over several steps of the scheduler.")
    n = len(tokens)
    n_blocks = -(-n // BLOCK)
    reference = all_position_logits(make_runner(setup), [Chunk(request(tokens, range(n_blocks)), 0, n)])
    blocks = list(range(40, 40 - n_blocks, -1))  # reversed, non-contiguous order
    for split in range(1, n):
        runner = make_runner(setup)
        req = request(tokens, blocks)
        first = all_position_logits(runner, [Chunk(req, 0, split)])
        second = all_position_logits(runner, [Chunk(req, split, n - split)])
        got = torch.cat([first, second])
        torch.testing.assert_close(got, reference, atol=ATOL, rtol=0, msg=f"split at {split}")


@pytest.mark.parametrize("length", [BLOCK * 3, BLOCK * 5 + 1, BLOCK * 5 - 1])
def test_decode_after_prefill_matches_one_pass(setup, length):
    """Block-aligned lengths (and one either side): prefill all but the last token, then decode it."""
    _, _, tok = setup
    tokens = tok.encode("one two three four five six seven eight nine ten eleven twelve thirteen " * 2)[:length]
    assert len(tokens) == length
    n_blocks = -(-length // BLOCK)
    reference = all_position_logits(make_runner(setup), [Chunk(request(tokens, range(n_blocks)), 0, length)])
    runner = make_runner(setup)
    req = request(tokens, range(10, 10 + n_blocks))
    all_position_logits(runner, [Chunk(req, 0, length - 1)])
    decoded = all_position_logits(runner, [Chunk(req, length - 1, 1)])
    torch.testing.assert_close(decoded[0], reference[-1], atol=ATOL, rtol=0)


def test_mixed_batch_equals_separate_runs(setup):
    """Decodes, a fresh prefill and a continued prefill in one flattened forward."""
    _, _, tok = setup
    texts = ["Alpha beta gamma delta epsilon", "The quick brown fox jumps over the lazy dog", "Hello there"]
    seqs = [tok.encode(t) for t in texts]
    refs = []
    for s in seqs:
        nb = -(-len(s) // BLOCK)
        refs.append(all_position_logits(make_runner(setup), [Chunk(request(s, range(nb)), 0, len(s))]))
    runner = make_runner(setup)
    reqs = []
    next_block = 0
    for s in seqs:
        nb = -(-len(s) // BLOCK)
        reqs.append(request(s, range(next_block, next_block + nb)))
        next_block += nb
    # Warm-up: seq0 has all but its last token cached; seq1 has its first 3 tokens cached.
    all_position_logits(runner, [Chunk(reqs[0], 0, len(seqs[0]) - 1), Chunk(reqs[1], 0, 3)])
    chunks = [
        Chunk(reqs[0], len(seqs[0]) - 1, 1),  # decode
        Chunk(reqs[1], 3, len(seqs[1]) - 3),  # continued prefill
        Chunk(reqs[2], 0, len(seqs[2])),  # fresh prefill
    ]
    got = all_position_logits(runner, chunks)
    torch.testing.assert_close(got[0], refs[0][-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1 : 1 + len(seqs[1]) - 3], refs[1][3:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[len(seqs[1]) - 2 :], refs[2], atol=ATOL, rtol=0)
