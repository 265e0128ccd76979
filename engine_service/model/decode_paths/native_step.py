"""The native decode step (``engine_service.model.native_decode``): a decode-only step of a few rows
through every layer in one C call, its logits and their argmax from the same call; several greedy
decode steps in one call (``num_scheduler_steps``). Larger steps and prefill chunks run the path it
was built over (the compiled step, or the eager forward)."""

from __future__ import annotations

import logging

import torch

from engine_service.config import DecodeCapabilities
from engine_service.model.attention import AttentionMetadata
from engine_service.model.decode_paths.base import DecodePath, PathSetup, PathSpec
from engine_service.model.native_decode import NativeDecode, native_decode_unavailable

logger = logging.getLogger(__name__)


class NativeStepPath(DecodePath):
    name = "native step"

    def __init__(self, setup: PathSetup, fallback: DecodePath) -> None:
        super().__init__(setup, fallback)
        self.native = NativeDecode(setup.model, setup.kv_caches, deterministic=setup.deterministic)
        self.warmup_seconds = self.native.warm_up(setup.scratch_slot)

    def _takes(self, meta: AttentionMetadata, rows: int) -> bool:
        return not meta.prefills and self.native.runs(rows)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self._takes(meta, input_ids.shape[0]):
            return self.native(input_ids, positions, meta)
        return self.fallback.hidden(input_ids, positions, meta)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               argmax: torch.Tensor) -> torch.Tensor | None:
        if not (self.native.fuses_head and self._takes(meta, input_ids.shape[0])):
            return None
        return self.native(input_ids, positions, meta, logits=True, argmax=argmax)

    def greedy_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = input_ids.shape[0]
        if not (self.native.fuses_head and self.native.runs(rows)):
            raise RuntimeError(f"a step of several decode steps needs the native decode step with its head, "
                               f"of fewer than {self.native.max_rows} rows")
        return self.native.greedy_steps(input_ids, positions, slots, block_tables, context_lens)

    def capabilities(self) -> DecodeCapabilities:
        rows = self.native.max_rows
        multi = rows if self.native.fuses_head and self.setup.num_scheduler_steps > 1 else 0
        return DecodeCapabilities(path=self.name, fast_step_max_rows=rows, multi_step_max_rows=multi,
                                  one_pass_rows=self.native.one_pass_rows)

    def describe(self) -> str:
        if self.native.deterministic:
            return "native step (every step, prefill chunks included)"
        return (f"native step (decode steps of up to {self.native.max_rows - 1} rows; other steps "
                f"{self.fallback.describe()})")


def unavailable(setup: PathSetup) -> str | None:
    if setup.reference:
        return "eager asked for (enforce_eager): the reference forward alone"
    if not setup.native_decode:
        return "--no-native-decode"
    if setup.attention_backend == "torch":
        return "the torch attention was asked for (the reference)"
    return native_decode_unavailable(setup.model, setup.kv_caches)


SPEC = PathSpec("native step", unavailable=unavailable, build=NativeStepPath, runs_every_step=False)
