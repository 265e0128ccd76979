"""One chat choice's text → reasoning, content and tool calls, in the model's dialects.

The text goes through the model's reasoning parser first (``gateway.reasoning``: ``<think>`` →
``reasoning_content``), and the answer through the tool stream (``gateway.tools.stream``: the
model's tool-call parser, or the forced call of ``tool_choice``). :class:`ChatOutputStream` does
it piece by piece for a stream; :func:`parse_chat_output` is that stream fed the whole text, for
the non-streamed response, so the two always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway import reasoning, tool_parsers
from gateway.reasoning import ThinkParser
from gateway.tool_parsers import ToolParser
from gateway.tools import ToolSpec, ToolStream, merge_tool_deltas
from sluice.wire.card import ModelCard


@dataclass
class Dialects:
    """The parsers the model card names."""

    tool_parser: ToolParser
    reasoning: ThinkParser | None

    @classmethod
    def of(cls, card: ModelCard) -> Dialects:
        return cls(tool_parsers.get(card.tool_call_parser), reasoning.get(card.reasoning_parser))


@dataclass
class OutputPiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # deltas, one per index

    def __iadd__(self, other: OutputPiece) -> OutputPiece:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls = merge_tool_deltas(self.tool_calls + other.tool_calls)
        return self


@dataclass
class ChatOutput:
    """A finished choice's message fields."""

    reasoning_content: str | None
    content: str | None
    tool_calls: list[dict]  # whole calls: id, type, function {name, arguments}


class ChatOutputStream:
    """One choice's text, piece by piece; ``spec`` None (no tools) or ``dialects.reasoning`` None
    (the model does not think) leave that step out. ``prompt``: the rendered prompt (whether it
    opened the reasoning)."""

    def __init__(self, dialects: Dialects, spec: ToolSpec | None, prompt: str) -> None:
        self.reasoning = dialects.reasoning.stream(prompt) if dialects.reasoning is not None else None
        self.tools = ToolStream(spec, dialects.tool_parser) if spec is not None and spec.parses_output else None

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.made_calls

    @property
    def thought(self) -> bool:
        return self.reasoning is not None and self.reasoning.thought

    def _answer(self, reasoning_text: str, answer: str, final: bool) -> OutputPiece:
        if self.tools is None:
            return OutputPiece(reasoning_text, answer)
        content, calls = self.tools.feed(answer)
        if final:
            rest, more = self.tools.finish()
            content, calls = content + rest, merge_tool_deltas(calls + more)
        return OutputPiece(reasoning_text, content, calls)

    def feed(self, text: str) -> OutputPiece:
        if self.reasoning is None:
            return self._answer("", text, final=False)
        return self._answer(*self.reasoning.feed(text), final=False)

    def finish(self) -> OutputPiece:
        if self.reasoning is None:
            return self._answer("", "", final=True)
        return self._answer(*self.reasoning.finish(), final=True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` for a choice that called tools and stopped by itself."""
        return "tool_calls" if self.made_calls and engine_reason == "stop" else engine_reason


def parse_chat_output(stream: ChatOutputStream, text: str) -> ChatOutput:
    """The message of a finished ``text`` (``stream`` fresh): the stream fed all of it. Content is
    None when the choice called tools or reasoned and has nothing else to say."""
    piece = stream.feed(text)
    piece += stream.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in piece.tool_calls]
    content: str | None = piece.content
    if not content and (calls or stream.thought):
        content = None
    return ChatOutput(piece.reasoning if stream.thought else None, content, calls)
