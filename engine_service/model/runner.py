"""ModelRunner: turns one scheduled step into one forward pass over a flattened batch.

It owns the model and the KV cache. For each scheduled chunk it lays out the chunk's tokens,
positions and cache slots, builds the attention metadata once (shared by every layer), runs the
model, and returns the logits the engine needs: one row per request that samples this step, plus
the prompt positions of requests that asked for prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from engine_service.core.request import Request
from engine_service.model.attention import AttentionMetadata, PrefillSequence
from engine_service.model.llama import KVCache, LlamaForCausalLM


class Chunk(Protocol):
    """What the runner reads of a scheduled chunk (``engine_service.core.scheduler.ScheduledChunk``)."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool: ...


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


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def prepare(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        prefills: list[PrefillSequence] = []
        decode_rows: list[int] = []
        decode_tables: list[np.ndarray] = []
        decode_lens: list[int] = []
        sample_rows: list[int] = []
        offset = 0
        for chunk in chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            ctx = start + n
            pos = np.arange(start, ctx, dtype=np.int64)
            table = np.asarray(req.block_ids[: -(-ctx // bs)], dtype=np.int64)
            ids.append(np.asarray(req.all_token_ids[start:ctx], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if n == 1:
                decode_rows.append(offset)
                decode_tables.append(table)
                decode_lens.append(ctx)
            else:
                mask = None
                if start > 0:
                    mask = self._tensor(np.arange(ctx)[None, :] <= pos[:, None])
                prefills.append(PrefillSequence(offset, n, ctx, self._tensor(table), mask))
            if chunk.samples:
                sample_rows.append(offset + n - 1)
            offset += n

        decode_index = decode_block_tables = decode_mask = None
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            padded = np.zeros((len(decode_tables), width), dtype=np.int64)
            for i, t in enumerate(decode_tables):
                padded[i, : len(t)] = t
            lens = np.asarray(decode_lens)
            mask = np.arange(width * bs)[None, :] < lens[:, None]
            decode_index = self._tensor(np.asarray(decode_rows, dtype=np.int64))
            decode_block_tables = self._tensor(padded)
            decode_mask = self._tensor(mask[:, None, None, :])
        meta = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots)),
            prefills=prefills,
            decode_token_index=decode_index,
            decode_block_tables=decode_block_tables,
            decode_mask=decode_mask,
        )
        return self._tensor(np.concatenate(ids)), self._tensor(np.concatenate(positions)), meta, sample_rows

    @torch.inference_mode()
    def forward_hidden(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, list[int]]:
        input_ids, positions, meta, sample_rows = self.prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return hidden, sample_rows

    @torch.inference_mode()
    def execute(self, chunks: Sequence[Chunk]) -> RunnerOutput:
        hidden, sample_rows = self.forward_hidden(chunks)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        sample_logits = self.model.compute_logits(hidden[rows])
        out = RunnerOutput(sample_logits, [c.request for c in chunks if c.samples])
        offset = 0
        for chunk in chunks:
            req = chunk.request
            wanted = req.sampling_params.prompt_logprobs
            last_predictable = req.num_prompt_tokens - 1  # positions < this predict a prompt token
            if wanted is not None and chunk.start < last_predictable:
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
