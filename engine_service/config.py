"""The engine's configuration, in one place: the offline ``LLM`` keywords and the ``sluice engine``
flags both resolve to an ``EngineConfig``."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_WATERMARK_SHARE = 0.01


@dataclass
class SchedulerConfig:
    """What the scheduler and its block pool need; derived from ``EngineConfig`` once the model
    (and so ``max_model_len`` and the KV pool size) is known."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    watermark_blocks: int | None = None  # None: DEFAULT_WATERMARK_SHARE of the pool
    enable_prefix_caching: bool = True

    def resolved_watermark_blocks(self) -> int:
        if self.watermark_blocks is not None:
            return self.watermark_blocks
        return int(DEFAULT_WATERMARK_SHARE * self.num_blocks)


@dataclass
class EngineConfig:
    model: str | None = None  # a local HF directory; None: the prepared default model
    served_model_name: str | None = None  # the name clients use; defaults to the directory's name
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_memory allows
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: 1 GiB on CPU, 90% of free on CUDA
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    watermark_blocks: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0  # seeds the sampler's generator for unseeded requests
