"""``qwen3``: Qwen3 and QwQ. The output is reasoning when it begins with ``<think>``, or when the
rendered prompt already ends with it (thinking-only templates); a prompt that closed an empty
``<think></think>`` (``enable_thinking`` false) gets a plain answer."""

from __future__ import annotations

from gateway.reasoning.base import ThinkParser


class Qwen3Parser(ThinkParser):
    name = "qwen3"
