"""Presence, frequency and repetition penalties over a batch, as vLLM defines them.

- repetition (over prompt AND generated tokens): a seen token's logit is divided by the penalty
  when positive and multiplied by it otherwise;
- frequency: ``logit -= frequency_penalty * count`` (count of the token among the generated ones);
- presence: ``logit -= presence_penalty * (count > 0)``.

They are applied in that order (vLLM's ``apply_penalties``), only to the rows that use them, with
the token counts built by one scatter per step. The token ids of each request are kept in a
per-request cache that grows by the new tokens only, so a step never rebuilds long Python lists.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


class _GrowingIds:
    """An int64 CPU buffer mirroring a Python list of token ids that only grows."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.long)
        self.n = 0

    def sync(self, ids: list[int]) -> torch.Tensor:
        m = len(ids)
        if m < self.n:  # the list was replaced or shortened: start over
            self.n = 0
        if m > self.n:
            if m > self.buf.numel():
                new = torch.empty(max(m, 2 * self.buf.numel(), 16), dtype=torch.long)
                new[: self.n] = self.buf[: self.n]
                self.buf = new
            self.buf[self.n : m] = torch.tensor(ids[self.n : m], dtype=torch.long)
            self.n = m
        return self.buf[:m]


class TokenIdCache:
    """Per-request CPU tensors of prompt and output token ids, dropped with the request."""

    def __init__(self) -> None:
        self._prompt: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._output: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def prompt(self, request) -> torch.Tensor:
        t = self._prompt.get(request)
        if t is None or t.numel() != len(request.prompt_token_ids):
            t = torch.tensor(request.prompt_token_ids, dtype=torch.long)
            self._prompt[request] = t
        return t

    def output(self, request) -> torch.Tensor:
        g = self._output.get(request)
        if g is None:
            g = self._output[request] = _GrowingIds()
        return g.sync(request.output_token_ids)


@dataclass
class PenaltyBatch:
    """The penalised rows of a batch and the token ids their penalties look at."""

    rows: torch.Tensor  # [P] row indices into the batch
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P]
    repetition: torch.Tensor  # [P]
    output_rows: torch.Tensor  # [T_out] index into 0..P-1, one per generated token
    output_tokens: torch.Tensor  # [T_out]
    prompt_rows: torch.Tensor | None  # [T_prompt] (only rows with a repetition penalty)
    prompt_tokens: torch.Tensor | None
    any_repetition: bool
    any_additive: bool  # some presence or frequency penalty is non-zero

    @classmethod
    def build(
        cls,
        rows: list[int],
        presence: list[float],
        frequency: list[float],
        repetition: list[float],
        output_ids: list[torch.Tensor],
        prompt_ids: list[torch.Tensor | None],
        device: torch.device,
    ) -> PenaltyBatch:
        n = len(rows)
        out_lens = torch.tensor([t.numel() for t in output_ids], dtype=torch.long)
        output_tokens = torch.cat(output_ids) if output_ids else torch.empty(0, dtype=torch.long)
        output_rows = torch.repeat_interleave(torch.arange(n), out_lens)
        any_repetition = any(r != 1.0 for r in repetition)
        prompt_rows = prompt_tokens = None
        if any_repetition:
            pieces = [p if p is not None else torch.empty(0, dtype=torch.long) for p in prompt_ids]
            lens = torch.tensor([p.numel() for p in pieces], dtype=torch.long)
            prompt_tokens = torch.cat(pieces).to(device)
            prompt_rows = torch.repeat_interleave(torch.arange(n), lens).to(device)
        return cls(
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            presence=torch.tensor(presence, dtype=torch.float32, device=device),
            frequency=torch.tensor(frequency, dtype=torch.float32, device=device),
            repetition=torch.tensor(repetition, dtype=torch.float32, device=device),
            output_rows=output_rows.to(device),
            output_tokens=output_tokens.to(device),
            prompt_rows=prompt_rows,
            prompt_tokens=prompt_tokens,
            any_repetition=any_repetition,
            any_additive=any(p != 0.0 for p in presence) or any(f != 0.0 for f in frequency),
        )


def apply_penalties(
    logits: torch.Tensor, batch: PenaltyBatch, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply the penalties to ``logits`` ([B, V] float32, contiguous) in place; returns it.
    ``rows`` overrides ``batch.rows`` (where the penalised rows sit in ``logits``).

    Sparse: only the (row, token) pairs that occur in a prompt or an output are read and written,
    so the cost follows the number of tokens, not rows x vocabulary."""
    vocab = logits.shape[1]
    rows = batch.rows if rows is None else rows
    device = logits.device
    keys = [rows[batch.output_rows] * vocab + batch.output_tokens]
    from_output = [torch.ones(batch.output_tokens.numel(), dtype=torch.float32, device=device)]
    if batch.any_repetition and batch.prompt_tokens is not None and batch.prompt_tokens.numel():
        keys.append(rows[batch.prompt_rows] * vocab + batch.prompt_tokens)
        from_output.append(torch.zeros(batch.prompt_tokens.numel(), dtype=torch.float32, device=device))
    all_keys = torch.cat(keys)
    if all_keys.numel() == 0:
        return logits
    uniq, inverse = torch.unique(all_keys, return_inverse=True)
    counts = torch.zeros(uniq.numel(), dtype=torch.float32, device=device)
    counts.index_add_(0, inverse, torch.cat(from_output))  # occurrences among the generated tokens
    # Per pair, the index of its penalised row (0..P-1) to read that row's penalties.
    lut = torch.full((logits.shape[0],), -1, dtype=torch.long, device=device)
    lut[rows] = torch.arange(rows.numel(), device=device)
    which = lut[torch.div(uniq, vocab, rounding_mode="floor")]
    flat = logits.view(-1)
    vals = flat[uniq]
    if batch.any_repetition:
        # Every pair is in the prompt or the output: "seen" for the repetition penalty.
        rp = batch.repetition[which]
        vals = torch.where(vals > 0, vals / rp, vals * rp)
    if batch.any_additive:
        vals = vals - batch.frequency[which] * counts - batch.presence[which] * (counts > 0).float()
    flat[uniq] = vals
    return logits
