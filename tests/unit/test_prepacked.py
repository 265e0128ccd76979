"""Linear weights prepacked for oneDNN (bfloat16 / float16 on CPU): the products of ``F.linear`` to the
type's rounding (oneDNN may block a sum differently for a packed weight), through the eager forward
and the compiled step's operator; greedy output unchanged on the model; which models get them; and
a model that keeps plain layers where this machine cannot prepack. A few bfloat16 rows (up to 64
through AMX tiles where the CPU has them, else up to 16 by VDPBF16PS on groups of rows) run the
native kernel on the packed weight (kernels/packed_gemv.c) where its layout checks out."""

from __future__ import annotations

import ctypes
import gc
import platform

import pytest
import torch
from torch import nn

from engine_service import LLM, SamplingParams
from engine_service.model.loader import load_model
from engine_service.model.native import _cpu_flags, native_ops_unavailable
from engine_service.model.prepacked import (
    PrepackedLinear,
    _gemv_supported,
    _packed_linear,
    gemv_layout,
    gemv_max_rows,
    prepack_model,
    prepack_unavailable,
    prepacked_linear_op,
)

pytestmark = pytest.mark.slow  # builds the native kernels

PREPACKS = prepack_unavailable(torch.bfloat16, torch.device("cpu")) is None


def _layers(model: nn.Module, kind: type) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, kind)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_products_equal_f_linear_to_rounding(dtype, bias):
    why_not = prepack_unavailable(dtype, torch.device("cpu"))
    if why_not is not None:
        pytest.skip(why_not)  # a CPU without the oneDNN kernel: the model keeps nn.Linear (tested below)
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(576, 960, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(960, 576, generator=gen) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(960, generator=gen))
    packed = PrepackedLinear(linear.weight.data, None if linear.bias is None else linear.bias.data)
    for shape in [(1, 576), (7, 576), (300, 576), (2, 5, 576)]:
        x = torch.randn(*shape, generator=gen).to(dtype)
        want = linear(x)
        got = packed(x)
        assert got.dtype == dtype and got.shape == want.shape
        # one unit in the last place of the largest products at most: the same sum, blocked differently
        ulp = torch.finfo(dtype).eps * want.float().abs().amax().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=ulp)
        # the operator the compiled step calls is the same product
        assert torch.equal(prepacked_linear_op(x, packed.handle, packed.bias, packed.out_features), got)


def _gemv_or_skip() -> None:
    """Skip only for what the CPU lacks; the native operators are a set-up step and must build."""
    if not PREPACKS:
        pytest.skip("bfloat16 is not prepacked on this machine")
    why = native_ops_unavailable()
    assert why is None, f"the native operators must build on this machine (gcc, g++): {why}"
    if not _gemv_supported():
        pytest.skip("this CPU has no AVX512-BF16: the bfloat16 GEMV is not built")


@pytest.mark.parametrize(("out_features", "in_features", "bias"),
                         [(960, 576, False), (3072, 576, True), (576, 1536, False), (100, 50, True)])
def test_one_row_runs_the_native_gemv_to_the_types_rounding(out_features, in_features, bias):
    _gemv_or_skip()
    gen = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    layer = PrepackedLinear(weight, b)
    assert layer.gemv, "the packed layout was not the GEMV's"  # (100, 50): padded to 128 x 64
    for shape in [(1, in_features), (in_features,), (1, 1, in_features)]:
        x = torch.randn(*shape, generator=gen).bfloat16()
        got = layer(x)
        assert got.shape == (*shape[:-1], out_features) and got.dtype == torch.bfloat16
        exact = x.double() @ weight.double().t() + (0 if b is None else b.double())
        # a float32 sum rounded once: within one bfloat16 ulp of the exact product, like oneDNN's
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((got.double() - exact).abs() <= ulp).all()
        onednn = _packed_linear(x.reshape(1, in_features), layer.packed, layer.bias).reshape(got.shape)
        assert (got != onednn).float().mean() < 0.01  # the same sums, blocked differently: rarely a last bit
        assert torch.equal(prepacked_linear_op(x, layer.handle, layer.bias, out_features), got)


def test_one_row_is_the_same_with_and_without_its_prefetch():
    """The one-row loop prefetches on some CPUs and not on others (packed_gemv.c: 512-bit loads with
    prefetches, 256-bit ones without): both loops must compute the same sums, bit for bit, and the
    CPU's own choice must be one of them."""
    _gemv_or_skip()
    from engine_service.model.native import native_library

    set_prefetch = native_library().packed_gemv_set_prefetch
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(3072, 576, generator=gen) * 0.05).bfloat16()
    layer = PrepackedLinear(weight, None)
    x = torch.randn(1, 576, generator=gen).bfloat16()
    try:
        assert set_prefetch(1) == 1
        on = prepacked_linear_op(x, layer.handle, None, 3072)
        assert set_prefetch(0) == 0
        off = prepacked_linear_op(x, layer.handle, None, 3072)
    finally:
        default = set_prefetch(-1)
    assert default in (0, 1)
    assert torch.equal(on, off)
    assert torch.equal(layer(x), on)
    exact = x.double() @ weight.double().t()
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((on.double() - exact).abs() <= ulp).all()


def test_the_kernel_takes_up_to_its_rows_and_onednn_the_rest():
    """Register a layer's handle with ANOTHER weight's packed buffer for the native kernel: up to
    gemv_max_rows() rows then give that weight's product (the kernel ran, through the eager
    forward and the operator), one row more the layer's own (oneDNN)."""
    _gemv_or_skip()
    most = gemv_max_rows()
    gen = torch.Generator().manual_seed(3)
    mine, other = ((torch.randn(128, 64, generator=gen) * 0.1).bfloat16() for _ in range(2))
    layer, decoy = PrepackedLinear(mine, None), PrepackedLinear(other, None)
    torch.ops.sluice.prepacked_register(layer.handle, layer.packed, torch.ops.mkldnn.data_ptr(decoy.packed),
                                        128, 64, 128, 64)
    for rows in sorted({1, 2, most}):
        if rows > most:
            continue
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        assert torch.equal(layer(x), decoy(x)) and not torch.equal(layer(x), _packed_linear(x, layer.packed, None))
        assert torch.equal(prepacked_linear_op(x, layer.handle, None, 128), decoy(x))
    over = torch.randn(most + 1, 64, generator=gen).bfloat16()
    assert torch.equal(layer(over), _packed_linear(over, layer.packed, None))
    assert torch.equal(prepacked_linear_op(over, layer.handle, None, 128), layer(over))
    # sizes that are not the layout's are refused at registration
    for sizes in [(128, 64, 100, 64), (128, 64, 192, 64), (128, 64, 128, 96), (0, 64, 64, 64)]:
        with pytest.raises(RuntimeError, match="not the GEMV layout"):  # not whole blocks; a block too many
            torch.ops.sluice.prepacked_register(layer.handle, layer.packed, 1, *sizes)


def _tiles() -> bool:
    """Whether this process may use AMX's tiles, asked of the CPU's flags and of Linux (which grants
    their register state on request, 5.16+) here, not of the kernel under test."""
    if not {"amx_tile", "amx_bf16"} <= set(_cpu_flags().split()) or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA


def test_the_kernel_takes_a_batch_through_the_tiles_and_sixteen_rows_without():
    _gemv_or_skip()
    assert gemv_max_rows() == (64 if _tiles() else 16)


@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(3072, 576, False), (576, 1536, True),
                                                                   (100, 50, True)])
def test_several_rows_to_the_types_rounding_each_independent_of_the_others(out_features, in_features, bias):
    """Rows 2..gemv_max_rows(): each within one bfloat16 ulp of the exact product (and float32's
    rounding of its sums) and bitwise the
    same row in any batch of two or more. Through AMX tiles a row is the one-row kernel's but for a
    rare last bit, and more than 16 rows go in passes of up to 16 a block whose last may redo rows
    of the one before (17: two of 9; 40: three of 14); without AMX (VDPBF16PS on groups of rows) it
    is the one-row kernel's, bit for bit."""
    _gemv_or_skip()
    most = gemv_max_rows()
    gen = torch.Generator().manual_seed(in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    layer = PrepackedLinear(weight, b)
    assert layer.gemv
    x = torch.randn(most, in_features, generator=gen).bfloat16()
    full = layer(x)
    exact = x.double() @ weight.double().t() + (0 if b is None else b.double())
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    # where a sum nearly cancels, float32's own rounding over in_features terms can pass one bfloat16
    # ulp of the result (at 64 rows x 576 outputs one sum is ~1e-6 out of terms ~1e-2, which float32
    # itself rounds 20% off): those outputs are held to that rounding (a random walk's, 4 sigma),
    # the rest to one ulp
    magnitude = x.double().abs() @ weight.double().abs().t() + (0 if b is None else b.double().abs())
    float32_error = 4 * in_features**0.5 * 2.0**-24 * magnitude
    error = (full.double() - exact).abs()
    cancels = float32_error > ulp / 2
    assert (error[~cancels] <= ulp[~cancels]).all() and (error <= ulp + float32_error).all()
    assert cancels.float().mean() < 0.2  # the strict bound still holds most outputs
    for rows in sorted({2, 3, 7, 15, 16, 17, 31, 33, 40, 63, most - 1} & set(range(2, most))):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
        assert torch.equal(layer(x[most - rows:]), full[most - rows:]), rows
    one = torch.cat([layer(x[i : i + 1]) for i in range(most)])
    if _tiles():
        assert (one != full).float().mean() < 0.01
    else:
        assert torch.equal(one, full)


@pytest.mark.parametrize(("out_features", "in_features"),
                         [(576, 1536), (960, 576), (3072, 576), (8256, 96), (8256, 32)])
def test_products_do_not_depend_on_the_thread_count(out_features, in_features):
    """Each output's sum is the same whichever thread computes its block or half of one: one to
    three threads give the same outputs bit for bit, for one row, five and forty (passes of tiles
    where the CPU has them). 8256 outputs are 129
    blocks: a team of two shares 32 of them in claims that shrink from 8 blocks to one, and the last
    one in halves, which one thread may compute and the other add (packed_gemv.c); at 32 inputs a
    block is one chunk, and no block is halved."""
    _gemv_or_skip()
    gen = torch.Generator().manual_seed(out_features + in_features)
    layer = PrepackedLinear((torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16(), None)
    x = torch.randn(min(40, gemv_max_rows()), in_features, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got[n] = (layer(x[:1]), layer(x[:5]), layer(x))
    finally:
        torch.set_num_threads(threads)
    for outputs in got.values():
        assert all(torch.equal(a, b) for a, b in zip(outputs, got[1], strict=True))


def test_a_layout_that_does_not_check_out_keeps_onednn(monkeypatch):
    _gemv_or_skip()
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(192, 96, generator=gen).bfloat16()
    layer = PrepackedLinear(weight, None)
    assert gemv_layout(weight, layer.packed) == (192, 96)
    changed = weight.clone()
    changed[5, 7] += 1
    assert gemv_layout(changed, layer.packed) is None  # the buffer does not hold this weight
    assert gemv_layout(weight.float(), layer.packed) is None
    import engine_service.model.prepacked as prepacked

    monkeypatch.setattr(prepacked, "gemv_layout", lambda weight, packed: None)
    kept = PrepackedLinear(weight, None)
    assert not kept.gemv and "native kernel" not in repr(kept)
    x = torch.randn(1, 96, generator=gen).bfloat16()
    assert torch.equal(kept(x), _packed_linear(x, kept.packed, None))


def test_float32_and_cuda_are_not_prepacked():
    assert prepack_unavailable(torch.float32, torch.device("cpu")) is not None
    assert prepack_unavailable(torch.bfloat16, torch.device("cuda")) is not None
    model = nn.Sequential(nn.Linear(8, 8))
    assert prepack_model(model) == 0 and isinstance(model[0], nn.Linear)


def test_unavailable_prepacking_leaves_the_model_alone(monkeypatch):
    import engine_service.model.prepacked as prepacked

    monkeypatch.setattr(prepacked, "prepack_unavailable", lambda dtype, device: "no oneDNN here")
    model = nn.Sequential(nn.Linear(8, 8, dtype=torch.bfloat16))
    assert prepack_model(model) == 0 and isinstance(model[0], nn.Linear)


@pytest.mark.skipif(not PREPACKS, reason="this CPU cannot prepack bfloat16 weights")
def test_the_operator_is_native_and_releases_weights_with_their_layer():
    """gcc/g++ are part of the test set-up: the operator's kernel is the C++ one, whose registry
    holds a layer's packed weight exactly as long as the layer lives."""
    layer = PrepackedLinear(torch.randn(16, 8).bfloat16(), None)
    x = torch.randn(3, 8).bfloat16()
    assert torch.equal(prepacked_linear_op(x, layer.handle, None, 16), layer(x))
    with pytest.raises(RuntimeError, match="out_features"):
        prepacked_linear_op(x, layer.handle, None, 17)
    handle = layer.handle
    del layer
    gc.collect()
    with pytest.raises(RuntimeError, match="no packed weight under this handle"):
        prepacked_linear_op(x, handle, None, 16)
    with pytest.raises(RuntimeError, match="0-d int64"):
        prepacked_linear_op(x, handle.float(), None, 16)


@pytest.mark.model
@pytest.mark.skipif(not PREPACKS, reason="this CPU cannot prepack bfloat16 weights")
def test_without_native_operators_a_prepacked_model_runs_eagerly(model_dir, monkeypatch, caplog):
    """No native library (no g++, a failed build): a bfloat16 engine asked to compile says why and
    runs eagerly instead of failing in its warm-up, and its layers register nothing."""
    import engine_service.model.native as native

    monkeypatch.setattr(native, "_loaded", {native.LIBRARY_NAME: native.NativeKernelError("no g++ here")})
    with caplog.at_level("WARNING"):
        llm = LLM(str(model_dir), dtype="bfloat16", enforce_eager=False, kv_cache_memory=8 << 20)
    engine = llm.engine
    assert engine.enforce_eager and engine.path_named("compiled") is None
    assert engine.attention_backend == "torch"
    assert any("prepacked layers need the native operators in a compiled graph: no g++ here" in r.getMessage()
               for r in caplog.records)
    layer = _layers(engine.runner.model, PrepackedLinear)[0]
    x = torch.randn(2, layer.in_features).bfloat16()
    # nothing under the layer's handle (or, when no earlier test loaded the library into this
    # process, no kernel at all)
    with pytest.raises(RuntimeError, match="no packed weight under this handle|Could not run 'sluice::prepacked_linear'"):
        prepacked_linear_op(x, layer.handle, None, layer.out_features)
    tokens = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids
    assert len(tokens) == 4


@pytest.mark.model
def test_bfloat16_model_prepacked_and_greedy_identical_to_plain_layers(model_dir, monkeypatch):
    model = load_model(model_dir, torch.bfloat16)
    plain = load_model(model_dir, torch.bfloat16, prepack=False)
    assert _layers(plain, PrepackedLinear) == [] and hasattr(plain, "lm_head") is False
    if not PREPACKS:
        assert _layers(model, PrepackedLinear) == []
        return
    layers = plain.config.num_hidden_layers
    # four projections a layer (q/k/v fused, o, gate/up fused, down) and a tied model's output head
    assert len(_layers(model, PrepackedLinear)) == 4 * layers + 1 and isinstance(model.lm_head, PrepackedLinear)
    assert _layers(model, nn.Linear) == []
    hidden = torch.randn(3, plain.config.hidden_size).bfloat16()
    want = plain.compute_logits(hidden)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().amax().item()
    torch.testing.assert_close(model.compute_logits(hidden), want, rtol=0, atol=ulp)
    del model, plain

    import engine_service.model.loader as loader

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    packed = [o.outputs[0].token_ids for o in LLM(str(model_dir), dtype="bfloat16").generate(prompts, greedy)]
    monkeypatch.setattr(loader, "prepack_model", lambda model: 0)
    reference = [o.outputs[0].token_ids for o in LLM(str(model_dir), dtype="bfloat16").generate(prompts, greedy)]
    assert packed == reference


@pytest.mark.model
def test_quantized_and_float32_models_keep_their_layers(model_dir):
    assert _layers(load_model(model_dir, torch.float32), PrepackedLinear) == []
    quantized = load_model(model_dir, torch.bfloat16, quantization="int8")
    assert _layers(quantized, PrepackedLinear) == []


def test_probe_refuses_products_that_disagree_or_fail(monkeypatch):
    import engine_service.model.prepacked as prepacked

    cpu = torch.device("cpu")
    if prepack_unavailable(torch.bfloat16, cpu) == "this torch has no oneDNN":
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(prepacked, "_packed_linear", lambda x, packed, bias: torch.zeros(x.shape[0], 48, dtype=x.dtype))
    prepacked._probe.cache_clear()
    try:
        assert "differs from F.linear" in prepack_unavailable(torch.bfloat16, cpu)

        def refuse(weight):
            raise RuntimeError("no kernel for this layout\nmore")

        monkeypatch.setattr(prepacked, "_pack", refuse)
        prepacked._probe.cache_clear()
        assert prepack_unavailable(torch.bfloat16, cpu) == "oneDNN cannot prepack torch.bfloat16 here: no kernel for this layout"
        model = nn.Sequential(nn.Linear(64, 48, dtype=torch.bfloat16))
        assert prepack_model(model) == 0 and isinstance(model[0], nn.Linear)
    finally:
        monkeypatch.undo()
        prepacked._probe.cache_clear()
