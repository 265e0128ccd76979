"""Weights and KV cache in huge-page-advised memory (engine_service.model.hugepages)."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from engine_service.model.hugepages import (
    ALIGN,
    MIN_BYTES,
    PACK_ALIGN,
    collapse_to_hugepages,
    collapse_unavailable,
    hugepage_tensors,
    move_to_hugepages,
    packed_hugepage_tensors,
)

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS")


def _smaps_field(address: int, field: str) -> list[str]:
    """The values of ``field`` (e.g. "VmFlags") for the mapping of this process that holds ``address``."""
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                mapping = start <= address < end
            elif mapping and line.startswith(field + ":"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> set[str]:
    return set(_smaps_field(address, "VmFlags"))


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping that holds ``address``."""
    return int(_smaps_field(address, "AnonHugePages")[0])


def _thp_mode() -> str:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return f.read().split("[")[1].split("]")[0]


def test_hugepage_tensors_are_zeroed_aligned_and_advised():
    a, b = hugepage_tensors([((3, 1000, 7), torch.float32), ((5, 4), torch.bfloat16)])
    assert a.shape == (3, 1000, 7) and a.dtype == torch.float32 and a.is_contiguous()
    assert b.shape == (5, 4) and b.dtype == torch.bfloat16
    assert not a.any() and not b.any()
    assert a.data_ptr() % ALIGN == 0 and b.data_ptr() % ALIGN == 0
    # separate storages: torch.compile treats views of one storage as aliased inputs, and mutating
    # aliased inputs (the KV cache) put the compiled decode step on a path 3-4x slower
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert "hg" in _vm_flags(a.data_ptr()), "the mapping was not advised MADV_HUGEPAGE"
    a.fill_(1.5)
    b.fill_(2)
    assert a.sum().item() == 1.5 * a.numel() and not b.sub(2).any()  # disjoint, writable


def test_packed_hugepage_tensors_share_one_advised_mapping_as_separate_storages():
    specs = [((300, 7), torch.float32), ((1001,), torch.uint8), ((16, 33), torch.bfloat16)]
    tensors = packed_hugepage_tensors(specs)
    for t, (shape, dtype) in zip(tensors, specs, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
        assert t.data_ptr() % PACK_ALIGN == 0
        assert "hg" in _vm_flags(t.data_ptr())
    # side by side in one mapping, in order, none overlapping the next
    for a, b in zip(tensors, tensors[1:], strict=False):
        assert a.data_ptr() + a.nbytes <= b.data_ptr() < a.data_ptr() + a.nbytes + PACK_ALIGN
    # separate storages (no aliasing as torch sees it), and writing one leaves the others alone
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    tensors[1].fill_(255)
    assert not tensors[0].any() and not tensors[2].any() and bool((tensors[1] == 255).all())
    with pytest.raises(ValueError, match="non-empty"):
        packed_hugepage_tensors([((0, 4), torch.float32)])
    assert packed_hugepage_tensors([]) == []


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 512)
        self.head = nn.Linear(512, 1024, bias=False)
        self.head.weight = self.embed.weight
        self.small = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(300_000, dtype=torch.float32))
        self.mid = nn.Linear(128, 256, bias=False)  # 128 KiB: between MIN_BYTES and a huge page
        self.register_buffer("codes", torch.arange(200_000, dtype=torch.int32).to(torch.uint8))


def test_move_to_hugepages_keeps_values_ties_and_small_tensors():
    module = _Tied()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    small_ptr = module.small.weight.data_ptr()
    moved = move_to_hugepages(module)
    # the tied weight once, the buffers, the mid-sized weight
    assert moved == 1024 * 512 * 4 + 300_000 * 4 + 128 * 256 * 4 + 200_000
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert module.head.weight is module.embed.weight, "a tie was split"
    assert isinstance(module.embed.weight, nn.Parameter) and isinstance(module.mid.weight, nn.Parameter)
    assert module.small.weight.data_ptr() == small_ptr and module.small.weight.nbytes < MIN_BYTES
    for tensor in (module.embed.weight, module.table, module.mid.weight, module.codes):
        assert "hg" in _vm_flags(tensor.data_ptr())
    # a huge page or more starts on a boundary; the smaller ones lie side by side in one mapping
    # (adjacent mappings may merge in /proc/self/maps, so the packing is what is checked)
    assert module.embed.weight.data_ptr() % ALIGN == 0
    packed = [module.table, module.mid.weight, module.codes]
    start = min(t.data_ptr() for t in packed)
    end = max(t.data_ptr() + t.nbytes for t in packed)
    assert end - start <= sum(t.nbytes for t in packed) + len(packed) * PACK_ALIGN
    assert all(t.data_ptr() % PACK_ALIGN == 0 for t in packed)
    x = torch.randint(0, 1024, (4,))
    weight = before["embed.weight"]
    assert torch.equal(module.head(module.embed(x)), nn.functional.linear(weight[x], weight))


@pytest.mark.model
def test_loaded_model_and_kv_cache_live_in_advised_memory(model_dir):
    from engine_service import LLM

    engine = LLM(str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory=32 << 20).engine
    large = [p for p in engine.runner.model.parameters() if p.nbytes >= MIN_BYTES]
    assert len(large) >= 4 * engine.model_config.num_hidden_layers
    for p in large:
        assert "hg" in _vm_flags(p.data_ptr())
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert "hg" in _vm_flags(k_cache.data_ptr()) and "hg" in _vm_flags(v_cache.data_ptr())


@pytest.mark.model
def test_an_int4_models_codes_and_scales_live_in_advised_memory(model_dir):
    """Every int4 projection of SmolLM2 is under a MiB (codes and scales): they share mappings
    advised for huge pages instead of staying on ordinary pages, and multiply as copies of them in
    ordinary memory do."""
    from engine_service import LLM, SamplingParams
    from engine_service.model.quantization import QuantizedLinear

    llm = LLM(str(model_dir), dtype="float32", quantization="int4", enforce_eager=True, kv_cache_memory=32 << 20)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    buffers = [b for m in layers for b in m.buffers() if b.nbytes >= MIN_BYTES]
    assert len(buffers) >= 4 * llm.engine.model_config.num_hidden_layers
    assert any(b.nbytes < ALIGN for b in buffers)
    for b in buffers:
        assert "hg" in _vm_flags(b.data_ptr())
    gen = torch.Generator().manual_seed(0)
    for layer in layers[:8]:
        x = torch.randn(3, layer.in_features, generator=gen)
        plain = torch.ops.sluice.q4_linear(x, layer.codes.clone(), layer.scales_zeros.clone(), layer.out_features)
        assert torch.equal(layer(x), plain)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_collapse_moves_a_buffer_onto_huge_pages_in_place():
    """A buffer on 4 KiB pages in a mapping nobody advised (as oneDNN's packed weights lie) is
    backed by huge pages where it lies, every 2 MiB region around it, its values untouched."""
    if collapse_unavailable() is not None:
        pytest.skip(f"this kernel cannot collapse: {collapse_unavailable()}")
    region = mmap.mmap(-1, 5 * ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % ALIGN + ALIGN // 2  # half a huge page into the first aligned one
    buffer = whole[start:start + 2 * ALIGN + 12345].view(-1)
    buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    want = buffer.clone()
    if _thp_mode() != "always":
        assert _anon_huge_kb(buffer.data_ptr()) == 0
    collapsed = collapse_to_hugepages([(buffer.data_ptr(), buffer.nbytes), (buffer.data_ptr() + 64, 100)])
    # the buffer touches three aligned regions, all inside the mapping
    assert collapsed == 3 * ALIGN
    assert _anon_huge_kb(buffer.data_ptr()) >= 3 * ALIGN // 1024
    assert torch.equal(buffer, want)
    buffer[7] += 1  # still ordinary writable memory
    assert buffer[7] == (int(want[7]) + 1) % 256


def test_collapse_of_nothing_or_of_unmapped_memory_collapses_nothing():
    assert collapse_to_hugepages([]) == 0
    assert collapse_to_hugepages([(4096, 0)]) == 0
    if collapse_unavailable() is None:
        region = mmap.mmap(-1, 4 * ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
        aligned = address - address % ALIGN + ALIGN
        del region  # unmapped now: the kernel refuses, and nothing breaks
        assert collapse_to_hugepages([(aligned, ALIGN)]) == 0


@pytest.mark.model
def test_a_bfloat16_models_packed_weights_are_collapsed_onto_huge_pages(model_dir):
    """oneDNN allocates the packed weights on ordinary pages; loading collapses them where they lie."""
    from engine_service.model.loader import load_model
    from engine_service.model.prepacked import packed_buffers, prepack_unavailable

    if prepack_unavailable(torch.bfloat16, torch.device("cpu")) is not None or collapse_unavailable() is not None:
        pytest.skip("bfloat16 prepacking or MADV_COLLAPSE is unavailable here")
    model = load_model(model_dir, torch.bfloat16)
    buffers = packed_buffers(model)
    assert len(buffers) == 4 * model.config.num_hidden_layers + 1
    for address, nbytes in buffers:
        assert _anon_huge_kb(address) >= ALIGN // 1024
        assert _anon_huge_kb(address + nbytes - 1) >= ALIGN // 1024
