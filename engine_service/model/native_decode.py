"""The native decode step: every decoder layer of a Llama-family model in one C call
(``kernels/decode_stack.c``), for decode-only steps, in place of the compiled step: int4 models
(float32 activations) and bfloat16 models, for steps of a few rows.

Why: with the products and the attention already native, one stream's compiled step still spent
about a third of its time between them, in ~150 operator calls through torch's dispatcher and
inductor's wrapper (docs/performance.md). ``decode_stack`` runs the same kernels from C with the
norms, rotary, cache writes, SiLU and residuals between them, so a step is one call.

It is called through ctypes, once a step: a ctypes call costs more than one dispatcher call, but it
replaces a step's worth of them, and needs no operator registration. What the call reads is described once, at engine start, in C
structs holding the weights' and caches' addresses; the tensors themselves stay referenced here
for the engine's life, and the engine never moves or replaces them.

Where it runs (``native_decode_unavailable`` says why not, and the engine logs it): CPU, a
``LlamaForCausalLM`` (Llama, SmolLM2, Mistral, Qwen2, Qwen3) whose attention the step computes
(``Attention.native_step``: Llama's, with q/k/v and output biases where the config has them, and
Qwen3's per-head q/k RMSNorms), float32, bfloat16 or float16 KV cache, and either

* every projection int4 in the native layout, float32 activations: decode steps of fewer rows than
  ``max_rows`` (``STACK_MAX_ROWS``, or the products' dense crossover if lower; more rows run the
  compiled or eager step). Each row's output depends only on that row (the products and the attention
  are row-independent), so a prompt decodes to the same tokens alone or in a batch;
* or every projection bfloat16 prepacked for the native kernel (``PrepackedLinear.gemv``): steps of
  up to ``prepacked.gemv_max_rows()`` rows (64 where the CPU has AMX: one stream, its drafts, a
  batch; 16 without; bigger batches run oneDNN's products in the compiled step). One row takes the
  VDPBF16PS kernel; several take AMX tiles where the CPU has them, in passes of up to 16 rows, which
  round a few outputs in ten thousand apart by one ulp, else VDPBF16PS on groups of rows, bit for
  bit the one-row kernel's. Rows do not depend on each
  other.
"""

from __future__ import annotations

import ctypes
import logging
import time

import torch

from engine_service.model.attention import AttentionMetadata
from engine_service.model.llama import Attention, KVCache, LlamaForCausalLM
from engine_service.model.prepacked import PrepackedLinear
from engine_service.model.q8_blocks import Q8_BLOCK_N, Q8Linear
from engine_service.model.quantization import QuantizedLinear

logger = logging.getLogger(__name__)

STACK_MAX_ROWS = 64  # int4: from this many rows a step runs the compiled or eager forward
# a deterministic step's most rows in one call (kernels/decode_stack.h STACK_DETERMINISTIC_MAX_ROWS):
# a prefill chunk of more runs in several calls, in order
CALL_MAX_ROWS = 1024
STACK_INT4, STACK_BF16 = 0, 1  # kernels/decode_stack.h
STACK_HEAD_LAYERS, STACK_HEAD_Q8 = 0, 1  # the head's layout: the layers' kind, or q8_gemv.h's blocks
# the caches' dtypes the step writes and reads: kernels/decode_stack.h's STACK_CACHE_*
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEADS = 128  # PDA_MAX_HEADS (kernels/paged_decode_attention.h)
MAX_HEAD_DIM = 256


class _Weight(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("scales_zeros", ctypes.c_void_p), ("n_out", ctypes.c_int64),
                ("n_pad", ctypes.c_int64), ("k", ctypes.c_int64), ("extra", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Weight), ("o", _Weight),
                ("gate_up", _Weight), ("down", _Weight), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("o_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("vocab", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("kind", ctypes.c_int), ("cache_type", ctypes.c_int),
                ("embed", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p), ("layers", ctypes.POINTER(_Layer)), ("head", _Weight),
                ("deterministic", ctypes.c_int), ("head_kind", ctypes.c_int)]


_ERRORS = {1: "out of memory", 2: "a size or a token id out of range", 3: "the attention kernel refused the shape"}


def _kind(model: torch.nn.Module) -> int | str:
    """STACK_INT4 or STACK_BF16 for the model's projections, else why neither."""
    dtype = model.model.embed_tokens.weight.dtype
    modules = [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if any(getattr(m, "bias", None) is not None for layer in model.model.layers
           for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj)):
        return "an MLP projection has a bias"
    if any(m.bias is not None and m.bias.dtype != dtype for m in modules[0::4] + modules[1::4]):
        return "an attention projection's bias is not in the activations' dtype"
    if dtype == torch.float32 and all(isinstance(m, QuantizedLinear) and m.native_q4 for m in modules):
        return STACK_INT4
    if dtype == torch.bfloat16 and all(isinstance(m, PrepackedLinear) and m.gemv_weight for m in modules):
        return STACK_BF16
    return ("the projections are neither int4 in the native layout with float32 activations nor bfloat16 "
            "prepacked for the native GEMV")


def native_decode_unavailable(model: torch.nn.Module, kv_caches: list[KVCache]) -> str | None:
    """None when ``NativeDecode`` runs this model's decode steps, else why not."""
    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        return f"{type(model).__name__} is not the Llama decoder"
    if model.model.embed_tokens.weight.device.type != "cpu":
        return "the model is not on CPU"
    cfg = model.config
    if not (0 < cfg.num_key_value_heads and cfg.num_attention_heads % cfg.num_key_value_heads == 0
            and cfg.num_attention_heads <= MAX_HEADS and 0 < cfg.head_dim <= MAX_HEAD_DIM and cfg.head_dim % 2 == 0):
        return "the attention's shape is outside the kernel's limits"
    for layer in model.model.layers:
        attn = layer.self_attn
        if not (isinstance(attn, Attention) and type(attn).native_step):
            return f"the step does not compute {type(attn).__name__} (llama.Attention.native_step)"
    kind = _kind(model)
    if isinstance(kind, str):
        return kind
    for k_cache, v_cache in kv_caches:
        if k_cache.dtype not in CACHE_TYPES or v_cache.dtype != k_cache.dtype:
            return f"no native decode for a {k_cache.dtype} KV cache"
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return "the KV cache is not contiguous"
    from engine_service.model.native import NativeKernelError, native_library

    try:
        native_library()
    except NativeKernelError as exc:
        return str(exc)
    return None


class NativeDecode:
    """Callable as ``(input_ids, positions, meta) -> hidden`` for a decode-only step of fewer than
    ``max_rows`` rows (``NativeDecode.runs``), like ``CompiledDecode``. The tensors its C structs
    point into are the model's own (kept referenced here): weights loaded once, never replaced."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], deterministic: bool = False) -> None:
        """``deterministic``: a deterministic engine's step (engine_service.model.determinism): any
        number of rows, a prefill chunk's included, each computed as the row alone computes it."""
        from engine_service.model.native import native_library

        why = native_decode_unavailable(model, kv_caches)
        if why is not None:
            raise ValueError(f"no native decode step for this model: {why}")
        self.model = model
        self.kv_caches = kv_caches
        cfg = model.config
        layers = list(model.model.layers)
        self._keep: list[torch.Tensor] = []  # every tensor the structs point into, alive with this object

        def ptr(t: torch.Tensor) -> int:
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            self._keep.append(t)
            return t.data_ptr()

        self.kind = _kind(model)
        self.dtype = model.model.embed_tokens.weight.dtype

        def weight(module: torch.nn.Module) -> _Weight:
            if self.kind == STACK_BF16:
                address, n_pad, k_pad = module.gemv_weight  # the packed buffer, kept alive by the module
                return _Weight(address, None, module.out_features, n_pad, module.in_features, k_pad)
            codes, sz = module.codes, module.scales_zeros
            k = codes.shape[1] * 8
            return _Weight(ptr(codes), ptr(sz), module.out_features, codes.shape[0] * 16, k, k // sz.shape[1])

        def optional(t: torch.Tensor | None) -> int | None:
            return None if t is None else ptr(t)

        def norm(attn: torch.nn.Module, name: str) -> int | None:
            module = getattr(attn, name, None)
            return None if module is None else ptr(module.weight)

        self._layers = (_Layer * len(layers))(*[
            _Layer(ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight),
                   weight(layer.self_attn.qkv_proj), weight(layer.self_attn.o_proj), weight(layer.mlp.gate_up_proj),
                   weight(layer.mlp.down_proj), ptr(k_cache), ptr(v_cache), optional(layer.self_attn.qkv_proj.bias),
                   optional(layer.self_attn.o_proj.bias), norm(layer.self_attn, "q_norm"), norm(layer.self_attn, "k_norm"))
            for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True)])
        norm = model.model.norm
        head = getattr(model, "lm_head", None)  # a tied model's own (prepacked or quantized) copy, if any
        # the logits come out of the same call (``logits=True``) when the head is of the layers' kind,
        # or, in an int4 step, a GGUF file's int8 blocks (Q8_0, Q6_K) read by q8_gemv's kernel
        same_kind = (isinstance(head, PrepackedLinear) and head.gemv_weight is not None if self.kind == STACK_BF16
                     else isinstance(head, QuantizedLinear) and head.native_q4)
        q8_head = self.kind == STACK_INT4 and isinstance(head, Q8Linear) and head.native
        self.fuses_head = (same_kind or q8_head) and head.bias is None
        self.vocab_out = head.out_features if self.fuses_head else 0

        def head_weight() -> _Weight:
            if not self.fuses_head:
                return _Weight()
            if q8_head:
                return _Weight(ptr(head.codes), ptr(head.scales), head.out_features, head.codes.shape[0] * Q8_BLOCK_N,
                               head.in_features, head.group_size)
            return weight(head)
        self._stack = _Stack(
            len(layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, kv_caches[0][0].shape[1], model.model.embed_tokens.weight.shape[0], float(norm.eps),
            float(layers[0].self_attn.scale), self.kind, CACHE_TYPES[kv_caches[0][0].dtype],
            ptr(model.model.embed_tokens.weight), ptr(norm.weight), self._layers,
            head_weight(), int(deterministic), STACK_HEAD_Q8 if self.fuses_head and q8_head else STACK_HEAD_LAYERS)
        self.deterministic = deterministic
        # the rows a step takes at about one row's cost (DecodeCapabilities.one_pass_rows): bfloat16's
        # products read each weight once for a tile's or a group's rows; int4's rows each cost their
        # own integer products (about a fifth of a step, docs/performance.md)
        self.one_pass_rows = 1
        if self.kind == STACK_BF16:
            from engine_service.model.prepacked import gemv_max_rows

            self.max_rows = gemv_max_rows() + 1  # the rows the products' native kernel takes
            pass_rows = native_library().packed_gemm_bf16_pass_rows
            pass_rows.restype, pass_rows.argtypes = ctypes.c_int, []
            self.one_pass_rows = max(1, min(int(pass_rows()), self.max_rows - 1))
        else:
            # the products dequantize from this many rows on (QuantizedLinear.dense_min_rows): more
            # rows than that run the compiled or eager step; and the stack's work between the
            # products runs on the calling thread, so a big batch goes to the compiled step's
            # parallel operators from STACK_MAX_ROWS rows
            # (a fused head too: its logits are compute_logits' bit for bit only where its own
            # product would take the kernel)
            dense = [m.dense_min_rows for layer in layers for m in (
                layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            if self.fuses_head:
                dense.append(head.dense_min_rows)
            self.max_rows = min([STACK_MAX_ROWS, *(d for d in dense if d is not None)])
        fn = native_library().decode_stack
        fn.restype = ctypes.c_int
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ctypes.POINTER(_Stack), vp, vp, vp, vp, i64, vp, vp, i64, vp, i64, vp, vp, vp]
        self._fn = fn
        steps_fn = native_library().decode_stack_steps
        steps_fn.restype = ctypes.c_int
        steps_fn.argtypes = [ctypes.POINTER(_Stack), vp, vp, vp, vp, i64, vp, vp, i64, vp, i64, i64, vp, vp]
        self._steps_fn = steps_fn
        self._stack_ref = ctypes.byref(self._stack)

    def runs(self, rows: int) -> bool:
        return self.deterministic or rows < self.max_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits: bool = False, argmax: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states [rows, hidden]; with ``logits`` (where ``fuses_head``), the
        logits [rows, vocab] in float32 instead: ``model.compute_logits`` of those hidden states, bit
        for bit, from the same call. With logits, ``argmax`` (int64 [rows]) is filled with each
        row's ``argmax`` of them, torch's pick among equal values, computed while they are still in
        the cache."""
        if logits and not self.fuses_head:
            raise ValueError("native decode: this model's output projection is not in the step")
        rows = input_ids.shape[0]
        if rows > CALL_MAX_ROWS and self.deterministic:
            return self._in_calls(input_ids, positions, meta, logits, argmax)
        if argmax is not None and not (logits and argmax.dtype == torch.int64 and argmax.shape == (rows,)
                                       and argmax.is_contiguous()):
            raise ValueError("native decode: argmax needs logits=True and a contiguous int64 tensor of one per row")
        rotary = self.model.rotary
        cos, sin = rotary.cos_table, rotary.sin_table  # float32, grown by the runner's prepare
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        tensors = (input_ids, positions, meta.slot_mapping, tables, lens)
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
            raise ValueError("native decode: ids, positions, slots, block tables and lengths must be contiguous int64")
        if not (positions.shape[0] == meta.slot_mapping.shape[0] == tables.shape[0] == lens.shape[0] == rows):
            raise ValueError("native decode: one position, slot, block table and length per row")
        out = (torch.empty(rows, self.vocab_out, dtype=torch.float32) if logits
               else torch.empty(rows, self._stack.hidden, dtype=self.dtype))
        rc = self._fn(self._stack_ref, input_ids.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      cos.shape[0], meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                      rows, None if logits else out.data_ptr(), out.data_ptr() if logits else None,
                      None if argmax is None else argmax.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native decode step failed: {_ERRORS.get(rc, rc)}")
        return out

    def _in_calls(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits: bool,
                  argmax: torch.Tensor | None) -> torch.Tensor:
        """A deterministic step of more rows than one call takes, in calls of CALL_MAX_ROWS rows in
        order: a call's rows attend to the K/V the calls before it wrote, as they would to their own
        call's, and each row's output does not depend on the rows beside it."""
        parts = []
        for r in range(0, input_ids.shape[0], CALL_MAX_ROWS):
            rows = slice(r, r + CALL_MAX_ROWS)
            part = AttentionMetadata(slot_mapping=meta.slot_mapping[rows], prefills=[], decode_token_index=None,
                                     decode_block_tables=meta.decode_block_tables[rows],
                                     decode_context_lens=meta.decode_context_lens[rows])
            parts.append(self(input_ids[rows], positions[rows], part, logits=logits,
                              argmax=None if argmax is None else argmax[rows]))
        return torch.cat(parts)

    def greedy_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Several greedy decode steps in one call (``fuses_head`` only): ``positions``, ``slots`` and
        ``context_lens`` are [steps, rows], step j's row r at ``positions[j, r]`` writing its K/V at
        ``slots[j, r]``; the first step's inputs are ``input_ids`` [rows], each later one's the
        argmax of the step before. ``block_tables`` [rows, width] must already hold every block the
        last step reaches. Returns the tokens [steps, rows] (each step's argmax: what ``steps``
        calls with ``argmax`` give, bit for bit) and the last step's logits [rows, vocab]."""
        if not self.fuses_head:
            raise ValueError("native decode: this model's output projection is not in the step")
        if positions.dim() != 2:
            raise ValueError("native decode: positions, slots and lengths are [steps, rows]")
        steps, rows = positions.shape
        tensors = (input_ids, positions, slots, block_tables, context_lens)
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
            raise ValueError("native decode: ids, positions, slots, block tables and lengths must be contiguous int64")
        if not (input_ids.shape == (rows,) and slots.shape == context_lens.shape == (steps, rows)
                and block_tables.dim() == 2 and block_tables.shape[0] == rows):
            raise ValueError("native decode: one id and block table per row, a position, slot and length per "
                             "step and row")
        rotary = self.model.rotary
        cos, sin = rotary.cos_table, rotary.sin_table
        tokens = torch.empty(steps, rows, dtype=torch.int64)
        logits = torch.empty(rows, self.vocab_out, dtype=torch.float32)
        rc = self._steps_fn(self._stack_ref, input_ids.data_ptr(), positions.data_ptr(), cos.data_ptr(),
                            sin.data_ptr(), cos.shape[0], slots.data_ptr(), block_tables.data_ptr(),
                            block_tables.shape[1], context_lens.data_ptr(), rows, steps, logits.data_ptr(),
                            tokens.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native decode steps failed: {_ERRORS.get(rc, rc)}")
        return tokens, logits

    def time_rows(self, scratch_slot: int, rows: int, repeats: int = 5) -> float:
        """The fastest of ``repeats`` steps of ``rows`` rows that write only ``scratch_slot`` (each row
        token 0 at position 0), in seconds; ``warm_up`` first, so the first call's costs are paid."""
        block_size = self.kv_caches[0][0].shape[1]
        self.model.rotary.ensure_positions(1)
        ids = torch.zeros(rows, dtype=torch.long)
        meta = AttentionMetadata(slot_mapping=torch.full((rows,), scratch_slot, dtype=torch.long), prefills=[],
                                 decode_token_index=None,
                                 decode_block_tables=torch.full((rows, 1), scratch_slot // block_size, dtype=torch.long),
                                 decode_context_lens=torch.ones(rows, dtype=torch.long))
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            self(ids, ids, meta)
            best = min(best, time.perf_counter() - started)
        return best

    def warm_up(self, scratch_slot: int) -> float:
        """One dummy decode writing only ``scratch_slot`` (a slot no request owns): the first call
        pays the kernels' first-touch costs. Returns the seconds it took."""
        return self.time_rows(scratch_slot, 1, repeats=1)
