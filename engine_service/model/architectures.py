"""The architectures this runtime serves: one table from ``config.json``'s ``architectures[0]`` to
the model class that implements it and what its config means differently from Llama's.

Every family is the Llama decoder with small variations. An entry names its model class (by import
path: this module imports no torch, so ``ModelConfig`` can read a config without loading the model
code) and a function mapping the raw ``config.json`` to the ``ModelConfig`` fields whose meaning
differs from Llama's; fields an entry does not return are read the Llama way
(``engine_service.model.config``). Adding a family is one entry here plus its differences: a model
class (usually a subclass that swaps one module) and, when its config differs, a mapping function.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class UnsupportedModelError(ValueError):
    pass


def _llama(cfg: dict) -> dict[str, Any]:
    # attention_bias covers q/k/v and the output projection
    return {}


def _qwen3(cfg: dict) -> dict[str, Any]:
    # sliding_window is written even when use_sliding_window is false, and then means nothing
    return {"sliding_window": cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None}


def _qwen2(cfg: dict) -> dict[str, Any]:
    # q/k/v always have biases; the output projection never does
    return {**_qwen3(cfg), "attention_bias": True, "o_proj_bias": False}


@dataclass(frozen=True)
class Architecture:
    name: str  # as config.json's "architectures" lists it
    model_class_path: str  # "module:Class"
    config_differences: Callable[[dict], dict[str, Any]] = _llama

    def model_class(self) -> type:
        module, cls = self.model_class_path.split(":")
        return getattr(importlib.import_module(module), cls)


_LLAMA = "engine_service.model.llama:LlamaForCausalLM"
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", _LLAMA),
    Architecture("MistralForCausalLM", _LLAMA),
    Architecture("Qwen2ForCausalLM", _LLAMA, _qwen2),
    # per-head q/k RMSNorm: the model class's difference
    Architecture("Qwen3ForCausalLM", "engine_service.model.qwen3:Qwen3ForCausalLM", _qwen3),
)}


def resolve_architecture(cfg: dict) -> Architecture:
    """The entry for a ``config.json``: its ``architectures[0]``; else a clear error listing the known ones."""
    archs = cfg.get("architectures") or []
    name = archs[0] if archs and isinstance(archs, list) else None
    if name not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {name or archs or cfg.get('model_type')!r}: "
            f"Sluice runs {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[name]
