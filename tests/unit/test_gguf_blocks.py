"""GGUF block decoding (engine_service.model.gguf_blocks): every served type's codes and scales give
exactly the weights ``gguf``'s own dequantization gives, and the fused projections stay exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine_service.model.gguf_blocks import BLOCK, BlockWeight, GGUFTensorError, concat_rows, decode

ROWS, COLS = 48, 512


def _random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of a K-quant type, byte by byte, with finite float16 scales."""
    rng = np.random.default_rng(seed)
    nbytes, per = BLOCK[type_name]
    blocks = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    halves = rng.uniform(1e-3, 5e-2, size=(rows, cols // per, 2)).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":  # d and dmin lead the block
        blocks[..., 0:4] = halves.reshape(rows, cols // per, 4)
    else:  # Q6_K: d closes it
        blocks[..., 208:210] = halves[..., :2]
    return blocks.reshape(rows, -1)


def _gguf_reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    return dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_by_gguf_decode_exactly(type_name):
    weights = np.random.default_rng(1).normal(0, 0.05, size=(ROWS, COLS)).astype(np.float32)
    raw = quantize(weights, GGMLQuantizationType[type_name])
    decoded = decode(raw, type_name, ROWS, COLS)
    assert decoded.family == ("q8" if type_name == "Q8_0" else "q4")
    assert torch.equal(decoded.dequantized(), torch.from_numpy(_gguf_reference(raw, type_name)))
    if decoded.family == "q4":
        assert int(decoded.codes.max()) <= 15 and decoded.codes.dtype == torch.uint8


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quants_decode_exactly(type_name):
    raw = _random_blocks(type_name, ROWS, COLS, seed=7)
    decoded = decode(raw, type_name, ROWS, COLS)
    assert decoded.group == (32 if type_name == "Q4_K" else 16)
    assert torch.equal(decoded.dequantized(), torch.from_numpy(_gguf_reference(raw, type_name)))
    if type_name == "Q6_K":
        assert decoded.codes.dtype == torch.int8 and int(decoded.codes.min()) >= -32 and int(decoded.codes.max()) <= 31


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_tensors_decode_exactly(type_name):
    weights = np.random.default_rng(2).normal(0, 1, size=(4, 64)).astype(np.float32)
    if type_name == "F16":
        raw = weights.astype(np.float16)
        want = raw.astype(np.float32)
    elif type_name == "BF16":
        raw = (weights.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        want = ((weights.view(np.uint32) >> 16) << 16).view(np.float32)
    else:
        raw, want = weights, weights
    assert torch.equal(decode(raw, type_name, 4, 64).dequantized(), torch.from_numpy(want))


def test_bad_blocks_are_refused_naming_why():
    raw = quantize(np.zeros((4, 64), np.float32), GGMLQuantizationType.Q4_1)
    with pytest.raises(GGUFTensorError, match="bytes, expected"):
        decode(raw[:, :-1], "Q4_1", 4, 64)
    with pytest.raises(GGUFTensorError, match="not a whole number of Q4_K blocks"):
        decode(raw, "Q4_K", 4, 64)
    with pytest.raises(GGUFTensorError, match="IQ2_XS is not served"):
        decode(raw, "IQ2_XS", 4, 64)


def test_fused_parts_concatenate_exactly_and_mixed_families_do_not():
    rng = np.random.default_rng(3)
    q8 = decode(quantize(rng.normal(0, 0.05, (32, COLS)).astype(np.float32), GGMLQuantizationType.Q8_0),
                "Q8_0", 32, COLS)
    q6 = decode(_random_blocks("Q6_K", 16, COLS, seed=4), "Q6_K", 16, COLS)
    fused = concat_rows([q8, q6])
    assert fused.group == 16  # Q8_0's scales repeated onto Q6_K's groups: the same weights
    assert torch.equal(fused.dequantized(), torch.cat([q8.dequantized(), q6.dequantized()]))
    q4 = decode(quantize(rng.normal(0, 0.05, (16, COLS)).astype(np.float32), GGMLQuantizationType.Q4_1),
                "Q4_1", 16, COLS)
    assert concat_rows([q4, q6]) is None
    order = torch.tensor([2, 0, 1] + list(range(3, 16)))
    assert torch.equal(q4.take_rows(order).dequantized(), q4.dequantized()[order])
    assert isinstance(concat_rows([q4, q4]), BlockWeight)
