"""The native int4 products (kernels/q4_gemv.c, ``sluice::q4_linear``) against their reference.

The kernel multiplies the packed codes by int8-quantized activations (per 32 inputs, as llama.cpp
multiplies Q4_1 by Q8), so it is not the float product of the dequantized weights: it is checked
(1) against the same arithmetic in float64 torch operations, to float32 summation error, and
(2) against the float product, within the bound the activation rounding allows. The layout's
packing and the dequantization for many rows are checked bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine_service.model.quantization import (
    QuantizedLinear,
    dequantize_q4,
    pack_q4,
    quantize_int4,
    unpack_q4,
)

pytestmark = pytest.mark.slow  # builds the native kernels


@pytest.fixture(autouse=True)
def _native_q4_or_fail():
    from engine_service.model.native import native_ops_unavailable

    why = native_ops_unavailable()
    assert why is None, f"the native operators must build on this machine (gcc, g++): {why}"
    if not torch.ops.sluice.q4_supported():
        pytest.skip("this CPU has no AVX512-VNNI: int4 keeps torch's packed kernel (tested in test_quantization.py)")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _emulated(x: torch.Tensor, codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: x rounded to int8 per 32 inputs (scale max|x| / 127,
    ties to even), sum_k code * xhat times the group's scale, plus min * sum_k xhat."""
    q = unpack_q4(codes).double()  # [N, K]
    n, k = q.shape
    groups = scales_zeros.shape[1]
    scale = scales_zeros[:, :, 0, :].transpose(1, 2).reshape(n, groups).double()
    mins = scales_zeros[:, :, 1, :].transpose(1, 2).reshape(n, groups).double()
    xf = x.float().reshape(-1, k)
    blocks = xf.view(-1, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # as C divides
    xhat = (torch.round(blocks * inv) * (amax / 127.0)).view(-1, k).double()
    qx = torch.einsum("ngj,mgj->mng", q.view(n, groups, -1), xhat.view(-1, groups, k // groups))
    xsum = xhat.view(-1, groups, k // groups).sum(-1)  # [M, G]: the rounded inputs' sums
    return (qx * scale).sum(-1) + xsum @ mins.t()


@pytest.mark.parametrize(("n", "k", "group"), [(16, 32, 32), (960, 576, 32), (576, 1536, 32), (200, 256, 64),
                                                (64, 512, 128)])
def test_packing_keeps_every_code_and_scale(n, k, group):
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n - n % 16 or 16, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(q.shape[0], k // group, generator=gen)
    mins = torch.randn(q.shape[0], k // group, generator=gen)
    codes, sz = pack_q4(q, scales, mins)
    assert codes.shape == (q.shape[0] // 16, k // 8, 64) and codes.dtype == torch.uint8  # two codes a byte
    assert sz.dtype == torch.float16
    assert torch.equal(unpack_q4(codes), q.to(torch.uint8))
    # w = code * scale + min, with the scale and min as float16 holds them (GGUF Q4_1's own pair)
    s16, m16 = scales.half().float(), mins.half().float()
    ref = (q.view(q.shape[0], -1, group).float() * s16[..., None] + m16[..., None]).view(q.shape[0], k)
    assert torch.equal(dequantize_q4(codes, sz, torch.float32), ref)
    # byte 4r + j of a block's first step: row r, inputs j (low nibble) and 4 + j (high nibble)
    assert codes[0, 0, 4 * 3 + 1].item() == q[3, 1].item() | q[3, 5].item() << 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
def test_native_dequantization_is_bitwise_the_torch_reference(dtype, group):
    w = _weight(200, 512, seed=3)
    w[5, :group] = 0.0  # a constant group: scale at its floor
    mod = QuantizedLinear.from_float(w, None, "int4", dtype, group)
    assert mod.native_q4
    dense = mod.dense_weight()
    assert dense.dtype == dtype and dense.shape == (208, 512)  # 200 rows padded to the block of 16
    assert torch.equal(dense, dequantize_q4(mod.codes, mod.scales_zeros, dtype))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize(("n", "k", "group"), [(200, 256, 32), (960, 576, 32), (576, 1536, 64)])
def test_products_are_the_kernels_arithmetic_and_within_the_activation_rounding(x_dtype, rows, n, k, group):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    w = _weight(n, k, seed=1)
    mod = QuantizedLinear.from_float(w, None, "int4", torch.bfloat16, group)
    mod.dense_min_rows = None  # every row count through the kernel
    x = (torch.randn(rows, 3, k, generator=gen) * torch.rand(1, 1, k, generator=gen) * 4).to(x_dtype)
    x[0, 0, :32] = 0.0  # an all-zero block of inputs
    y = mod(x)
    assert y.shape == (rows, 3, n) and y.dtype == x_dtype
    want = _emulated(x, mod.codes, mod.scales_zeros)[:, :n].view(rows, 3, n)
    deq = dequantize_q4(mod.codes, mod.scales_zeros, torch.float64)[:n]
    xf = x.double().reshape(-1, k)
    # (1) the arithmetic: float32 sums against float64 (relative to the size of the terms summed),
    # then the output's own rounding
    out_eps = 0.0 if x_dtype == torch.float32 else 2 ** -8
    terms = (xf.abs() @ deq.abs().t()).view(rows, 3, n)
    assert ((y.double() - want).abs() <= 1e-5 * terms + out_eps * want.abs()).all()
    # (2) against the float product of the dequantized weights: the activation rounding's bound,
    # half an int8 step of each block's scale times the weights it multiplies
    exact = xf @ deq.t()
    step = (xf.view(-1, k // 32, 32).abs().amax(-1) / 127.0).repeat_interleave(32, dim=1)  # [M, K]
    bound = (step / 2) @ deq.abs().t()
    got = y.double().reshape(-1, n)
    assert ((got - exact).abs() <= bound + 1e-5 * terms.view(-1, n) + out_eps * exact.abs()).all()
    assert (got - exact).abs().max() > 0  # the activations really were rounded (the check can fail)


# the VPDPBUSD passes take rows four at a time (11 = 4 + 4 + 3); where the CPU has AMX, 12 rows and
# more take tile passes of up to 16 (21 = 16 + 5): every row must come out as it does alone, through
# the one-row VPDPBUSD path, whatever the group size (64: two integer sums per group)
@pytest.mark.parametrize(("rows", "group"), [(2, 32), (3, 32), (11, 32), (12, 32), (21, 32), (21, 64)])
def test_rows_are_independent_and_threads_do_not_change_a_bit(rows, group):
    w = _weight(576, 1536, seed=5)
    mod = QuantizedLinear.from_float(w, None, "int4", torch.bfloat16, group)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(9))
    together = mod(x)
    alone = torch.cat([mod(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mod(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, together)


@pytest.mark.parametrize(("n", "k"), [(3072, 576), (200, 256)])  # 200: a last task of fewer blocks
def test_one_row_is_the_same_with_and_without_its_prefetch(n, k):
    """The one-row loop prefetches its codes on some CPUs and not on others (one_row_prefetch.h):
    both must give the same sums, bit for bit, and the CPU's own choice must be one of them."""
    from engine_service.model.native import native_library

    set_prefetch = native_library().q4_gemv_set_prefetch
    mod = QuantizedLinear.from_float(_weight(n, k, seed=3), None, "int4", torch.bfloat16)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(11))
    try:
        assert set_prefetch(1) == 1
        on = mod(x)
        assert set_prefetch(0) == 0
        off = mod(x)
    finally:
        default = set_prefetch(-1)
    assert default in (0, 1)
    assert torch.equal(on, off)
    assert torch.equal(mod(x), on)
    assert on.abs().sum() > 0


def test_a_cpu_with_amx_runs_the_tile_passes():
    """Where /proc/cpuinfo lists AMX-INT8, the build uses it (so the row tests above ran the tile
    passes, not only the VPDPBUSD ones); elsewhere it reports no AMX and the same tests hold."""
    from engine_service.model.native import _cpu_flags, native_library

    usable = native_library().q4_amx_usable()
    assert usable == (1 if {"amx_int8", "amx_tile"} <= set(_cpu_flags().split()) else 0)


def test_bias_and_many_rows():
    """A bias is added after the product; from ``dense_min_rows`` rows the dense GEMM of the same
    dequantized weights runs instead, and the two agree within the activation rounding."""
    gen = torch.Generator().manual_seed(11)
    w = _weight(192, 576, seed=4)
    bias = torch.randn(192, generator=gen)
    mod = QuantizedLinear.from_float(w, bias, "int4", torch.bfloat16, 32)
    rows = mod.dense_min_rows
    assert rows is not None
    x = torch.randn(rows, 576, generator=gen)
    dense = mod(x)
    assert torch.equal(dense, torch.nn.functional.linear(x.bfloat16(), mod.dense_weight()).float()[:, :192] + bias)
    few = mod(x[: rows - 1])
    assert torch.equal(few[:1], mod(x[:1]))
    assert (few - dense[: rows - 1]).abs().max() <= 0.02 * dense.abs().max()
    nobias = QuantizedLinear.from_float(w, None, "int4", torch.bfloat16, 32)
    assert torch.equal(few[:3], nobias(x[:3]) + bias)


@pytest.mark.model
def test_engine_greedy_output_is_sensible_and_batch_invariant(model_dir):
    from engine_service import LLM, SamplingParams

    llm = LLM(str(model_dir), quantization="int4", kv_cache_memory=32 << 20)
    head = llm.engine.runner.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.native_q4
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    batched = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert batched[0].text.startswith(" Paris")
    for prompt, out in zip(prompts, batched, strict=True):
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == out.token_ids


def test_the_operators_refuse_bad_arguments():
    q, s, z = quantize_int4(_weight(32, 64), 32)
    codes, sz = pack_q4(q, s, z - 8 * s)
    x = torch.randn(2, 64)
    assert torch.ops.sluice.q4_linear(x, codes, sz, 32).shape == (2, 32)
    assert torch.ops.sluice.q4_linear(x, codes, sz, 17).shape == (2, 17)  # padded rows sliced off
    assert torch.ops.sluice.q4_linear(x[:0], codes, sz, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="end in the weight's 64 inputs"):
        torch.ops.sluice.q4_linear(torch.randn(2, 32), codes, sz, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.sluice.q4_linear(x.half(), codes, sz, 32)
    with pytest.raises(RuntimeError, match="out_features 33"):
        torch.ops.sluice.q4_linear(x, codes, sz, 33)
    with pytest.raises(RuntimeError, match="out_features 16"):
        torch.ops.sluice.q4_linear(x, codes, sz, 16)  # a whole padded block: not this weight
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        torch.ops.sluice.q4_linear(x, codes.view(torch.int8), sz, 32)
    with pytest.raises(RuntimeError, match="scales_zeros must be"):
        torch.ops.sluice.q4_linear(x, codes, sz.float(), 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.sluice.q4_linear(x, codes, torch.ones(2, 4, 2, 16, dtype=torch.float16), 32)
    with pytest.raises(RuntimeError, match="scales_zeros must be"):
        torch.ops.sluice.dequantize_q4(codes, sz[:1], False)
