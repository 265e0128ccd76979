"""Verifying drafted tokens (speculative decoding) with the ordinary sampler.

A request with k drafts has k + 1 logits rows: row j is the model's distribution after its known
tokens and its first j drafts. Each row is sampled as the request would be sampled at that output
position (``DraftPosition``: the request seen with its first j drafts appended), by the same
sampler and the same uniform (a seeded request's is a pure function of seed and position), and
the drafts are kept while each equals the token sampled before it; the first token sampled that
differs (or the one after the last draft, the bonus) ends the chunk.

This *is* rejection sampling for a draft that is one token with certainty (an n-gram lookup, q
one-hot): the draft x is accepted with probability p(x), min(1, p(x) / q(x)); on rejection the
token comes from p with x removed and renormalised, (p - q)+ normalised. Sampling from p and
comparing with x gives exactly that joint law, and more: the tokens are the ones decoding
without drafts would have sampled from the same uniforms, so greedy requests and seeded requests
produce the same tokens with or without speculation, and unseeded ones the same distribution.
Penalties, ``min_tokens`` and ``logit_bias`` see each position's own history (the drafts before
it), and logprobs are those of each position's row. Requests with a grammar never draft (the
scheduler's choice, ``engine_service.core.scheduler``).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_service.core.request import Request


class DraftPosition:
    """``request`` as it will be if its first ``j`` drafts are accepted: what the sampler's
    metadata reads (parameters, prompt, outputs and their count, EOS ids, id)."""

    def __init__(self, request: Request, drafts: Sequence[int]) -> None:
        self.request = request
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.prompt_token_ids = request.prompt_token_ids
        self.eos_token_ids = request.eos_token_ids
        self.output_token_ids = request.output_token_ids + list(drafts)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def expand_rows(requests: Sequence[Request], counts: Sequence[int], drafts: dict[str, list[int]]) -> list:
    """One entry per logits row: the request itself for its first row, then a ``DraftPosition``
    per draft."""
    rows: list = []
    for req, count in zip(requests, counts, strict=True):
        rows.append(req)
        if count > 1:
            d = drafts[req.request_id]
            rows.extend(DraftPosition(req, d[:j]) for j in range(1, count))
    return rows


def num_accepted(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts are kept: each while it equals the token sampled at its position."""
    a = 0
    for token, draft in zip(sampled, drafts, strict=False):
        if token != draft:
            break
        a += 1
    return a
