"""CUDA graphs (``engine_service.model.cuda_graphs``): decode-only steps replayed from graphs
captured per batch and width bucket; the steps no bucket fits, and prefill chunks, run the eager
forward."""

from __future__ import annotations

import logging

import torch

from engine_service.model.attention import AttentionMetadata
from engine_service.model.cuda_graphs import GraphedDecode
from engine_service.model.decode_paths.base import DecodePath, PathSetup, PathSpec

logger = logging.getLogger(__name__)


class CudaGraphsPath(DecodePath):
    name = "cuda graphs"

    def __init__(self, setup: PathSetup, fallback: DecodePath, capture: bool = True) -> None:
        """``capture=False`` runs the same padded steps eagerly (for tests without a GPU)."""
        super().__init__(setup, fallback)
        self.graphed = GraphedDecode(setup.model, setup.kv_caches, setup.scratch_slot, setup.max_batch,
                                     setup.max_model_len, decode_kernel=setup.decode_kernel, capture=capture)

    def warm_up(self) -> float:
        """Capture the smallest bucket; raises RuntimeError where the model's kernels cannot be captured."""
        self.warmup_seconds = self.graphed.warm_up()
        if self.graphed.failed is not None:  # logged with its traceback by the capture
            raise RuntimeError(f"capturing the decode step's CUDA graph failed: {self.graphed.failed}")
        logger.info("decode steps of up to %d rows replay CUDA graphs (captured at first use)",
                    self.graphed.batch_sizes[-1])
        return self.warmup_seconds

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not meta.prefills:
            hidden = self.graphed(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        return self.fallback.hidden(input_ids, positions, meta)


def unavailable(setup: PathSetup) -> str | None:
    if setup.device.type != "cuda":
        return "not a CUDA device"
    if setup.reference or not setup.compile:
        return "eager asked for (enforce_eager)"
    if not setup.cuda_graphs:
        return "--no-cuda-graphs"
    if setup.deterministic:
        return "deterministic: CUDA steps are not batch-invariant"
    return None


def build(setup: PathSetup, fallback: DecodePath | None) -> CudaGraphsPath:
    path = CudaGraphsPath(setup, fallback)
    path.warm_up()
    return path


SPEC = PathSpec("cuda graphs", unavailable=unavailable, build=build, runs_every_step=False,
                asked=lambda setup: setup.device.type == "cuda" and setup.compile and setup.cuda_graphs)
