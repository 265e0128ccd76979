"""The continuous-batching scheduler: each step it decides who runs, and on which KV blocks.

One step (token budget B = ``max_num_batched_tokens``, slots S = ``max_num_seqs``):

1. Running requests first, oldest admission first: each gets its next token (decode) or its next
   prefill chunk, growing its block table as needed. When the pool cannot grow it, the youngest
   running request is preempted by recompute (blocks freed, tokens kept, back to the front of the
   waiting queue), possibly the request itself; the oldest running request is never preempted, so
   it always finishes.
2. Then, unless something was preempted this step, waiting and preempted requests are admitted in
   order (strict FIFO: the head blocks the rest) while budget and slots remain, reusing the blocks of
   their longest cached prefix and prefilling in chunks when a prompt exceeds the remaining budget.
   With several tenants (``Request.tenant``) the order is fair share's (``fair_share``): each tenant
   keeps its own FIFO queue, the head of the tenant with the least virtual time (tokens forwarded
   / weight) goes next, and that head blocks the rest; preemption takes its victim from the tenant
   furthest over its slot share (its youngest request not yet scheduled this step, never the
   oldest running request), and when every slot is taken, a tenant under its share may take one
   slot of the tenant furthest over it at the start of a step. With one tenant, steps 1 and 2 are
   exactly as above.
3. Watermark: admission keeps ``watermark_blocks`` free; growth ignores it. The watermark may delay a
   request, never exclude it: ``reserve = watermark_blocks if need <= admissible_blocks else 0``,
   where ``need`` is what the request's whole known sequence (prompt, plus outputs when it is
   re-admitted after a preemption) takes from the free pool, its cache hits counted, and
   ``admissible_blocks = total - watermark_blocks`` is what the watermark lets admission use of an
   idle pool. Only the first chunk's blocks are allocated at admission.
4. A step costs about what a fresh prefill of B tokens costs, whatever the prompts' lengths
   (``_cut_chunk``). Attention makes a prefill chunk's work grow with what precedes it: a chunk of
   c tokens after s computed ones attends, through a mask, to c * (s + c) query-key pairs
   (``attention_pairs``; a fresh chunk, causal from 0, to c * (c + 1) / 2), so B tokens at offset
   6,000 cost many times the attention of the prompt's first B. A step's prefill chunks together
   attend to at most B * (B + 1) / 2 pairs (``SchedulerConfig.max_num_batched_pairs``), what one
   fresh prefill of B tokens does and fresh prompts never exceed (their chunks sum to at most B
   tokens), so a long prompt's later chunks shrink as its context grows. And a chunk
   whose prompt logprobs are wanted counts two tokens per token: each of its rows also computes
   and scores logits over the whole vocabulary. Decodes (one token) are not cut. A chunk cut to
   nothing still gets one token when it is the step's first, so the oldest request always moves.
5. The door (``add_request``): a request whose prompt plus max_tokens exceeds ``max_model_len``, or
   whose KV could never fit the empty pool, is refused with ``RequestRejected``. Passing it is a
   promise to run it.

Contract with the engine: ``schedule()`` advances ``num_computed_tokens`` of every scheduled request
by its chunk and registers the blocks those chunks fill in the prefix cache, so the engine must
forward every chunk of a ``SchedulerOutput`` (the KV of every scheduled token is written before any
attention reads it in that layer); apply aborts between steps, or between ``schedule()`` and
``update_from_output()`` as long as the forward still runs the aborted request's chunk.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine_service.config import SchedulerConfig, check_num_scheduler_steps
from engine_service.core.block_pool import ROOT_HASH, BlockPool, blocks_for_length, hash_block_tokens
from engine_service.core.fair_share import ROW_COST, FairShare, FairView
from engine_service.core.request import FinishReason, Request, RequestStatus
from engine_service.core.scheduler_stats import SchedulerStats
from engine_service.core.spec_decode import NgramDrafter, SpecDecodeStats
from engine_service.core.stopping import check_stop
from sluice.wire import limits, tenants
from sluice.wire.error_codes import Code

__all__ = [
    "RequestRejected",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]


def attention_pairs(start: int, num_tokens: int) -> int:
    """The query-key pairs a prefill chunk of ``num_tokens`` after ``start`` computed tokens costs:
    causal from 0 when nothing precedes it, else every query against every key through a mask (what
    the model's attention computes for each case)."""
    if start == 0:
        return num_tokens * (num_tokens + 1) // 2
    return num_tokens * (start + num_tokens)


def _tenant_problem(request: Request) -> limits.Problem | None:
    """The tenant rules (``sluice.wire.tenants``), at the door too: a weight below 1 would divide
    by zero in the fair share, an id outside the alphabet would become a metric label."""
    if problem := tenants.check_tenant_id(request.tenant):
        return limits.invalid("tenant", problem)
    if problem := tenants.check_weight(request.tenant_weight):
        return limits.invalid("tenant_weight", problem)
    return None


class RequestRejected(ValueError):
    """Refused at the door. ``code`` (``sluice.wire.error_codes.Code``): ``CONTEXT_LENGTH_EXCEEDED`` |
    ``KV_CACHE_TOO_SMALL`` | ``INVALID_REQUEST``; the message says which limit and by how much."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int  # request.num_computed_tokens before this step
    num_tokens: int  # forward request.all_token_ids[start:start+num_tokens] this step
    # request.num_tokens when scheduled (-1: read it live), so ``samples`` keeps its answer after
    # update_from_output has appended the sampled token
    num_known_tokens: int = -1
    # speculative decoding: the tokens drafted after the request's last one (``num_tokens`` counts
    # them); the engine samples every position of the chunk (``num_sample_rows``) and keeps the
    # drafts up to the first the model would not have produced
    draft_token_ids: list[int] | None = None
    # greedy decode steps this chunk runs (``num_scheduler_steps``): a one-token decode whose KV slots
    # reach num_steps tokens; each step's input is the step before's argmax, and the engine returns
    # the num_steps tokens
    num_steps: int = 1

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids) if self.draft_token_ids else 0

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens: the engine samples for it."""
        known = self.num_known_tokens if self.num_known_tokens >= 0 else self.request.num_tokens
        return self.start + self.num_tokens - self.num_draft_tokens == known

    @property
    def token_ids(self) -> list[int]:
        known = self.request.all_token_ids[self.start : self.start + self.num_tokens - self.num_draft_tokens]
        return known + self.draft_token_ids if self.draft_token_ids else known


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # running requests first, then newly admitted
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # tokens the chunks' extra decode steps forward beyond num_batched_tokens (num_scheduler_steps)
    num_step_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class _State:
    """The scheduler's private bookkeeping for one unfinished request."""

    __slots__ = ("block_hashes", "num_registered", "high_water", "thrash_target", "max_kv_tokens", "drafter",
                 "drafts_in_flight")

    def __init__(self, max_kv_tokens: int, drafter: NgramDrafter | None = None) -> None:
        self.block_hashes: list[int] = []  # chained hashes of the request's full blocks, computed lazily
        self.num_registered = 0  # leading blocks of block_ids already offered to the prefix cache
        self.high_water = 0  # most tokens ever computed (re-forwarding below it is recompute)
        self.thrash_target = 0  # an eviction before num_computed_tokens reaches this is a thrash
        self.max_kv_tokens = max_kv_tokens  # the most tokens it will ever forward (the door's figure)
        self.drafter = drafter  # n-gram speculation, for the requests that speculate
        self.drafts_in_flight = 0  # drafts scheduled and not yet verified (computed beyond the tokens)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        watermark_blocks: int | None = None,
    ) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(config, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be at least 1, got {getattr(config, name)}")
        self.config = config
        self.clock = clock
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        pairs = config.max_num_batched_pairs
        if pairs is not None and pairs < 0:
            raise ValueError(f"SchedulerConfig.max_num_batched_pairs must be >= 0 (0: no limit), got {pairs}")
        budget = config.max_num_batched_tokens
        self.max_num_batched_pairs = (attention_pairs(0, budget) if pairs is None
                                      else pairs or 1 << 62)  # 0, no limit: a bound no step reaches
        wm = config.resolved_watermark_blocks() if watermark_blocks is None else watermark_blocks
        if wm < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {wm}")
        self.watermark_blocks = wm
        self.enable_prefix_caching = config.enable_prefix_caching
        self.block_pool = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        # the waiting requests, one FIFO queue per active tenant (fair_share.TenantShare.waiting)
        self._fair = FairShare()
        self.fair_share_preemption = config.fair_share_preemption
        self._running: list[Request] = []  # in admission order: [0] is the oldest
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._state: dict[str, _State] = {}
        self._stats = SchedulerStats()
        self._num_preempted_waiting = 0  # waiting requests that were preempted (a subset of the waiting)
        self._idle_violation: str | None = None
        spec = config.speculative_config
        if spec is not None:
            spec.check(config.max_num_batched_tokens)
        self.speculative_config = spec
        self.spec_stats = SpecDecodeStats(
            num_accepted_tokens_per_pos=[0] * (spec.num_speculative_tokens if spec is not None else 0))
        check_num_scheduler_steps(config.num_scheduler_steps, spec is not None)
        self.num_scheduler_steps = config.num_scheduler_steps
        self.multi_step_max_rows = config.decode.multi_step_max_rows
        self.fast_step_max_rows = config.decode.fast_step_max_rows

    # --- views ---
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(share.waiting) for share in self._fair.tenants.values())

    @property
    def num_preempted_waiting(self) -> int:
        """Waiting requests that ran and were preempted (counted in ``num_waiting`` too)."""
        return self._num_preempted_waiting

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        """The waiting requests, tenant by tenant, each tenant's in its order."""
        return tuple(r for share in self._fair.tenants.values() for r in share.waiting)

    def fair_view(self) -> FairView:
        """The fair share between tenants now (``fair_share.FairView``: safe to hand to other threads)."""
        return self._fair.view()

    @property
    def admissible_blocks(self) -> int:
        """The most blocks admission may take from an idle pool while keeping the watermark free.
        A request that needs more than this is admitted without the reserve (it would otherwise be
        excluded forever)."""
        return max(0, self.block_pool.num_total_blocks - self.watermark_blocks)

    @property
    def stats(self) -> SchedulerStats:
        s = self._stats
        s.cached_block_evictions = self.block_pool.num_evictions
        return s

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # --- the door ---
    def add_request(self, request: Request) -> None:
        """Queue ``request`` or raise ``RequestRejected``; a request that passes will run."""
        self._stats.requests_received += 1
        try:
            max_kv_tokens = self._check_door(request)
        except RequestRejected:
            self._stats.requests_rejected += 1
            raise
        self._requests[request.request_id] = request
        drafter = None
        if self.speculative_config is not None and request.sampling_params.structured_outputs is None:
            # a grammar's state would have to advance through every draft: such requests decode plainly
            drafter = NgramDrafter(self.speculative_config)
        self._state[request.request_id] = _State(max_kv_tokens, drafter)
        request.status = RequestStatus.WAITING
        share = self._fair.join(request.tenant, request.tenant_weight)
        share.num_requests += 1
        share.waiting.append(request)

    def _check_door(self, request: Request) -> int:
        """Return the most tokens the request will ever forward (its KV need)."""
        rid = request.request_id
        if rid in self._requests:
            raise RequestRejected(Code.INVALID_REQUEST, f"request id {rid!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.block_ids:
            raise RequestRejected(Code.INVALID_REQUEST, f"request {rid!r} is not a fresh waiting request")
        n_prompt = request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        max_len = self.max_model_len
        # the rules every layer applies (sluice.wire.limits): a prompt, max_tokens, the context
        problem = (limits.check_prompt(request.prompt_token_ids, None)
                   or _tenant_problem(request)
                   or (limits.MAX_TOKENS.check(max_tokens) if max_tokens is not None else None)
                   or limits.check_context(n_prompt, max_tokens, max_len))
        if problem is not None:
            raise RequestRejected(problem.code, problem.message)
        total = max_len if max_tokens is None else n_prompt + max_tokens
        # The last generated token is never forwarded, so the KV need is total - 1 tokens.
        kv_tokens = total - 1
        need = blocks_for_length(kv_tokens, self.block_size)
        pool = self.block_pool.num_total_blocks
        if need > pool:
            what = (
                f"prompt ({n_prompt} tokens) plus max_tokens ({max_tokens})"
                if max_tokens is not None
                else f"max_model_len ({max_len} tokens)"
            )
            raise RequestRejected(
                Code.KV_CACHE_TOO_SMALL,
                f"{what} needs KV for {kv_tokens} tokens, {need} blocks of {self.block_size}, "
                f"{need - pool} more than the whole KV cache ({pool} blocks, {pool * self.block_size} tokens)",
            )
        return kv_tokens

    # --- aborts ---
    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort requests in any state, releasing everything they hold. Unknown or finished ids are a
        no-op. Returns the requests aborted (finished with ``FinishReason.ABORT``)."""
        return self.finish_requests(request_ids, FinishReason.ABORT)

    def finish_requests(
        self, request_ids: Iterable[str], reason: FinishReason, error: str | None = None
    ) -> list[Request]:
        """Finish unfinished requests with ``reason`` (ABORT, or ERROR for e.g. an expired deadline)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        done: list[Request] = []
        removed_running = False
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is None:
                continue
            was_running = req.status is RequestStatus.RUNNING
            if was_running:
                removed_running = True
            else:
                if req.status is RequestStatus.PREEMPTED:
                    self._num_preempted_waiting -= 1
                self._fair.tenants[req.tenant].waiting.remove(req)
            self._release(req, was_running)
            req.finish(reason, error=error)
            if reason is FinishReason.ABORT:
                self._stats.requests_aborted += 1
            done.append(req)
        if removed_running:
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        return done

    def _release(self, req: Request, running: bool = True) -> None:
        """Free the request's blocks (cached content stays in the prefix cache) and forget it
        (``running``: it held a slot)."""
        if req.block_ids:
            self.block_pool.free(reversed(req.block_ids))
            req.block_ids = []
        del self._requests[req.request_id]
        del self._state[req.request_id]
        share = self._fair.tenants[req.tenant]
        share.num_requests -= 1
        if running:
            share.num_running -= 1
        if not share.num_requests:
            self._fair.leave(share)

    # --- one step ---
    def schedule(self) -> SchedulerOutput:
        pool = self.block_pool
        bs = self.block_size
        states = self._state
        running = self._running
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        now = self.clock()

        caching = self.enable_prefix_caching
        forwarded = 0
        pairs = self.max_num_batched_pairs  # attention pairs left this step (see 4.)
        num_batched = 0

        fair = self._fair
        shares = fair.tenants
        multi = len(shares) > 1  # several tenants: fair share decides (one tenant: exactly FIFO)
        taker = None  # the tenant that took a slot this step: its head is admitted first
        moved: list[Request] = []
        if multi and len(running) >= self.max_num_seqs and self.fair_share_preemption:
            move = fair.slot_move(running)
            if move is not None:  # at the step's start: the giver's request has no chunk yet
                taker, j = move
                moved.append(running[j])
                self._preempt(running[j], j)

        spec = self.speculative_config
        # drafts this step: speculation on, and the batch no larger than its disable_by_batch_size
        speculate = spec is not None and (spec.disable_by_batch_size is None
                                          or len(running) <= spec.disable_by_batch_size)
        fast_rows = self.fast_step_max_rows
        prefilling = False  # a prefill chunk in this step: it runs the full forward whatever its rows

        # 1. running requests, oldest first (preemption only ever pops the tail)
        for i, req in enumerate(running):
            if budget <= 0:
                break
            start = req.num_computed_tokens
            known = len(req._all_token_ids)  # req.num_tokens, without a property call (hot path)
            num_new = known - start
            if num_new <= 0:  # nothing to forward (cannot happen while requests sample every chunk)
                continue
            cost = num_new
            if num_new > 1:  # a prefill chunk: cut to the step's tokens and attention pairs
                num_new, cost = self._cut_chunk(req, start, num_new, budget, pairs, not chunks)
                if num_new == 0:
                    continue
            elif budget < 1:
                continue
            drafts = None
            if speculate:
                drafter = states[req.request_id].drafter
                if drafter is not None and num_new == 1:
                    room = budget
                    if fast_rows and not prefilling and num_batched + len(running) - i < fast_rows:
                        # a step of decodes that the fast step takes stays on it: past its rows a
                        # verifying step runs the compiled step's slower products (four streams
                        # decoded 1.03-1.14x faster with this; docs/scheduler.md, "Drafts keep
                        # the fast step")
                        room = min(budget, fast_rows - 1 - num_batched)
                    drafts = self._draft(req, drafter, start, known, room, pairs, len(running) - i - 1)
                    if drafts:
                        num_new = cost = 1 + len(drafts)
                    else:
                        drafts = None
            end = start + num_new
            need = -(-end // bs) - len(req.block_ids)
            if need > 0:
                victim_self = False
                while need > pool.num_free_blocks:
                    # one tenant: the youngest; several: the youngest of the tenant furthest over its
                    # share among the requests not scheduled yet (req and those after it)
                    j = fair.victim_index(running, i or 1) if multi else len(running) - 1
                    victim = running[j] if j >= 0 else req
                    if victim is req:
                        if i == 0:
                            raise AssertionError(
                                f"the oldest running request {req.request_id!r} cannot grow by {need} blocks "
                                f"with every other request preempted ({pool.num_free_blocks} free)"
                            )
                        victim_self = True
                    self._preempt(victim, j)
                    preempted.append(victim)
                    if victim_self:
                        break
                if victim_self:
                    # one tenant: req was the youngest, everything after it is gone too; several:
                    # those after it wait for the next step
                    break
                req.block_ids.extend(pool.allocate(need))
            st = states[req.request_id]
            if drafts is not None:
                # the known token is accounted as a decode; the drafts' KV counts as computed until
                # update_from_output keeps the accepted ones (their blocks are registered then)
                self._advance(req, st, start, 1)
                req.num_computed_tokens = end
                st.drafts_in_flight = num_new - 1
                forwarded += num_new - 1
            elif start >= st.high_water and (not caching or end // bs <= st.num_registered):
                # fast path (a plain decode): no recompute, no block filled
                req.num_computed_tokens = end
                st.high_water = end
                forwarded += num_new
            else:
                self._advance(req, st, start, num_new)
            chunks.append(ScheduledChunk(req, start, num_new, known, drafts))
            budget -= cost
            if num_new > 1:
                pairs -= attention_pairs(start, num_new)
                prefilling |= drafts is None
            num_batched += num_new
        self._stats.forwarded_tokens += forwarded
        if multi:  # each tenant pays for what its running requests forward (admission reads it next)
            for chunk in chunks:
                share = shares[chunk.request.tenant]
                share.vtime += (chunk.num_tokens + ROW_COST) / share.weight

        # 2. admission, in order, unless this step had to preempt
        if not preempted:
            wm = self.watermark_blocks
            admissible = self.admissible_blocks
            solo = None if multi else next(iter(shares.values()), None)
            while budget > 0 and len(running) < self.max_num_seqs:
                if not multi:
                    share = solo
                    if share is None or not share.waiting:
                        break
                elif taker is not None:  # the slot it took is its own this step, or nobody's
                    share, taker = taker, None
                else:
                    share = fair.next_waiting()
                    if share is None:
                        break
                waiting = share.waiting
                req = waiting[0]
                st = states[req.request_id]
                num_tokens = req.num_tokens
                hit_blocks: list[int] = []
                if caching and not (
                    req.sampling_params.prompt_logprobs is not None and not req.output_token_ids
                ):
                    # (a request that wants prompt logprobs computes its whole prompt once)
                    # the last token is always computed (so the request can sample)
                    max_hit = (num_tokens - 1) // bs
                    if max_hit:
                        hashes = self._block_hashes(req, st, max_hit)
                        hit_blocks = pool.lookup(hashes, max_hit)
                num_hit = len(hit_blocks) * bs
                num_new, cost = self._cut_chunk(req, num_hit, num_tokens - num_hit, budget, pairs, not chunks)
                if num_new == 0:
                    break  # strict FIFO: the head waits for a step with room for it
                # need: what the whole known sequence takes from the free pool (new blocks plus
                # cache hits that are free now), though only the first chunk's blocks are allocated
                need = -(-num_tokens // bs) - len(hit_blocks)
                if hit_blocks:
                    need += pool.num_unreferenced(hit_blocks)
                reserve = wm if need <= admissible else 0
                if need + reserve > pool.num_free_blocks:
                    break
                new_blocks = -(-(num_hit + num_new) // bs) - len(hit_blocks)
                waiting.popleft()
                share.num_running += 1
                if multi:
                    share.vtime += (num_new + ROW_COST) / share.weight
                if hit_blocks:
                    pool.touch(hit_blocks)
                req.block_ids = hit_blocks + pool.allocate(new_blocks)
                if self.enable_prefix_caching:
                    self._stats.prefix_cache_queries += num_tokens
                    self._stats.prefix_cache_hits += num_hit
                st.num_registered = len(hit_blocks)
                req.num_cached_tokens = min(num_hit, req.num_prompt_tokens)
                req.num_computed_tokens = num_hit
                if req.status is RequestStatus.PREEMPTED:
                    self._num_preempted_waiting -= 1
                req.status = RequestStatus.RUNNING
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                if num_hit > st.high_water:
                    st.high_water = num_hit
                end = num_hit + num_new
                st.thrash_target = (end // bs + 1) * bs
                self._stats.admissions += 1
                running.append(req)
                self._advance(req, st, num_hit, num_new)
                chunks.append(ScheduledChunk(req, num_hit, num_new, num_tokens))
                budget -= cost
                if num_new > 1:
                    pairs -= attention_pairs(num_hit, num_new)
                num_batched += num_new
            if not running and (head := next((s.waiting[0] for s in shares.values() if s.waiting), None)):
                self._idle_violation = (
                    f"request {head.request_id!r} waits while nothing runs "
                    f"({pool.num_free_blocks}/{pool.num_total_blocks} blocks free)"
                )

        step_tokens = 0
        if (self.num_scheduler_steps > 1 and chunks and not preempted and not moved and not self.num_waiting
                and len(chunks) < self.multi_step_max_rows):
            step_tokens = self._multi_step(chunks)
        if chunks:
            self._stats.iterations += 1
        self._stats.schedule_calls += 1
        return SchedulerOutput(chunks=chunks, preempted=moved + preempted if moved else preempted,
                               num_batched_tokens=num_batched, num_step_tokens=step_tokens)

    @staticmethod
    def _cut_chunk(req: Request, start: int, num_new: int, budget: int, pairs: int, first: bool) -> tuple[int, int]:
        """(tokens, budget cost) of the chunk of ``num_new`` tokens from ``start`` this step can take:
        within the token ``budget`` left, a prompt-logprobs row counting two, and, for more than one
        token, within the ``pairs`` of attention left (``attention_pairs(start, c) <= pairs``). A chunk
        cut to nothing still gets one token when it is the step's ``first`` (the docstring's point 4)."""
        weight = 2 if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1 else 1
        c = min(num_new, max(0, budget) // weight)
        if c > 1 and attention_pairs(start, c) > pairs:
            p = max(0, pairs)
            # the largest c within the pairs: the positive root of c^2 + s c = p, or of c^2 + c = 2 p
            c = (math.isqrt(start * start + 4 * p) - start) // 2 if start else (math.isqrt(8 * p + 1) - 1) // 2
            while c > 1 and attention_pairs(start, c) > pairs:
                c -= 1
        if c == 0 and first:
            c = 1
        return c, c * weight

    def _multi_step(self, chunks: list[ScheduledChunk]) -> int:
        """Give a step of plain greedy decodes several decode steps (``num_scheduler_steps``): the
        most that every request's ``max_tokens``, the context and the free blocks allow (beyond the
        watermark: extra steps never preempt anyone, they shrink or vanish), the same for every row.
        Runs after admission, and only when nothing waits: a request that arrives meanwhile waits
        the burst out. Returns the tokens the extra steps forward."""
        steps = self.num_scheduler_steps
        for chunk in chunks:
            req = chunk.request
            known = len(req._all_token_ids)
            if (chunk.num_tokens != 1 or chunk.draft_token_ids or chunk.start + 1 != known
                    or not req.sampling_params.decodes_by_argmax(known - req.num_prompt_tokens)):
                return 0
            steps = min(steps, 1 + self._extra_token_room(req, chunk.start, known, 0))
        pool, bs = self.block_pool, self.block_size
        while steps > 1:
            need = sum(max(0, -(-(c.start + steps) // bs) - len(c.request.block_ids)) for c in chunks)
            if need <= pool.num_free_blocks - self.watermark_blocks:
                break
            steps -= 1
        if steps < 2:
            return 0
        for chunk in chunks:
            req = chunk.request
            grow = -(-(chunk.start + steps) // bs) - len(req.block_ids)
            if grow > 0:
                req.block_ids.extend(pool.allocate(grow))
            # like drafts: the steps' KV counts as computed until update_from_output has their tokens
            req.num_computed_tokens = chunk.start + steps
            self._state[req.request_id].drafts_in_flight = steps - 1
            chunk.num_steps = steps
        self._stats.forwarded_tokens += len(chunks) * (steps - 1)
        return len(chunks) * (steps - 1)

    def _extra_token_room(self, req: Request, start: int, known: int, num_after: int) -> int:
        """How many tokens a decoding request may compute this step beyond its one: within
        ``max_tokens`` and the context (with the model's own token after them, the request holds at
        most ``max_tokens`` outputs and ``max_model_len`` tokens, so its KV stays within what the
        door promised), and within the free blocks beyond one per later running request
        (``num_after``) and the watermark."""
        limit = self.max_model_len - known - 1
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - (known - req.num_prompt_tokens) - 1)
        if limit <= 0:
            return 0
        bs = self.block_size
        have = len(req.block_ids)
        base = max(have, -(-(start + 1) // bs))  # the blocks a plain decode needs
        spare = self.block_pool.num_free_blocks - (base - have) - num_after - self.watermark_blocks
        return max(0, min(limit, (base + max(0, spare)) * bs - start - 1))

    def _draft(self, req: Request, drafter: NgramDrafter, start: int, known: int, budget: int, pairs: int,
               num_after: int) -> list[int]:
        """The drafts of a decoding request this step: what its n-gram drafter proposes, within

        - the token budget (or, in a step of decodes, the rows the runner's fast step has left),
          keeping one token for each of the ``num_after`` running requests after it (speculation
          never pushes a running request out of a step);
        - ``max_tokens``, the context and the free blocks (``_extra_token_room``): drafts never
          preempt anyone, they shrink or vanish instead;
        - the step's attention pairs (a draft chunk attends like a prefill chunk)."""
        limit = min(budget - 1 - num_after, self._extra_token_room(req, start, known, num_after))
        if limit <= 0:
            return []
        drafts = drafter.propose(req.all_token_ids, limit)
        while drafts and attention_pairs(start, 1 + len(drafts)) > pairs:
            drafts.pop()
        return drafts

    def _advance(self, req: Request, st: _State, start: int, num_new: int) -> None:
        """Account a scheduled chunk: computed tokens, recompute, and the blocks it fills."""
        end = start + num_new
        req.num_computed_tokens = end
        stats = self._stats
        stats.forwarded_tokens += num_new
        if start < st.high_water:
            stats.recomputed_tokens += min(end, st.high_water) - start
        if end > st.high_water:
            st.high_water = end
        self._register_full_blocks(req, st, end)

    def _register_full_blocks(self, req: Request, st: _State, end: int) -> None:
        """Offer the prefix cache every block the first ``end`` tokens fill."""
        if self.enable_prefix_caching:
            full = end // self.block_size
            if full > st.num_registered:
                hashes = self._block_hashes(req, st, full)
                pool = self.block_pool
                table = req.block_ids
                for j in range(st.num_registered, full):
                    pool.cache_block(table[j], hashes[j])
                st.num_registered = full

    def _block_hashes(self, req: Request, st: _State, upto: int) -> list[int]:
        """The chained hashes of the request's first ``upto`` full blocks (computed once each)."""
        hashes = st.block_hashes
        n = len(hashes)
        if n < upto:
            bs = self.block_size
            tokens = req.all_token_ids
            parent = hashes[-1] if hashes else ROOT_HASH
            for j in range(n, upto):
                parent = hash_block_tokens(parent, tokens[j * bs : (j + 1) * bs])
                hashes.append(parent)
        return hashes

    def _preempt(self, req: Request, index: int = -1) -> None:
        """Preempt by recompute the running request ``req`` (``running[index]``: the youngest by
        default) and put it back at the front of its tenant's queue."""
        victim = self._running.pop(index)
        assert victim is req
        st = self._state[req.request_id]
        if req.num_computed_tokens < st.thrash_target:
            self._stats.thrashed_admissions += 1
        self.block_pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_computed_tokens = 0
        st.num_registered = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._stats.preemptions += 1
        self._num_preempted_waiting += 1
        share = self._fair.tenants[req.tenant]
        share.num_running -= 1
        share.waiting.appendleft(req)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append the sampled token of every chunk that samples, apply the stopping rules and free the
        finished requests' blocks. Returns the requests that got a token or finished this step.
        Requests aborted since ``schedule()`` are skipped."""
        result: list[Request] = []
        any_finished = False
        max_len = self.max_model_len
        for chunk in output.chunks:
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted (or finished otherwise) since schedule()
            known = chunk.num_known_tokens
            if known < 0:
                known = req.num_tokens
            if chunk.start + chunk.num_tokens != known and not chunk.draft_token_ids:
                continue  # a prefill chunk that does not reach the end: nothing sampled
            token = sampled.get(req.request_id)
            if chunk.num_steps > 1:
                if self._update_multi_step(req, chunk, token):
                    any_finished = True
                result.append(req)
                continue
            if chunk.draft_token_ids is not None or (token is not None and type(token) is not int):
                if self._update_speculative(req, chunk, token):
                    any_finished = True
                result.append(req)
                continue
            if token is None:
                # the engine must sample every chunk that samples; without a token the request
                # could never move again, so it ends with an error instead of hanging
                self._release(req)
                req.finish(FinishReason.ERROR, error="the engine returned no token for a sampling step")
                any_finished = True
                result.append(req)
                continue
            first = req.first_token_time is None
            req.append_output_token(token)
            if first:
                req.first_token_time = self.clock()  # the scheduler's clock, like first_scheduled_time
            if check_stop(req, max_len):
                any_finished = True
                self._release(req)
                self._stats.requests_finished += 1
            result.append(req)
        if any_finished:
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        self._idle_violation = None
        return result

    def _update_speculative(self, req: Request, chunk: ScheduledChunk, tokens: int | list[int] | None) -> bool:
        """Append a verification chunk's tokens (the accepted drafts, then the model's own token),
        stopping at the first that ends the request; roll the KV back to the accepted tokens:
        ``num_computed_tokens`` and the block table shrink, the rejected drafts' blocks go back to
        the pool, and the blocks the accepted tokens fill join the prefix cache. Returns whether
        the request finished."""
        if tokens is None:
            tokens = []
        elif type(tokens) is int:
            tokens = [tokens]
        drafts = chunk.draft_token_ids or []
        accepted = len(tokens) - 1
        if not tokens or accepted > len(drafts) or tokens[:accepted] != drafts[:accepted]:
            self._release(req)
            req.finish(FinishReason.ERROR, error=f"the engine returned {tokens} for the drafts {drafts}: "
                       "not the accepted drafts followed by one token")
            return True
        st = self._state[req.request_id]
        st.drafts_in_flight = 0
        if drafts:
            self.spec_stats.observe(len(drafts), accepted)
            if st.drafter is not None:
                st.drafter.observe(len(drafts), accepted)
        if self._append_until_stop(req, tokens):
            return True
        if not drafts:
            return False
        computed = chunk.start + len(tokens)  # the last token and the accepted drafts have KV
        req.num_computed_tokens = computed
        keep = blocks_for_length(computed, self.block_size)
        if len(req.block_ids) > keep:
            self.block_pool.free(reversed(req.block_ids[keep:]))
            del req.block_ids[keep:]
        if computed > st.high_water:
            st.high_water = computed
        self._register_full_blocks(req, st, computed)
        return False

    def _append_until_stop(self, req: Request, tokens: list[int]) -> bool:
        """Append several tokens of one step (verified drafts, multi-step tokens), applying the
        stopping rules after each: at the first that ends the request, release it and drop the rest.
        Returns whether it finished."""
        max_len = self.max_model_len
        for token in tokens:
            first = req.first_token_time is None
            req.append_output_token(token)
            if first:
                req.first_token_time = self.clock()
            if check_stop(req, max_len):
                self._release(req)
                self._stats.requests_finished += 1
                return True
        return False

    def _update_multi_step(self, req: Request, chunk: ScheduledChunk, tokens: int | list[int] | None) -> bool:
        """Append a multi-step chunk's tokens, stopping at the first that ends the request (the
        later ones were computed and are dropped with the request's blocks); when none does, every
        step's KV is kept and the blocks they fill join the prefix cache. Returns whether the
        request finished."""
        st = self._state[req.request_id]
        st.drafts_in_flight = 0
        if type(tokens) is not list or len(tokens) != chunk.num_steps:
            self._release(req)
            req.finish(FinishReason.ERROR, error=f"the engine returned {tokens!r} for a step of {chunk.num_steps} "
                       "decode steps: not one token a step")
            return True
        if self._append_until_stop(req, tokens):
            return True
        computed = chunk.start + chunk.num_steps
        if computed > st.high_water:
            st.high_water = computed
        self._register_full_blocks(req, st, computed)
        return False

    # --- checks ---
    def check_invariants(self) -> None:
        """Raise AssertionError describing the first violated invariant."""
        pool = self.block_pool
        bs = self.block_size
        assert self._idle_violation is None, self._idle_violation
        assert len(self._running) <= self.max_num_seqs, (
            f"{len(self._running)} running requests exceed max_num_seqs ({self.max_num_seqs})"
        )
        seen: set[str] = set()
        for req in self._running:
            rid = req.request_id
            assert rid not in seen, f"request {rid!r} is twice in the running list"
            seen.add(rid)
            assert req.status is RequestStatus.RUNNING, f"running request {rid!r} has status {req.status}"
            assert self._requests.get(rid) is req, f"running request {rid!r} is not registered"
            in_flight = self._state[rid].drafts_in_flight  # between schedule() and update_from_output()
            assert 0 < req.num_computed_tokens <= req.num_tokens + in_flight, (
                f"running request {rid!r}: {req.num_computed_tokens} computed of {req.num_tokens} tokens"
                + (f" and {in_flight} drafts" if in_flight else "")
            )
            want = blocks_for_length(req.num_computed_tokens, bs)
            assert len(req.block_ids) == want, (
                f"running request {rid!r} holds {len(req.block_ids)} blocks for "
                f"{req.num_computed_tokens} computed tokens (needs {want})"
            )
        waiting = [r for share in self._fair.tenants.values() for r in share.waiting]
        for req in waiting:
            rid = req.request_id
            assert rid not in seen, f"request {rid!r} is both running and waiting (or waits twice)"
            seen.add(rid)
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
                f"waiting request {rid!r} has status {req.status}"
            )
            assert self._requests.get(rid) is req, f"waiting request {rid!r} is not registered"
            assert not req.block_ids, f"waiting request {rid!r} holds blocks {req.block_ids}"
            assert req.num_computed_tokens == 0, f"waiting request {rid!r} has computed tokens"
        preempted = sum(1 for r in waiting if r.status is RequestStatus.PREEMPTED)
        assert preempted == self._num_preempted_waiting, (
            f"{preempted} preempted requests wait, but the counter says {self._num_preempted_waiting}"
        )
        assert seen == set(self._requests), (
            f"registered but neither running nor waiting: {sorted(set(self._requests) - seen)}"
        )
        assert set(self._state) == set(self._requests), "scheduler state out of step with its requests"
        self._check_tenants()
        if not self._running and not waiting:
            assert pool.num_free_blocks == pool.num_total_blocks, (
                f"nothing runs yet only {pool.num_free_blocks}/{pool.num_total_blocks} blocks are free (leak)"
            )
        pool.check_invariants(r.block_ids for r in self._running)

    def _check_tenants(self) -> None:
        """The fair share's bookkeeping: every unfinished request's tenant is active, and waits in
        that tenant's queue (and nowhere else) or runs; each active tenant's counts are its
        requests', it holds at least one, and a weight of at least 1."""
        shares = self._fair.tenants
        running: dict[str, int] = {}
        requests: dict[str, int] = {}
        for req in self._requests.values():
            assert req.tenant in shares, f"request {req.request_id!r} of tenant {req.tenant!r}, which is not active"
            requests[req.tenant] = requests.get(req.tenant, 0) + 1
        for req in self._running:
            running[req.tenant] = running.get(req.tenant, 0) + 1
        for name, share in shares.items():
            assert share.name == name and share.weight >= 1, f"tenant {name!r}: {share!r}"
            for req in share.waiting:
                assert req.tenant == name, f"request {req.request_id!r} of tenant {req.tenant!r} waits in {name!r}'s queue"
            assert share.num_running == running.get(name, 0), (
                f"tenant {name!r} counts {share.num_running} running requests, {running.get(name, 0)} run")
            assert share.num_requests == requests.get(name, 0) > 0, (
                f"tenant {name!r} counts {share.num_requests} requests, holds {requests.get(name, 0)}")
