"""Weights and KV cache in memory the kernel may back with transparent huge pages (2 MiB), on CPU.

Decoding one token reads every weight once: a stream of 538 MB (SmolLM2-135M in float32) through
4 KiB pages is a TLB miss every 4 KiB, and under a hypervisor each miss is a two-level page walk.
On the development VM the 121 projections of one decode step took 50-62 ms from ordinary torch
allocations and 25-27 ms from huge-page memory, the same bytes (docs/performance.md). torch only
asks for huge pages when ``THP_MEM_ALLOC_ENABLE=1`` is set before its first allocation, which an
engine embedded in someone's process cannot promise, so the engine places its large tensors
itself in anonymous mappings advised ``MADV_HUGEPAGE`` before they are touched: one each from a
huge page up, one shared by the smaller ones. Where the advice is unavailable (not Linux, THP ``never``) this is an ordinary allocation.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import sys
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

ALIGN = 2 << 20  # a tensor of a huge page or more starts on a 2 MiB boundary, in a mapping of its own
MIN_BYTES = 64 << 10  # smaller tensors stay where they are (norm weights, biases)
PACK_ALIGN = 64  # a smaller tensor's offset in a shared mapping: a cache line, what the kernels load
MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1+; Python's mmap module advises only its own mappings


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _advised_region(nbytes: int) -> mmap.mmap:
    """A zero-filled anonymous mapping of at least ``nbytes``, whole huge pages, advised for them."""
    size = max(_round_up(nbytes, ALIGN), ALIGN)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError as exc:  # THP disabled or unsupported: ordinary pages
            logger.debug("MADV_HUGEPAGE refused: %s", exc)
    return region


def hugepage_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of ``nbytes`` in one anonymous mapping advised for huge pages.
    The mapping lives as long as the tensor (and every view of it)."""
    return torch.frombuffer(_advised_region(nbytes), dtype=torch.uint8, count=nbytes)


def hugepage_tensors(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zero-filled tensors of the given shapes and dtypes, each in its own huge-page mapping.

    One mapping per tensor, not one shared: tensors viewing one storage alias each other as far as
    torch.compile is concerned, and aliased graph inputs that are mutated (the KV cache) send it
    down a slow path that rebuilds them from a common base on every call."""
    return [hugepage_buffer(torch.Size(shape).numel() * dtype.itemsize).view(dtype).view(shape)
            for shape, dtype in specs]


def packed_hugepage_tensors(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zero-filled tensors of the given shapes and dtypes, side by side in one huge-page mapping,
    each starting on a cache line.

    For tensors smaller than a huge page (an int4 model's projections: a few hundred KB each): in a
    mapping each, every one would take a 2 MiB page of its own; left where torch put them (as they
    were, below a MiB), they sit on 4 KiB pages, where an int4 decode step's products ran slower
    than from one shared mapping (docs/performance.md, tenth round). Each tensor is its own storage (``torch.frombuffer``
    at its offset), so torch sees no aliasing between them; they are for weights, never for
    tensors a graph mutates (``hugepage_tensors``' note)."""
    if not specs:
        return []
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    if any(size <= 0 for size in sizes):
        raise ValueError("packed_hugepage_tensors takes non-empty tensors only")
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end = _round_up(end + size, PACK_ALIGN)
    region = _advised_region(end)
    return [torch.frombuffer(region, dtype=torch.uint8, count=size, offset=offset).view(dtype).view(shape)
            for (shape, dtype), size, offset in zip(specs, sizes, offsets, strict=True)]


def move_to_hugepages(module: nn.Module) -> int:
    """Copy the module's CPU parameters and buffers of MIN_BYTES or more into huge-page mappings
    (same values, same dtypes; ties stay tied): a mapping each from a huge page up, one shared by
    the smaller ones (``packed_hugepage_tensors``). Returns the bytes moved."""
    seen: dict[int, torch.Tensor] = {}
    slots: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
    for owner in module.modules():
        for name, tensor in [*((n, p) for n, p in owner._parameters.items()),
                             *((n, b) for n, b in owner._buffers.items())]:
            if (tensor is None or tensor.device.type != "cpu" or tensor.layout != torch.strided
                    or tensor.nbytes < MIN_BYTES):
                continue
            slots.append((owner, name, name in owner._parameters, tensor))
            seen.setdefault(id(tensor), tensor)
    unique = list(seen.values())
    if not unique:
        return 0
    large = [t for t in unique if t.nbytes >= ALIGN]
    small = [t for t in unique if t.nbytes < ALIGN]
    placed = dict(zip((id(t) for t in large),
                      hugepage_tensors([(tuple(t.shape), t.dtype) for t in large]), strict=True))
    placed.update(zip((id(t) for t in small),
                      packed_hugepage_tensors([(tuple(t.shape), t.dtype) for t in small]), strict=True))
    with torch.no_grad():
        for t in unique:
            placed[id(t)].copy_(t)
    params: dict[int, nn.Parameter] = {}  # one Parameter per original, so tied weights stay tied
    for owner, name, is_param, tensor in slots:
        new = placed[id(tensor)]
        if is_param:
            if id(tensor) not in params:
                params[id(tensor)] = nn.Parameter(new, requires_grad=tensor.requires_grad)
            owner._parameters[name] = params[id(tensor)]
        else:
            owner._buffers[name] = new
    return sum(t.nbytes for t in unique)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


@functools.cache
def collapse_unavailable() -> str | None:
    """None when ``MADV_COLLAPSE`` works in this process (tried once on a mapping of its own), else
    why not."""
    madvise = _madvise()
    if madvise is None:
        return "not Linux"
    region = mmap.mmap(-1, 2 * ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = ctypes.c_char.from_buffer(region)
        address = ctypes.addressof(view)
        offset = _round_up(address, ALIGN) - address
        region[offset] = 1  # a populated page: the kernel collapses nothing where nothing is mapped
        failed = madvise(address + offset, ALIGN, MADV_COLLAPSE) != 0
        code = ctypes.get_errno()
        del view
    finally:
        region.close()
    if failed:  # EINVAL: a kernel before 6.1, or THP "never"
        return f"MADV_COLLAPSE failed with {errno.errorcode.get(code, code)}"
    return None


def collapse_to_hugepages(buffers: Iterable[tuple[int, int]]) -> int:
    """Back the memory of ``buffers`` ((address, bytes) of allocations this process made through
    someone else's allocator: oneDNN's packed weights) with huge pages where it lies, by
    ``MADV_COLLAPSE``. Returns the bytes of the 2 MiB regions collapsed (0 where the kernel cannot).

    Why in place: oneDNN allocates its packed weights through torch's allocator, on 4 KiB pages
    under THP ``madvise``, and holds them in opaque tensors that cannot be moved into a mapping of
    our own without a second copy of every weight. Each 2 MiB region around a buffer is collapsed
    whole, so a region's neighbours (other allocations, free heap) move onto the huge page with it:
    the kernel copies the contents under the page-table lock, so nothing in the process sees a
    change but the page size, and memory grows by at most the unpopulated part of the regions at
    the buffers' edges. A region the kernel refuses (it straddles two mappings, or no huge page is
    free) stays as it was."""
    spans: list[list[int]] = []
    for address, nbytes in sorted(buffers):
        if nbytes <= 0:
            continue
        lo, hi = address // ALIGN * ALIGN, _round_up(address + nbytes, ALIGN)
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    if not spans:
        return 0
    why_not = collapse_unavailable()
    if why_not is not None:
        logger.info("buffers stay on 4 KiB pages: %s", why_not)
        return 0
    madvise = _madvise()
    assert madvise is not None
    collapsed, refused = 0, Counter[str]()
    for lo, hi in spans:
        for region in range(lo, hi, ALIGN):
            for _ in range(2):  # EAGAIN: a transient failure (a page lock held), worth one more try
                ok = madvise(region, ALIGN, MADV_COLLAPSE) == 0
                code = 0 if ok else ctypes.get_errno()
                if code != errno.EAGAIN:
                    break
            if ok:
                collapsed += ALIGN
            else:
                refused[errno.errorcode.get(code, str(code))] += 1
    if refused:
        logger.info("MADV_COLLAPSE refused %s of %d regions", dict(refused), sum(refused.values()) + collapsed // ALIGN)
    return collapsed
