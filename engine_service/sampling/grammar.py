"""Grammar-constrained decoding: one llguidance matcher per sequence, a bitmask per step.

Lifecycle (driven by ``LLMEngine``):

* ``add`` when a sequence enters the engine: the request's constraint is compiled (checked again
  here: the engine never trusts the queue) against the model's vocabulary, cached by its key, and
  the sequence gets its own matcher (``n > 1``: one per completion), a deep copy of the cached
  one, so llguidance's lazily built lexer states are shared and stay warm;
* ``apply_bitmask`` each step, before the sampler, on the step's logits: only the constrained
  rows are touched (a batch with none costs nothing and unconstrained rows are never modified);
* ``accept`` for every sampled token: the matcher advances; when the grammar is complete the
  sequence is marked so the stopping rules end it (the grammar allows nothing but EOS then);
* ``free`` when a sequence finishes or is aborted.

A preemption (recompute) keeps a sequence's tokens, so its matcher stays valid; every step checks
that the matcher has consumed exactly the sequence's output tokens and rebuilds it from them when
not (a recompute path that replays or drops tokens can never leave a stale matcher behind).

EOS is allowed exactly where the grammar may end (llguidance sets the EOS bits of the mask only
in accepting states).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from sluice.structured import StructuredOutputError, StructuredOutputsParams

logger = logging.getLogger(__name__)



@dataclass
class _Sequence:
    matcher: object  # llguidance.LLMatcher
    key: tuple[str, str]
    num_consumed: int = 0


@torch.inference_mode()
def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to ``-inf`` (in place) the logits of ``rows`` whose token's bit is 0 in ``bitmask``
    (int32 [len(rows), ceil(V/32)], llguidance's layout: token t is bit t % 32 of word t // 32).

    On CPU the bits are unpacked and applied with NumPy, single-threaded: a handful of rows is
    too little work for torch's intra-op threads, whose start-up dominated (tens of ms on a busy
    2-core machine against well under 1 ms in NumPy)."""
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        x = logits.numpy()
        for j, row in enumerate(rows):
            np.putmask(x[row], bits[j] == 0, -np.inf)
        return
    allowed = torch.from_numpy(bits).to(logits.device).bool()
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


class GrammarManager:
    """The matchers of one engine, keyed by sequence (request) id."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = 128) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lltokenizer = None  # built on first use (~0.5 s)
        self._templates: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cache_size = cache_size
        self._sequences: dict[str, _Sequence] = {}
        self.cache_hits = 0
        self.cache_misses = 0

    # ------------------------------------------------------------------ compile
    def _tokenizer(self):
        if self._lltokenizer is None:
            import llguidance

            self._lltokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._lltokenizer

    def _template(self, params: StructuredOutputsParams):
        key = params.key
        template = self._templates.get(key)
        if template is not None:
            self._templates.move_to_end(key)
            self.cache_hits += 1
            return template
        import llguidance

        grammar = params.to_grammar()  # raises StructuredOutputError naming the parameter
        template = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise StructuredOutputError(
                f"structured_outputs.{params.kind} does not compile: {template.get_error()}",
                f"structured_outputs.{params.kind}",
            )
        self.cache_misses += 1
        self._templates[key] = template
        while len(self._templates) > self._cache_size:
            self._templates.popitem(last=False)
        return template

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile (or find in the cache) ``params``'s grammar; raise ``StructuredOutputError``."""
        self._template(params)

    # ------------------------------------------------------------------ lifecycle
    def add(self, request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        template = self._template(params)
        self._sequences[request.request_id] = _Sequence(template.deep_copy(), params.key)
        if request.output_token_ids:  # a sequence that already has tokens (a restart)
            self._rebuild(request)

    def free(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)

    @property
    def num_active(self) -> int:
        return len(self._sequences)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._sequences

    def _rebuild(self, request) -> _Sequence:
        seq = self._sequences[request.request_id]
        seq.matcher = self._templates[seq.key].deep_copy() if seq.key in self._templates else \
            self._template(request.sampling_params.structured_outputs).deep_copy()
        seq.num_consumed = 0
        for token in request.output_token_ids:
            if not seq.matcher.consume_token(token):
                break
            seq.num_consumed += 1
        return seq

    # ------------------------------------------------------------------ per step
    def apply_bitmask(self, logits: torch.Tensor, requests: list) -> int:
        """Mask the logits of the constrained rows in place; returns how many rows were masked."""
        if not self._sequences:
            return 0
        rows: list[int] = []
        seqs: list[_Sequence] = []
        for i, req in enumerate(requests):
            seq = self._sequences.get(req.request_id)
            if seq is None:
                continue
            if seq.num_consumed != len(req.output_token_ids):  # recomputed or replayed: rebuild
                seq = self._rebuild(req)
            rows.append(i)
            seqs.append(seq)
        if not rows:
            return 0
        import llguidance.torch as lgt

        bitmask = torch.full(((len(rows)), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for j, seq in enumerate(seqs):
            lgt.fill_next_token_bitmask(seq.matcher, bitmask, j)
        apply_token_bitmask(logits, rows, bitmask)
        return len(rows)

    def accept(self, request, token: int) -> None:
        """Advance ``request``'s matcher by its sampled ``token``; mark the request when the
        grammar is complete (``structured_done``) or the token was refused (``structured_error``)."""
        seq = self._sequences.get(request.request_id)
        if seq is None:
            return
        matcher = seq.matcher
        if matcher.is_stopped():
            request.structured_done = True
            return
        if not matcher.consume_token(token):
            request.structured_error = f"the sampled token {token} does not follow the grammar: {matcher.get_error()}"
            return
        seq.num_consumed += 1
        if matcher.is_stopped():
            request.structured_done = True
