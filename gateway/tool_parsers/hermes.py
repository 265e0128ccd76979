"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the
text (Hermes 2 Pro, Qwen 2.5 / 3, and the gateway's default tools prompt)."""

from __future__ import annotations

import json

from gateway.tool_parsers.base import (
    ParsedCall,
    ToolParser,
    call_from_object,
    loads,
    maybe_json,
    scan_for_marker,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    instructions = (
        "You can call functions. The available functions, as JSON schemas:\n"
        "<tools>\n{tools}\n</tools>\n"
        "To call a function, answer with a JSON object inside tags, one per call:\n"
        '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
    )

    def scan(self, text: str, at_start: bool) -> tuple[int, int | None]:
        return scan_for_marker(text, OPEN)

    def region_end(self, region: str) -> int | None:
        pos = region.find(CLOSE)
        return None if pos < 0 else pos + len(CLOSE)

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        body = region[len(OPEN):]
        if body.endswith(CLOSE):
            body = body[:-len(CLOSE)]
        try:  # an unclosed block at the end still counts when its JSON is whole
            call = call_from_object(loads(body))
        except ValueError:
            return None
        return None if call is None else [call]

    def format_call(self, call: ParsedCall) -> str:
        return f"{OPEN}\n" + json.dumps({"name": call.name, "arguments": maybe_json(call.arguments)}) + f"\n{CLOSE}"
