"""The arithmetic a workload needs, and the rate a plain GEMM reaches on this machine: together the
FLOP utilisation ``sluice bench offline`` reports.

Counted FLOPs are the model's useful ones (a multiply-add is two): per token that runs through the
decoder, every projection (q/k/v/o, gate/up/down) and its attention over the context it sees
(scores and the weighted sum of values); per sampled token, the output projection. A request of P
prompt tokens and O output tokens (EOS ignored) runs P + O - 1 tokens through the decoder (the
last output is not fed back) and samples O times. Padding, recomputation after preemption and the
norms are not counted, so the figure is what the workload needs, whatever a system spends on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg) -> ModelShape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                   cfg.num_key_value_heads, head_dim, cfg.vocab_size)

    @property
    def layer_weights(self) -> int:
        """Multiply-adds of one token through one layer's projections."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden + 3 * self.hidden * self.intermediate

    def request_flops(self, prompt_len: int, output_len: int) -> int:
        tokens = prompt_len + output_len - 1
        projections = 2 * self.layers * self.layer_weights * tokens
        # the token at position t attends over t + 1 keys: 2 products of heads x head_dim per key
        contexts = tokens * (tokens + 1) // 2
        attention = 2 * 2 * self.layers * self.heads * self.head_dim * contexts
        head = 2 * self.hidden * self.vocab * output_len
        return projections + attention + head


def gemm_peak_gflops(dtype, size: int = 2048, repeats: int = 5) -> float:
    """The best of ``repeats`` square ``size`` GEMMs (torch.mm, this process's threads) in GFLOP/s."""
    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool, oneDNN's kernel choice
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9
