"""Deterministic engines: a position's logits and K/V do not depend on how the work was split.

A request's tokens (greedy, or sampled with a seed) are the same whether it runs alone or batched, on
a prefix-cache hit or miss, across chunked-prefill splits, after preemption and recompute, with or
without speculation, and across restarts (docs/determinism.md). That holds when every reduction that
reaches the logits computes each row the same way whatever the batch:

* every row attends as a decode of its own length, a prefill chunk's rows included
  (``ModelRunner.every_row_decodes``), through the native decode attention, whose partitions are
  fixed by the context length alone; bfloat16 caches never score a chunk's rows together on AMX
  tiles (``PagedDecodeAttention.exact_op``);
* every product computes each row the same way whatever the rows beside it and their count:
  bfloat16 weights through the packed GEMV for every row count, on groups of rows (never AMX tiles,
  which round apart from the one-row kernel; ``PrepackedLinear.set_deterministic``); int4 and int8
  weights (a GGUF file's blocks among them, ``Q8Linear``) through their packed kernels for every row count (no dense path for many rows, whose
  dequantized GEMM sums in another order; ``QuantizedLinear.dense_min_rows`` None); float32 and
  float16 weights through fixed tiles of ``FIXED_TILE_ROWS`` rows, each its own call of the same
  shape (MKL's and oneDNN's products pick their kernel and split by the row count, so a row's sums
  changed with its batch; at one shape they do not: ``fixed_tile_rows``);
* the native decode step runs every step, prefill chunks included (``DecodeStack.deterministic``);
* norms, rotary, SiLU and residuals are row by row already, and the sampler is batch-invariant
  given its rows (docs/sampling.md).

``determinism_unavailable`` names what keeps an engine from it (CUDA, the torch attention, the
compiled step), and ``make_deterministic`` sets a loaded model's layers up for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from engine_service.model.prepacked import PrepackedLinear, _packed_linear
from engine_service.model.q8_blocks import Q8Linear
from engine_service.model.quantization import QuantizedLinear

# The rows of one product call for float32 and float16 weights in a deterministic engine: a step's
# rows go through calls of exactly this many (the last padded with zeros). Small, because one
# stream's decode step pays for the padded rows' arithmetic; the figures are in docs/determinism.md.
FIXED_TILE_ROWS = 8


def fixed_tile_rows(x: torch.Tensor, out_features: int,
                    product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product`` (a [FIXED_TILE_ROWS, in] -> [FIXED_TILE_ROWS, out] product) of every row of ``x``
    in calls of ``FIXED_TILE_ROWS`` rows, each row's output the same whatever the rows beside it:
    every call has the same shape and reads its rows from one buffer of its own (the same alignment
    every time), the last one padded with zeros."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, tile = x2.shape[0], FIXED_TILE_ROWS
    out = x2.new_empty(rows, out_features)
    buffer = x2.new_zeros(tile, shape[-1])
    for start in range(0, rows, tile):
        n = min(tile, rows - start)
        buffer[:n].copy_(x2[start : start + n])
        if n < tile:
            buffer[n:].zero_()
        out[start : start + n] = product(buffer)[:n]
    return out.reshape(*shape[:-1], out_features)


class FixedTileLinear(nn.Module):
    """An ``nn.Linear`` (float32, float16), a float16 ``PrepackedLinear`` or a tied output projection
    whose products run in fixed tiles (``fixed_tile_rows``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.inner
        if isinstance(inner, PrepackedLinear):
            return fixed_tile_rows(x, self.out_features, lambda t: _packed_linear(t, inner.packed, inner.bias))
        return fixed_tile_rows(x, self.out_features, lambda t: F.linear(t, inner.weight, inner.bias))


def products_unavailable(model: nn.Module) -> str | None:
    """None when every product of ``model`` can compute each row the same way whatever the batch
    (``make_deterministic``), else why not."""
    for name, module in model.named_modules():
        if isinstance(module, PrepackedLinear) and module.dtype == torch.bfloat16 and not module.gemv:
            return (f"{name}: its bfloat16 weight is not in the native GEMV's layout (no AVX512-BF16, or "
                    "oneDNN packed it otherwise), and oneDNN's products are not batch-invariant")
    return None


def make_deterministic(model: nn.Module) -> int:
    """Set a loaded model's products up to compute each row the same way whatever the batch (the
    module docstring), in place; returns how many layers it changed. The tied output projection
    (``compute_logits`` on the embedding) goes through a fixed-tile projection of its own."""
    changed = 0
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, PrepackedLinear,
                                                                                QuantizedLinear, Q8Linear))]
    for name, module in targets:
        if isinstance(module, QuantizedLinear) or (isinstance(module, Q8Linear) and module.native):
            module.dense_min_rows = None  # the packed (or block) kernel for every row count
        elif isinstance(module, PrepackedLinear) and module.gemv:
            module.set_deterministic()
        else:  # float32 / float16 (plain, or prepacked for oneDNN)
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, FixedTileLinear(module))
        changed += 1
    cfg = getattr(model, "config", None)
    if cfg is not None and cfg.tie_word_embeddings and getattr(model, "lm_head", None) is None:
        model.lm_head = FixedTileLinear(_TiedHead(model.model.embed_tokens.weight))
        changed += 1
    return changed


class _TiedHead(nn.Module):
    """The embedding table as an output projection, sharing its storage (no copy)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None
        self.out_features, self.in_features = weight.shape


def determinism_costly(model: nn.Module) -> str | None:
    """Why making ``model`` deterministic would cost a measurable share of its speed (so that the
    default leaves it off and says so), or None where it costs next to nothing: the bfloat16 native
    GEMV and the native int4 kernel already compute each row on its own. float32 and float16 products
    in fixed tiles pay MKL's and oneDNN's many-row kernel for every decode row (2-4x a float32 decode
    step on the development machine), and int8 and torch's int4 without their dense path pay the
    packed kernel for every prefill row (docs/determinism.md)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            if not module.native_q4 and module.dense_min_rows is not None:
                return f"{module.method}'s prefill without its dense products"
        elif isinstance(module, Q8Linear) and not module.native:
            return f"{str(module.kernel_dtype).removeprefix('torch.')} products in fixed tiles (no native int8 blocks)"
        elif isinstance(module, nn.Linear) or (isinstance(module, PrepackedLinear) and not module.gemv):
            dtype = module.weight.dtype if isinstance(module, nn.Linear) else module.dtype
            return f"{str(dtype).removeprefix('torch.')} products in fixed tiles"
    return None


def determinism_unavailable(model: nn.Module, device: torch.device, attention_backend: str,
                            compile_asked: bool) -> str | None:
    """None when an engine of this model, device, attention and compile setting can be deterministic
    (the module docstring), else why not, naming the knobs."""
    if device.type != "cpu":
        return (f"on {device.type} the products (cuBLAS) and the attention are not batch-invariant (only CPU "
                "engines are deterministic)")
    if attention_backend != "native":
        return ("the torch attention (attention_backend torch, or no native kernel here) pads each step's "
                "contexts to its longest and is not batch-invariant")
    if compile_asked:
        return ("the compiled decode step (enforce_eager false) fuses each batch shape's norms as inductor "
                "chooses, and runs prefill chunks eagerly")
    return products_unavailable(model)
