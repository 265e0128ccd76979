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

Compiling is ``sluice.structured.Vocabulary``'s, the gateway's check too: the same resource limits
(``GRAMMAR_LIMITS``) and the same walk to the constraint's shortest completion, so what would fail
here was refused at the door; a failure that still comes (a limit hit on a path the walk did not
take) ends that sequence alone, with the grammar engine's first line as the error
(``structured_error``) and the ``invalid_request`` code.

**The token budget.** Each constrained sequence knows how many tokens it may still emit (up to
``max_tokens`` and the context's end) and what its constraint needs at least to end: the shortest
completion from its matcher's state (``Vocabulary.shortest_completion``). Far from the end that is
re-walked every ``PLAN_EVERY`` tokens; within ``WATCH`` tokens of it, every step. When what is left
no longer exceeds what is needed, the sequence is steered: its mask allows only the completion's
next token, to the end (EOS included where the grammar needs it), so the output parses with
``finish_reason`` "stop". One sampled token can raise what is needed by more than one (a member
name whose value has required members of its own): after each free token the completion is walked
again, and a token after which it no longer fits is replaced by the previous completion's first
token (``accept`` returns the token kept), which always fits.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from sluice.structured import GrammarEngineError, StructuredOutputsParams, Vocabulary

logger = logging.getLogger(__name__)

WATCH = 16  # within this many tokens of what the constraint needs, its completion is walked each step
PLAN_EVERY = 16  # farther away, every this many tokens


@dataclass
class _Sequence:
    matcher: object  # llguidance.LLMatcher
    key: tuple[str, str]
    num_consumed: int = 0
    plan: list[int] | None = None  # the shortest completion from the state after num_consumed tokens
    plan_at: int = -1  # num_consumed when ``plan`` was walked
    forced: list[int] | None = None  # steering: the completion's tokens still to emit, in order


def _remaining(request, max_model_len: int | None) -> int:
    """Tokens ``request`` may still emit: up to max_tokens and to the end of the context."""
    left = []
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        left.append(max_tokens - request.num_output_tokens)
    if max_model_len is not None:
        left.append(max_model_len - request.num_tokens)
    return min(left) if left else 1 << 30


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
                 cache_size: int = 128, max_model_len: int | None = None) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self._vocabulary: Vocabulary | None = None  # built on first use (~1 s)
        # steer constrained sequences to end within their token budget (off: the masks alone;
        # ``sluice bench structured`` compares the two)
        self.budget_steering = True
        self.steered = 0  # sequences whose end was forced by the token budget
        self.replaced = 0  # sampled tokens replaced because the constraint would no longer fit
        self.walk_seconds = 0.0  # time spent walking completions (the steering's own cost)
        self._templates: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cache_size = cache_size
        self._sequences: dict[str, _Sequence] = {}
        self.cache_hits = 0
        self.cache_misses = 0

    # ------------------------------------------------------------------ compile
    def vocabulary(self) -> Vocabulary:
        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self._tokenizer_json, self.vocab_size, self.eos_token_ids)
        return self._vocabulary

    def _template(self, params: StructuredOutputsParams):
        key = params.key
        template = self._templates.get(key)
        if template is not None:
            self._templates.move_to_end(key)
            self.cache_hits += 1
            return template
        template = self.vocabulary().matcher(params)  # raises StructuredOutputError naming the parameter
        self.cache_misses += 1
        self._templates[key] = template
        while len(self._templates) > self._cache_size:
            self._templates.popitem(last=False)
        return template

    def check(self, params: StructuredOutputsParams, max_tokens: int | None = None) -> int:
        """The door's check (``Vocabulary.check``, as the gateway's): compile (or find in the
        cache) ``params``'s grammar and walk its shortest completion; returns its length in tokens.
        Raises ``StructuredOutputError`` (``ConstraintBudgetError`` when it cannot end within
        ``max_tokens``)."""
        self._template(params)
        return self.vocabulary().check(params, max_tokens)

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
        seq.plan, seq.plan_at, seq.forced = None, -1, None
        for token in request.output_token_ids:
            if not seq.matcher.consume_token(token):
                break
            seq.num_consumed += 1
        return seq

    # ------------------------------------------------------------------ per step
    def _walk(self, seq: _Sequence, budget: int) -> list[int] | None:
        """The shortest completion from ``seq``'s state (None: none within what the budget could
        hold, or the grammar engine failed on the way: then no steering, and a failure on the
        sampled path ends the sequence through ``accept``)."""
        started = time.perf_counter()
        try:
            seq.plan = self.vocabulary().shortest_completion(seq.matcher, max_bytes=min(4096, 32 * max(budget, 1)))
        except GrammarEngineError:
            seq.plan = None
        self.walk_seconds += time.perf_counter() - started
        seq.plan_at = seq.num_consumed
        return seq.plan

    def _steer(self, seq: _Sequence, request) -> None:
        """Walk the completion when due; force it when what is left no longer exceeds it."""
        left = _remaining(request, self.max_model_len)
        need = len(seq.plan) if seq.plan is not None else None
        due = seq.plan_at != seq.num_consumed and (
            seq.plan_at < 0 or seq.num_consumed - seq.plan_at >= PLAN_EVERY
            or (need is not None and left <= need + WATCH))
        if due:
            self._walk(seq, left)
        if seq.plan is not None and seq.plan_at == seq.num_consumed and len(seq.plan) >= left:
            seq.forced = list(seq.plan)
            self.steered += 1

    def apply_bitmask(self, logits: torch.Tensor, requests: list) -> int:
        """Mask the logits of the constrained rows in place; returns how many rows were masked.
        A steered row allows only its completion's next token."""
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
            if self.budget_steering and seq.forced is None and not seq.matcher.is_stopped():
                self._steer(seq, req)
            rows.append(i)
            seqs.append(seq)
        if not rows:
            return 0
        import llguidance.torch as lgt

        bitmask = torch.full(((len(rows)), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for j, seq in enumerate(seqs):
            if seq.forced:
                token = seq.forced[0]
                bit = 1 << (token % 32)
                bitmask[j] = 0
                bitmask[j, token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32's bit pattern
            else:
                lgt.fill_next_token_bitmask(seq.matcher, bitmask, j)
        apply_token_bitmask(logits, rows, bitmask)
        return len(rows)

    def accept(self, request, token: int) -> int:
        """Advance ``request``'s matcher by its sampled ``token``; mark the request when the
        grammar is complete (``structured_done``) or failed (``structured_error``). Returns the
        token kept: ``token``, or the completion's first token where ``token`` would leave the
        constraint unable to end within the budget (see the module's docstring)."""
        seq = self._sequences.get(request.request_id)
        if seq is None:
            return token
        matcher = seq.matcher
        if matcher.is_stopped():
            request.structured_done = True
            return token
        if seq.forced:
            token = seq.forced.pop(0)  # the mask allowed nothing else
        elif self.budget_steering and seq.plan is not None and seq.plan_at == seq.num_consumed:
            token = self._keep_within_budget(seq, request, token)
        if not matcher.consume_token(token):
            request.structured_error = (
                f"the output constraint failed at output token {request.num_output_tokens}: "
                f"{self._first_line(matcher.get_error()) or f'token {token} does not follow it'}")
            return token
        seq.num_consumed += 1
        if matcher.is_stopped():
            request.structured_done = True
        return token

    def _keep_within_budget(self, seq: _Sequence, request, token: int) -> int:
        """``token``, unless the completion from after it no longer fits in what is left after it:
        then the current completion's first token (and the rest of it is forced)."""
        left = _remaining(request, self.max_model_len)
        plan = seq.plan
        if left > len(plan) + WATCH:
            return token
        if token == plan[0]:  # the model follows the completion: its rest fits, no walk needed
            seq.plan, seq.plan_at = plan[1:], seq.num_consumed + 1
            return token
        started = time.perf_counter()
        probe = seq.matcher.deep_copy()
        after = None
        if probe.consume_token(token):
            try:
                after = self.vocabulary().shortest_completion(probe, max_bytes=min(4096, 32 * max(left, 1)))
            except GrammarEngineError:
                after = None
        self.walk_seconds += time.perf_counter() - started
        if after is not None and len(after) <= left - 1:
            seq.plan, seq.plan_at = after, seq.num_consumed + 1  # the next step's walk, done
            return token
        self.replaced += 1
        self.steered += 1
        seq.forced = plan[1:]
        return plan[0]

    @staticmethod
    def _first_line(message: str) -> str:
        return message.strip().splitlines()[0][:300] if message.strip() else ""
