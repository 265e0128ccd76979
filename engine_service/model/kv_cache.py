"""The paged KV cache: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from engine_service.config import KV_CACHE_DTYPES
from engine_service.model.config import ModelConfig
from engine_service.model.hugepages import hugepage_tensors

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB
DEFAULT_CUDA_KV_SHARE = 0.9  # of the memory free once the weights are loaded


def kv_cache_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for the ``kv_cache_dtype`` knob: ``auto`` is the model's."""
    if name == "auto":
        return model_dtype
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    return getattr(torch, name)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * element


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                          budget_bytes: int | None) -> int:
    if budget_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget_bytes = int(free * DEFAULT_CUDA_KV_SHARE)
        else:
            budget_bytes = DEFAULT_CPU_KV_BYTES
    blocks = budget_bytes // bytes_per_block(cfg, block_size, dtype)
    if blocks < 1:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens")
    return int(blocks)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    if device.type == "cpu":  # zero-filled, in huge pages (engine_service.model.hugepages)
        tensors = hugepage_tensors([(shape, dtype)] * (2 * cfg.num_hidden_layers))
        return list(zip(tensors[0::2], tensors[1::2], strict=True))
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_hidden_layers)
    ]
