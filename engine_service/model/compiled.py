"""The compiled decode step: ``torch.compile`` (inductor) of the model's forward for steps in which
every scheduled token is a decode, the steady state of generation.

* Whole stack: the embedding lookup, every decoder layer and the final norm are one graph
  (``CompiledDecode``).
* Shapes: the batch size and the block-table width are dynamic (``mark_dynamic``), so one graph
  serves every batch of two or more decodes and every context length; inductor specialises size 1,
  so batch 1 gets its own graph. Block tables are padded to at least two columns so the width never
  specialises. Recompilation is therefore bounded: two graphs, both built by ``warm_up`` at engine
  start (its duration is logged and kept in ``warmup_seconds``).
* Attention: the native kernel (``engine_service.model.native``, called as the operator
  ``sluice::paged_decode_attention``) where the engine has it; otherwise ``decode_attention_inplace``,
  whose block-table gathers inductor fuses into the reductions. Either way no padded copy of any
  sequence's K/V is made.
* Steps with a prefill chunk run eagerly (``ModelRunner`` decides per step): their cost is in large
  matmuls, where the per-op overhead compilation removes is small.
* ``enforce_eager=True`` (``--enforce-eager``) skips all of this; the eager path is the reference.
"""

from __future__ import annotations

import hashlib
import logging
import time
import types
from collections.abc import Callable

import torch

from engine_service.model.attention import AttentionMetadata, decode_attention_inplace

logger = logging.getLogger(__name__)


def compile_supported(device: torch.device) -> str | None:
    """None when inductor can compile for ``device`` here, else why not."""
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001 - inductor raises a bare RuntimeError without a compiler
            return f"no C++ compiler for inductor ({exc})"
    elif device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
    return None


def skip_weight_guards(entries: list) -> list[bool]:
    """Dynamo's guards minus those on the modules' tensors and objects and every guard on the
    decoder layers; guards on the top-level modules' plain values (ints, floats) stay. Checking ~300
    weights cost ~0.8 ms a step (a cache lookup of 0.9 ms against 0.12 ms, int4 at batch 1), and the
    30 layers' ~1,700 type and constant guards most of what was left. Safe here because every weight
    and buffer is a graph input, read from the module at each call, never a constant baked into the
    graph: engines in one process that share a graph each run their own weights and caches; what
    the layers' guards checked (their types and the values a trace bakes in) is the structure key,
    and only engines of one structure key share a code object, so a graph (``_per_structure``);
    and the engine never swaps a module after load."""
    return [not entry.orig_guard.source.is_unspecialized_nn_module()
            or (entry.guard_type in ("CONSTANT_MATCH", "EQUALS_MATCH") and not entry.name.startswith("layers["))
            for entry in entries]


def structure_key(model: torch.nn.Module) -> str:
    """A digest of every submodule's name, type and plain attributes (ints, floats, bools, strings,
    dtypes: the values a traced forward bakes into its graph), the same for two models of the same
    architecture, size, dtype and kernels, whatever their weights."""
    digest = hashlib.blake2b(digest_size=12)
    for name, module in model.named_modules():
        digest.update(f"{name}|{type(module).__module__}.{type(module).__qualname__}".encode())
        for attr, value in sorted(vars(module).items()):
            if isinstance(value, (bool, int, float, str, torch.dtype)):
                digest.update(f"|{attr}={value!r}".encode())
        digest.update(b"\n")
    return digest.hexdigest()


_CODE_BY_STRUCTURE: dict[str, types.CodeType] = {}


def _per_structure(fn: Callable[..., torch.Tensor], key: str) -> Callable[..., torch.Tensor]:
    """``fn`` with a code object of its own for each structure key (the same one for every engine
    of that structure). Dynamo keeps its compiled graphs per code object, so an engine only ever
    looks up graphs built for its own structure: with the layers' guards skipped, one code object
    for all let a plain bfloat16 engine run an int4 engine's graph (it failed: KeyError 'handle').
    It also counts graphs against its recompile limit (8) per code object: one for all was used up
    by a process that built four kinds of engine (the anchor bench's modes, a test session's
    models), and the next fell back to eager."""
    code = _CODE_BY_STRUCTURE.setdefault(key, fn.__code__.replace(
        co_name=f"{fn.__code__.co_name}_{key[:8]}", co_qualname=f"{fn.__code__.co_qualname}_{key[:8]}"))
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _decode_layer_using(kernel: Callable[..., torch.Tensor] | None) -> Callable[..., torch.Tensor]:
    """One decoder layer's decode step, attending with ``kernel`` (AttentionMetadata.decode_kernel)."""

    def decode_layer(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=slot_mapping, prefills=[], decode_token_index=None,
                                 decode_block_tables=block_tables, decode_context_lens=context_lens,
                                 decode_kernel=kernel)
        return layer(x, cos, sin, (k_cache, v_cache), meta)

    return decode_layer


def decode_only_forward(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                        kernel: Callable[..., torch.Tensor] | None) -> Callable[..., torch.Tensor]:
    """The forward of a decode-only step over explicit tensors, ``(input_ids, cos, sin,
    slot_mapping, block_tables, context_lens) -> hidden``: what the compiled step compiles and a
    CUDA graph captures (``engine_service.model.cuda_graphs``). ``kernel`` is the decode attention
    (None: the reference)."""
    decode_layer = _decode_layer_using(kernel)
    layers = list(model.model.layers)

    def decode_forward(input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor) -> torch.Tensor:
        x = model.model.embed_tokens(input_ids)
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            x = decode_layer(layer, x, cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens)
        return model.model.norm(x)

    return decode_forward


class CompiledDecode:
    """Callable as ``(input_ids, positions, meta) -> hidden`` for a decode-only step.

    The whole stack of decoder layers (the embedding lookup, every layer, the final norm) is one
    graph, so a step costs one guard check and one call of inductor's generated code. The first
    version compiled one layer and called it per layer: 30 guard checks and graph calls a step,
    about 150 µs each, which ate most of what compiling saves (int4, batch 1: 18.4 ms a step
    against 11.1 for the whole graph, docs/performance.md). Shapes: only the batch (every
    per-decode input's first dimension) and the block-table width are dynamic
    (``mark_dynamic``), the weights' and caches' shapes are static; inductor specialises a batch
    of 1, so ``warm_up`` builds two graphs. The rotary tables are looked up eagerly (they grow with
    the longest context, which would otherwise change a graph input's shape)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 attention: Callable[..., torch.Tensor] | None = None) -> None:
        """``attention``: the native decode attention's operator (``AttentionMetadata.decode_kernel``),
        or None for ``decode_attention_inplace``."""
        self.model = model
        self.kv_caches = kv_caches
        self.warmup_seconds: float | None = None
        kernel = attention if attention is not None else decode_attention_inplace
        decode_forward = decode_only_forward(model, kv_caches, kernel)
        self._forward = torch.compile(_per_structure(decode_forward, structure_key(model)), dynamic=False,
                                      fullgraph=True,
                                      options={"guard_filter_fn": skip_weight_guards})

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cos, sin = self.model.rotary.cos_sin(positions, self.model.model.embed_tokens.weight.dtype)
        args = (input_ids, cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)
        for tensor in args:
            torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(meta.decode_block_tables, 1)
        return self._forward(*args)

    @torch.inference_mode()
    def warm_up(self, scratch_slot: int) -> float:
        """Compile both graphs (batch 1 and batch >= 2) on dummy decodes that write only
        ``scratch_slot`` (a slot no request owns). Returns the seconds it took."""
        started = time.perf_counter()
        device = self.kv_caches[0][0].device
        block_size = self.kv_caches[0][0].shape[1]
        block = scratch_slot // block_size
        for batch in (1, 2):
            ids = torch.zeros(batch, dtype=torch.long, device=device)
            positions = torch.zeros(batch, dtype=torch.long, device=device)
            slots = torch.full((batch,), scratch_slot, dtype=torch.long, device=device)
            tables = torch.full((batch, 2), block, dtype=torch.long, device=device)
            lens = torch.ones(batch, dtype=torch.long, device=device)
            meta = AttentionMetadata(slot_mapping=slots, prefills=[], decode_token_index=None,
                                     decode_block_tables=tables, decode_context_lens=lens)
            self(ids, positions, meta)
        self.warmup_seconds = time.perf_counter() - started
        logger.info("compiled the decode step (inductor, batch 1 and batch >= 2) in %.1fs", self.warmup_seconds)
        return self.warmup_seconds
