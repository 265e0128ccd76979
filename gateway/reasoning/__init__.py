"""Reasoning parsers, registered under vLLM's names: a model that thinks in ``<think>…</think>``
returns ``message.reasoning_content`` / ``delta.reasoning_content`` apart from ``content``.

The model card names the parser (``sluice.wire.dialects``: ``--reasoning-parser`` on the engine,
else detected from the chat template); :func:`get` gives it. One module per parser, listed in
``PARSERS`` (and its name in ``sluice.wire.dialects.REASONING_PARSERS``).
"""

from __future__ import annotations

from gateway.reasoning.base import ReasoningStream, ThinkParser
from gateway.reasoning.deepseek_r1 import DeepSeekR1Parser
from gateway.reasoning.qwen3 import Qwen3Parser

PARSERS: dict[str, type[ThinkParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def get(name: str | None) -> ThinkParser | None:
    """The parser registered as ``name`` (None for None); ``KeyError`` naming the known ones."""
    if name is None:
        return None
    try:
        return PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}") from None


__all__ = ["PARSERS", "ReasoningStream", "ThinkParser", "get"]
