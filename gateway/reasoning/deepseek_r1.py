"""``deepseek_r1``: DeepSeek-R1 and its distills. Their template opens ``<think>`` in the prompt,
so the output starts inside the reasoning (an opening tag the model repeats is dropped) and all
of it is reasoning until ``</think>`` (vLLM's ``DeepSeekR1ReasoningParser``)."""

from __future__ import annotations

from gateway.reasoning.base import ThinkParser


class DeepSeekR1Parser(ThinkParser):
    name = "deepseek_r1"

    def thinks_from_start(self, prompt: str) -> bool:
        return True
