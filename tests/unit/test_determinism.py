"""The kernels of a deterministic engine (``engine_service.model.determinism``) against their
reference: every row's output is bit for bit what the row alone gives, whatever the rows beside it
and their count, and within the dtype's rounding of the plain product or attention. And which
engines can be deterministic, and what they say when they are not."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from engine_service.model.determinism import (
    FIXED_TILE_ROWS,
    FixedTileLinear,
    determinism_unavailable,
    fixed_tile_rows,
)
from engine_service.model.native import native_ops_unavailable
from engine_service.model.prepacked import PrepackedLinear, _gemv_supported, prepack_unavailable
from engine_service.model.quantization import QuantizedLinear

pytestmark = pytest.mark.slow  # builds the native kernels


@pytest.fixture(autouse=True)
def _native_or_fail():
    why = native_ops_unavailable()
    assert why is None, f"the native operators must build on this machine (gcc, g++): {why}"


def _alone(layer, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])


# 1 row, a group, past the one-call rows (16 without AMX, 64 with), several passes of 64, odd counts
ROWS = [1, 6, 17, 65, 130]


@pytest.mark.parametrize("bias", [False, True])
def test_a_deterministic_bfloat16_product_gives_every_row_what_it_gives_alone(bias):
    if prepack_unavailable(torch.bfloat16, torch.device("cpu")) is not None or not _gemv_supported():
        pytest.skip("this CPU has no AVX512-BF16: a bfloat16 engine is not deterministic here (tested below)")
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16()
    b = torch.randn(960, generator=gen).bfloat16() if bias else None
    layer = PrepackedLinear(weight, b)
    layer.set_deterministic()
    for rows in ROWS:
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        got = layer(x)
        assert torch.equal(got, _alone(layer, x)), rows
        # the reference: the exact product rounded once; one bfloat16 ulp of the largest output at most
        want = (x.double() @ weight.double().t() + (b.double() if bias else 0)).float()
        ulp = torch.finfo(torch.bfloat16).eps * want.abs().amax().item()
        assert (got.float() - want).abs().max().item() <= 2 * ulp, rows


def test_a_bfloat16_product_refuses_determinism_without_the_gemv_layout():
    if prepack_unavailable(torch.bfloat16, torch.device("cpu")) is not None:
        pytest.skip("bfloat16 is not prepacked on this machine")
    layer = PrepackedLinear((torch.randn(64, 64) * 0.05).bfloat16(), None)
    layer.gemv = False  # as oneDNN's own layout leaves it
    with pytest.raises(ValueError, match="GEMV's layout"):
        layer.set_deterministic()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_tiles_give_every_row_what_it_gives_alone(dtype):
    gen = torch.Generator().manual_seed(4)
    linear = nn.Linear(576, 1536, bias=True, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1536, 576, generator=gen) * 0.05)
    layer = FixedTileLinear(linear)
    for rows in [1, FIXED_TILE_ROWS - 1, FIXED_TILE_ROWS, FIXED_TILE_ROWS + 1, 3 * FIXED_TILE_ROWS + 5]:
        x = torch.randn(2, rows, 576, generator=gen).to(dtype)  # leading dims are flattened
        got = layer(x)
        assert got.shape == (2, rows, 1536)
        assert torch.equal(got.reshape(-1, 1536), _alone(layer, x.reshape(-1, 576))), rows
        want = F.linear(x.double(), linear.weight.double(), linear.bias.double())
        ulp = torch.finfo(dtype).eps * want.abs().amax().item()
        assert (got.double() - want).abs().max().item() <= 8 * ulp, rows
    # the product is called only on whole tiles
    shapes = []
    fixed_tile_rows(torch.randn(11, 8), 4, lambda t: shapes.append(tuple(t.shape)) or t[:, :4])
    assert shapes == [(FIXED_TILE_ROWS, 8)] * 2


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_products_without_the_dense_path_give_every_row_what_it_gives_alone(method):
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(576, 1536, generator=gen) * 0.05
    layer = QuantizedLinear.from_float(weight, None, method, torch.bfloat16)
    layer.dense_min_rows = None  # what make_deterministic sets: the packed kernel for every row count
    x = torch.randn(200, 1536, generator=gen)
    assert torch.equal(layer(x), _alone(layer, x))


def _sequence_attention(cache_dtype: torch.dtype, rows: int, context: int):
    """One sequence's last ``rows`` positions, each attending as a decode of its own length (a
    prefill chunk's rows in a deterministic engine), over a cache of ``context`` tokens."""
    gen = torch.Generator().manual_seed(6)
    bs, heads, kv_heads, dim = 16, 9, 3, 64
    blocks = -(-context // bs)
    k_cache = torch.randn(blocks + 1, bs, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(blocks + 1, bs, kv_heads, dim, generator=gen).to(cache_dtype)
    q = torch.randn(rows, heads, dim, generator=gen)
    table = torch.randperm(blocks, generator=gen) + 1  # scattered blocks, as the pool hands them out
    tables = table.repeat(rows, 1)
    lens = torch.arange(context - rows + 1, context + 1)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_the_deterministic_attention_gives_every_row_what_it_gives_alone(cache_dtype):
    from engine_service.model.attention import AttentionMetadata, decode_attention_reference
    from engine_service.model.native import PagedDecodeAttention

    kernel = PagedDecodeAttention()
    scale = 0.125
    for rows, context in [(1, 40), (7, 300), (33, 700)]:
        q, k_cache, v_cache, tables, lens = _sequence_attention(cache_dtype, rows, context)
        got = kernel.exact_op(q, k_cache, v_cache, tables, lens, scale)
        alone = torch.cat([kernel.exact_op(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], scale)
                           for i in range(rows)])
        assert torch.equal(got, alone), (rows, context)
        meta = AttentionMetadata(slot_mapping=torch.zeros(rows, dtype=torch.long), prefills=[],
                                 decode_token_index=None, decode_block_tables=tables, decode_context_lens=lens)
        want = decode_attention_reference(q, k_cache, v_cache, meta, scale)
        assert (got - want).abs().max().item() < 1e-4, (rows, context)


@pytest.mark.model
def test_float32_and_int8_engines_are_deterministic_only_when_asked(model_dir):
    """Left unset, deterministic is on only where it costs next to nothing; an engine that leaves it
    off says why at start, and --deterministic turns it on."""
    from engine_service import LLM

    for keywords, costly in (({"dtype": "float32"}, "float32 products in fixed tiles"),
                             ({"dtype": "float32", "quantization": "int8"}, "int8's prefill")):
        off = LLM(str(model_dir), kv_cache_memory=8 << 20, **keywords).engine
        assert not off.deterministic and off.choices["deterministic"].startswith(f"off (auto: {costly}")
        on = LLM(str(model_dir), kv_cache_memory=8 << 20, deterministic=True, **keywords).engine
        assert on.deterministic and on.choices["deterministic"] == "on (asked for)"
    four = LLM(str(model_dir), kv_cache_memory=8 << 20, dtype="float32", quantization="int4").engine
    if torch.ops.sluice.q4_supported():
        assert four.deterministic and four.choices["deterministic"] == "on (auto)"


def test_which_engines_can_be_deterministic():
    model = nn.Sequential(nn.Linear(8, 8))
    cpu = torch.device("cpu")
    assert determinism_unavailable(model, cpu, "native", compile_asked=False) is None
    assert "enforce_eager" in determinism_unavailable(model, cpu, "native", compile_asked=True)
    assert "attention_backend" in determinism_unavailable(model, cpu, "torch", compile_asked=False)
    assert "cuda" in determinism_unavailable(model, torch.device("cuda"), "native", compile_asked=False)
