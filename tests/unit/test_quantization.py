"""Weight-only int8 / int4 quantization: the numerics, torch's packed kernels against a
dequantized float reference, the model swap, an engine run, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_service.model.quantization import (
    QuantizationError,
    QuantizedLinear,
    check_supported,
    dequantize_int4,
    dequantize_int8,
    int4_mm,
    parse_quantization,
    quantize_int4,
    quantize_int8,
    quantize_model,
)


def _weight(n=96, k=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def test_int8_round_trip_within_half_a_step():
    w = _weight()
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-7).all()
    # The largest weight of each row maps to +-127 exactly.
    assert (q.abs().amax(dim=1) == 127).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group_size):
    w = _weight()
    q, scales, zeros = quantize_int4(w, group_size)
    assert q.min() >= 0 and q.max() <= 15
    assert scales.shape == (w.shape[0], w.shape[1] // group_size)
    deq = dequantize_int4(q, scales, zeros, group_size)
    step = scales.repeat_interleave(group_size, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    # A group's min and max are representable (up to rounding of the affine map).
    wg = w.view(w.shape[0], -1, group_size)
    dg = deq.view_as(wg)
    assert torch.allclose(dg.amin(-1), wg.amin(-1), atol=1e-6)
    assert torch.allclose(dg.amax(-1), wg.amax(-1), atol=1e-5)


def test_int4_packing_round_trip_through_the_kernel():
    """Unpack the packed CPU layout by multiplying the identity: the kernel must return exactly
    the reference dequantization (rounded to bf16, its output dtype)."""
    w = _weight(n=64, k=128)
    q, scales, zeros = quantize_int4(w, 32)
    mod = QuantizedLinear.from_float(w, None, "int4", torch.bfloat16, 32)
    assert mod.qweight.dtype == torch.uint8 and mod.qweight.numel() == q.numel() // 2  # two codes a byte
    eye = torch.eye(128, dtype=torch.bfloat16)
    unpacked = int4_mm(eye, mod.qweight, 32, mod.scales_zeros).float().t()  # [N, K]
    sz = mod.scales_zeros.float()  # the (scale, zero) pairs as the kernel stores them (bf16)
    ref = dequantize_int4(q, sz[..., 0].t(), sz[..., 1].t(), 32)
    assert torch.allclose(unpacked, ref.bfloat16().float(), rtol=0, atol=1e-2 * ref.abs().max().item())
    codes = torch.round((unpacked - sz[..., 1].t().repeat_interleave(32, 1)) /
                        sz[..., 0].t().repeat_interleave(32, 1)) + 8
    assert (codes.clamp(0, 15) == q).float().mean() > 0.99


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("kernel_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_quantized_linear_matches_dequantized_reference(method, kernel_dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w = _weight(n=200, k=256, seed=1)
    bias = torch.randn(200, generator=gen) * 0.1
    if kernel_dtype not in check_supported(method, "cpu"):
        pytest.skip(f"{method} has no {kernel_dtype} kernel on this CPU")
    mod = QuantizedLinear.from_float(w, bias, method, kernel_dtype, 32)
    if method == "int8":
        deq = dequantize_int8(*quantize_int8(w))
    else:
        deq = dequantize_int4(*quantize_int4(w, 32), 32)
    x = torch.randn(rows, 3, 256, generator=gen)  # leading dims are kept
    y = mod(x)
    assert y.shape == (rows, 3, 200) and y.dtype == torch.float32
    ref = torch.nn.functional.linear(x.to(kernel_dtype).float(), deq, bias)
    tol = 0.02 if kernel_dtype == torch.bfloat16 else 1e-4
    assert (y - ref).abs().max() <= tol * ref.abs().max()
    # and the quantization error itself stays small against the float weights
    full = torch.nn.functional.linear(x, w, bias)
    assert (y - full).abs().max() <= (0.02 if method == "int8" else 0.12) * full.abs().max()


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.block = nn.Sequential(nn.Linear(128, 64, bias=False))


def test_quantize_model_swaps_every_linear():
    m = _Tiny().requires_grad_(False)
    x = torch.randn(4, 64)
    ref = m.block(m.a(x))
    quantize_model(m, "int8", kernel_dtype=torch.float32)
    assert isinstance(m.a, QuantizedLinear) and isinstance(m.block[0], QuantizedLinear)
    assert not any(isinstance(mod, nn.Linear) for mod in m.modules())
    assert (m.block(m.a(x)) - ref).abs().max() < 0.02 * ref.abs().max()


def test_refusals_are_clear():
    with pytest.raises(QuantizationError, match="int8, int4"):
        parse_quantization("fp8")
    assert parse_quantization(None) is None and parse_quantization("INT4") == "int4"
    with pytest.raises(QuantizationError, match="group size"):
        check_supported("int4", "cpu", group_size=48)
    with pytest.raises(QuantizationError, match="cpu or cuda"):
        check_supported("int8", "meta")
    with pytest.raises(QuantizationError, match="multiple of the group size"):
        quantize_int4(torch.randn(8, 48), 32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_at_load():
    with pytest.raises((QuantizationError, RuntimeError, AssertionError)):
        check_supported("int4", "cuda")


@pytest.fixture(scope="module")
def prompts():
    return ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


@pytest.fixture(scope="module")
def float_outputs(model_dir, prompts):
    from engine_service import LLM, SamplingParams

    ref = LLM(str(model_dir), kv_cache_memory=32 << 20)
    return [o.outputs[0].token_ids for o in ref.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_runs_quantized_and_agrees_with_float(model_dir, prompts, float_outputs, method):
    from engine_service import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = float_outputs
    llm = LLM(str(model_dir), quantization=method, kv_cache_memory=32 << 20)
    model = llm.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert isinstance(model.lm_head, QuantizedLinear)  # the tied head got a quantized copy
    outs = llm.generate(prompts, params)
    got = [o.outputs[0].token_ids for o in outs]
    assert all(len(g) == 12 for g in got)
    # Sensible output: the first greedy token matches the float model's on (nearly) every prompt,
    # and much of the continuation does (`sluice bench quality` measures the agreement properly).
    first = sum(g[0] == e[0] for g, e in zip(got, expected, strict=True))
    assert first >= (3 if method == "int8" else 2)
    agree = sum(a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True))
    assert agree >= (0.5 if method == "int8" else 0.25) * 36
    assert "Paris" in outs[0].outputs[0].text
    # batched equals alone (the quantized kernels are row-independent)
    alone = llm.generate(prompts[1], params)[0].outputs[0].token_ids
    assert alone == got[1]


def test_engine_refuses_an_unknown_method(model_dir):
    from engine_service import LLM

    with pytest.raises(QuantizationError, match="quantization must be one of"):
        LLM(str(model_dir), quantization="int3", kv_cache_memory=16 << 20)
