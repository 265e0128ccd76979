"""int8 block-quantized weights as GGUF stores them (Q8_0, Q6_K), served without re-quantization.

Both formats are int8 codes with one float32 scale per group of ``g`` inputs, ``w = code * scale``:

- Q8_0: blocks of 32 weights, ``w = d * q`` (``d`` float16, ``q`` int8): ``g = 32``, scale ``d``;
- Q6_K: super-blocks of 256 in 16 sub-blocks of 16, ``w = d * sc * (q - 32)`` (``d`` float16,
  ``sc`` int8, ``q`` 6 bits): ``g = 16``, code ``q - 32``, scale ``d * sc`` (exact in float32: an
  11-bit by 8-bit product).

:func:`gguf_q8_0_codes` and :func:`gguf_q6_k_codes` decode GGUF's raw block bytes into those codes
and scales; :func:`pack_q8` lays them out for the native ``sluice::q8_linear`` (kernels/q8_gemv.h:
the codes stored as ``code + 128``, unsigned, 16 rows x 4 inputs per 64 bytes, read in place by
AVX512-VNNI integer dot products with the activations rounded to int8 per 32 inputs, as
``sluice::q4_linear`` does for int4); :class:`Q8Linear` is the layer.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine_service.model.native import native_ops_unavailable

Q8_BLOCK_N = 16  # output rows per block of the layout (kernels/q8_gemv.h)
Q8_STEP_K = 4  # inputs per 64-byte step of a block
Q8_XBLOCK = 32  # inputs per activation scale: k must be a multiple of it
Q8_GROUPS = (16, 32)  # the group sizes the kernel takes
Q8_MAX_ROWS = 4096  # the native kernel's most rows in one call
Q8_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)  # what sluice::q8_linear takes and returns
# From this many rows a product dequantizes the weights (native, portable C) and runs a dense
# GEMM. The kernel stays ahead of the dense path up to the most rows it takes in one call: its
# time over the dense path's at 256 / 1024 / 2048 / 4096 rows, one thread of an AMD EPYC (Zen 4)
# shared with other jobs, the two alternating in one process (a one-off A/B, not kept):
#   49152x576: float32 0.28 / 0.40 / 0.47 / 0.51, bfloat16 0.56 / 0.80 / 0.83 / 0.96;
#   576x1536:  float32 0.37 / 0.39 / 0.39 / 0.43, bfloat16 0.70 / 0.85 / 0.91 / 0.95.
# So only a product of Q8_MAX_ROWS rows or more (which the kernel would take in several calls)
# goes dense, whatever the kernel dtype.
DENSE_MIN_ROWS_Q8 = Q8_MAX_ROWS

# GGUF block sizes in bytes (ggml's block_q8_0 and block_q6_K)
Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # d (float16), qs[32] (int8)
Q6_K_BLOCK, Q6_K_BYTES = 256, 210  # ql[128], qh[64], scales[16] (int8), d (float16)


class Q8FormatError(ValueError):
    """Weights or raw GGUF blocks whose shape, dtype or size is not the format's."""


# --------------------------------------------------------------------------- GGUF blocks
def _raw_blocks(raw: np.ndarray, n: int, k: int, block: int, nbytes: int, name: str) -> np.ndarray:
    if n <= 0 or k <= 0 or k % block:
        raise Q8FormatError(f"{name} needs a positive input size that is a multiple of {block}, got [{n}, {k}]")
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.size != n * (k // block) * nbytes:
        raise Q8FormatError(f"{name} [{n}, {k}] is {n * (k // block) * nbytes} bytes of uint8 blocks "
                            f"({nbytes} per {block} weights), got {raw.size} of {raw.dtype}")
    return np.ascontiguousarray(raw).reshape(n * (k // block), nbytes)


def gguf_q8_0_codes(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 blocks (the uint8 array ``gguf.GGUFReader`` gives as a tensor's ``data``, [n,
    bytes per row]) -> (codes int8 [n, k], scales float32 [n, k/32]), ``codes * scales`` exactly
    the weights ggml dequantizes."""
    blocks = _raw_blocks(raw, n, k, Q8_0_BLOCK, Q8_0_BYTES, "Q8_0")
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    codes = blocks[:, 2:].copy().view(np.int8)
    return torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(d.reshape(n, k // Q8_0_BLOCK))


def gguf_q6_k_codes(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q6_K super-blocks (as ``gguf_q8_0_codes`` takes them) -> (codes int8 [n, k] in [-32, 31],
    scales float32 [n, k/16]), ``codes * scales`` exactly the weights ggml dequantizes.

    A super-block of 256 weights is two halves of 128: half h's weight 32 * j + l (j = 0..3, l =
    0..31) has its low four bits in ``ql[64 h + 32 (j & 1) + l]`` (the low nibble for j < 2, the
    high one after) and its top two in bits 2j, 2j + 1 of ``qh[32 h + l]``; sub-block s (16 weights)
    has scale ``d * scales[s]`` (gguf's quants.Q6_K.dequantize_blocks)."""
    blocks = _raw_blocks(raw, n, k, Q6_K_BLOCK, Q6_K_BYTES, "Q6_K")
    nb = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    low = ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & np.uint8(0x0F)).reshape(nb, 2, 128)
    high = qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(0x03)).reshape(nb, 2, 128)
    codes = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = d * sc  # [nb, 16], exact
    return torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(scales.reshape(n, k // 16))


# --------------------------------------------------------------------------- the layout
def _check_codes_scales(codes: torch.Tensor, scales: torch.Tensor) -> int:
    if codes.dim() != 2 or codes.dtype != torch.int8:
        raise Q8FormatError(f"codes must be int8 [N, K], got {codes.dtype} {list(codes.shape)}")
    n, k = codes.shape
    if n == 0 or k == 0 or k % Q8_XBLOCK:
        raise Q8FormatError(f"the input size {k} must be a positive multiple of {Q8_XBLOCK}, with rows (N={n})")
    if scales.dim() != 2 or scales.dtype != torch.float32 or scales.shape[0] != n or scales.shape[1] == 0 \
            or k % scales.shape[1] or k // scales.shape[1] not in Q8_GROUPS:
        raise Q8FormatError(f"scales must be float32 [{n}, K/g] with g in {Q8_GROUPS}, got {scales.dtype} "
                            f"{list(scales.shape)}")
    return k // scales.shape[1]


def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``codes`` [N, K] and their float32 ``scales`` [N, K/g] (g = 16 or 32) in the layout of
    the native ``sluice::q8_linear`` (kernels/q8_gemv.h), N padded with zero rows to a multiple of
    16: codes [N/16, K/4, 64] uint8, byte 4r + j of a block's step t holding code + 128 of row r,
    input 4t + j; scales [N/16, K/g, 16] float32."""
    _check_codes_scales(codes, scales)
    n, k = codes.shape
    pad = -n % Q8_BLOCK_N
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
    n_pad, groups = n + pad, scales.shape[1]
    biased = (codes.to(torch.int16) + 128).to(torch.uint8)
    blocks = biased.view(n_pad // Q8_BLOCK_N, Q8_BLOCK_N, k // Q8_STEP_K, Q8_STEP_K)
    packed = blocks.permute(0, 2, 1, 3).reshape(n_pad // Q8_BLOCK_N, k // Q8_STEP_K, 4 * Q8_BLOCK_N).contiguous()
    block_scales = scales.view(n_pad // Q8_BLOCK_N, Q8_BLOCK_N, groups).transpose(1, 2).contiguous()
    return packed, block_scales


def unpack_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes [N_pad, K] and float32 scales [N_pad, K/g] held in ``pack_q8``'s layout."""
    nb, steps, _ = codes.shape
    c = codes.view(nb, steps, Q8_BLOCK_N, Q8_STEP_K).permute(0, 2, 1, 3).reshape(nb * Q8_BLOCK_N, steps * Q8_STEP_K)
    q = (c.to(torch.int16) - 128).to(torch.int8)
    return q, scales.transpose(1, 2).reshape(nb * Q8_BLOCK_N, scales.shape[1])


def dequantize_q8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N_pad, K] weights of ``pack_q8``'s layout in ``dtype`` (float32 products, one
    rounding): the torch reference of the native ``sluice::dequantize_q8``, equal bit for bit."""
    q, s = unpack_q8(codes, scales)
    n, k = q.shape
    groups = s.shape[1]
    return (q.view(n, groups, k // groups).float() * s[..., None]).view(n, k).to(dtype)


# --------------------------------------------------------------------------- the layer
def native_q8() -> bool:
    """Whether the native operators are loaded (built at first use) and the CPU runs the VNNI kernel."""
    return native_ops_unavailable() is None and bool(torch.ops.sluice.q8_supported())


class Q8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` held as int8 codes and float32 scales per group of 16 or 32
    inputs (GGUF Q6_K, Q8_0), multiplied by the native ``sluice::q8_linear`` in place.

    ``x`` is float32 or bfloat16 of any leading shape; ``y`` has ``x``'s dtype. Products of at least
    ``dense_min_rows`` rows dequantize the weights into a dense matrix of ``kernel_dtype`` for that
    call and run ``F.linear`` (no extra memory kept); ``None`` means every product takes the kernel,
    whose rows are each the same bit for bit whatever rows share the call (the deterministic mode).

    Where the native operators cannot run (no compiler, no AVX512-VNNI), the layer dequantizes its
    weights once, at construction, into a dense ``kernel_dtype`` matrix and every product is
    ``F.linear`` (``native`` is False; the memory is that of the dense weights)."""

    def __init__(self, in_features: int, out_features: int, group_size: int, kernel_dtype: torch.dtype,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.kernel_dtype = kernel_dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.native = False
        self.dense_min_rows: int | None = None

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                   kernel_dtype: torch.dtype = torch.float32) -> Q8Linear:
        """The layer of int8 ``codes`` [N, K] and float32 ``scales`` [N, K/g] (``gguf_q8_0_codes``,
        ``gguf_q6_k_codes``), on CPU."""
        if kernel_dtype not in Q8_ACTIVATION_DTYPES:
            raise Q8FormatError(f"kernel_dtype must be float32 or bfloat16, got {kernel_dtype}")
        group = _check_codes_scales(codes, scales)
        n, k = codes.shape
        if bias is not None and bias.shape != (n,):
            raise Q8FormatError(f"bias must be [{n}], got {list(bias.shape)}")
        mod = cls(k, n, group, kernel_dtype, bias)
        packed, block_scales = pack_q8(codes, scales)
        if native_q8():
            mod.register_buffer("codes", packed)
            mod.register_buffer("scales", block_scales)
            mod.native = True
            mod.dense_min_rows = DENSE_MIN_ROWS_Q8
        else:
            mod.register_buffer("weight", dequantize_q8(packed, block_scales, kernel_dtype)[:n].contiguous())
        return mod

    def dense_weight(self) -> torch.Tensor:
        """The weights as a dense [N_pad, K] matrix of the kernel dtype (N padded to 16 where native)."""
        if not self.native:
            return self.weight
        return torch.ops.sluice.dequantize_q8(self.codes, self.scales, self.kernel_dtype == torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if self.native and x2.dtype in Q8_ACTIVATION_DTYPES and (self.dense_min_rows is None
                                                                 or rows < self.dense_min_rows):
            # more rows than the kernel takes in one call (a deterministic engine's) in calls of
            # Q8_MAX_ROWS: each row's output is its own
            y = torch.cat([torch.ops.sluice.q8_linear(x2[r: r + Q8_MAX_ROWS], self.codes, self.scales,
                                                      self.out_features)
                           for r in range(0, rows, Q8_MAX_ROWS)]) if rows > Q8_MAX_ROWS else \
                torch.ops.sluice.q8_linear(x2, self.codes, self.scales, self.out_features)
        else:
            y = nn.functional.linear(x2.to(self.kernel_dtype), self.dense_weight())
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = f"native, dense from {self.dense_min_rows} rows" if self.native and self.dense_min_rows \
            else "native" if self.native else "dense"
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"kernel_dtype={self.kernel_dtype}, {path}")
