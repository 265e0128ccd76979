"""The compiled decode step (``engine_service.model.compiled``): decode-only steps through one
inductor graph of the whole stack; steps with a prefill chunk run the eager forward."""

from __future__ import annotations

import torch

from engine_service.model.attention import AttentionMetadata
from engine_service.model.compiled import CompiledDecode, compile_supported
from engine_service.model.decode_paths.base import DecodePath, PathSetup, PathSpec
from engine_service.model.decode_paths.eager import EagerPath
from engine_service.model.prepacked import compile_unavailable


class CompiledPath(DecodePath):
    name = "compiled"
    min_table_width = 2  # the graph's block-table width stays dynamic (no 1-specialisation)

    def __init__(self, setup: PathSetup) -> None:
        super().__init__(setup, EagerPath(setup))
        self.compiled = CompiledDecode(setup.model, setup.kv_caches, attention=setup.decode_kernel)
        self.warmup_seconds = self.compiled.warm_up(setup.scratch_slot)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.prefills:
            return self.fallback.hidden(input_ids, positions, meta)
        return self.compiled(input_ids, positions, meta)

    def describe(self) -> str:
        return "compiled (prefill chunks eager)"


def unavailable(setup: PathSetup) -> str | None:
    if setup.reference or not setup.compile:
        return "eager asked for (enforce_eager)" if setup.reference else "enforce_eager (the device's default)"
    if setup.device.type == "cuda" and setup.cuda_graphs:
        return "CUDA graphs replay the decode steps (--no-cuda-graphs compiles them)"
    if setup.deterministic:
        return "deterministic: the compiled step is not batch-invariant"
    return compile_supported(setup.device) or compile_unavailable(setup.model)


SPEC = PathSpec("compiled", unavailable=unavailable, build=lambda setup, fallback: CompiledPath(setup),
                runs_every_step=True,
                asked=lambda setup: setup.compile and not (setup.device.type == "cuda" and setup.cuda_graphs))
