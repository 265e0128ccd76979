"""Tool-call parsers: one small module per model dialect, registered under vLLM's name.

The model card names the dialect (``sluice.wire.dialects``: ``--tool-call-parser`` on the engine,
else detected from the chat template); :func:`get` gives its parser. A dialect is one
:class:`~gateway.tool_parsers.base.ToolParser` subclass in its own module, listed in
``PARSERS`` below (and its name in ``sluice.wire.dialects.TOOL_CALL_PARSERS``, for the engine's
flag check).
"""

from __future__ import annotations

from gateway.tool_parsers.base import ParsedCall, ToolParser
from gateway.tool_parsers.hermes import HermesParser
from gateway.tool_parsers.llama3_json import Llama3JsonParser
from gateway.tool_parsers.mistral import MistralParser
from gateway.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def get(name: str) -> ToolParser:
    """The parser registered as ``name``; ``KeyError`` naming the known ones otherwise."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}") from None


__all__ = ["PARSERS", "ParsedCall", "ToolParser", "get"]
