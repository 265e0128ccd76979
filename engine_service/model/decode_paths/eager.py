"""The eager forward: the model's own ``forward``, every step, prefill chunks included. The reference
every other path is compared with, and what runs the steps a step path does not take."""

from __future__ import annotations

import torch

from engine_service.model.attention import AttentionMetadata
from engine_service.model.decode_paths.base import DecodePath, PathSpec


class EagerPath(DecodePath):
    name = "eager"

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta)


SPEC = PathSpec("eager", unavailable=lambda setup: None, build=lambda setup, fallback: EagerPath(setup),
                runs_every_step=True)
