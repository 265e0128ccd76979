"""Weight-only quantization computed at load from the float weights: ``int8`` and ``int4``.

After ``load_model`` has built the float model, :func:`quantize_model` replaces every projection
(``nn.Linear``: q/k/v/o and the MLP's gate/up/down) and the output projection by a module that
keeps integer weights and runs torch's own packed CPU/CUDA kernels:

- ``int8``: symmetric, one scale per output channel (the group is the whole input row, the layout
  ``torch.ops.aten._weight_int8pack_mm`` takes): ``w ≈ q * scale``, ``q`` in [-127, 127].
- ``int4``: asymmetric and group-wise (default 32 input columns per group, the granularity of
  llama.cpp's Q4_1): ``w ≈ (q - 8) * scale + zero``, ``q`` in [0, 15], one (scale, zero) per
  group, run by ``_weight_int4pack_mm_for_cpu`` (``_weight_int4pack_mm`` on CUDA) on weights
  packed once at load by ``_convert_weight_to_int4pack[_for_cpu]``.

Both kernels read the weights as integers and dequantize in registers, so a decode step reads a
quarter (int8) or an eighth (int4, plus its scales) of the float32 bytes. They are built for a few
rows: on CPU their time grows with every row (about 11 µs a row through a 1536 x 576 layer here,
where a dense bfloat16 product of 512 rows takes 0.5 ms in all). So a product of at least
``DENSE_MIN_ROWS`` rows (a prefill chunk, a big batch) dequantizes the layer's weights into a dense
matrix for that call and multiplies it with torch's dense GEMM instead: the same integer weights,
no extra memory kept, several times less time (docs/performance.md has the figures). The
dequantization is a native one-pass kernel (``sluice::dequantize_int4``/``_int8``, built with the
attention's; ``dequantize_int4_packed`` and ``dequantize_int8_rows`` are its torch reference, equal
bit for bit). int4 reads its codes out of torch's packed layout itself; each layer checks at load
that the unpacking returns exactly the codes it packed. Where the kernel cannot be built, or the
layout is not the one the unpacking knows (CUDA, another torch), every product runs the packed
kernel, as before.

On a CPU with AVX512-VNNI, int4 has a layout of its own instead (``pack_q4``, read in place by the
native ``sluice::q4_linear``, kernels/q4_gemv.c): the activations are rounded to int8 per 32
inputs and multiplied in integers, with AMX tiles for many rows where the CPU has them. That
kernel stays ahead of the dense path far longer, so its crossover is ``DENSE_MIN_ROWS_Q4``, by the
kernel dtype, and prefill chunks below it round their activations as decode steps do.

The activations go through the kernel in the *kernel dtype* (``pick_kernel_dtype``: bfloat16 wherever the
kernel takes it, else float32; a rule, not a timing); the result is cast back to the model's dtype,
so the rest of the model (norms, attention, the KV cache) is unchanged.

The tied output projection (SmolLM2 shares it with the embedding) gets its own quantized copy
(``model.lm_head``); the embedding lookup keeps the float table.

A combination the device cannot run (no kernel for it in this torch build, e.g. int4 before
sm80 on CUDA) is refused at load by :func:`check_supported`, which runs the kernel once on a
tiny input and reports why it failed.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from engine_service.config import QUANTIZATION_METHODS
from engine_service.model.linear_swap import swap_linears
from engine_service.model.native import native_ops_unavailable

logger = logging.getLogger(__name__)

DEFAULT_INT4_GROUP_SIZE = 32
INT4_INNER_K_TILES = 2
INT4_N_MULTIPLE = 16  # the tiling the packed int4 layout is built for (CUDA: 2, 4 or 8)
INT4_CPU_BLOCK_N = 64  # the CPU packed layout's block of output rows (see unpack_int4_cpu)
# From this many rows a product dequantizes the weights and runs a dense GEMM: where the two cost
# the same for a decoder layer's projections here (int4 in torch's packed layout: 45-55 rows, int8: 25-35; the table is in
# docs/performance.md). A layer whose dense copy outgrows the caches (the output projection's
# 49,152 rows) pays again to read it back, and its crossing is about three times later.
DENSE_MIN_ROWS = {"int4": 64, "int8": 32}
# int4 in the native layout (kernels/q4_gemv.c: integer dot products, AMX tiles from 12 rows where the
# CPU has them) stays in its kernel far longer, by the kernel dtype: its dense path dequantizes with
# portable C (several ms a layer), and float32's dense GEMM is slow. Measured with
# scripts/bench_dense_crossover.py (docs/performance.md): float32 dense never catches up by 2048
# rows; bfloat16 (oneDNN's GEMM) crosses at 512-1024.
DENSE_MIN_ROWS_Q4 = {torch.float32: 2048, torch.bfloat16: 512}
Q4_MAX_ROWS = 4096  # the native kernel's most rows in one call (kernels/q4_gemv.h)
DENSE_LARGE_BYTES = 16 << 20
Q4_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)  # what sluice::q4_linear takes and returns
DENSE_LARGE_FACTOR = 3


class QuantizationError(ValueError):
    """A quantization method or device combination this build cannot run."""


def parse_quantization(name: str | None) -> str | None:
    if name is None or name in ("", "none", "None"):
        return None
    key = name.lower()
    if key not in QUANTIZATION_METHODS:
        raise QuantizationError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or none), got {name!r}"
        )
    return key


# --------------------------------------------------------------------------- numerics (reference)
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``weight`` [N, K] float -> (q int8 [N, K], scales [N] f32)
    with ``weight ≈ q * scales[:, None]``."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 (min/max per group): ``weight`` [N, K] float -> (q int32 [N, K]
    in [0, 15], scales [N, K/g] f32, zeros [N, K/g] f32) with
    ``weight ≈ (q - 8) * scale + zero`` per group (the tinygemm convention torch's kernels use)."""
    n, k = weight.shape
    if k % group_size:
        raise QuantizationError(f"int4 needs the input size {k} to be a multiple of the group size {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)
    lo = w.amin(dim=2)
    hi = w.amax(dim=2)
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.int32)
    zeros = lo + 8.0 * scales
    return q.reshape(n, k), scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    g = q.reshape(n, k // group_size, group_size).float()
    return ((g - 8.0) * scales[..., None] + zeros[..., None]).reshape(n, k)


# --------------------------------------------------------------------------- kernels
def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The kernel layout of int4 codes ``q`` ([N, K] int32 in [0, 15]) on ``device``."""
    if _is_cuda(device):
        # The CUDA kernel packs two codes per byte, high nibble first, before its own tiling.
        qu8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
        return torch.ops.aten._convert_weight_to_int4pack(qu8, INT4_INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(device), INT4_INNER_K_TILES)


def int4_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[K/g, N, 2] (scale, zero) pairs, the layout the int4 kernels read."""
    return torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()


def unpack_int4_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int4 codes ([N, K] uint8 in [0, 15]) held in the CPU packed layout of ``pack_int4``.

    That layout (torch's ``_convert_weight_to_int4pack_for_cpu``) cuts the N output rows into
    blocks of 64 and stores each block K-major, 32 bytes per input column: the low nibble of byte
    ``j`` holds row ``j`` of the block, the high nibble row ``32 + j``. It is torch's internal
    layout, so callers check the result against the codes they packed (``QuantizedLinear``)."""
    blocks = packed.view(n // INT4_CPU_BLOCK_N, k, INT4_CPU_BLOCK_N // 2)
    low = (blocks & 15).transpose(1, 2)
    high = (blocks >> 4).transpose(1, 2)
    return torch.stack([low, high], dim=1).reshape(n, k)


def dequantize_int4_packed(packed: torch.Tensor, scales_zeros: torch.Tensor, n: int, k: int,
                           group_size: int) -> torch.Tensor:
    """The dense [N, K] weights (in ``scales_zeros``' dtype) of a CPU-packed int4 layer, in torch
    operations: the reference of the native ``sluice::dequantize_int4`` (bitwise, in float32 with
    one rounding to the output dtype)."""
    codes = unpack_int4_cpu(packed, n, k).view(n, k // group_size, group_size).float()
    scales = scales_zeros[..., 0].t().float()[..., None]  # [N, K/g, 1]
    zeros = scales_zeros[..., 1].t().float()[..., None]
    return ((codes - 8.0) * scales + zeros).view(n, k).to(scales_zeros.dtype)


def dequantize_int8_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q * scales[:, None]`` in ``scales``' dtype (float32 math, one rounding): the reference of
    the native ``sluice::dequantize_int8``."""
    return (q.float() * scales.float()[:, None]).to(scales.dtype)


Q4_BLOCK_N = 16  # output rows per block of the native int4 layout (kernels/q4_gemv.h)
Q4_STEP_K = 8  # inputs per 64-byte step of a block


def pack_q4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes ``q`` ([N, K] in [0, 15], N a multiple of 16) and their per-group ``scales`` and
    ``mins`` ([N, K/g]; ``w = code * scale + min``) in the layout of the native ``sluice::q4_linear``
    (kernels/q4_gemv.h): codes [N/16, K/8, 64] uint8, where byte 4r + j of a block's step holds row
    r's inputs j (low nibble) and 4 + j (high nibble), so that each 32-bit lane is one row's four
    consecutive inputs; scales_zeros [N/16, K/g, 2, 16] float16 (scale, then min, of the block's 16
    rows): a GGUF Q4_0/Q4_1 block's own (d, m) pairs, so its weights come through without a rounding."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n // Q4_BLOCK_N, Q4_BLOCK_N, k // Q4_STEP_K, Q4_STEP_K)
    packed = blocks[..., :4] | (blocks[..., 4:] << 4)  # [N/16, 16, K/8, 4]
    codes = packed.permute(0, 2, 1, 3).reshape(n // Q4_BLOCK_N, k // Q4_STEP_K, 4 * Q4_BLOCK_N).contiguous()
    groups = scales.shape[1]

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // Q4_BLOCK_N, Q4_BLOCK_N, groups).transpose(1, 2)

    scales_zeros = torch.stack([per_block(scales), per_block(mins)], dim=2).to(torch.float16).contiguous()
    if not bool(torch.isfinite(scales_zeros).all()):
        raise QuantizationError("int4 weights beyond float16's range (65504): a group's scale or minimum overflows")
    return codes, scales_zeros


def unpack_q4(codes: torch.Tensor) -> torch.Tensor:
    """The [N, K] uint8 codes held in ``pack_q4``'s layout."""
    nb, steps, _ = codes.shape
    c = codes.view(nb, steps, Q4_BLOCK_N, 4)
    both = torch.cat([c & 15, c >> 4], dim=-1)  # [N/16, K/8, 16, 8]
    return both.permute(0, 2, 1, 3).reshape(nb * Q4_BLOCK_N, steps * Q4_STEP_K)


def dequantize_q4(codes: torch.Tensor, scales_zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weights of ``pack_q4``'s layout in ``dtype`` (float32 arithmetic, one rounding):
    the torch reference of the native ``sluice::dequantize_q4``."""
    q = unpack_q4(codes)
    n, k = q.shape
    groups = scales_zeros.shape[1]
    scales = scales_zeros[:, :, 0, :].transpose(1, 2).reshape(n, groups, 1).float()
    mins = scales_zeros[:, :, 1, :].transpose(1, 2).reshape(n, groups, 1).float()
    return (q.view(n, groups, k // groups).float() * scales + mins).view(n, k).to(dtype)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    if _is_cuda(x.device):
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)


def int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, q, scales)


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held as int8 or int4 and multiplied by torch's packed kernel."""

    def __init__(self, method: str, in_features: int, out_features: int, kernel_dtype: torch.dtype,
                 group_size: int | None, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.method = method
        self.in_features = in_features
        self.out_features = out_features
        self.kernel_dtype = kernel_dtype
        self.group_size = group_size
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # From how many rows a product dequantizes the weights (from_float; None: never).
        self.dense_min_rows: int | None = None
        # int4 in the native layout (codes, scales_zeros: pack_q4), run by sluice::q4_linear
        self.native_q4 = False

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, method: str,
                   kernel_dtype: torch.dtype, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> QuantizedLinear:
        out_features, in_features = weight.shape
        device = weight.device
        mod = cls(method, in_features, out_features, kernel_dtype,
                  group_size if method == "int4" else None, bias)
        if method == "int8":
            q, scales = quantize_int8(weight)
            mod.register_buffer("qweight", q.to(device))
            mod.register_buffer("scales", scales.to(device=device, dtype=kernel_dtype))
            dense_ok = device.type == "cpu"
        elif method == "int4":
            pad = -out_features % INT4_N_MULTIPLE  # the packed layout tiles N by 16: zero rows, sliced off
            if pad:
                weight = torch.cat([weight, weight.new_zeros(pad, in_features)])
            q, scales, zeros = quantize_int4(weight, group_size)
            if device.type == "cpu" and native_q4_available():
                # the native layout: decode rows multiplied in integers in place (kernels/q4_gemv.c)
                codes, scales_zeros = pack_q4(q, scales, zeros - 8.0 * scales)
                mod.register_buffer("codes", codes)
                mod.register_buffer("scales_zeros", scales_zeros)
                mod.native_q4 = True
                dense_ok = True
            else:
                mod.register_buffer("qweight", pack_int4(q, device))
                mod.register_buffer("scales_zeros", int4_scales_and_zeros(scales, zeros, kernel_dtype).to(device))
                dense_ok = _unpacks_exactly(mod.qweight, q, device)
        else:
            raise QuantizationError(f"unknown quantization method {method!r}")
        mod._set_dense_rows(dense_ok, weight.shape[0])
        return mod

    @classmethod
    def from_q4(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None,
                kernel_dtype: torch.dtype = torch.float32) -> QuantizedLinear:
        """A layer over int4 codes as they are (a GGUF Q4_0/Q4_1/Q4_K tensor, ``gguf_blocks``):
        ``codes`` [N, K] in [0, 15], ``scales`` and ``mins`` [N, K/32] with ``w = code * scale + min``,
        in the native layout (the caller checked ``native_q4_available``); no weight is rounded
        again, and the (scale, min) pairs are kept in float16, as Q4_0 and Q4_1 hold them."""
        out_features, in_features = codes.shape
        group = in_features // scales.shape[1]
        if kernel_dtype not in Q4_ACTIVATION_DTYPES:
            kernel_dtype = torch.float32
        mod = cls("int4", in_features, out_features, kernel_dtype, group, bias)
        pad = -out_features % INT4_N_MULTIPLE
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, in_features)])
            scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
            mins = torch.cat([mins, mins.new_zeros(pad, mins.shape[1])])
        packed, scales_zeros = pack_q4(codes, scales, mins)
        mod.register_buffer("codes", packed)
        mod.register_buffer("scales_zeros", scales_zeros)
        mod.native_q4 = True
        mod._set_dense_rows(True, codes.shape[0])
        return mod

    def _set_dense_rows(self, dense_ok: bool, padded_rows: int) -> None:
        # Only the native one-pass kernel pays: the same dequantization in torch operations costs
        # 1-6 ms a layer here, as much as the packed kernel's 100-500 rows.
        if dense_ok and _native_dequantize():
            rows = DENSE_MIN_ROWS_Q4.get(self.kernel_dtype, DENSE_MIN_ROWS[self.method]) if self.native_q4 \
                else DENSE_MIN_ROWS[self.method]
            dense_bytes = padded_rows * self.in_features * self.kernel_dtype.itemsize
            self.dense_min_rows = rows * DENSE_LARGE_FACTOR if dense_bytes > DENSE_LARGE_BYTES else rows
            if self.native_q4:
                self.dense_min_rows = min(self.dense_min_rows, Q4_MAX_ROWS)

    def dense_weight(self) -> torch.Tensor:
        """The layer's weights dequantized into a dense [N, K] matrix of the kernel dtype (int4: N
        padded to the packed tiling), by the native kernel (only a layer with ``dense_min_rows``
        has it); ``dequantize_int4_packed`` and ``dequantize_int8_rows`` are its torch reference."""
        if self.method == "int8":
            return torch.ops.sluice.dequantize_int8(self.qweight, self.scales)
        if self.native_q4:
            return torch.ops.sluice.dequantize_q4(self.codes, self.scales_zeros, self.kernel_dtype == torch.float32)
        return torch.ops.sluice.dequantize_int4(self.qweight, self.scales_zeros, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out_dtype = x.dtype
        x2 = x.reshape(-1, self.in_features)
        if (self.native_q4 and x2.dtype in Q4_ACTIVATION_DTYPES
                and (self.dense_min_rows is None or x2.shape[0] < self.dense_min_rows)):
            # the model's own dtype goes in and comes out: no casts around the product; more rows
            # than the kernel takes in one call (a deterministic engine's, whose products never go
            # dense) in calls of Q4_MAX_ROWS, each row's output its own
            y = torch.cat([torch.ops.sluice.q4_linear(x2[r : r + Q4_MAX_ROWS], self.codes, self.scales_zeros,
                                                      self.out_features)
                           for r in range(0, x2.shape[0], Q4_MAX_ROWS)]) if x2.shape[0] > Q4_MAX_ROWS else \
                torch.ops.sluice.q4_linear(x2, self.codes, self.scales_zeros, self.out_features)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*shape[:-1], self.out_features)
        if x2.dtype != self.kernel_dtype:
            x2 = x2.to(self.kernel_dtype)
        if self.dense_min_rows is not None and x2.shape[0] >= self.dense_min_rows:
            y = torch.nn.functional.linear(x2, self.dense_weight())
        elif self.method == "int8":
            y = int8_mm(x2, self.qweight, self.scales)
        else:
            y = int4_mm(x2.contiguous(), self.qweight, self.group_size, self.scales_zeros)
        if y.shape[1] != self.out_features:  # int4's padded rows
            y = y[:, : self.out_features]
        if y.dtype != out_dtype:
            y = y.to(out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        extra = f", group_size={self.group_size}" if self.group_size else ""
        extra += f", dense from {self.dense_min_rows} rows" if self.dense_min_rows else ""
        return (f"{self.method}, in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel_dtype={self.kernel_dtype}{extra}")


_reasons_logged: set[str] = set()


def _native_dequantize() -> bool:
    """Whether the native dequantization operators are loaded (built at first use); why they are
    not is logged once (per reason), and every product then runs the packed kernel."""
    why = native_ops_unavailable()
    if why is not None and why not in _reasons_logged:
        _reasons_logged.add(why)
        logger.warning("quantized layers run every product through the packed kernels (slower prefill: "
                       "no native dequantization): %s", why)
    return why is None


def native_q4_available() -> bool:
    """Whether int4 layers can take the native layout here: the operators are loaded and the CPU
    runs the VNNI kernel (else torch's packed int4 kernel, as before)."""
    return _native_dequantize() and bool(torch.ops.sluice.q4_supported())


def _unpacks_exactly(packed: torch.Tensor, codes: torch.Tensor, device: torch.device) -> bool:
    """Whether ``unpack_int4_cpu`` reads ``codes`` back out of their packed form (CPU only)."""
    n, k = codes.shape
    if device.type != "cpu" or n % INT4_CPU_BLOCK_N or packed.shape != (n, k // 2) or packed.dtype != torch.uint8:
        return False
    return bool(torch.equal(unpack_int4_cpu(packed, n, k), codes.to(torch.uint8)))


# --------------------------------------------------------------------------- support and choice
def _kernel_dtypes(device: torch.device) -> list[torch.dtype]:
    # The int4 kernels take bfloat16 (and float16 on CUDA) activations; int8 takes any float.
    if _is_cuda(device):
        return [torch.bfloat16]
    return [torch.bfloat16, torch.float32]


def _probe(method: str, device: torch.device, dtype: torch.dtype, n: int = 64, k: int = 256,
           group_size: int = DEFAULT_INT4_GROUP_SIZE) -> QuantizedLinear:
    # Fixed inputs: the verdict must not depend on a random draw (it decides which kernels run).
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.05
    mod = QuantizedLinear.from_float(w.to(device), None, method, dtype, group_size)
    x = torch.randn(2, k, generator=gen).to(device=device, dtype=dtype)
    y = mod(x)
    ref = torch.nn.functional.linear(x.float(), w.to(device))
    err = (y.float() - ref).abs().max().item()
    if not err < 0.1 * ref.abs().max().item() + 1e-3:
        raise RuntimeError(f"the kernel's result is off by {err:.3g}")
    return mod


def check_supported(method: str, device: torch.device | str,
                    group_size: int = DEFAULT_INT4_GROUP_SIZE) -> list[torch.dtype]:
    """The kernel dtypes ``method`` runs with on ``device``; raises ``QuantizationError`` saying why
    when there is none (no kernel in this torch build, an unsupported GPU, ...)."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise QuantizationError(f"quantization={method!r} runs on cpu or cuda, not {device.type!r}")
    if method == "int4" and group_size not in (32, 64, 128, 256):
        raise QuantizationError(f"int4 group size must be 32, 64, 128 or 256, got {group_size}")
    ok: list[torch.dtype] = []
    errors: list[str] = []
    for dtype in _kernel_dtypes(device):
        try:
            _probe(method, device, dtype, group_size=group_size)
            ok.append(dtype)
        except (RuntimeError, NotImplementedError) as exc:
            errors.append(f"{dtype}: {str(exc).splitlines()[0][:200]}")
    if not ok:
        name = torch.cuda.get_device_name(device) if _is_cuda(device) else "this CPU"
        raise QuantizationError(
            f"quantization={method!r} cannot run on {device} ({name}) with torch {torch.__version__}: "
            + "; ".join(errors)
        )
    return ok


def pick_kernel_dtype(candidates: list[torch.dtype]) -> torch.dtype:
    """The kernel dtype among ``candidates`` (``check_supported``'s, in its order): bfloat16 wherever
    the kernels take it, else float32. A rule, not a timing: the same machine always gets the same
    kernels. Why bfloat16 first: torch's int4 and int8 kernels vectorise their bfloat16 path and not
    their float one (several times faster where the CPU has AVX512-BF16; docs/performance.md)."""
    return torch.bfloat16 if torch.bfloat16 in candidates else candidates[0]


# --------------------------------------------------------------------------- the model swap
def quantize_model(model: nn.Module, method: str, *, group_size: int = DEFAULT_INT4_GROUP_SIZE,
                   kernel_dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`QuantizedLinear`, and give a
    tied-embedding model its own quantized output projection. Returns the model."""
    method = parse_quantization(method)
    if method is None:
        return model
    started = time.perf_counter()
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return model
    candidates = check_supported(method, device, group_size)
    if kernel_dtype is None:
        kernel_dtype = pick_kernel_dtype(candidates)
    elif kernel_dtype not in candidates:
        raise QuantizationError(f"quantization={method!r} cannot use kernel dtype {kernel_dtype} on {device}")

    def build(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantizedLinear:
        return QuantizedLinear.from_float(weight, bias, method, kernel_dtype, group_size)

    swapped = swap_linears(model, build)
    float_bytes = sum(w.numel() * w.element_size() for w, _ in swapped)
    quant_bytes = sum(b.numel() * b.element_size() for _, q in swapped for b in q.buffers())
    logger.info("quantized %d linear layers to %s (kernel dtype %s%s): %.0f MB of weights -> %.0f MB in %.1fs",
                len(swapped), method, kernel_dtype, f", group {group_size}" if method == "int4" else "",
                float_bytes / 1e6, quant_bytes / 1e6, time.perf_counter() - started)
    return model
