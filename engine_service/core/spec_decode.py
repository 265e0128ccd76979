"""Speculative decoding with n-gram prompt lookup (vLLM's ``method: "ngram"``): the configuration,
the per-request drafter and its back-off, and the counters.

A request drafts from its own tokens: an earlier occurrence of its last ``n`` tokens (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``) in prompt + output, and the up to
``num_speculative_tokens`` tokens that followed it there. Which occurrence: the nearest one at or
just after the copy cursor, where the last draft's source left off, when there is one; else the
most recent. Near the cursor a single token is match enough (see ``NgramDrafter``). The
scheduler forwards the request's last token and the drafts as one chunk; the engine samples every position and keeps the drafts up to
the first one the model would not have produced, plus the model's own token at that position.

Torch-free: the scheduler (``engine_service.core``) imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_service.config import SpeculativeConfig

__all__ = ["NgramDrafter", "SpecDecodeStats", "SpeculativeConfig"]

# A request whose drafts keep failing skips drafting for 1, 2, 4, ... up to this many decode steps.
MAX_BACKOFF_STEPS = 64

# How far past the copy cursor an occurrence may end and still count as the copy going on: a few
# tokens the model inserted or tokenized differently (a line break where the source had a space).
COPY_WINDOW = 8


class NgramDrafter:
    """One request's drafter: an index of its n-grams and its back-off.

    The index maps, per size n, each n-gram to the end of its most recent occurrence (the position
    of the token that followed it). It grows by the new tokens only: O(sizes) dictionary updates
    per token, never a rescan of the sequence, and tokens only ever grow (a preemption keeps them),
    so the index survives preemption. An occurrence ending at the last token is the suffix itself,
    so the index stops one position short of the end when it is looked up.

    The copy cursor: a model that edits or copies a passage walks through it, so after a draft from
    the occurrence ending at ``e`` with ``a`` tokens accepted, the model's next tokens most likely
    continue the passage at ``e + a + 1`` (the model's own token took the place of the source's
    token at ``e + a``). The next lookup first tries, for each ``n`` from the longest down to 1, the
    nearest occurrence ending within ``COPY_WINDOW`` tokens at or after that cursor, and only then
    the index's most recent one (sizes ``prompt_lookup_min`` and up). Why: the most recent
    occurrence of a short n-gram (" the", a line break) is often elsewhere in the passage, and
    after a reworded token no n-gram of ``prompt_lookup_min`` matches at all, while the passage
    goes on right after the cursor. Replayed on the grounded bench's greedy outputs it keeps
    more tokens a step (docs/performance.md, eighth round). It only changes what is drafted,
    never what is kept: outputs stay plain decoding's.
    """

    __slots__ = ("sizes", "max_k", "backs_off", "_index", "_indexed", "k_next", "_skip", "_backoff", "_cursor",
                 "_source")

    def __init__(self, config: SpeculativeConfig) -> None:
        self.sizes = tuple(range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1))  # longest first
        self.max_k = config.num_speculative_tokens
        self.backs_off = config.backoff != "off"  # the engine resolves "auto" before requests arrive
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # ends < this are in the index
        self.k_next = config.num_speculative_tokens  # drafts to offer next (the back-off's state)
        self._skip = 0  # decode steps left without drafting
        self._backoff = 1  # the next skip after a draft with nothing accepted
        self._cursor: int | None = None  # where the copy goes on (set by observe)
        self._source: int | None = None  # the end of the occurrence the last proposal came from

    def _extend(self, tokens: list[int], upto: int) -> None:
        index = self._index
        for end in range(max(self._indexed, 1), upto):
            for n in self.sizes:
                if end >= n:
                    index[n][tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, upto)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(limit, k_next)`` tokens that followed an earlier occurrence of the longest
        matching suffix of ``tokens``: the nearest after the copy cursor, else the most recent; []
        when backing off or nothing matches."""
        self._source = None
        if self._skip > 0:
            self._skip -= 1
            return []
        limit = min(limit, self.k_next)
        if limit <= 0:
            return []
        length = len(tokens)
        self._extend(tokens, length)  # every end < length: earlier occurrences only
        index = self._index
        cursor, lo = self._cursor, self.sizes[-1]
        for n in range(min(self.sizes[0], length), 0, -1):
            suffix = tokens[length - n:]
            end = None
            if cursor is not None:
                for e in range(max(cursor, n), min(cursor + COPY_WINDOW, length - 1) + 1):
                    if tokens[e - n:e] == suffix:
                        end = e
                        break
            if end is None and n >= lo:
                end = index[n].get(tuple(suffix))
            if end is not None:
                self._source = end
                return tokens[end:end + limit]
        return []

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Back-off: after a draft of ``num_drafted`` with ``num_accepted`` kept, offer one more
        than what was kept (all kept: twice as many, up to k); nothing kept: skip 1, 2, 4, ... decode
        steps (up to ``MAX_BACKOFF_STEPS``) before drafting one token again, so a request whose
        text does not repeat itself costs next to nothing. With the back-off off, every draft
        offers k. Either way the copy cursor moves past the accepted tokens of the last proposal's
        source."""
        if num_drafted > 0 and self._source is not None:
            self._cursor = self._source + num_accepted + 1
        if num_drafted <= 0 or not self.backs_off:
            return
        if num_accepted == 0:
            self.k_next = 1
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, MAX_BACKOFF_STEPS)
            return
        self._backoff = 1
        if num_accepted >= num_drafted:
            self.k_next = min(self.max_k, max(self.k_next, 2 * num_drafted))
        else:
            self.k_next = min(self.max_k, num_accepted + 1)


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: drafts (verification chunks), drafted and accepted tokens, and
    accepted tokens per draft position (position 0: the first draft token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for j in range(num_accepted):
            per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step, the model's own token included: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length}
