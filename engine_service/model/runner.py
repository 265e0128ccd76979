"""ModelRunner: turns one scheduled step into one forward pass over a flattened batch.

It owns the model and the KV cache. For each scheduled chunk it lays out the chunk's tokens,
positions and cache slots, builds the attention metadata once (shared by every layer), runs the
model, and returns the logits the engine needs: one row per request that samples this step, plus
the prompt positions of requests that asked for prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from engine_service.core.request import Request
from engine_service.model.attention import AttentionMetadata, PrefillSequence
from engine_service.model.decode_paths.base import DecodePath, PathSetup
from engine_service.model.decode_paths.eager import EagerPath
from engine_service.model.llama import KVCache, LlamaForCausalLM


class Chunk(Protocol):
    """What the runner reads of a scheduled chunk (``engine_service.core.scheduler.ScheduledChunk``)."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool: ...

    # speculative decoding (``ScheduledChunk.draft_token_ids``): drafted tokens after the request's
    # known ones, counted in ``num_tokens``; every position of such a chunk is sampled


# Steps of up to this many one-token decodes are laid out by Runner._prepare_decodes.
FEW_DECODES = 8


def _drafts(chunk: Chunk) -> list[int] | None:
    return getattr(chunk, "draft_token_ids", None)


@dataclass
class PromptLogits:
    request: Request
    first_position: int  # logits row i predicts the prompt token at first_position + i
    logits: torch.Tensor  # [k, vocab] float32
    target_ids: torch.Tensor  # [k] the prompt tokens those rows predict


@dataclass
class RunnerOutput:
    sample_logits: torch.Tensor  # [requests that sample, vocab] float32, in chunk order
    sample_requests: list[Request]
    prompt_logits: list[PromptLogits] = field(default_factory=list)
    # rows of ``sample_logits`` per request, in order, when a chunk carries drafts (1 + its drafts:
    # row j predicts the token after its j-th draft); None: one row each
    sample_counts: list[int] | None = None
    # each row's argmax of ``sample_logits`` when the step computed it with them (the native step
    # does); None: not computed. The sampler's all-greedy rows take it instead of an argmax of their own.
    greedy_token_ids: list[int] | None = None
    # a multi-step chunk's tokens (``ScheduledChunk.num_steps``), one list per request, in order: the
    # step's native greedy steps took them; ``sample_logits`` then holds the last step's logits
    step_token_ids: list[list[int]] | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int,
                 device: torch.device, decode_kernel: Callable[..., torch.Tensor] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # the decode attention the forward uses instead of the reference gather + SDPA (AttentionMetadata)
        self.decode_kernel = decode_kernel
        # how a step's forward runs (engine_service.model.decode_paths): the eager forward until the
        # engine hands it the path it chose
        self.path: DecodePath = EagerPath(self.path_setup())
        self.min_decode_width = 1  # the path's fewest block-table columns (DecodePath.min_table_width)
        # a deterministic engine's layout (engine_service.model.determinism): every token, a prefill
        # chunk's included, attends as a decode of its own length, so that a position's attention
        # does not depend on how the work was split into chunks and steps
        self.every_row_decodes = False

    def path_setup(self, **facts) -> PathSetup:
        """A ``PathSetup`` of this runner's model, caches and decode attention; ``facts`` are the
        rest of its fields (the scratch slot defaults to the first slot of the last block, which the
        engine never hands out)."""
        facts.setdefault("scratch_slot", (self.num_blocks - 1) * self.block_size)
        facts.setdefault("max_batch", 256)
        facts.setdefault("max_model_len", getattr(getattr(self.model, "config", None), "max_position_embeddings", 0))
        facts.setdefault("decode_kernel", self.decode_kernel)
        facts.setdefault("attention_backend", "native" if self.decode_kernel is not None else "torch")
        return PathSetup(model=self.model, kv_caches=self.kv_caches, device=self.device, block_size=self.block_size,
                         **facts)

    def use(self, path: DecodePath) -> None:
        """Run every later step through ``path``."""
        self.path = path
        self.min_decode_width = path.min_table_width

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def prepare(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Lay out one step. Per-token and per-decode arrays are built with whole-array numpy
        operations: the only per-request Python work is reading each chunk's fields and extending
        two flat lists (its token ids and its block ids). A step of a few one-token decodes takes
        ``_prepare_decodes``."""
        if len(chunks) <= FEW_DECODES and all(c.num_tokens == 1 + len(_drafts(c) or ()) for c in chunks):
            return self._prepare_decodes(chunks)
        bs = self.block_size
        n = len(chunks)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=n)
        ctx = starts + lens
        nblocks = -(-ctx // bs)
        token_ids: list[int] = []
        block_ids: list[int] = []
        any_drafts = False
        for chunk, s, e, nb in zip(chunks, starts.tolist(), ctx.tolist(), nblocks.tolist(), strict=True):
            req = chunk.request
            token_ids.extend(req.all_token_ids[s:e])  # a draft chunk's slice stops at its known tokens
            drafts = _drafts(chunk)
            if drafts:
                token_ids.extend(drafts)
                any_drafts = True
            block_ids.extend(req.block_ids[:nb])
        # Row r of `tables` is chunk r's block table, padded with 0.
        width = int(nblocks.max())
        tables = np.zeros((n, width), dtype=np.int64)
        tables[np.arange(width)[None, :] < nblocks[:, None]] = block_ids
        # Per token: its chunk, position and slot.
        row_of_token = np.repeat(np.arange(n), lens)
        ends = np.cumsum(lens)
        offsets = ends - lens
        positions = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(offsets - starts, lens)
        slots = tables[row_of_token, positions // bs] * bs + positions % bs
        self.model.rotary.ensure_positions(int(ctx.max()))

        is_decode = lens == 1
        every_token = any_drafts or self.every_row_decodes  # a decode row per token, not per chunk
        if self.every_row_decodes:
            is_decode[:] = True
        elif any_drafts:
            # every position of a draft chunk attends as a decode of its own length: the same
            # attention, and the same kernel, as decoding those tokens one by one
            is_decode |= np.fromiter((bool(_drafts(c)) for c in chunks), dtype=bool, count=n)
        prefills: list[PrefillSequence] = []
        for r in np.flatnonzero(~is_decode).tolist():
            start, ctx_r, off = int(starts[r]), int(ctx[r]), int(offsets[r])
            mask = None
            if start > 0:
                mask = self._tensor(np.arange(ctx_r)[None, :] <= positions[off : off + lens[r], None])
            prefills.append(PrefillSequence(off, int(lens[r]), ctx_r, self._tensor(tables[r, : nblocks[r]]), mask))

        decode_index = decode_tables = decode_lens = None
        decode_rows = np.flatnonzero(is_decode)  # chunks
        if decode_rows.size:
            if every_token:  # one decode per token of the decode and draft chunks (of every chunk)
                token_index = np.flatnonzero(np.repeat(is_decode, lens))
                decode_rows = row_of_token[token_index]
                decode_ctx = positions[token_index] + 1
            else:
                token_index = offsets[decode_rows]
                decode_ctx = ctx[decode_rows]
            dwidth = max(int(nblocks[decode_rows].max()), self.min_decode_width)
            dtables = np.zeros((decode_rows.size, dwidth), dtype=np.int64)
            dtables[:, : min(dwidth, width)] = tables[decode_rows, :dwidth]
            decode_tables = self._tensor(dtables)
            decode_lens = self._tensor(decode_ctx)
            if prefills:
                decode_index = self._tensor(token_index)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            prefills=prefills,
            decode_token_index=decode_index,
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            decode_kernel=self.decode_kernel,
        )
        sample_rows = (ends - 1)[np.fromiter((c.samples for c in chunks), dtype=bool, count=n)].tolist()
        if any_drafts:  # every position of a draft chunk: its known token's and each draft's
            sample_rows = []
            for chunk, end in zip(chunks, ends.tolist(), strict=True):
                if chunk.samples:
                    d = len(_drafts(chunk) or ())
                    sample_rows.extend(range(end - 1 - d, end))
        input_ids = self._tensor(np.asarray(token_ids, dtype=np.int64))
        return input_ids, self._tensor(positions), meta, sample_rows

    def _prepare_decodes(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                  list[int]]:
        """``prepare`` for a step of one-token decodes, a few of them, each perhaps with its drafts
        (a row per position, each attending as a decode of its own length): the same tensors, from
        Python lists and one numpy array. Why: the step before it streamed every weight through the
        caches, so each numpy or torch call here first fetches its own code and data from memory;
        the general path's thirty-odd array operations cost a step of one stream more than its
        Python lists do (docs/performance.md, eleventh round), and a verifying step twice what a
        one-row step's layout costs (docs/performance.md, stop 57)."""
        bs = self.block_size
        # every row of a chunk reads the chunk's table: as many blocks as its last position needs
        width = max(max((c.start + c.num_tokens - 1) // bs + 1 for c in chunks), self.min_decode_width)
        tables = np.zeros((sum(c.num_tokens for c in chunks), width), dtype=np.int64)
        token_ids, positions, slots, sample_rows = [], [], [], []
        r = 0
        for chunk in chunks:
            req, p = chunk.request, chunk.start
            blocks = req.block_ids[: (p + chunk.num_tokens - 1) // bs + 1]
            drafts = _drafts(chunk) or ()
            token_ids.append(req.all_token_ids[p])
            token_ids.extend(drafts)
            for j in range(chunk.num_tokens):
                tables[r + j, : len(blocks)] = blocks
                slots.append(blocks[(p + j) // bs] * bs + (p + j) % bs)
                positions.append(p + j)
            if chunk.samples:
                sample_rows.extend(range(r, r + chunk.num_tokens))
            r += chunk.num_tokens
        self.model.rotary.ensure_positions(max(positions) + 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            prefills=[],
            decode_token_index=None,
            decode_block_tables=self._tensor(tables),
            decode_context_lens=torch.tensor([p + 1 for p in positions], dtype=torch.long, device=self.device),
            decode_kernel=self.decode_kernel,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=self.device), meta, sample_rows

    @torch.inference_mode()
    def forward_hidden(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, list[int]]:
        input_ids, positions, meta, sample_rows = self.prepare(chunks)
        return self._forward(input_ids, positions, meta), sample_rows

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.path.hidden(input_ids, positions, meta)

    def _execute_steps(self, chunks: Sequence[Chunk], steps: int) -> RunnerOutput:
        """A step of one-token greedy decodes, each run ``steps`` decode steps in one call of the
        path (``DecodePath.greedy_steps``): step j of a row at position start + j, its K/V in that
        position's slot of the blocks the scheduler already gave the row."""
        bs = self.block_size
        starts = [c.start for c in chunks]
        width = max((p + steps - 1) // bs + 1 for p in starts)
        tables = np.zeros((len(chunks), width), dtype=np.int64)
        for r, (chunk, p) in enumerate(zip(chunks, starts, strict=True)):
            if getattr(chunk, "num_steps", 1) != steps or chunk.num_tokens != 1:
                raise RuntimeError("a multi-step batch's chunks must all be one-token decodes of the same steps")
            nb = (p + steps - 1) // bs + 1
            tables[r, :nb] = chunk.request.block_ids[:nb]
        positions = np.array(starts, dtype=np.int64)[None, :] + np.arange(steps, dtype=np.int64)[:, None]
        rows = np.arange(len(chunks))[None, :]
        slots = tables[rows, positions // bs] * bs + positions % bs
        self.model.rotary.ensure_positions(int(positions.max()) + 1)
        ids = torch.tensor([c.request.all_token_ids[p] for c, p in zip(chunks, starts, strict=True)], dtype=torch.long)
        tokens, logits = self.path.greedy_steps(ids, torch.from_numpy(positions), torch.from_numpy(slots),
                                                torch.from_numpy(tables), torch.from_numpy(positions + 1))
        out = RunnerOutput(logits, [c.request for c in chunks])
        out.step_token_ids = tokens.t().tolist()
        return out

    @torch.inference_mode()
    def execute(self, chunks: Sequence[Chunk]) -> RunnerOutput:
        steps = getattr(chunks[0], "num_steps", 1) if chunks else 1
        if steps > 1:
            return self._execute_steps(chunks, steps)
        input_ids, positions, meta, sample_rows = self.prepare(chunks)
        rows = input_ids.shape[0]
        hidden = sample_logits = None
        if len(sample_rows) == rows:
            # a step where every row samples (so none wants prompt logprobs, which only prompt
            # positions before the last have): a path may give the logits from the step itself
            greedy = torch.empty(rows, dtype=torch.long)
            sample_logits = self.path.logits(input_ids, positions, meta, greedy)
        if sample_logits is None:
            hidden = self._forward(input_ids, positions, meta)
            if len(sample_rows) == rows:
                sampled = hidden  # every row samples (sample_rows ascend): no index, no copy
            else:
                sampled = hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
            sample_logits = self.model.compute_logits(sampled)
        out = RunnerOutput(sample_logits, [c.request for c in chunks if c.samples])
        if hidden is None:
            out.greedy_token_ids = greedy.tolist()
        if len(sample_rows) != len(out.sample_requests):
            out.sample_counts = [1 + len(_drafts(c) or ()) for c in chunks if c.samples]
        offset = 0
        for chunk in chunks:
            req = chunk.request
            wanted = req.sampling_params.prompt_logprobs
            last_predictable = req.num_prompt_tokens - 1  # positions < this predict a prompt token
            if wanted is not None and chunk.start < last_predictable:
                assert hidden is not None  # such a chunk does not sample, so the native head did not run
                count = min(chunk.num_tokens, last_predictable - chunk.start)
                targets = req.all_token_ids[chunk.start + 1 : chunk.start + 1 + count]
                out.prompt_logits.append(PromptLogits(
                    request=req,
                    first_position=chunk.start + 1,
                    logits=self.model.compute_logits(hidden[offset : offset + count]),
                    target_ids=torch.tensor(targets, dtype=torch.long, device=self.device),
                ))
            offset += chunk.num_tokens
        return out
