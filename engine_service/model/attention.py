"""Paged attention in plain torch: one code path for CPU and CUDA.

Each layer first writes the K/V of every token scheduled this step into its cache slots, then
attends. Writing before reading means a request may attend to blocks another request filled in
the same step (prefix-cache sharing between copies admitted together).

Decode tokens (one query per sequence) have two implementations with the same inputs:

* ``decode_attention_reference``: gathers every sequence's blocks into a padded
  ``[decodes, kv_heads, max_blocks * block_size, head_dim]`` copy and makes one SDPA call. This is
  the plain-torch reference the tests compare against, and what the eager forward runs (in eager
  mode it is the fastest formulation: aten's gather and SDPA are single kernels).
* ``decode_attention_inplace``: the same attention written as products and reductions whose
  operands are indexed through the block tables (``k_cache[slot]`` inside the reduction). Eager torch
  would materialise those gathers; under ``torch.compile`` inductor fuses each gather into the
  reduction that consumes it, so the cache is read where it lies, once, and no padded copy of any
  sequence's K/V exists. The compiled decode step (``engine_service.model.compiled``) uses it.
* a native kernel (``engine_service.model.native``, C built at first use): the same attention read
  through the block tables in place, each context split into partitions that run as separate
  OpenMP tasks and are combined by log-sum-exp (so one stream uses every core, and a sequence's
  output does not depend on its batch). What the eager forward and the compiled step run on CPU
  when the kernel builds (``attention_backend``: auto / native).

Prefill chunks run one SDPA call each, causal over the sequence's cached and new tokens.

The cache may hold a narrower dtype than the model computes in (``kv_cache_dtype``): every path
then attends to the K/V as the cache holds them, rounded, this step's new tokens included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class PrefillSequence:
    query_start: int  # offset of the chunk's first token in the flattened batch
    query_len: int
    context_len: int  # tokens with KV once this chunk is written: cached + new
    block_table: torch.Tensor  # [num_blocks] long, covering context_len tokens
    mask: torch.Tensor | None  # [query_len, context_len] bool (True = attend); None when causal from 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each scheduled token
    prefills: list[PrefillSequence]
    # rows of the flattened batch that are decodes; None when every row is a decode (decode-only step)
    decode_token_index: torch.Tensor | None
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long (padded with 0)
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] long: tokens each decode attends to
    # the decode attention to use instead of the reference gather + SDPA, called as
    # kernel(q, k_cache, v_cache, block_tables, context_lens, scale): decode_attention_inplace or the
    # native kernel (engine_service.model.native); None = the reference
    decode_kernel: Callable[..., torch.Tensor] | None = None
    _decode_mask: torch.Tensor | None = None

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_block_tables is None else self.decode_block_tables.shape[0]

    def decode_mask(self, block_size: int) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool, True where a decode may attend."""
        if self._decode_mask is None:
            width = self.decode_block_tables.shape[1] * block_size
            positions = torch.arange(width, device=self.decode_block_tables.device)
            self._decode_mask = (positions[None, :] < self.decode_context_lens[:, None])[:, None, None, :]
        return self._decode_mask


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V at its slot. Caches are [num_blocks, block_size, kv_heads, head_dim]."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [decodes, heads, head_dim] -> [decodes, heads, head_dim], through a padded gather."""
    tables = meta.decode_block_tables
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, L, D]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    attn = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.decode_mask(k_cache.shape[1]),
        scale=scale, enable_gqa=True,
    )
    return attn.squeeze(2)


def decode_attention_inplace(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """The reference's attention as reductions over K/V indexed through the block tables.

    q: [B, heads, D]; caches [num_blocks, block_size, kv_heads, D]; block_tables [B, M];
    context_lens [B]. Compiled, no K/V copy is made (see the module docstring)."""
    batch, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    width = block_tables.shape[1] * block_size
    pos = torch.arange(width, device=q.device)
    slots = block_tables[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    keys = k_cache.view(num_blocks * block_size, kv_heads, head_dim)[slots]  # [B, L, KV, D] (fused away)
    values = v_cache.view(num_blocks * block_size, kv_heads, head_dim)[slots]
    query = q.reshape(batch, 1, kv_heads, group, head_dim).float()
    scores = (query * keys[:, :, :, None, :].float()).sum(-1) * scale  # [B, L, KV, G]
    visible = (pos[None, :] < context_lens[:, None])[:, :, None, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=1)
    out = (probs[..., None] * values[:, :, :, None, :].float()).sum(1)  # [B, KV, G, D]
    return out.reshape(batch, heads, head_dim).to(q.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] for this step's tokens.
    Returns [tokens, heads, head_dim]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def decode(query: torch.Tensor) -> torch.Tensor:
        if meta.decode_kernel is not None:
            return meta.decode_kernel(query, k_cache, v_cache, meta.decode_block_tables,
                                      meta.decode_context_lens, scale)
        return decode_attention_reference(query, k_cache, v_cache, meta, scale)

    if not meta.prefills and meta.decode_token_index is None:
        return decode(q)  # decode-only step: every row is a decode, in order

    out = torch.empty_like(q)
    if meta.num_decodes:
        idx = meta.decode_token_index
        out[idx] = decode(q[idx])

    for seq in meta.prefills:
        start, end = seq.query_start, seq.query_start + seq.query_len
        if seq.mask is None:
            # Nothing cached before this chunk: its own K/V are the whole context, as the cache
            # holds them (rounded to a narrower cache dtype), so that a prompt attends to the same
            # values whether it is prefilled in one chunk, in several, or recomputed after preemption.
            keys, values = k[start:end], v[start:end]
            if k_cache.dtype != k.dtype:
                keys, values = keys.to(k_cache.dtype).to(k.dtype), values.to(v_cache.dtype).to(v.dtype)
        else:
            keys = k_cache[seq.block_table].flatten(0, 1)[: seq.context_len].to(q.dtype)
            values = v_cache[seq.block_table].flatten(0, 1)[: seq.context_len].to(q.dtype)
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attn[0].transpose(0, 1)
    return out
