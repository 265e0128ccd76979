"""What a tool-call parser is: how a model dialect writes calls into its text, read back.

A parser describes its dialect in four small steps, which :class:`gateway.tools.stream.ToolStream`
drives both over a stream and over a finished text (the non-streamed answer is the stream fed the
whole text at once, so the two always agree):

* :meth:`ToolParser.scan`: how much of the text is surely content, and where a call region starts;
* :meth:`ToolParser.region_end`: where that region ends (None: not yet, or only at the end);
* :meth:`ToolParser.parse_region`: the calls a finished region holds, or None when it holds none
  (then the region is plain content: output a parser cannot read is never an error);
* :attr:`ToolParser.instructions` / :meth:`ToolParser.format_call`: how the default tools prompt
  teaches the format, and how a past call is written back into a history, for a chat template
  that does not read ``tools`` itself.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


def loads(text: str) -> Any:
    """``json.loads``, with JSON nested too deep for it a ``ValueError`` like any other bad JSON
    (it raises ``RecursionError``): model output and a client's strings can be anything."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def maybe_json(text: str) -> Any:
    """``text`` parsed as JSON, or the text itself when it is not JSON."""
    try:
        return loads(text)
    except ValueError:
        return text


def arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def call_from_object(obj: Any) -> ParsedCall | None:
    """``{"name": ..., "arguments" | "parameters": {...}}`` as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict | str):
        return None
    return ParsedCall(obj["name"], arguments_text(arguments))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def scan_for_marker(text: str, marker: str) -> tuple[int, int | None]:
    """:meth:`ToolParser.scan` for a dialect whose calls begin with ``marker`` anywhere."""
    pos = text.find(marker)
    if pos >= 0:
        return pos, pos
    return len(text) - partial_suffix(text, marker), None


def scan_at_start(text: str, at_start: bool, openers: tuple[str, ...]) -> tuple[int, int | None]:
    """:meth:`ToolParser.scan` for a dialect whose calls are the whole output, recognised by how
    it begins (after whitespace): one of ``openers``. Undecided while the text is whitespace or a
    proper prefix of an opener."""
    if not at_start:
        return len(text), None
    head = text.lstrip()
    if any(head.startswith(o) for o in openers):
        return 0, 0
    if not head or any(o.startswith(head) for o in openers):
        return 0, None
    return len(text), None


class ToolParser(ABC):
    name: ClassVar[str]
    # The default tools prompt's instructions ({tools}: one JSON function schema a line).
    instructions: ClassVar[str]

    @abstractmethod
    def scan(self, text: str, at_start: bool) -> tuple[int, int | None]:
        """``(safe, start)`` over ``text``, the undecided rest of the output (``at_start``: it begins
        the output): the first ``safe`` characters are surely content; ``start`` is where a call
        region begins (then ``start == safe``), or None."""

    def region_end(self, region: str) -> int | None:
        """Where a region (``region`` starts at its start) ends; None: not yet, or at the end."""
        return None

    @abstractmethod
    def parse_region(self, region: str) -> list[ParsedCall] | None:
        """The calls of a complete region, or None when it is not one this dialect can read."""

    @abstractmethod
    def format_call(self, call: ParsedCall) -> str:
        """A past call as the model would have written it."""

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return "\n".join(self.format_call(c) for c in calls)
