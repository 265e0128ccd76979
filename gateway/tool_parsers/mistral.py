"""``mistral``: ``[TOOL_CALLS]`` then the calls, as a JSON list
``[{"name": ..., "arguments": {...}}]`` (Mistral 7B v0.3, Nemo) or, from the v11 tokenizer on,
``name{...}`` / ``name[ARGS]{...}`` per call. Everything from the marker to the end is calls.

``[TOOL_CALLS]`` is a special token, so with the default ``skip_special_tokens`` it is not in the
text: an output that begins with a JSON list of calls is read as calls too (a list that is not
calls stays content)."""

from __future__ import annotations

import json
import re

from gateway.tool_parsers.base import (
    ParsedCall,
    ToolParser,
    arguments_text,
    call_from_object,
    loads,
    maybe_json,
    partial_suffix,
)

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(\{.*)", re.S)


class MistralParser(ToolParser):
    name = "mistral"
    instructions = (
        "You can call functions. The available functions, as JSON schemas:\n{tools}\n"
        "To call functions, answer with [TOOL_CALLS] and a JSON list of calls: "
        '[TOOL_CALLS][{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}]'
    )

    def scan(self, text: str, at_start: bool) -> tuple[int, int | None]:
        if at_start:
            head = text.lstrip()
            if head.startswith("[{") or head.startswith(MARKER):
                return 0, 0
            if not head or "[{".startswith(head) or MARKER.startswith(head):
                return 0, None
        pos = text.find(MARKER)
        if pos >= 0:
            return pos, pos
        return len(text) - partial_suffix(text, MARKER), None

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        calls: list[ParsedCall] = []
        for part in region.split(MARKER):
            part = part.strip()
            if not part:
                continue
            if part[0] in "[{":
                try:
                    value = loads(part)
                except ValueError:
                    return None
                objs = value if isinstance(value, list) else [value]
                found = [call_from_object(o) for o in objs]
                if not found or None in found:
                    return None
                calls.extend(found)
                continue
            match = _NAMED.fullmatch(part)
            if match is None:
                return None
            try:
                arguments = loads(match.group(2))
            except ValueError:
                return None
            if not isinstance(arguments, dict):
                return None
            calls.append(ParsedCall(match.group(1), arguments_text(arguments)))
        return calls or None

    def format_call(self, call: ParsedCall) -> str:
        return self.format_calls([call])

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return MARKER + json.dumps([{"name": c.name, "arguments": maybe_json(c.arguments)} for c in calls])
