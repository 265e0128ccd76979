"""The Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2; Qwen3 swaps the attention,
``engine_service.model.qwen3``) over a paged KV cache.

Parameter names follow Hugging Face's so checkpoints load by name, except two fused projections:
``self_attn.qkv_proj`` is ``q_proj``, ``k_proj`` and ``v_proj`` concatenated on the output axis, and
``mlp.gate_up_proj`` is ``gate_proj`` and ``up_proj``; the loader concatenates the checkpoint's
separate tensors (``FUSED_PROJECTIONS``), so one matmul replaces three (two) per layer. The forward
takes one flattened batch of every token scheduled this step, whatever request it belongs to.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine_service.model.attention import AttentionMetadata, paged_attention
from engine_service.model.config import ModelConfig
from engine_service.model.layers import GatedMLP, RMSNorm, RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]

# fused parameter prefix -> the checkpoint's separate prefixes, concatenated in this order (dim 0)
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class Attention(nn.Module):
    # whether the native decode step (model/native_decode.py, kernels/decode_stack.c) computes this
    # attention: Llama's, with the biases a config gives it. A subclass that changes the forward is
    # not, unless it says so (the step computes its change too, as Qwen3's q/k norms).
    native_step: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "native_step" not in cls.__dict__:
            cls.native_step = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # Rotate q and k in one go: they are adjacent in the fused output.
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = RotaryEmbedding.apply(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: type[nn.Module] = Attention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: type[nn.Module] = Attention) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, attention) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # a family that differs only inside the attention (Qwen3's q/k norms) subclasses and swaps this
    attention_class: type[nn.Module] = Attention

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.attention_class)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [tokens]. Returns the final hidden states [tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # A tied model has no lm_head unless quantization gave it its own (quantized) copy.
        head = getattr(self, "lm_head", None)
        if head is None:
            return torch.nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
        return head(hidden).float()
