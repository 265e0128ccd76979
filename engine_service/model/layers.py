"""Building blocks of the Llama-family decoder, written to match Hugging Face's numerics."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference, then cast back before the weight.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # gate_proj and up_proj fused: one matmul, [gate; up] on the output axis
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rope_inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama-3-style or linear scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    factor = float(rope_scaling.get("factor", 1.0))
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over absolute positions (``rotate_half`` convention, as HF).

    ``cos_sin`` looks positions up in a table computed once (``ensure_positions`` grows it); the
    table holds exactly what computing per step would give (the same float32 elementwise ops).
    """

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict | None,
                 max_positions: int = 0) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", rope_inverse_frequencies(head_dim, theta, rope_scaling), persistent=False
        )
        self.register_buffer("cos_table", torch.empty(0, head_dim), persistent=False)
        self.register_buffer("sin_table", torch.empty(0, head_dim), persistent=False)
        if max_positions:
            self.ensure_positions(max_positions)

    def ensure_positions(self, n: int) -> None:
        """Make the table cover positions [0, n) (eager code: call it before a compiled forward)."""
        have = self.cos_table.shape[0]
        if n <= have:
            return
        n = max(n, 2 * have, 256)
        positions = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table, self.sin_table = emb.cos(), emb.sin()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_table[positions].to(dtype), self.sin_table[positions].to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]
