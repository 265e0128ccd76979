"""Decode-only steps replayed from CUDA graphs, one per (batch, block-table width) bucket.

Why: on a GPU a small model's decode step is launch-bound. The eager forward issues several hundred
kernels a step, each a few microseconds of Python and driver work, while each kernel runs for less
than that; a captured graph issues them all in one call.

How (vLLM's scheme, on our eager forward):

* Static inputs, allocated once at the largest bucket: token ids, the rotary cos/sin rows, cache
  slots, block tables and context lengths. A step copies its inputs into the first rows and pads
  the rest of its bucket with decodes that attend to one token and write only the scratch slot (the
  block the scheduler never hands out), so padding can never touch a request's cache.
* Buckets: batch sizes in powers of two up to ``max_batch``; block-table widths in powers of two up
  to the context limit, so attention reads at most twice the blocks a step needs. A bucket whose
  padded attention would gather more than ``MAX_GRAPH_POSITIONS`` key positions is not captured: such
  a step is large enough to amortise its launches and runs the eager forward.
* A bucket's graph is captured the first time a step needs it (one eager warm-up run, then the
  capture, both on dummy decodes of the scratch slot), so start-up captures only the smallest
  (``warm_up``) and the number of graphs stays bounded by the buckets. A capture that fails is
  logged and every later step runs the eager forward: the graphs are an optimisation of it. All graphs share one memory pool; a replay's
  output is copied out before the next replay can reuse that memory.
* The rotary rows are looked up eagerly: the table grows with the longest context, which a graph
  that captured its address would miss.

Without ``capture`` (a CPU, in tests) the same padded inputs run the forward eagerly: the bucketing
and padding are then checked where no GPU is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine_service.model.attention import AttentionMetadata
from engine_service.model.compiled import decode_only_forward

logger = logging.getLogger(__name__)

# key positions (batch x table width x block size) a captured step may gather per layer: the
# padded K and V gathers of the widest graph stay a few hundred MB in float32
MAX_GRAPH_POSITIONS = 1 << 18
MAX_GRAPH_BATCH = 256


def _powers_of_two_to(limit: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= limit, the last replaced by limit itself."""
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    sizes[-1] = limit
    return sizes


class GraphedDecode:
    """Callable as ``(input_ids, positions, meta) -> hidden | None`` for a decode-only step; None
    when the step fits no bucket (the caller runs its own forward)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 scratch_slot: int, max_batch: int, max_model_len: int,
                 decode_kernel: Callable[..., torch.Tensor] | None = None, capture: bool = True) -> None:
        k_cache = kv_caches[0][0]
        self.device = k_cache.device
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.model = model
        self.capture = capture
        self.block_size = k_cache.shape[1]
        self.scratch_slot = scratch_slot
        self.scratch_block = scratch_slot // self.block_size
        self.batch_sizes = _powers_of_two_to(min(max_batch, MAX_GRAPH_BATCH))
        self.widths = _powers_of_two_to(-(-max_model_len // self.block_size))
        self.dtype = model.model.embed_tokens.weight.dtype
        self._forward = decode_only_forward(model, kv_caches, decode_kernel)
        rows, width, head_dim = self.batch_sizes[-1], self.widths[-1], model.config.head_dim
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.cos = torch.zeros(rows, head_dim, dtype=self.dtype, device=self.device)
        self.sin = torch.zeros(rows, head_dim, dtype=self.dtype, device=self.device)
        self.slot_mapping = torch.full((rows,), scratch_slot, dtype=torch.long, device=self.device)
        self.block_tables = torch.full((rows, width), self.scratch_block, dtype=torch.long, device=self.device)
        self.context_lens = torch.ones(rows, dtype=torch.long, device=self.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_seconds = 0.0
        self.failed: str | None = None  # why capturing failed; every step then runs eagerly

    def report(self) -> dict[str, float | int]:
        """Graphs captured so far and the seconds their captures took (what benches print)."""
        return {"captured": len(self.graphs), "capture_s": self.capture_seconds}

    def bucket(self, rows: int, width: int) -> tuple[int, int] | None:
        """The smallest (batch, width) bucket holding a step of ``rows`` decodes whose block tables
        are ``width`` wide, or None when none does or its attention would gather too much."""
        batch = next((b for b in self.batch_sizes if b >= rows), None)
        cols = next((w for w in self.widths if w >= width), None)
        if batch is None or cols is None or batch * cols * self.block_size > MAX_GRAPH_POSITIONS:
            return None
        return batch, cols

    def _inputs(self, batch: int, width: int) -> tuple[torch.Tensor, ...]:
        return (self.input_ids[:batch], self.cos[:batch], self.sin[:batch], self.slot_mapping[:batch],
                self.block_tables[:batch, :width], self.context_lens[:batch])

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop) become decodes of one token in the scratch slot."""
        if stop > start:
            self.slot_mapping[start:stop].fill_(self.scratch_slot)
            self.context_lens[start:stop].fill_(1)
            self.block_tables[start:stop, 0].fill_(self.scratch_block)

    @torch.inference_mode()  # as the runner's steps are: no autograd state kept alive in the pool
    def _capture(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        started = time.perf_counter()
        self._pad(0, batch)
        args = self._inputs(batch, width)
        # a warm-up run off the capturing stream: cuBLAS and the allocator set up outside the graph
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(*args)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        logger.info("captured the decode step's CUDA graph for batch %d, %d blocks wide, in %.3fs",
                    batch, width, seconds)
        return graph, out

    def warm_up(self) -> float:
        """Capture the smallest bucket at engine start, so that a model whose kernels cannot be
        captured says so there (``failed``) rather than in a client's step. Returns the seconds."""
        if self.capture:
            self._captured(1, self.widths[0])
        return self.capture_seconds

    def _captured(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        try:
            entry = self.graphs[(batch, width)] = self._capture(batch, width)
        except Exception as exc:  # noqa: BLE001 - any capture failure: the eager forward is complete
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.exception("capturing the decode step's CUDA graph failed; decode steps run eagerly")
            return None
        return entry

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor | None:
        if self.failed is not None:
            return None
        rows, width = meta.decode_block_tables.shape
        key = self.bucket(rows, width)
        if key is None:
            return None
        batch, cols = key
        entry = self.graphs.get(key)
        if entry is None and self.capture:
            entry = self._captured(batch, cols)
            if entry is None:
                return None
        cos, sin = self.model.rotary.cos_sin(positions, self.dtype)
        self.input_ids[:rows].copy_(input_ids)
        self.cos[:rows].copy_(cos)
        self.sin[:rows].copy_(sin)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.context_lens[:rows].copy_(meta.decode_context_lens)
        # columns past this step's width keep older block ids: the context lengths mask them
        self.block_tables[:rows, :width].copy_(meta.decode_block_tables)
        self._pad(rows, batch)
        if entry is None:  # no capture: the padded step, eagerly
            return self._forward(*self._inputs(batch, cols))[:rows]
        graph, out = entry
        graph.replay()
        return out[:rows].clone()  # the pool's next replay may reuse the output's memory
