"""The batched sampler against NumPy references: distributions (chi-square, fixed seeds, so the
tests are deterministic), exact logits processing, reproducibility, greedy, logprobs, min_tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine_service.core.request import Request
from engine_service.sampling import SamplingParams
from engine_service.sampling.logprobs import compute_logprobs
from engine_service.sampling.metadata import SamplingMetadata, seeded_uniform
from engine_service.sampling.sampler import (
    Sampler,
    _top_p,
    apply_logits_processors,
    apply_sampling_transforms,
)
from sluice_bench.sampler import benchmark_sampler

# A fixed small logit vector: distinct values, no ties, no top_p/min_p boundary hit exactly.
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 1.2, 0.3, -2.0], dtype=np.float32)
V = LOGITS.size
DRAWS = 20000


# ---------------------------------------------------------------- NumPy reference


def ref_process(logits, params, prompt, output, eos=()):
    """min_tokens, logit_bias, then repetition / frequency / presence penalties (vLLM v1 order),
    in float32 like the sampler."""
    x = np.array(logits, dtype=np.float32, copy=True)
    if len(output) < params.min_tokens:
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= set(eos)
        for t in stop:
            x[t] = -np.inf
    for t, b in (params.logit_bias or {}).items():
        x[t] = np.float32(x[t] + np.float32(b))
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=x.size).astype(np.float32)
    seen = counts > 0
    seen[np.asarray(prompt, dtype=np.int64)] = True
    rp = np.float32(params.repetition_penalty)
    if params.repetition_penalty != 1.0:
        x = np.where(seen, np.where(x > 0, x / rp, x * rp), x).astype(np.float32)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        x = x - np.float32(params.frequency_penalty) * counts
        x = x - np.float32(params.presence_penalty) * (counts > 0).astype(np.float32)
    return x.astype(np.float32)


def ref_probs(processed, params):
    """temperature, min_p, top_k, top_p (renormalised after top_k) -> final distribution."""
    x = processed.astype(np.float64) / params.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.min_p > 0:
        p[p < params.min_p * p.max()] = 0.0
    if params.top_k > 0:
        kth = np.sort(p)[::-1][min(params.top_k, p.size) - 1]
        p[p < kth] = 0.0
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        exclusive = np.cumsum(p[order]) - p[order]
        assert np.min(np.abs(exclusive - params.top_p)) > 1e-6, "test vector sits on a top_p boundary"
        drop = order[exclusive >= params.top_p]
        p[drop] = 0.0
    return p / p.sum()


def make_request(params, prompt=(0, 1), output=(), eos=(), rid="r"):
    return Request(rid, list(prompt), params, eos_token_ids=frozenset(eos), output_token_ids=list(output))


def draw_counts(params_list, logits=LOGITS, prompt=(0, 1), output=(), eos=(), sampler_seed=0):
    """One sampler call over a batch of len(params_list) identical rows -> token counts."""
    reqs = [make_request(p, prompt, output, eos, rid=str(i)) for i, p in enumerate(params_list)]
    batch = torch.tensor(np.tile(logits, (len(reqs), 1)))
    out = Sampler(logits.size, seed=sampler_seed)(batch, reqs)
    return np.bincount(np.array(out.token_ids), minlength=logits.size)


def assert_matches(counts, probs, alpha=1e-3):
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew excluded tokens: {counts} for {probs}"
    result = stats.chisquare(counts[support], probs[support] * n)
    assert result.pvalue > alpha, (result, counts, np.round(probs * n, 1))


# ---------------------------------------------------------------- distributions

METHODS = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "combined": dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
    "penalties_bias": dict(
        temperature=1.0,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias={9: 3.0, 0: -1.0},
    ),
}


@pytest.mark.slow  # thousands of draws per case
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_distribution_matches_numpy_reference(method, seeded):
    kwargs = METHODS[method]
    prompt, output = (1, 4), (2, 2, 5)
    params = [SamplingParams(seed=(1000 + i) if seeded else None, **kwargs) for i in range(DRAWS)]
    counts = draw_counts(params, prompt=prompt, output=output)
    probs = ref_probs(ref_process(LOGITS, params[0], prompt, output), params[0])
    assert_matches(counts, probs)


@pytest.mark.slow  # thousands of draws
def test_chi_square_has_power():
    """The same test rejects the untruncated distribution, so a missing top_k would be caught."""
    params = [SamplingParams(top_k=3, seed=i) for i in range(DRAWS)]
    counts = draw_counts(params)
    wrong = ref_probs(LOGITS, SamplingParams(top_k=5))
    with pytest.raises(AssertionError):
        assert_matches(counts, wrong)


def test_seeded_uniforms_are_uniform_over_seeds_and_positions():
    across = np.array([seeded_uniform(s, p) for s in range(200) for p in range(100)])
    one_seed = np.array([seeded_uniform(7, p) for p in range(DRAWS)])
    for u in (across, one_seed):
        assert u.min() >= 0.0 and u.max() < 1.0
        assert stats.kstest(u, "uniform").pvalue > 1e-3
    # consecutive positions are uncorrelated
    assert abs(np.corrcoef(one_seed[:-1], one_seed[1:])[0, 1]) < 0.03
    assert seeded_uniform(7, 3) != seeded_uniform(8, 3) and seeded_uniform(-1, 0) == seeded_uniform(-1, 0)


@pytest.mark.slow  # thousands of draws
def test_seeded_draws_at_later_positions_follow_the_distribution():
    params = SamplingParams(temperature=0.9, seed=7)
    reqs = [make_request(params, output=[3] * pos, rid=str(pos)) for pos in range(0, 2000)]
    reqs += [make_request(params.replace(seed=s), output=[3] * 5, rid=f"s{s}") for s in range(18000)]
    out = Sampler(V)(torch.tensor(np.tile(LOGITS, (len(reqs), 1))), reqs)
    counts = np.bincount(np.array(out.token_ids), minlength=V)
    assert_matches(counts, ref_probs(LOGITS, params))


# ---------------------------------------------------------------- exact processing


def _random_case(rng, vocab):
    prompt = rng.integers(0, vocab, size=rng.integers(1, 30)).tolist()
    output = rng.integers(0, vocab, size=rng.integers(0, 30)).tolist()
    output += output[: len(output) // 2]  # repeats, so counts > 1
    return prompt, output


def test_penalties_and_bias_change_logits_exactly_like_numpy():
    rng = np.random.default_rng(0)
    vocab = 64
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=0.5),
        SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0, logit_bias={3: 10.0, 7: -100.0}),
        SamplingParams(),  # untouched row in the middle of the batch
        SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.2, logit_bias={0: 1.5}),
        SamplingParams(min_tokens=5, stop_token_ids=[9], logit_bias={9: 50.0}, frequency_penalty=0.1),
    ]
    cases = [_random_case(rng, vocab) for _ in params]
    reqs = [
        make_request(p, prompt, output, eos=(1,), rid=str(i))
        for i, (p, (prompt, output)) in enumerate(zip(params, cases, strict=True))
    ]
    logits = torch.tensor(rng.normal(0, 3, size=(len(reqs), vocab)).astype(np.float32))
    before = logits.clone()
    meta = SamplingMetadata.from_requests(reqs, vocab)
    got = apply_logits_processors(logits, meta).numpy()
    assert torch.equal(logits, before), "the input logits must not be modified"
    for i, (p, (prompt, output)) in enumerate(zip(params, cases, strict=True)):
        want = ref_process(logits[i].numpy(), p, prompt, output, eos=(1,))
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6, err_msg=f"row {i}")
        if len(output) < p.min_tokens:
            assert got[i][9] == -np.inf and got[i][1] == -np.inf


def test_sampling_transforms_keep_the_reference_support():
    rng = np.random.default_rng(1)
    vocab = 200
    params = [
        SamplingParams(temperature=0.8, top_k=17),
        SamplingParams(temperature=1.1, top_p=0.7),
        SamplingParams(temperature=0.6, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.85, min_p=0.02),
        SamplingParams(temperature=1.4),
    ]
    logits = rng.normal(0, 2, size=(len(params), vocab)).astype(np.float32)
    reqs = [make_request(p, rid=str(i)) for i, p in enumerate(params)]
    meta = SamplingMetadata.from_requests(reqs, vocab)
    x = apply_sampling_transforms(torch.tensor(logits), meta).numpy()
    for i, p in enumerate(params):
        probs = ref_probs(logits[i], p)
        np.testing.assert_array_equal(np.isfinite(x[i]), probs > 0, err_msg=f"row {i}")
        kept = np.isfinite(x[i])
        scaled = logits[i].astype(np.float64) / p.temperature
        np.testing.assert_allclose(x[i][kept], (scaled - scaled.max())[kept], rtol=1e-5, atol=1e-5)


def test_top_p_candidate_ladder_matches_a_full_sort():
    """Peaked rows are solved from 512 candidates, broader ones from 4096, flat ones by a sort."""
    rng = np.random.default_rng(2)
    vocab = 6000
    scales = [8.0, 3.0, 1.0, 0.3, 0.01]  # no exact ties: their order inside top_p is arbitrary
    x = np.stack([rng.normal(0, 1, vocab) * s for s in scales]).astype(np.float32)
    top_p = torch.tensor([0.9, 0.95, 0.8, 0.5, 0.9])
    w = torch.exp(torch.tensor(x) - torch.tensor(x).max(dim=1, keepdim=True).values)
    got = torch.log(_top_p(w, top_p)).numpy()
    for i in range(len(scales)):
        p = np.exp(x[i].astype(np.float64) - x[i].max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        exclusive = np.cumsum(p[order]) - p[order]
        keep = np.zeros(vocab, bool)
        keep[order[exclusive < float(top_p[i])]] = True
        # float32 vs float64 cumsum may disagree on the one token at the boundary
        assert np.sum(np.isfinite(got[i]) != keep) <= 1, i
        kept = np.isfinite(got[i])
        np.testing.assert_allclose(got[i][kept], (x[i] - x[i].max())[kept], atol=1e-5)


# ---------------------------------------------------------------- greedy


def test_temperature_zero_is_argmax_bit_exact():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(33, 1000, generator=g).to(dtype)
        reqs = [make_request(SamplingParams(temperature=0.0), rid=str(i)) for i in range(33)]
        out = Sampler(1000)(logits, reqs)
        assert out.token_ids == logits.float().argmax(dim=1).tolist()
        assert out.logprobs == [None] * 33


def test_a_given_argmax_is_taken_only_where_every_row_is_plain_greedy():
    """The native step hands the sampler each row's argmax with the logits: an all-greedy batch
    without processing or logprobs takes those tokens (given tokens that are not the argmax here, to
    see which were taken); a batch with a penalised, a random or a logprobs row computes its own."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=g)
    given = ((logits.argmax(dim=1) + 1) % 50).tolist()
    greedy = [make_request(SamplingParams(temperature=0.0), rid=str(i)) for i in range(3)]
    assert Sampler(50)(logits, greedy, argmax=given).token_ids == given
    assert Sampler(50)(logits, greedy).token_ids == logits.argmax(dim=1).tolist()
    for other in (SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.8, seed=1),
                  SamplingParams(temperature=0.0, logprobs=2)):
        batch = greedy[:2] + [make_request(other, rid="x")]
        out = Sampler(50)(logits, batch, argmax=given).token_ids
        assert out[:2] == logits[:2].argmax(dim=1).tolist()
    with pytest.raises(ValueError, match="argmax"):
        Sampler(50)(logits, greedy, argmax=given[:2])


def test_greedy_rows_in_a_mixed_batch_are_argmax_of_processed_logits():
    g = torch.Generator().manual_seed(4)
    vocab = 300
    logits = torch.randn(6, vocab, generator=g)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),
    ]
    argmax = logits.argmax(dim=1)
    reqs = [make_request(p, prompt=[int(argmax[4])], rid=str(i)) for i, p in enumerate(params)]
    tokens = Sampler(vocab)(logits, reqs).token_ids
    assert tokens[0] == argmax[0] and tokens[5] == argmax[5]
    assert tokens[2] == 5
    want4 = ref_process(logits[4].numpy(), params[4], reqs[4].prompt_token_ids, []).argmax()
    assert tokens[4] == want4


# ---------------------------------------------------------------- reproducibility


def fake_model(requests, vocab=500):
    """Deterministic logits from each request's tokens (a stand-in for the model)."""
    rows = []
    for r in requests:
        g = torch.Generator().manual_seed(hash(tuple(r.all_token_ids[-3:])) % (2**31) + r.num_tokens)
        rows.append(torch.randn(vocab, generator=g) * 3)
    return torch.stack(rows)


def generate(requests, sampler, steps, target):
    """Run ``steps`` decode steps for all ``requests``; return the tokens of ``target``."""
    for _ in range(steps):
        out = sampler(fake_model(requests), requests)
        for r, t in zip(requests, out.token_ids, strict=True):
            r.append_output_token(t)
    return list(target.output_token_ids)


SEEDED = dict(temperature=1.0, top_p=0.95, top_k=100, seed=1234, repetition_penalty=1.1)


def others(n, salt):
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0.8, top_p=0.5, presence_penalty=1.0),
        SamplingParams(temperature=1.0, seed=99 + salt),
        SamplingParams(temperature=0.5, min_p=0.1, logit_bias={1: 5.0}),
    ]
    return [make_request(kinds[(i + salt) % len(kinds)], prompt=[i, salt], rid=f"o{i}") for i in range(n)]


def test_seeded_request_is_independent_of_batch_composition():
    alone = make_request(SamplingParams(**SEEDED), prompt=[5, 6, 7])
    want = generate([alone], Sampler(500, seed=0), 12, alone)
    for n_others, position, sampler_seed in [(3, 0, 1), (7, 4, 2), (10, 10, 3)]:
        target = make_request(SamplingParams(**SEEDED), prompt=[5, 6, 7])
        batch = others(n_others, salt=n_others)
        batch.insert(position, target)
        got = generate(batch, Sampler(500, seed=sampler_seed), 12, target)
        assert got == want, (n_others, position)


def test_seeded_request_survives_preemption_and_a_fresh_engine():
    ref = make_request(SamplingParams(**SEEDED), prompt=[1, 2])
    want = generate([ref], Sampler(500), 16, ref)
    # First half in one engine, in a crowd; then "preempted" and resumed in a fresh sampler (a
    # restarted engine) with a different crowd: the already generated tokens are kept.
    req = make_request(SamplingParams(**SEEDED), prompt=[1, 2])
    generate([*others(4, 1), req], Sampler(500, seed=5), 8, req)
    got = generate([req, *others(2, 2)], Sampler(500, seed=6), 8, req)
    assert got == want
    # Re-sampling the same position gives the same token (what a recompute would see).
    again = make_request(SamplingParams(**SEEDED), prompt=[1, 2], output=want[:5])
    assert Sampler(500)(fake_model([again]), [again]).token_ids == [want[5]]


def test_n_children_with_seed_differ_but_are_reproducible():
    parent = SamplingParams(temperature=1.0, seed=5, n=4)
    runs = []
    for _ in range(2):
        kids = [make_request(parent.for_child(i), prompt=[3, 3], rid=str(i)) for i in range(4)]
        generate(kids, Sampler(500), 6, kids[0])
        runs.append([k.output_token_ids for k in kids])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) > 1


def test_unseeded_requests_follow_the_sampler_seed():
    def run(seed):
        reqs = [make_request(SamplingParams(temperature=1.0), rid=str(i)) for i in range(8)]
        return generate(reqs, Sampler(500, seed=seed), 5, reqs[0])

    assert run(11) == run(11)
    assert run(11) != run(12)


# ---------------------------------------------------------------- min_tokens / stopping


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab = 20
    logits = torch.full((1, vocab), -5.0)
    logits[0, 3] = 10.0  # EOS would win
    logits[0, 4] = 9.0  # then the stop token
    eos = (3,)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    s = Sampler(vocab)
    for pos, want in [(0, lambda t: t not in (3, 4)), (1, lambda t: t not in (3, 4)), (2, lambda t: t == 3)]:
        r = make_request(params, output=[7] * pos, eos=eos)
        tok = s(logits, [r]).token_ids[0]
        assert want(tok), (pos, tok)
    # ignore_eos: EOS is an ordinary token, stop ids are still held back until min_tokens
    r = make_request(params.replace(ignore_eos=True), output=[7], eos=eos)
    assert s(logits, [r]).token_ids[0] == 3
    r = make_request(params.replace(ignore_eos=True, min_tokens=1), eos=eos)
    logits2 = logits.clone()
    logits2[0, 3] = -10.0
    assert s(logits2, [r]).token_ids[0] not in (3, 4)
    # sampled (not greedy) too: never an EOS before min_tokens
    rs = [
        make_request(SamplingParams(min_tokens=3, seed=i), output=[1], eos=eos, rid=str(i))
        for i in range(200)
    ]
    toks = s(logits.repeat(200, 1), rs).token_ids
    assert 3 not in toks


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_the_raw_log_softmax_with_ranks():
    g = torch.Generator().manual_seed(8)
    vocab = 400
    logits = torch.randn(5, vocab, generator=g) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, top_k=10, logprobs=20, repetition_penalty=1.5, seed=2),
        SamplingParams(temperature=1.0),  # no logprobs
        SamplingParams(temperature=1.5, top_p=0.9, logprobs=0, logit_bias={7: 30.0}),
        SamplingParams(temperature=1.0, presence_penalty=2.0, logprobs=3),
    ]
    reqs = [make_request(p, prompt=[1, 2, 3], output=[4, 4], rid=str(i)) for i, p in enumerate(params)]
    out = Sampler(vocab)(logits.to(torch.bfloat16), reqs)
    ref = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    assert out.logprobs[2] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        d = out.logprobs[i]
        tok = out.token_ids[i]
        assert next(iter(d)) == tok, "the chosen token comes first"
        assert abs(d[tok].logprob - float(ref[i, tok])) < 1e-5
        assert d[tok].rank == int((ref[i] > ref[i, tok]).sum()) + 1
        top = torch.topk(ref[i], p.logprobs)
        for rank, (val, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            assert abs(d[tid].logprob - val) < 1e-5
            assert d[tid].rank == rank
        assert len(d) in (p.logprobs, p.logprobs + 1)
    assert out.token_ids[3] == 7  # the bias moved the sample, not the reported logprobs
    assert out.logprobs[3][7].logprob == pytest.approx(float(ref[3, 7]), abs=1e-5)


def test_compute_logprobs_for_prompt_tokens():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(7, 50, generator=g)
    targets = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    got = compute_logprobs(logits, targets, num_top=2)
    ref = torch.log_softmax(logits, dim=-1)
    for i, d in enumerate(got):
        tok = int(targets[i])
        assert list(d)[0] == tok
        assert d[tok].logprob == pytest.approx(float(ref[i, tok]), abs=1e-6)
        assert d[tok].rank == int((ref[i] > ref[i, tok]).sum()) + 1
        best = int(ref[i].argmax())
        assert d[best].rank == 1
    assert compute_logprobs(logits[:0], targets[:0], 3) == []


# ---------------------------------------------------------------- misc


def test_shape_mismatch_is_refused_and_empty_batch_is_fine():
    s = Sampler(10)
    with pytest.raises(ValueError):
        s(torch.zeros(2, 10), [make_request(SamplingParams())])
    assert s(torch.zeros(0, 10), []).token_ids == []


def test_benchmark_helper_runs():
    ms = benchmark_sampler(batch_size=8, vocab=1000, steps=2, warmup=1, prompt_len=8, output_len=4)
    assert ms > 0
    ms = benchmark_sampler(batch_size=8, vocab_size=500, steps=1, warmup=0, logprobs=3, clock="cpu")
    assert ms >= 0


def test_input_logits_are_not_modified_and_workspace_is_reused():
    g = torch.Generator().manual_seed(10)
    vocab = 700
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05, logit_bias={3: 4.0}),
        SamplingParams(temperature=1.2, top_k=5, seed=3, repetition_penalty=1.2),
    ]
    reqs = [make_request(p, prompt=[1, 2, 3], output=[3, 4], rid=str(i)) for i, p in enumerate(params)]
    s = Sampler(vocab)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(4, vocab, generator=g) * 3).to(dtype)
        before = logits.clone()
        first = s(logits, reqs).token_ids
        assert torch.equal(logits, before)
        # same rows again in another order: seeded and greedy rows give the same tokens
        again = s(logits[[3, 1, 0, 2]], [reqs[3], reqs[1], reqs[0], reqs[2]]).token_ids
        assert (again[0], again[1], again[2]) == (first[3], first[1], first[0])
    with pytest.raises(ValueError):
        s(torch.zeros(4, vocab + 1), reqs)


@pytest.mark.parametrize("changes, outputs", [
    ({}, 0), ({"temperature": 0.5}, 0), ({"temperature": 0.5, "seed": 2}, 0), ({"logprobs": 0}, 0),
    ({"logit_bias": {3: 2.0}}, 0), ({"presence_penalty": 0.1}, 0), ({"frequency_penalty": -0.2}, 0),
    ({"repetition_penalty": 1.1}, 0), ({"min_tokens": 2}, 1), ({"min_tokens": 2}, 2), ({"min_tokens": 2}, 3),
    ({"min_tokens": 2, "ignore_eos": True}, 0), ({"structured_outputs": {"json_object": True}}, 0),
])
def test_decodes_by_argmax_is_what_the_sampler_leaves_greedy_and_unprocessed(changes, outputs):
    """``SamplingParams.decodes_by_argmax``, which lets the scheduler run several greedy steps
    without the sampler (``num_scheduler_steps``), promises no more than the sampler's metadata
    grants: a greedy row, unprocessed, without logprobs. min_tokens with nothing to mask (EOS
    ignored, no stop ids) is still refused: the promise may be narrower, never wider."""
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **changes})
    req = make_request(params, output=tuple(range(10, 10 + outputs)), eos=(1,))
    meta = Sampler(len(LOGITS)).metadata([req])
    plain = meta.greedy_rows == [0] and not meta.needs_processing and meta.num_logprobs == [None]
    if params.decodes_by_argmax(outputs):
        assert plain
    expected = not changes or (changes == {"min_tokens": 2} and outputs >= 2)
    assert params.decodes_by_argmax(outputs) is expected
