"""Replace a model's linear layers in place: what weight-only quantization and oneDNN prepacking both do.

Every ``nn.Linear`` is rebuilt from its weight and bias by ``build``, and a tied-embedding model
(SmolLM2 shares its output projection with the embedding, so it has no ``lm_head``) gets an output
projection of its own built from the embedding table; the embedding keeps the table for the lookup.
``LlamaForCausalLM.compute_logits`` uses ``lm_head`` whenever the model has one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Build = Callable[[torch.Tensor, "torch.Tensor | None"], nn.Module]


def swap_linears(model: nn.Module, build: Build) -> list[tuple[torch.Tensor, nn.Module]]:
    """Replace every ``nn.Linear`` by ``build(weight, bias)`` and give a tied model an ``lm_head``
    built from its embedding. Returns (original weight, new module) for each replacement."""
    swapped = []
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = build(linear.weight.data, None if linear.bias is None else linear.bias.data)
        setattr(parent, attr, new)
        swapped.append((linear.weight, new))
    cfg = getattr(model, "config", None)
    if cfg is not None and cfg.tie_word_embeddings and not hasattr(model, "lm_head"):
        embedding = model.model.embed_tokens.weight
        model.lm_head = build(embedding.data, None)
        swapped.append((embedding, model.lm_head))
    return swapped
