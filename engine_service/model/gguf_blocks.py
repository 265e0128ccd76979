"""GGUF's block-quantized tensors decoded into the integer codes and float scales the native
kernels read, without a rounding of any weight.

Every supported type is one of two shapes of weight, whatever its block layout on disk:

* ``q4``: 4-bit codes in [0, 15] with one (scale, min) pair per 32 inputs, ``w = code * scale +
  min`` (the int4 kernel's layout, ``quantization.pack_q4``). Q4_1 is exactly that (``d``, ``m``);
  Q4_0 is ``scale = d``, ``min = -8 d``; Q4_K's super-block of 256 is eight such groups, ``scale =
  d * sc``, ``min = -dmin * m`` with 6-bit ``sc`` and ``m``.
* ``q8``: signed 8-bit codes with one scale per ``g`` inputs, ``w = code * scale`` (the int8 block
  kernel's layout, ``q8_blocks``): Q8_0 (``g`` = 32) and Q6_K (``g`` = 16, ``scale = d * sc``,
  ``code = q - 32``).

The scales are exact in float32 (a float16 times a small integer). The int4 kernel keeps its pair
in float16, which holds Q4_0's and Q4_1's exactly; Q4_K's products ``d * sc`` can need up to 17
bits and are rounded once to float16's 11 (a relative 2^-12 of the group's step at most; the codes
are the file's). ``tests/unit/test_gguf_blocks.py`` checks each decoder against ``gguf``'s own
dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
Q8_TYPES = ("Q8_0", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = Q4_TYPES + Q8_TYPES + FLOAT_TYPES
# bytes of one block and the inputs it holds, per type (ggml's block_q4_0 ... block_q6_K)
BLOCK = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256), "Q8_0": (34, 32), "Q6_K": (210, 256)}


class GGUFTensorError(ValueError):
    """A tensor's bytes are not what its type and shape say."""


@dataclass(frozen=True)
class BlockWeight:
    """One weight matrix [rows, cols] as a kernel reads it. ``family`` is ``q4`` (``codes`` uint8 in
    [0, 15], ``scales`` and ``mins`` float32 [rows, cols / 32]), ``q8`` (``codes`` int8, ``scales``
    float32 [rows, cols / group]) or ``float`` (``dense`` float32 [rows, cols])."""

    family: str
    rows: int
    cols: int
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    dense: torch.Tensor | None = None

    @property
    def group(self) -> int:
        return self.cols // self.scales.shape[1] if self.scales is not None else self.cols

    def take_rows(self, index: torch.Tensor) -> BlockWeight:
        """The same weight with its rows in ``index``'s order (llama.cpp's rotary row order undone)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index).contiguous()

        return BlockWeight(self.family, self.rows, self.cols, pick(self.codes), pick(self.scales), pick(self.mins),
                           pick(self.dense))

    def dequantized(self) -> torch.Tensor:
        """The float32 weights: exact for every family (each is a float16 times small integers)."""
        if self.family == "float":
            return self.dense
        group = self.group
        codes = self.codes.float().view(self.rows, -1, group)
        w = codes * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.view(self.rows, self.cols)

    def with_group(self, group: int) -> BlockWeight:
        """A q8 weight with its scales repeated to a finer ``group`` (Q8_0's 32 as Q6_K's 16): exact."""
        if self.family != "q8" or group == self.group:
            return self
        return BlockWeight("q8", self.rows, self.cols, self.codes,
                           self.scales.repeat_interleave(self.group // group, dim=1).contiguous())


def _blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> np.ndarray:
    nbytes, per = BLOCK[type_name]
    if cols % per:
        raise GGUFTensorError(f"{cols} inputs are not a whole number of {type_name} blocks of {per}")
    data = np.asarray(raw).view(np.uint8)
    if data.size != rows * (cols // per) * nbytes:
        raise GGUFTensorError(f"{data.size} bytes, expected {rows * (cols // per) * nbytes} for {type_name} "
                              f"[{rows}, {cols}]")
    return data.reshape(rows, cols // per, nbytes)


def _half(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit order within 32 inputs: input j in the low nibble of byte j, j + 16 in the high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def decode(raw: np.ndarray, type_name: str, rows: int, cols: int) -> BlockWeight:
    """``raw`` (the tensor's bytes, or its float array for F32/F16/BF16) as a :class:`BlockWeight`."""
    if type_name in FLOAT_TYPES:
        data = np.asarray(raw)
        if type_name == "BF16":
            data = data.view(np.uint16).astype(np.uint32) << 16
            data = data.view(np.float32)
        dense = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32).reshape(-1).copy())
        if dense.numel() != rows * cols:
            raise GGUFTensorError(f"{dense.numel()} values, expected {rows} x {cols}")
        return BlockWeight("float", rows, cols, dense=dense.view(rows, cols))
    if type_name not in BLOCK:
        raise GGUFTensorError(f"tensor type {type_name} is not served (supported: {', '.join(SUPPORTED_TYPES)})")
    b = _blocks(raw, type_name, rows, cols)
    if type_name == "Q4_0":
        d = _half(b[..., 0:2])
        codes, scales, mins = _nibbles(b[..., 2:18]), d, -8.0 * d
    elif type_name == "Q4_1":
        codes, scales, mins = _nibbles(b[..., 4:20]), _half(b[..., 0:2]), _half(b[..., 2:4])
    elif type_name == "Q4_K":
        from gguf.quants import Q4_K

        nb = b.shape[1]
        d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(rows * nb, 12))
        scales = d[..., None] * sc.reshape(rows, nb, 8).astype(np.float32)
        mins = -(dmin[..., None] * m.reshape(rows, nb, 8).astype(np.float32))
        qs = b[..., 16:144].reshape(rows, nb, 4, 32)  # four chunks of 64 inputs: low nibbles, then high
        codes = np.stack([qs & 15, qs >> 4], axis=3)  # [rows, nb, 4, 2, 32]
    else:  # Q8_0, Q6_K: int8 codes and a scale per 32 or 16 inputs (q8_blocks decodes them)
        from engine_service.model.q8_blocks import Q8FormatError, gguf_q6_k_codes, gguf_q8_0_codes

        try:
            codes8, scales8 = (gguf_q8_0_codes if type_name == "Q8_0" else gguf_q6_k_codes)(
                np.asarray(raw).view(np.uint8), rows, cols)
        except Q8FormatError as exc:
            raise GGUFTensorError(str(exc)) from exc
        return BlockWeight("q8", rows, cols, codes8, scales8)
    codes = np.ascontiguousarray(codes).reshape(rows, cols).astype(np.uint8)
    return BlockWeight("q4", rows, cols, torch.from_numpy(codes),
                       torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, cols // 32)),
                       torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32).reshape(rows, cols // 32)))


def concat_rows(parts: list[BlockWeight]) -> BlockWeight | None:
    """Parts of one fused projection (q, k, v; gate, up) as one weight, or None where their families
    differ (each part then runs its own product)."""
    families = {p.family for p in parts}
    if len(families) != 1 or len({p.cols for p in parts}) != 1:
        return None
    family, cols, rows = parts[0].family, parts[0].cols, sum(p.rows for p in parts)
    if family == "float":
        return BlockWeight("float", rows, cols, dense=torch.cat([p.dense for p in parts]))
    if family == "q8":
        group = min(p.group for p in parts)
        parts = [p.with_group(group) for p in parts]
        return BlockWeight("q8", rows, cols, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))
    return BlockWeight("q4", rows, cols, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                       torch.cat([p.mins for p in parts]))
