"""int8 block-quantized weights (engine_service/model/q8_blocks.py) and their native products
(kernels/q8_gemv.c, ``sluice::q8_linear``).

GGUF's Q8_0 and Q6_K blocks decode into int8 codes and float32 scales whose products are exactly
gguf's dequantized weights. The kernel multiplies the codes by int8-quantized activations (per 32
inputs, as q4_linear does), so it is checked (1) against the same arithmetic in float64 torch
operations, to float32 summation error, and (2) against the float product of the weights, within
the bound the activation rounding allows; every row of a product must be the same bit for bit
whatever rows share the call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine_service.model import q8_blocks
from engine_service.model.q8_blocks import (
    Q8FormatError,
    Q8Linear,
    dequantize_q8,
    gguf_q6_k_codes,
    gguf_q8_0_codes,
    pack_q8,
    unpack_q8,
)


@pytest.fixture
def native():
    from engine_service.model.native import native_ops_unavailable

    why = native_ops_unavailable()
    assert why is None, f"the native operators must build on this machine (gcc, g++): {why}"
    if not torch.ops.sluice.q8_supported():
        pytest.skip("this CPU has no AVX512-VNNI: Q8Linear runs dense (test_the_layer_without_the_kernel)")


def _codes_scales(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes as the formats make them: Q8_0's whole int8 range, Q6_K's [-32, 31], and scales
    of either sign (Q6_K's sub-block scales are signed)."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 128) if group == 32 else (-32, 32)
    codes = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.randn(n, k // group, generator=gen) * (0.05 / (hi / 2))
    return codes, scales


def _random_f16_bits(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random finite float16 values as bytes: every exponent but inf/NaN's, subnormals included."""
    bits = rng.integers(0, 1 << 16, size=size, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)
    return bits.view(np.uint8).reshape(size, 2)


def _emulated(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: x rounded to int8 per 32 inputs (scale max|x| / 127, ties
    to even, 127 / amax in float32 as C divides), then per group sum(code * xq) * (s_w * s_x)."""
    q, s = unpack_q8(codes, scales)
    n, k = q.shape
    groups = s.shape[1]
    g = k // groups
    xf = x.float().reshape(-1, k)
    blocks = xf.view(-1, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv).view(-1, k).double()
    xs = (amax / 127.0).view(-1, k // 32).repeat_interleave(32 // g, dim=1).double()  # [M, groups]
    isum = torch.einsum("ngj,mgj->mng", q.double().view(n, groups, g), xq.view(-1, groups, g))
    return (isum * s.double()[None] * xs[:, None, :]).sum(-1)


# --------------------------------------------------------------------------- GGUF blocks
def test_q8_0_blocks_decode_exactly_to_ggufs_weights():
    rng = np.random.default_rng(0)
    n, k = 24, 256
    weights = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    weights[3, :32] = 0.0  # an all-zero block: d = 0
    quantized = gguf_quantize(weights, GGMLQuantizationType.Q8_0)
    # and raw blocks no quantizer makes: code -128, any finite float16 d (subnormals, negatives)
    raw = rng.integers(0, 256, size=(n, k // 32 * 34), dtype=np.uint8).reshape(n * k // 32, 34)
    raw[:, :2] = _random_f16_bits(rng, n * k // 32)
    for data in (quantized, raw.reshape(n, -1)):
        codes, scales = gguf_q8_0_codes(data, n, k)
        assert codes.dtype == torch.int8 and codes.shape == (n, k)
        assert scales.dtype == torch.float32 and scales.shape == (n, k // 32)
        want = gguf_dequantize(data, GGMLQuantizationType.Q8_0)
        got = (codes.float().view(n, k // 32, 32) * scales[..., None]).view(n, k)
        assert np.array_equal(got.numpy(), want)  # NaN-free: bitwise equal
    assert codes.min() == -128


def _random_q6_k(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Random Q6_K super-blocks byte by byte (gguf's quants.py has no Q6_K quantizer): ql[128],
    qh[64], scales[16] int8, d float16 (block_q6_K)."""
    blocks = n * k // 256
    raw = rng.integers(0, 256, size=(blocks, 210), dtype=np.uint8)
    raw[:, 208:210] = _random_f16_bits(rng, blocks)
    return raw.reshape(n, k // 256 * 210)


def test_q6_k_blocks_decode_exactly_to_ggufs_weights():
    rng = np.random.default_rng(1)
    n, k = 20, 768
    data = _random_q6_k(rng, n, k)
    codes, scales = gguf_q6_k_codes(data, n, k)
    assert codes.dtype == torch.int8 and codes.shape == (n, k)
    assert scales.dtype == torch.float32 and scales.shape == (n, k // 16)
    assert codes.min() == -32 and codes.max() == 31  # q - 32 for six bits, both ends drawn
    want = gguf_dequantize(data, GGMLQuantizationType.Q6_K)
    got = (codes.float().view(n, k // 16, 16) * scales[..., None]).view(n, k)
    assert np.array_equal(got.numpy(), want)


def test_block_decoders_refuse_the_wrong_bytes():
    data = _random_q6_k(np.random.default_rng(2), 4, 256)
    with pytest.raises(Q8FormatError, match="Q6_K \\[4, 256\\] is 840 bytes"):
        gguf_q6_k_codes(data[:, :-1], 4, 256)
    with pytest.raises(Q8FormatError, match="multiple of 256"):
        gguf_q6_k_codes(data, 8, 128)
    with pytest.raises(Q8FormatError, match="of int8"):
        gguf_q8_0_codes(np.zeros((4, 34), dtype=np.int8), 4, 32)
    with pytest.raises(Q8FormatError, match="multiple of 32"):
        gguf_q8_0_codes(np.zeros((4, 34), dtype=np.uint8), 8, 17)


# --------------------------------------------------------------------------- the layout
@pytest.mark.parametrize(("n", "k", "group"), [(16, 32, 32), (200, 256, 16), (49, 576, 32), (576, 1536, 16)])
def test_packing_keeps_every_code_and_scale(n, k, group):
    codes, scales = _codes_scales(n, k, group, seed=n + k)
    codes[0, :4] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)
    packed, block_scales = pack_q8(codes, scales)
    n_pad = n + (-n % 16)
    assert packed.shape == (n_pad // 16, k // 4, 64) and packed.dtype == torch.uint8
    assert block_scales.shape == (n_pad // 16, k // group, 16) and block_scales.dtype == torch.float32
    q, s = unpack_q8(packed, block_scales)
    assert torch.equal(q[:n], codes) and torch.equal(s[:n], scales)
    assert not q[n:].any() and not s[n:].any()  # zero padding rows
    # byte 4r + j of a block's step t: row r, input 4t + j, stored as code + 128
    assert packed[0, 0, :4].tolist() == [0, 255, 128, 127]
    assert packed[0, 5, 4 * 3 + 2].item() == codes[3, 22].item() + 128
    dense = dequantize_q8(packed, block_scales, torch.float32)
    assert torch.equal(dense[:n], (codes.float().view(n, -1, group) * scales[..., None]).view(n, k))


def test_packing_refuses_what_is_not_the_format():
    codes, scales = _codes_scales(16, 64, 32)
    with pytest.raises(Q8FormatError, match="codes must be int8"):
        pack_q8(codes.to(torch.int16), scales)
    with pytest.raises(Q8FormatError, match="multiple of 32"):
        pack_q8(codes[:, :48], scales[:, :1])
    with pytest.raises(Q8FormatError, match="g in \\(16, 32\\)"):
        pack_q8(codes, scales[:, :1])  # a group of 64
    with pytest.raises(Q8FormatError, match="scales must be float32"):
        pack_q8(codes, scales.double())


# --------------------------------------------------------------------------- the native kernel
@pytest.mark.slow  # builds the native kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 32])
def test_native_dequantization_is_bitwise_the_torch_reference(native, dtype, group):
    codes, scales = _codes_scales(200, 512, group, seed=3)
    scales[7, 2] = 1e-40  # a subnormal scale
    packed, block_scales = pack_q8(codes, scales)
    got = torch.ops.sluice.dequantize_q8(packed, block_scales, dtype == torch.float32)
    assert got.dtype == dtype and got.shape == (208, 512)
    assert torch.equal(got, dequantize_q8(packed, block_scales, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
@pytest.mark.parametrize(("n", "k", "group"), [(200, 64, 16), (72, 1536, 32), (130, 576, 16), (49, 96, 32)])
def test_products_are_the_kernels_arithmetic_and_within_the_activation_rounding(native, x_dtype, rows, n, k, group):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    codes, scales = _codes_scales(n, k, group, seed=1)
    packed, block_scales = pack_q8(codes, scales)
    x = (torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 4).to(x_dtype)
    x[0, :32] = 0.0  # an all-zero block of inputs
    y = torch.ops.sluice.q8_linear(x, packed, block_scales, n)
    assert y.shape == (rows, n) and y.dtype == x_dtype
    want = _emulated(x, packed, block_scales)[:, :n]
    deq = dequantize_q8(packed, block_scales, torch.float64)[:n]
    xf = x.double()
    # (1) the arithmetic: float32 sums against float64 (relative to the size of the terms summed),
    # then the output's own rounding
    out_eps = 0.0 if x_dtype == torch.float32 else 2 ** -8
    terms = xf.abs() @ deq.abs().t()
    got = y.double()
    assert ((got - want).abs() <= 1e-5 * terms + out_eps * want.abs()).all()
    # (2) against the float product of the weights: the activation rounding's bound, half an int8
    # step of each block's scale times the weights it multiplies
    exact = xf @ deq.t()
    step = (xf.view(-1, k // 32, 32).abs().amax(-1) / 127.0).repeat_interleave(32, dim=1)  # [M, K]
    bound = (step / 2) @ deq.abs().t()
    assert ((got - exact).abs() <= bound + 1e-5 * terms + out_eps * exact.abs()).all()
    assert (got - exact).abs().max() > 0  # the activations really were rounded (the check can fail)


# passes take rows four at a time (7 = 4 + 3, 17 = 4 * 4 + 1): every row must come out as it does
# alone, through the one-row path, and the thread count must not change a bit
@pytest.mark.slow
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("rows", [7, 17])
def test_rows_are_independent_and_threads_do_not_change_a_bit(native, x_dtype, group, rows):
    codes, scales = _codes_scales(1000, 576, group, seed=5)  # 63 blocks: a last task of three
    packed, block_scales = pack_q8(codes, scales)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(9)).to(x_dtype)
    together = torch.ops.sluice.q8_linear(x, packed, block_scales, 1000)
    for i in range(rows):
        alone = torch.ops.sluice.q8_linear(x[i : i + 1], packed, block_scales, 1000)
        assert torch.equal(together[i : i + 1], alone), f"row {i} of {rows}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.sluice.q8_linear(x, packed, block_scales, 1000)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, together)


@pytest.mark.slow
def test_one_row_is_the_same_with_and_without_its_prefetch(native):
    from engine_service.model.native import native_library

    set_prefetch = native_library().q8_gemv_set_prefetch
    packed, block_scales = pack_q8(*_codes_scales(3072, 576, 32, seed=3))
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(11))
    try:
        assert set_prefetch(1) == 1
        on = torch.ops.sluice.q8_linear(x, packed, block_scales, 3072)
        assert set_prefetch(0) == 0
        off = torch.ops.sluice.q8_linear(x, packed, block_scales, 3072)
    finally:
        assert set_prefetch(-1) in (0, 1)
    assert torch.equal(on, off) and on.abs().sum() > 0


@pytest.mark.slow
def test_the_operators_refuse_bad_arguments(native):
    packed, block_scales = pack_q8(*_codes_scales(32, 64, 32))
    op = torch.ops.sluice.q8_linear
    x = torch.randn(2, 64)
    assert op(x, packed, block_scales, 32).shape == (2, 32)
    assert op(x, packed, block_scales, 17).shape == (2, 17)  # padded rows sliced off
    assert op(x[:0], packed, block_scales, 32).shape == (0, 32)
    assert op(x.t().contiguous().t(), packed, block_scales, 32).shape == (2, 32)  # not contiguous: copied
    with pytest.raises(RuntimeError, match="end in the weight's 64 inputs"):
        op(torch.randn(2, 32), packed, block_scales, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(x.half(), packed, block_scales, 32)
    with pytest.raises(RuntimeError, match="out_features 33"):
        op(x, packed, block_scales, 33)
    with pytest.raises(RuntimeError, match="out_features 16"):
        op(x, packed, block_scales, 16)  # a whole padded block: not this weight
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        op(x, packed.view(torch.int8), block_scales, 32)
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        op(x, packed.transpose(0, 1), block_scales, 32)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        op(x, packed, block_scales.bfloat16(), 32)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        op(x, packed, block_scales[:1], 32)
    with pytest.raises(RuntimeError, match="must be 16 or 32"):
        op(x, packed, torch.ones(2, 1, 16), 32)  # a group of 64
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 48), torch.zeros(2, 12, 64, dtype=torch.uint8), torch.ones(2, 3, 16), 32)
    with pytest.raises(RuntimeError, match="at most 4096 rows"):
        op(torch.randn(4097, 64), packed, block_scales, 32)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        torch.ops.sluice.dequantize_q8(packed, block_scales[:, :, :8], False)


# --------------------------------------------------------------------------- the layer
@pytest.mark.slow
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_dtype", [torch.float32, torch.bfloat16])
def test_the_layer_through_the_kernel_and_the_dense_path(native, x_dtype, kernel_dtype):
    n, k = 100, 576
    codes, scales = _codes_scales(n, k, 16, seed=7)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    mod = Q8Linear.from_codes(codes, scales, bias, kernel_dtype=kernel_dtype)
    assert mod.native and (mod.in_features, mod.out_features) == (k, n)
    assert mod.dense_min_rows is not None and 1 < mod.dense_min_rows <= q8_blocks.Q8_MAX_ROWS
    w = (codes.float().view(n, -1, 16) * scales[..., None]).view(n, k)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(2)).to(x_dtype)
    y = mod(x)
    assert y.shape == (2, 3, n) and y.dtype == x_dtype
    assert torch.equal(y.reshape(6, n), (torch.ops.sluice.q8_linear(x.reshape(6, k), mod.codes, mod.scales, n)
                                         + bias).to(x_dtype))
    ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    step = (x.double().reshape(6, k // 32, 32).abs().amax(-1) / 127.0).repeat_interleave(32, dim=1)
    bound = ((step / 2) @ w.double().abs().t()).view(2, 3, n)
    tol = 1e-5 * (x.double().abs() @ w.double().abs().t()) + (2 ** -8 * ref.abs() if x_dtype == torch.bfloat16 else 0)
    assert ((y.double() - ref).abs() <= bound + tol).all()
    # the dense path: from dense_min_rows rows, F.linear of the dequantized weight in the kernel dtype
    mod.dense_min_rows = 6
    dense = mod(x)
    want = torch.nn.functional.linear(x.reshape(6, k).to(kernel_dtype), w.to(kernel_dtype))
    assert torch.equal(dense.reshape(6, n), (want + bias).to(x_dtype))
    assert torch.equal(mod(x[:1, :2]), y[:1, :2])  # fewer rows: the kernel again


@pytest.mark.slow
def test_the_layer_splits_more_rows_than_one_call_takes(native):
    codes, scales = _codes_scales(40, 64, 32, seed=8)
    mod = Q8Linear.from_codes(codes, scales)
    mod.dense_min_rows = None  # the deterministic mode: every product through the kernel
    x = torch.randn(q8_blocks.Q8_MAX_ROWS + 3, 64, generator=torch.Generator().manual_seed(3))
    y = mod(x)
    assert y.shape == (q8_blocks.Q8_MAX_ROWS + 3, 40)
    for i in (0, q8_blocks.Q8_MAX_ROWS - 1, q8_blocks.Q8_MAX_ROWS, q8_blocks.Q8_MAX_ROWS + 2):
        assert torch.equal(y[i : i + 1], mod(x[i : i + 1]))


def test_the_layer_without_the_kernel(monkeypatch):
    """Where the native operators cannot run, the weights are dequantized once and every product
    is F.linear of them (no native call: nothing is built here)."""
    monkeypatch.setattr(q8_blocks, "native_q8", lambda: False)
    n, k = 50, 96
    codes, scales = _codes_scales(n, k, 32, seed=9)
    bias = torch.randn(n)
    mod = Q8Linear.from_codes(codes, scales, bias, kernel_dtype=torch.bfloat16)
    assert not mod.native and mod.weight.shape == (n, k) and mod.weight.dtype == torch.bfloat16
    w = (codes.float().view(n, -1, 32) * scales[..., None]).view(n, k)
    x = torch.randn(4, k)
    y = mod(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, (torch.nn.functional.linear(x.bfloat16(), w.bfloat16()) + bias).float())
    with pytest.raises(Q8FormatError, match="bias must be"):
        Q8Linear.from_codes(codes, scales, torch.zeros(n + 1))
