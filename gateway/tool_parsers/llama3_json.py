"""``llama3_json``: Llama 3.1 / 3.2 JSON calls. The whole output is the calls: an optional
``<|python_tag|>``, then ``{"name": ..., "parameters": {...}}`` objects separated by ``;`` (vLLM's
``Llama3JsonToolParser``). Output that begins otherwise is content."""

from __future__ import annotations

import json

from gateway.tool_parsers.base import ParsedCall, ToolParser, call_from_object, maybe_json, scan_at_start

TAG = "<|python_tag|>"  # a special token: in the text only with skip_special_tokens false


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    instructions = (
        "You can call functions. The available functions, as JSON schemas:\n{tools}\n"
        "To call a function, answer with only a JSON object, and nothing else: "
        '{{"name": "<function name>", "parameters": {{<arguments as JSON>}}}}. '
        "Separate several calls with '; '."
    )

    def scan(self, text: str, at_start: bool) -> tuple[int, int | None]:
        return scan_at_start(text, at_start, (TAG, "{"))

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        text = region.strip()
        if text.startswith(TAG):
            text = text[len(TAG):].lstrip()
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(text):
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):  # RecursionError: nested too deeply
                return None
            call = call_from_object(obj)
            if call is None:
                return None
            calls.append(call)
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
        return calls or None

    def format_call(self, call: ParsedCall) -> str:
        return json.dumps({"name": call.name, "parameters": maybe_json(call.arguments)})

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return "; ".join(self.format_call(c) for c in calls)
