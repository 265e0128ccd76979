"""Sampling: parameters (``SamplingParams``), the batched ``Sampler`` and logprobs.

``SamplingParams`` is imported eagerly; the torch-based parts are loaded on first use, because
``engine_service.core.request`` imports this package (a cycle otherwise) and so that importing the
parameters never needs torch.
"""

from __future__ import annotations

from typing import Any

from engine_service.sampling.params import SAMPLING_EPS, SamplingParams

__all__ = [
    "SAMPLING_EPS",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "compute_logprobs",
]

_LAZY = {
    "Sampler": "engine_service.sampling.sampler",
    "SamplerOutput": "engine_service.sampling.sampler",
    "compute_logprobs": "engine_service.sampling.logprobs",
    "SamplingMetadata": "engine_service.sampling.metadata",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
