"""Paged attention in plain torch: one code path for CPU and CUDA.

Each layer first writes the K/V of every token scheduled this step into its cache slots, then
attends. Writing before reading means a request may attend to blocks another request filled in
the same step (prefix-cache sharing between copies admitted together).

Decode tokens (one query per sequence) are batched into one padded SDPA call; prefill chunks run
one SDPA call each, causal over the sequence's cached and new tokens.
"""

from __future__ import annotations

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
    decode_token_index: torch.Tensor | None  # [num_decodes] long, rows of the flattened batch
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long (padded with 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V at its slot. Caches are [num_blocks, block_size, kv_heads, head_dim]."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] for this step's tokens.
    Returns [tokens, heads, head_dim]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)

    if meta.decode_token_index is not None:
        idx = meta.decode_token_index
        tables = meta.decode_block_tables
        keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, L, D]
        values = v_cache[tables].flatten(1, 2).transpose(1, 2)
        query = q[idx].unsqueeze(2)  # [B, heads, 1, D]
        attn = F.scaled_dot_product_attention(
            query, keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.decode_mask, scale=scale,
            enable_gqa=True,
        )
        out[idx] = attn.squeeze(2)

    for seq in meta.prefills:
        start, end = seq.query_start, seq.query_start + seq.query_len
        if seq.mask is None:
            # Nothing cached before this chunk: its own K/V are the whole context.
            keys, values = k[start:end], v[start:end]
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
