"""Logprobs as OpenAI reports them: ``log_softmax`` of the model's raw logits (float32), before any
penalty, bias, temperature or truncation; the given token's logprob and 1-based rank, plus the
``num_top`` most likely tokens."""

from __future__ import annotations

import torch

from engine_service.core.request import Logprob


def logprob_dicts(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[dict[int, Logprob]]:
    """``logits``: [N, V] float32 raw logits; ``token_ids``: [N]; ``num_top``: per row, how many
    alternatives to add. Returns one dict per row, the given token first.

    ``log_softmax(x) = x - logsumexp(x)`` is a per-row shift, so ranks and the top N are read from
    the logits and only the chosen and top values are shifted: no [N, V] logprob tensor is built."""
    token_ids = token_ids.to(device=logits.device, dtype=torch.long)
    lse = torch.logsumexp(logits, dim=1, keepdim=True)  # [N, 1]
    chosen_logit = logits.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logits > chosen_logit).sum(dim=1, dtype=torch.int32) + 1  # int32: ~2x faster on CPU
    max_top = min(max(num_top, default=0), logits.shape[1])
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_top > 0:
        vals, ids = logits.topk(max_top, dim=1)
        top_vals, top_ids = (vals - lse).tolist(), ids.tolist()
    chosen_l = (chosen_logit - lse).squeeze(1).tolist()
    ranks_l = ranks.tolist()
    tokens_l = token_ids.tolist()
    out: list[dict[int, Logprob]] = []
    for i, tok in enumerate(tokens_l):
        d: dict[int, Logprob] = {tok: Logprob(logprob=chosen_l[i], rank=ranks_l[i])}
        for j in range(min(num_top[i], max_top)):
            tid = top_ids[i][j]
            if tid not in d:
                d[tid] = Logprob(logprob=top_vals[i][j], rank=j + 1)
        out.append(d)
    return out


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | list[int], num_top: int | None
) -> list[dict[int, Logprob]]:
    """For each row of ``logits`` ([N, V], any float dtype, computed in float32): the logprob and
    rank of ``token_ids[row]`` plus the top ``num_top`` alternatives (used for prompt logprobs)."""
    if logits.shape[0] == 0:
        return []
    if not torch.is_tensor(token_ids):
        token_ids = torch.tensor(token_ids, dtype=torch.long)
    return logprob_dicts(logits.float(), token_ids, [num_top or 0] * logits.shape[0])
