"""The sparse sampling paths (the default) give the same tokens as the dense reference pipeline,
row for row, on batches of every kind, and leave the input logits untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from engine_service.core.request import Request
from engine_service.sampling import SamplingParams
from engine_service.sampling.sampler import Sampler, chunk_maxima, fast_argmax

KINDS = [
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=1.3, top_p=0.99),
    dict(temperature=1.0, top_k=50, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    dict(temperature=1.0, top_k=40, min_p=0.05),
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.0, top_k=1),
    dict(temperature=2.0, min_p=0.1),
    dict(temperature=1.0, min_p=0.3, top_k=200),
    dict(temperature=1.0),  # temperature only: dense path
    dict(temperature=0.9, top_k=20, top_p=0.8),  # both: dense path
    dict(temperature=0.0, repetition_penalty=1.3, logit_bias={5: 3.0}),
    dict(temperature=1.0, top_k=5000),  # above the sparse limit: dense path
    dict(temperature=0.6, top_p=0.95, logit_bias={7: 5.0, 11: -100.0}, min_tokens=3),
]


def _logits(rows: int, vocab: int, gen: torch.Generator, shape: str) -> torch.Tensor:
    if shape == "zipf":
        ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
        perm = torch.argsort(torch.rand(rows, vocab, generator=gen), dim=1)
        return -1.2 * torch.log(ranks)[perm] + 0.1 * torch.randn(rows, vocab, generator=gen)
    if shape == "flat":  # spread-out distributions: top_p needs many tokens
        return 0.05 * torch.randn(rows, vocab, generator=gen)
    if shape == "ties":  # heavy ties: quantised logits
        return torch.randint(-4, 3, (rows, vocab), generator=gen).float()
    return 3.0 * torch.randn(rows, vocab, generator=gen)


def _batch(vocab: int, rows: int, gen: torch.Generator, seeded: bool) -> list[Request]:
    requests = []
    for i in range(rows):
        kind = dict(KINDS[int(torch.randint(len(KINDS), (1,), generator=gen))])
        if seeded and kind["temperature"] > 0 and i % 2:
            kind["seed"] = i
        prompt = torch.randint(0, vocab, (6,), generator=gen).tolist()
        out = torch.randint(0, vocab, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen).tolist()
        kind = {k: v for k, v in kind.items() if not (k == "logit_bias" and max(v) >= vocab)}
        requests.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=None, **kind), output_token_ids=out,
                                eos_token_ids=frozenset({0})))
    return requests


@pytest.mark.parametrize(("vocab", "shape"), [
    (v, s) for v in (10, 100, 1000, 4099) for s in ("zipf", "flat", "ties", "normal")
] + [pytest.param(49152, s, marks=pytest.mark.slow) for s in ("zipf", "flat")])  # the full vocabulary: seconds
def test_sparse_equals_dense_reference(vocab, shape):
    gen = torch.Generator().manual_seed(vocab * 7 + len(shape))
    rows = 24 if vocab >= 4099 else 48
    for trial in range(3):
        requests = _batch(vocab, rows, gen, seeded=trial > 0)
        logits = _logits(rows, vocab, gen, shape)
        before = logits.clone()
        sparse = Sampler(vocab, seed=trial)(logits, requests)
        assert torch.equal(logits, before), "the input logits were modified"
        dense = Sampler(vocab, seed=trial)(logits, copy.deepcopy(requests), dense=True)
        assert sparse.token_ids == dense.token_ids, (vocab, shape, trial)


def test_sparse_keeps_bf16_and_logprobs_paths():
    gen = torch.Generator().manual_seed(3)
    vocab = 3000
    requests = _batch(vocab, 16, gen, seeded=True)
    for r in requests[::3]:
        r.sampling_params = r.sampling_params.replace(logprobs=2)
    logits = _logits(16, vocab, gen, "zipf").bfloat16()
    a = Sampler(vocab, seed=1)(logits, requests)
    b = Sampler(vocab, seed=1)(logits, copy.deepcopy(requests), dense=True)
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs


@pytest.mark.parametrize("vocab", [1, 7, 64, 65, 1000, 49152])
def test_fast_argmax_is_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 3, (37, vocab), generator=gen).float()  # many ties: the first one wins
    x[5] = float("-inf")
    if vocab > 3:
        x[6, 2] = float("nan")
    assert torch.equal(fast_argmax(x), x.argmax(dim=1))
    assert chunk_maxima(x).shape == (37, -(-vocab // 64))


def test_greedy_only_batch_skips_the_transforms():
    vocab = 500
    gen = torch.Generator().manual_seed(0)
    requests = [Request(f"g{i}", [1, 2], SamplingParams(temperature=0.0, max_tokens=None)) for i in range(9)]
    logits = torch.randn(9, vocab, generator=gen)
    sampler = Sampler(vocab)
    out = sampler(logits, requests)
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert sampler._workspace is None  # no working copy was ever made
