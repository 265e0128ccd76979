"""A stub model for benchmarks of the serving path: the model's cost taken out (issue 25, item 4).

``StubModel`` stands where ``LlamaForCausalLM`` stands (``ModelRunner`` calls the same three
things: ``forward``, ``compute_logits`` and ``rotary.ensure_positions``), reads no weight and
computes nothing per layer. Its logits are fixed: the row of position ``p`` favours the token at
``(p + 1) % len(STUB_TOKENS)`` of a fixed English passage (ordinary words, punctuation and a few
multi-byte characters, so the gateway's incremental detokenizer does its usual work), every other
token at 0 — greedy decoding writes that passage over and over, the same for every request at the
same position, in any batch. A request ends at its ``max_tokens`` (the passage holds no EOS).

Everything around it is real: the scheduler, the runner's step layout, the sampler (which reads
a full ``[rows, vocab]`` logits tensor, as with a model), the Redis I/O and the gateways.

It is never a model a user can serve: the engine builds it only for ``--stub-model`` (hidden from
``--help``), and only when ``$SLUICE_BENCH_STUB_MODEL`` is ``1`` (the benches that need it set it
for the engines they start; ``check_bench_mode``). Its architecture is in no registry: a
``config.json`` cannot name it. The served name ends in ``-stub``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

BENCH_ENV = "SLUICE_BENCH_STUB_MODEL"
FAVOURED_LOGIT = 30.0  # every other token 0: e^-30 of the favoured one's weight, even when sampled

# What the stub "writes": encoded once by the model's own tokenizer. Ordinary words, digits,
# punctuation, newlines, and multi-byte characters (é, —, ü, ½) that byte-level tokens split.
STUB_PASSAGE = (
    "The river kept its own time. Each morning the ferry crossed at seven, carried twelve "
    "passengers and one bicycle, and came back empty — except on market days, when the café "
    "owner brought crates of pears, 3½ kilos each, to the Müller sisters.\n"
    "Nobody remembered who had built the pier; the planks were new, the posts were old, and the "
    "gulls did not care either way. "
)


class StubModelRefused(RuntimeError):
    """The stub was asked for outside a benchmark."""


def check_bench_mode() -> None:
    """Raise ``StubModelRefused`` unless the process runs for a benchmark (``$SLUICE_BENCH_STUB_MODEL=1``)."""
    if os.environ.get(BENCH_ENV) != "1":
        raise StubModelRefused(
            f"--stub-model is for benchmarks of the serving path only (it generates a fixed text, "
            f"not a model's); the benches that use it set {BENCH_ENV}=1 for the engines they start")


class _NoRotary:
    """The runner grows the real model's rotary tables before a step; the stub has none."""

    def ensure_positions(self, n: int) -> None:
        pass


class StubModel(nn.Module):
    def __init__(self, vocab_size: int, token_ids: list[int]) -> None:
        super().__init__()
        if not token_ids:
            raise ValueError("the stub model needs at least one token to favour")
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise ValueError("the stub model's tokens must lie in the vocabulary")
        self.vocab_size = vocab_size
        self.rotary = _NoRotary()
        self._tokens = torch.tensor(token_ids, dtype=torch.long)
        # Logits buffers reused across steps: one per compute_logits call of a step (the sample
        # rows, then any prompt-logprob rows), each with the entries it set last time (reset
        # before the next use). The sampler never modifies its input logits.
        self._buffers: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._call = 0

    @classmethod
    def for_tokenizer(cls, vocab_size: int, tokenizer) -> StubModel:
        ids = tokenizer.encode(STUB_PASSAGE, add_special_tokens=False)
        return cls(vocab_size, [t for t in ids if t not in set(tokenizer.eos_token_ids)])

    def favoured(self, positions: torch.Tensor) -> torch.Tensor:
        """The token each position's logits favour: the passage's token after position ``p``."""
        return self._tokens[(positions.long() + 1) % self._tokens.numel()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        """The "hidden states" are the positions: all ``compute_logits`` needs."""
        self._call = 0
        return positions

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        index = self._call
        self._call += 1
        if index == len(self._buffers):
            self._buffers.append((torch.zeros(0, self.vocab_size), None))
        buf, hot = self._buffers[index]
        if buf.shape[0] < rows:
            buf, hot = torch.zeros(max(rows, 2 * buf.shape[0]), self.vocab_size), None
        elif hot is not None:
            buf[hot[0], hot[1]] = 0.0
        favoured = self.favoured(hidden)
        where = (torch.arange(rows), favoured)
        buf[where] = FAVOURED_LOGIT
        self._buffers[index] = (buf, where)
        return buf[:rows]


def stub_kv_cache(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A KV "cache" that holds nothing: the runner reads only its number of blocks."""
    empty = torch.empty(num_blocks, 0)
    return [(empty, empty)]
