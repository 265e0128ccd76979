"""Linear layers whose weights oneDNN lays out once, at load, for its CPU kernels (bfloat16, float16).

``F.linear`` on a bfloat16 CPU tensor hands oneDNN a plain row-major weight. oneDNN's AMX /
AVX512-BF16 kernels want a blocked layout, so every call first reorders the whole weight, which is
as large as the product itself at decode sizes. A one-row product through SmolLM2's [3072, 576]
MLP projection took 187 µs through ``F.linear`` and 62 µs from a prepacked weight on the
development VM; 512 rows took 882 against 674 µs (``docs/performance.md``). Inductor does the same
when it freezes a CPU graph; the engine does it in its eager forward too.

:func:`prepack_model` replaces every ``nn.Linear`` of a bfloat16 or float16 model on CPU by a
:class:`PrepackedLinear` holding the weight in oneDNN's layout (``mkldnn._reorder_linear_weight``)
and multiplying with ``mkldnn._linear_pointwise``, the operators inductor's freezing emits. A
tied-embedding model gets a prepacked output projection of its own (the embedding keeps its table
for the lookup). The products are oneDNN's, as before, but oneDNN may block the sum differently
for a packed weight: on the development VM they are bitwise equal to ``F.linear``'s at most row
counts and differ in the last bit of a few elements at others (bf16 at 300 rows, fp16 at 1). That
is within the type's rounding, and float32, the type exactness is pinned to, is never prepacked
(its oneDNN path measured no faster; ``F.linear`` runs MKL's sgemm there). A probe at load checks
that the products agree with ``F.linear`` to the type's rounding and leaves the model alone,
logged, when they do not or when this torch has no oneDNN. One bfloat16 row is the exception: it
runs the native GEMV on the same packed buffer (below), also within one ulp of the exact product.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import weakref

import torch
from torch import nn

from engine_service.model.hugepages import collapse_to_hugepages
from engine_service.model.linear_swap import swap_linears

logger = logging.getLogger(__name__)

PREPACK_DTYPES = (torch.bfloat16, torch.float16)
BATCH_HINT = 1  # the row count oneDNN picks the blocked layout for; products of any row count run on it


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack_unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """None when prepacked products run here and agree with ``F.linear`` to the dtype's rounding,
    else why not."""
    if device.type != "cpu":
        return f"prepacking is for CPU, not {device.type}"
    if dtype not in PREPACK_DTYPES:
        return f"{dtype} is not prepacked"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    return _probe(dtype)


@functools.cache
def _probe(dtype: torch.dtype) -> str | None:
    # once per process and dtype: dtype auto at engine start and the loader both ask
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    try:
        for rows in (1, 5, 67):
            x = torch.randn(rows, 64, generator=gen).to(dtype)
            for b in (None, bias):
                got = _packed_linear(x, _pack(weight), b).float()
                want = torch.nn.functional.linear(x, weight, b).float()
                if not torch.allclose(got, want, rtol=2 * torch.finfo(dtype).eps, atol=2 * torch.finfo(dtype).eps):
                    return f"oneDNN's prepacked product differs from F.linear in {dtype} here"
    except (RuntimeError, NotImplementedError) as exc:
        return f"oneDNN cannot prepack {dtype} here: {str(exc).splitlines()[0][:200]}"
    return None


# A compiled graph cannot take an opaque oneDNN tensor as an input (it has no strides to fake), so
# under torch.compile a PrepackedLinear passes a handle, a 0-d integer tensor (a buffer, so a graph
# input read from the module at every call: two engines in one process may share a compiled graph,
# and an int baked into it would be the first engine's weight), to the operator
# sluice::prepacked_linear, which finds the packed weight by it. The operator's CPU kernel is C++
# (kernels/prepacked_linear_op.cpp, built with the other native operators by
# engine_service.model.native: a Python kernel cost 8-50 µs a call, 121 calls a step), holding the
# packed weights in its own registry (sluice::prepacked_register / prepacked_unregister, the entry
# dropped when the layer is collected). Where the native operators cannot be built, a bfloat16
# model runs eagerly (compile_unavailable). Registered with torch.library's low-level API:
# ``torch.library.custom_op`` cost ~50 µs a call more in the graph.
_handles = itertools.count()

_library = torch.library.Library("sluice", "FRAGMENT")
_library.define("prepacked_linear(Tensor x, Tensor handle, Tensor? bias, int out_features) -> Tensor")
_library.define("prepacked_register(Tensor handle, Tensor packed, int gemv_data, int out_features, int in_features, "
                "int out_padded, int in_padded) -> ()")
_library.define("packed_gemv_supported() -> bool")
_library.define("packed_gemv_max_rows() -> int")
_library.define("prepacked_unregister(Tensor handle) -> ()")
_library.define("prepacked_set_deterministic(Tensor handle, bool on) -> ()")


def _prepacked_linear_fake(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None,
                           out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_library.impl("prepacked_linear", _prepacked_linear_fake, "Meta")
prepacked_linear_op = torch.ops.sluice.prepacked_linear


def _native_ops_unavailable() -> str | None:
    from engine_service.model.native import native_ops_unavailable  # native imports this module

    return native_ops_unavailable()


# One row of bfloat16 (one stream's decode step) runs the native GEMV (kernels/packed_gemv.c) on
# oneDNN's packed weight, which it reads in place: oneDNN's one-row product streams the weights at
# ~18 GB/s on the development VM, the GEMV at ~25 (docs/performance.md). Up to gemv_max_rows() rows
# do too (a verifying step's drafts, a batch's decode step, a short prefill chunk): the kernel reads
# each weight once for all of them (up to 64 rows through AMX tiles where the CPU has them, else up
# to 16 by VDPBF16PS on groups of rows), where oneDNN's product of a few rows takes about twice a
# one-row step. The layout is oneDNN's
# choice, not a promise, so each layer checks at load that its packed buffer is the one the kernel
# reads (blocks of 64 rows x 32 inputs, input pairs innermost, zero padding); any other layout keeps
# oneDNN for every product.
GEMV_BLOCK_N, GEMV_BLOCK_K = 64, 32


def _gemv_supported() -> bool:
    return _native_ops_unavailable() is None and bool(torch.ops.sluice.packed_gemv_supported())


@functools.cache
def gemv_max_rows() -> int:
    """The most rows of bfloat16 the native kernel takes in this process (0 without one)."""
    return int(torch.ops.sluice.packed_gemv_max_rows()) if _gemv_supported() else 0


def gemv_layout(weight: torch.Tensor, packed: torch.Tensor) -> tuple[int, int] | None:
    """(padded rows, padded inputs) when ``packed`` holds ``weight`` in the layout the native GEMV
    reads, else None."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    n, k = weight.shape
    n_pad, k_pad = -(-n // GEMV_BLOCK_N) * GEMV_BLOCK_N, -(-k // GEMV_BLOCK_K) * GEMV_BLOCK_K
    try:
        if torch.ops.mkldnn._nbytes(packed) != n_pad * k_pad * 2:
            return None
        address = torch.ops.mkldnn.data_ptr(packed)
    except (RuntimeError, AttributeError):
        return None
    raw = torch.frombuffer((ctypes.c_int16 * (n_pad * k_pad)).from_address(address), dtype=torch.int16)
    blocked = (raw.view(n_pad // GEMV_BLOCK_N, k_pad // GEMV_BLOCK_K, GEMV_BLOCK_K // 2, GEMV_BLOCK_N, 2)
               .permute(0, 3, 1, 2, 4).reshape(n_pad, k_pad))
    if not torch.equal(blocked[:n, :k], weight.view(torch.int16)):
        return None
    if blocked[n:].any() or blocked[:, k:].any():  # the kernel multiplies the padding too
        return None
    return n_pad, k_pad


def compile_unavailable(model: nn.Module) -> str | None:
    """None when ``model``'s prepacked layers (if any) can run in a compiled graph, else why not."""
    if not any(isinstance(m, PrepackedLinear) for m in model.modules()):
        return None
    why_not = _native_ops_unavailable()
    return None if why_not is None else f"prepacked layers need the native operators in a compiled graph: {why_not}"


class PrepackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's blocked layout (an opaque ``torch._mkldnn``
    tensor: it has no strides, so it is not a parameter and is never saved or copied)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = _pack(weight)
        handle = torch.tensor(next(_handles))
        self.register_buffer("handle", handle, persistent=False)
        self.gemv = False  # up to gemv_max_rows() rows run the native kernel on the packed weight
        self.gemv_weight: tuple[int, int, int] | None = None  # (address, n_pad, k_pad) when gemv
        if _native_ops_unavailable() is None:  # else the model never compiles: compile_unavailable
            padded = gemv_layout(weight, self.packed) if _gemv_supported() else None
            self.gemv = padded is not None
            address = torch.ops.mkldnn.data_ptr(self.packed) if padded else 0
            n_pad, k_pad = padded or (0, 0)
            if padded:
                self.gemv_weight = (address, n_pad, k_pad)
                self.gemv_max_numel = gemv_max_rows() * self.in_features
            torch.ops.sluice.prepacked_register(handle, self.packed, address, self.out_features, self.in_features,
                                                n_pad, k_pad)
            weakref.finalize(self, torch.ops.sluice.prepacked_unregister, handle)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def set_deterministic(self) -> None:
        """Every row count through the native GEMV on groups of rows, never AMX tiles: each row's
        output is what the row alone gives, bit for bit (a deterministic engine's products, a
        prefill chunk's included; engine_service.model.determinism). Needs ``gemv``."""
        if not self.gemv:
            raise ValueError("a deterministic product needs the weight in the native GEMV's layout")
        torch.ops.sluice.prepacked_set_deterministic(self.handle, True)
        self.gemv_max_numel = 1 << 62

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or (self.gemv and x.numel() <= self.gemv_max_numel):
            return prepacked_linear_op(x, self.handle, self.bias, self.out_features)
        return _packed_linear(x, self.packed, self.bias)  # eager: no custom-op dispatch per call

    def extra_repr(self) -> str:
        gemv = f", up to {gemv_max_rows()} rows by the native kernel" if self.gemv else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, oneDNN layout{gemv}"


def prepack_model(model: nn.Module) -> int:
    """Swap the model's ``nn.Linear`` layers (and a tied output projection) for prepacked ones, in
    place, where :func:`prepack_unavailable` allows. Returns how many layers were prepacked."""
    try:
        weight = next(model.parameters())
    except StopIteration:
        return 0
    why_not = prepack_unavailable(weight.dtype, weight.device)
    if why_not is not None:
        logger.info("linear weights not prepacked: %s", why_not)
        return 0
    count = len(swap_linears(model, PrepackedLinear))
    huge = collapse_to_hugepages(packed_buffers(model))
    logger.info("prepacked %d linear layers for oneDNN (%s), %d MiB of them on huge pages", count, weight.dtype,
                huge >> 20)
    return count


def packed_buffers(model: nn.Module) -> list[tuple[int, int]]:
    """(address, bytes) of every prepacked layer's oneDNN buffer in ``model``.

    A decode step streams them all, and oneDNN leaves them on 4 KiB pages; collapsed onto huge pages
    where they lie (``collapse_to_hugepages``) they stream faster (docs/performance.md, eleventh
    round)."""
    buffers = []
    for module in model.modules():
        if isinstance(module, PrepackedLinear):
            try:
                buffers.append((torch.ops.mkldnn.data_ptr(module.packed), torch.ops.mkldnn._nbytes(module.packed)))
            except (RuntimeError, AttributeError):  # a torch without these accessors: leave it be
                continue
    return buffers
