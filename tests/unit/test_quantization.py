"""Weight-only int8 / int4 quantization: the numerics, torch's packed kernels against a
dequantized float reference, the model swap, an engine run, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_service.model.quantization import (
    DENSE_LARGE_FACTOR,
    DENSE_MIN_ROWS,
    DENSE_MIN_ROWS_Q4,
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


@pytest.fixture
def torch_int4(monkeypatch):
    """int4 layers in torch's packed layout, multiplied by torch's int4 kernel: the path of a machine
    where the native int4 kernel cannot run (no compiler, no AVX512-VNNI). Where it can, int4 layers
    take the native layout instead (tests/unit/test_q4_gemv.py)."""
    from engine_service.model import quantization

    monkeypatch.setattr(quantization, "native_q4_available", lambda: False)


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


def test_int4_packing_round_trip_through_the_kernel(torch_int4):
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
def test_quantized_linear_matches_dequantized_reference(method, kernel_dtype, rows, torch_int4):
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


@pytest.mark.model
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


@pytest.mark.model
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_long_prompt_prefills_through_dense_products(model_dir, method, monkeypatch):
    """Not deterministic (``--no-deterministic``; int4 is deterministic by default and then never
    goes dense): a prompt of at least the layers' ``dense_min_rows`` tokens is one prefill chunk that
    many rows: every decoder projection dequantizes its weights once for it, decode steps (one row)
    keep the packed kernels, and the answer is right."""
    from engine_service import LLM, SamplingParams

    llm = LLM(str(model_dir), quantization=method, kv_cache_memory=256 << 20, max_num_batched_tokens=4096,
              deterministic=False)
    layers = llm.engine.runner.model.model.layers
    need = layers[0].mlp.gate_up_proj.dense_min_rows  # int4's native layout: hundreds to thousands of rows
    assert need is not None and need < 4096
    dense_calls: list[QuantizedLinear] = []
    real = QuantizedLinear.dense_weight
    monkeypatch.setattr(QuantizedLinear, "dense_weight", lambda self: dense_calls.append(self) or real(self))
    unit = ("Europe is a continent with many countries, each with its own capital city, language and "
            "history. Travellers often visit the capitals first, because museums, palaces and old town "
            "centres are there. ")
    tokenizer = llm.get_tokenizer()
    preamble = unit
    while len(tokenizer.encode(preamble)) < need:
        preamble += unit
    out = llm.generate(preamble + "The capital of France is",
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert need <= len(out.prompt_token_ids) <= llm.engine.config.max_num_batched_tokens  # one chunk
    assert len(dense_calls) == 4 * len(layers)  # qkv, o, gate_up, down of each layer, once
    assert llm.engine.runner.model.lm_head not in dense_calls  # one row to sample
    assert out.outputs[0].text.startswith(" Paris")


@pytest.mark.model
def test_engine_refuses_an_unknown_method(model_dir):
    from engine_service import LLM

    with pytest.raises(QuantizationError, match="quantization must be one of"):
        LLM(str(model_dir), quantization="int3", kv_cache_memory=16 << 20)


# --------------------------------------------------------------------------- products of many rows
def _native_or_fail():
    from engine_service.model.native import native_ops_unavailable

    why = native_ops_unavailable()
    assert why is None, f"the native operators must build on this machine (gcc, g++): {why}"


@pytest.mark.parametrize(("n", "k"), [(64, 32), (960, 576), (576, 1536), (3072, 96)])
def test_unpack_int4_cpu_reads_back_the_packed_codes(n, k):
    """The unpacking knows torch's CPU packed layout (blocks of 64 rows, K-major, two rows a byte):
    every code comes back. (Row counts that leave a partial block keep the packed kernel: below.)"""
    from engine_service.model.quantization import _unpacks_exactly, pack_int4, unpack_int4_cpu

    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n), dtype=torch.int32)
    packed = pack_int4(q, torch.device("cpu"))
    assert torch.equal(unpack_int4_cpu(packed, n, k), q.to(torch.uint8))
    assert _unpacks_exactly(packed, q, torch.device("cpu"))
    other = q.clone()
    other[n - 1, k - 1] = (other[n - 1, k - 1] + 1) % 16
    assert not _unpacks_exactly(packed, other, torch.device("cpu"))  # the check can fail


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("kernel_dtype", [torch.bfloat16, torch.float32])
def test_native_dequantization_is_bitwise_the_torch_reference(method, kernel_dtype, torch_int4):
    from engine_service.model.quantization import dequantize_int4_packed, dequantize_int8_rows

    _native_or_fail()
    w = _weight(n=320, k=576, seed=3)
    w[5, :32] = 0.0  # a constant group: scale at its floor
    mod = QuantizedLinear.from_float(w, None, method, kernel_dtype, 32)
    dense = mod.dense_weight()
    if method == "int8":
        ref = dequantize_int8_rows(mod.qweight, mod.scales)
    else:
        ref = dequantize_int4_packed(mod.qweight, mod.scales_zeros, 320, 576, 32)
        # and the reference is the quantization's own dequantization, rounded once
        sz = mod.scales_zeros.float()
        q, _, _ = quantize_int4(w, 32)
        assert torch.equal(ref, dequantize_int4(q, sz[..., 0].t(), sz[..., 1].t(), 32).to(kernel_dtype))
    assert dense.dtype == kernel_dtype and dense.shape == (320, 576)
    assert torch.equal(dense, ref)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_many_rows_run_a_dense_product_of_the_same_weights(method):
    """From ``dense_min_rows`` rows on, the product is the dense GEMM of the dequantized weights
    (bitwise), and it agrees with the packed kernel's product up to rounding; fewer rows keep the
    packed kernel."""
    _native_or_fail()
    gen = torch.Generator().manual_seed(7)
    w = _weight(n=192, k=576, seed=4)
    bias = torch.randn(192, generator=gen) * 0.1
    mod = QuantizedLinear.from_float(w, bias, method, torch.bfloat16, 32)
    rows = mod.dense_min_rows
    assert rows == (DENSE_MIN_ROWS_Q4[torch.bfloat16] if mod.native_q4 else DENSE_MIN_ROWS[method])
    x = torch.randn(rows, 576, generator=gen)
    y = mod(x)
    dense = torch.nn.functional.linear(x.bfloat16(), mod.dense_weight()).float() + bias
    assert torch.equal(y, dense)
    mod.dense_min_rows = None
    kernel = mod(x)
    assert not torch.equal(kernel, y)  # a different product indeed ran
    assert (kernel - y).abs().max() <= 0.02 * kernel.abs().max()
    mod.dense_min_rows = rows
    few = x[: rows - 1]
    assert torch.equal(mod(few), kernel[: rows - 1])  # fewer rows: the packed kernel, row for row


@pytest.mark.slow
def test_an_int4_layer_with_a_partial_block_of_64_rows_keeps_the_packed_kernel(torch_int4):
    """200 output rows pad to 208 for int4: a partial block of the CPU layout, which the unpacking
    does not cover. int8 has no such layout."""
    _native_or_fail()
    w = _weight(n=200, k=576, seed=4)
    assert QuantizedLinear.from_float(w, None, "int4", torch.bfloat16, 32).dense_min_rows is None
    assert QuantizedLinear.from_float(w, None, "int8", torch.bfloat16).dense_min_rows == DENSE_MIN_ROWS["int8"]


@pytest.mark.slow
def test_a_dense_copy_past_the_caches_waits_for_more_rows():
    _native_or_fail()
    big = QuantizedLinear.from_float(torch.zeros(8192, 1088), None, "int8", torch.bfloat16)  # 17.8 MB dense
    assert big.dense_min_rows == DENSE_MIN_ROWS["int8"] * DENSE_LARGE_FACTOR


def test_without_the_native_operators_every_product_runs_the_packed_kernel(monkeypatch, caplog):
    from engine_service.model import quantization

    monkeypatch.setattr(quantization, "native_ops_unavailable", lambda: "no g++ on PATH (test)")
    with caplog.at_level("WARNING", logger="engine_service.model.quantization"):
        mod = QuantizedLinear.from_float(_weight(n=192, k=256), None, "int4", torch.bfloat16, 32)
    assert mod.dense_min_rows is None
    assert "no g++ on PATH (test)" in caplog.text
    x = torch.randn(256, 256)
    assert torch.equal(mod(x)[:8], mod(x[:8]))  # 256 rows ran the packed kernel, row for row
    assert "dense" not in repr(mod)


@pytest.mark.slow
def test_the_dequantization_operators_refuse_bad_arguments():
    _native_or_fail()
    packed = torch.zeros(64, 32, dtype=torch.uint8)
    sz = torch.ones(2, 64, 2, dtype=torch.bfloat16)
    assert torch.ops.sluice.dequantize_int4(packed, sz, 32).shape == (64, 64)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.sluice.dequantize_int4(torch.zeros(48, 32, dtype=torch.uint8), sz[:, :48], 32)
    with pytest.raises(RuntimeError, match="group size"):
        torch.ops.sluice.dequantize_int4(packed, sz, 48)
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.sluice.dequantize_int4(packed.int(), sz, 32)
    with pytest.raises(RuntimeError, match=r"\[k/group_size, n, 2\]"):
        torch.ops.sluice.dequantize_int4(packed, sz[:1], 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.sluice.dequantize_int4(packed, sz.half(), 32)
    q = torch.zeros(4, 8, dtype=torch.int8)
    assert torch.ops.sluice.dequantize_int8(q, torch.ones(4)).shape == (4, 8)
    with pytest.raises(RuntimeError, match=r"scales must be \[n\]"):
        torch.ops.sluice.dequantize_int8(q, torch.ones(5))
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.sluice.dequantize_int8(q.float(), torch.ones(4))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.sluice.dequantize_int8(q, torch.ones(4, dtype=torch.float64))
