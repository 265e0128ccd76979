"""Qwen3: the Llama decoder with an RMSNorm over each head of q and of k (``q_norm``, ``k_norm``,
one weight of ``head_dim`` shared by all heads), applied after the projection and before the rotary
embedding. Everything else (fused projections, paged attention, the compiled decode step, the
native kernels and the native decode step, prepacking and quantization, which swap only
``nn.Linear``) is the Llama path's."""

from __future__ import annotations

import torch

from engine_service.model.attention import AttentionMetadata, paged_attention
from engine_service.model.config import ModelConfig
from engine_service.model.layers import RMSNorm, RotaryEmbedding
from engine_service.model.llama import Attention, KVCache, LlamaForCausalLM


class QKNormAttention(Attention):
    native_step = True  # the native decode step norms q and k per head too (its StackLayer.q_norm, k_norm)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim))
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = QKNormAttention
