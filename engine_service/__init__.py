"""The engine: model runtime, paged KV cache, scheduler and sampler, plus the Redis service.

The offline API mirrors vLLM's::

    from engine_service import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "StructuredOutputsParams"]

if TYPE_CHECKING:
    from engine_service.config import EngineConfig
    from engine_service.core.sampling_params import SamplingParams
    from engine_service.engine import LLMEngine
    from engine_service.llm import LLM
    from sluice.structured import StructuredOutputsParams


def __getattr__(name: str):
    # Lazy, so that model-free parts (scheduler, batchbench) import without loading torch.
    if name == "LLM":
        from engine_service.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine_service.engine import LLMEngine

        return LLMEngine
    if name == "SamplingParams":
        from engine_service.core.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from sluice.structured import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "EngineConfig":
        from engine_service.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'engine_service' has no attribute {name!r}")
