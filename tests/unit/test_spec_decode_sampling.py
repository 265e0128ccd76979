"""Verification of drafts at the sampler level (engine_service.sampling.speculative): on a tiny
controlled distribution, accepting a one-hot draft x happens with probability p(x), a rejected
position draws from p with x removed and renormalised, and the tokens kept follow the model's
distribution at every position (chi-square); a seeded request keeps the very tokens it samples
without drafts, penalties included (each position sees its own history)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine_service.core.request import Request
from engine_service.sampling import SamplingParams
from engine_service.sampling.sampler import Sampler
from engine_service.sampling.speculative import expand_rows, num_accepted

V = 6
ROW0 = np.array([1.2, 0.3, -0.5, 0.9, -1.0, 0.0], dtype=np.float32)  # after the known tokens
ROW1 = np.array([-0.2, 1.0, 0.4, -0.7, 0.6, 0.1], dtype=np.float32)  # after the draft x
X, Y = 3, 4  # the drafts: x (p0(x) ~ 0.26), then y
DRAWS = 6000


def probs(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    p = np.exp((logits.astype(np.float64) - logits.max()) / temperature)
    return p / p.sum()


def verify(params: list[SamplingParams], sampler_seed: int = 0) -> list[list[int]]:
    """Each request drafts [X, Y]; its three rows are ROW0, ROW1, ROW0. Returns the kept tokens."""
    reqs = [Request(str(i), [0, 1], p) for i, p in enumerate(params)]
    rows = expand_rows(reqs, [3] * len(reqs), {r.request_id: [X, Y] for r in reqs})
    logits = torch.tensor(np.tile(np.stack([ROW0, ROW1, ROW0]), (len(reqs), 1)))
    out = Sampler(V, seed=sampler_seed)(logits, rows).token_ids
    kept = []
    for i in range(len(reqs)):
        tokens = out[3 * i : 3 * i + 3]
        kept.append(tokens[: num_accepted(tokens, [X, Y]) + 1])
    return kept


def chi2(counts: np.ndarray, p: np.ndarray) -> float:
    support = p > 0
    assert counts[~support].sum() == 0, counts
    expected = p[support].astype(np.float64)
    return stats.chisquare(counts[support], expected / expected.sum() * counts.sum()).pvalue


@pytest.mark.slow  # thousands of draws
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_rejection_sampling_of_a_one_hot_draft_keeps_the_model_distribution(seeded):
    temperature = 0.9
    params = [SamplingParams(temperature=temperature, seed=(7000 + i) if seeded else None) for i in range(DRAWS)]
    kept = verify(params)
    p0, p1 = probs(ROW0, temperature), probs(ROW1, temperature)
    first = np.bincount([k[0] for k in kept], minlength=V)
    assert chi2(first, p0) > 1e-3  # the first token follows p0, drafts or not
    accepted = np.array([k[0] == X for k in kept])
    # x is accepted with probability p0(x) (a binomial test)
    assert stats.binomtest(int(accepted.sum()), DRAWS, p0[X]).pvalue > 1e-3
    # rejected: p0 with x removed, renormalised
    rejected = np.bincount([k[0] for k in kept if k[0] != X], minlength=V)
    residual = p0.copy()
    residual[X] = 0
    assert chi2(rejected, residual / residual.sum()) > 1e-3
    # after an accepted x, the next token follows p1
    second = np.bincount([k[1] for k in kept if len(k) > 1], minlength=V)
    assert chi2(second, p1) > 1e-3
    # the check has power: the residual is not p0 itself
    assert chi2(rejected, p0) < 1e-3


def test_a_seeded_request_keeps_the_tokens_it_samples_without_drafts():
    """Verification samples each position with the uniform of (seed, position), the one plain
    decoding uses: accepting or not, the kept tokens are plain decoding's."""
    params = [SamplingParams(temperature=1.0, seed=100 + i, repetition_penalty=1.4, frequency_penalty=0.3)
              for i in range(300)]
    kept = verify(params)
    sampler = Sampler(V, seed=123)  # a different generator: seeded rows do not use it
    logits = [ROW0, ROW1, ROW0]
    for i, p in enumerate(params):
        req = Request(str(i), [0, 1], p)
        plain = []
        for j in range(len(kept[i])):
            # plain decoding: one position at a time, the outputs so far seen by the penalties
            token = sampler(torch.tensor(logits[j][None, :]), [req]).token_ids[0]
            plain.append(token)
            req.append_output_token(token)
        assert kept[i] == plain, i
    assert any(len(k) > 1 for k in kept) and any(len(k) == 1 for k in kept)


def test_greedy_verification_is_argmax_at_every_position():
    kept = verify([SamplingParams(temperature=0.0)])[0]
    assert kept == [int(np.argmax(ROW0))]  # argmax ROW0 is 0, not the draft 3: nothing accepted
    reqs = [Request("a", [0], SamplingParams(temperature=0.0))]
    rows = expand_rows(reqs, [3], {"a": [0, 1]})
    logits = torch.tensor(np.stack([ROW0, ROW1, ROW0]))
    tokens = Sampler(V)(logits, rows).token_ids
    assert tokens == [0, 1, 0] and num_accepted(tokens, [0, 1]) == 2  # both drafts and the bonus
