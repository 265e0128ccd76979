"""A completion's text → content and tool calls, streamed; the non-streamed answer is the same
stream fed the whole text at once (``gateway.chat_output.parse_chat_output``), so the two never
disagree.

What each ``tool_choice`` gives (``feed`` returns what may be sent now, ``finish`` the rest):

* ``auto``: the model's tool-call parser (``gateway.tool_parsers``) reads the text. What is
  surely content goes out at once; a call region is held back until it ends, then goes out as
  whole calls (one ``tool_calls`` entry per call: id, name and arguments together), or as
  content when the parser cannot read it. Whitespace next to a call is not content.
* ``named``: decoding is constrained to the function's arguments; they stream as they come.
* ``required``: decoding is constrained to a JSON list of calls; each goes out when its object
  closes.
* ``none``: the text is content.

A forced call (``named`` / ``required``) cut short by ``max_tokens`` is still a tool call, with
the arguments as far as they got (they do not parse) and ``finish_reason: "length"``, streamed
or not (OpenAI's behaviour); only a ``required`` list cut before its first call's name is
complete has no call, and its text is then the content, streamed or not.

With ``parallel_tool_calls: false`` at most one call is returned (a later one is dropped).
Every ``tool_calls`` list this module returns holds one entry per index (:func:`merge_tool_deltas`):
a client merges the entries of a chunk by index, and the openai SDK's ``.stream()`` helper
loses argument text when a chunk holds two entries with the same index.
"""

from __future__ import annotations

import re
import secrets

from gateway.tool_parsers import ParsedCall, ToolParser
from gateway.tool_parsers.base import call_from_object, loads
from gateway.tools.spec import ToolSpec


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def call_delta(index: int, call: ParsedCall) -> dict:
    return {"index": index, "id": new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def merge_tool_deltas(deltas: list[dict]) -> list[dict]:
    """One entry per index: the first entry's id, type and name, the arguments concatenated."""
    merged: dict[int, dict] = {}
    for d in deltas:
        into = merged.get(d["index"])
        if into is None:
            merged[d["index"]] = {**d, "function": dict(d.get("function") or {})}
            continue
        fn = into["function"]
        more = (d.get("function") or {}).get("arguments")
        if more:
            fn["arguments"] = (fn.get("arguments") or "") + more
    return [merged[i] for i in sorted(merged)]


class _AutoStream:
    """``tool_choice: auto`` through a :class:`ToolParser` (see the module doc)."""

    def __init__(self, parser: ToolParser, max_calls: int | None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.buffer = ""
        self.in_region = False
        self.at_start = True  # nothing of the output consumed yet
        self.calls = 0
        self.regions = 0  # call regions read as calls (a dropped extra call included)
        self.after_call = False  # drop the whitespace that follows a call
        self.held_ws = ""  # trailing whitespace of the content: dropped if a call follows

    def _content(self, text: str) -> str:
        if text:
            self.at_start = False
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        body = text.rstrip()
        if not body:
            self.held_ws += text
            return ""
        out, self.held_ws = self.held_ws + body, text[len(body):]
        return out

    def _region(self, region: str) -> tuple[str, list[dict]]:
        self.at_start = False
        calls = self.parser.parse_region(region)
        if not calls:
            return self._content(region), []
        self.regions += 1
        self.held_ws, self.after_call = "", True
        out = []
        for call in calls:
            if self.max_calls is not None and self.calls >= self.max_calls:
                break
            out.append(call_delta(self.calls, call))
            self.calls += 1
        return "", out

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if self.in_region:
                end = self.parser.region_end(self.buffer)
                if end is None:
                    break
                region, self.buffer = self.buffer[:end], self.buffer[end:]
                self.in_region = False
                more, found = self._region(region)
                content += more
                calls += found
                continue
            safe, start = self.parser.scan(self.buffer, self.at_start)
            content += self._content(self.buffer[:safe])
            self.buffer = self.buffer[safe:]
            if start is None:
                break
            self.in_region = True
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if self.in_region:
            content, calls = self._region(rest)
        else:
            content, calls = self._content(rest), []
        if not self.regions:
            content += self.held_ws
        self.held_ws = ""
        return content, calls


class _NamedStream:
    """``tool_choice`` names a function: the text is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def _header(self, arguments: str) -> list[dict]:
        self.started = True
        return [{"index": 0, "id": new_call_id(), "type": "function",
                 "function": {"name": self.name, "arguments": arguments}}]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if not text:
            return "", []
        if not self.started:
            return "", self._header(text)
        return "", [{"index": 0, "function": {"arguments": text}}]

    def finish(self) -> tuple[str, list[dict]]:
        return ("", []) if self.started else ("", self._header(""))


# The start of a `required` call object cut short: its name is whole, its arguments are not.
_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(.*)', re.S)


class _RequiredStream:
    """``tool_choice: required``: the text is a JSON list of ``{"name", "arguments"}`` objects
    (the grammar sees to it); each call goes out when its object closes."""

    def __init__(self, max_calls: int | None) -> None:
        self.max_calls = max_calls
        self.text = ""
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_string = self.escaped = False
        self.object_start: int | None = None
        self.calls = 0

    def _call(self, call: ParsedCall | None) -> list[dict]:
        if call is None or (self.max_calls is not None and self.calls >= self.max_calls):
            return []
        self.calls += 1
        return [call_delta(self.calls - 1, call)]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        out: list[dict] = []
        for i in range(self.pos, len(self.text)):
            ch = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.object_start = i
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.object_start is not None:
                    out += self._call(_object_call(self.text[self.object_start:i + 1]))
                    self.object_start = None
        self.pos = len(self.text)
        return "", out

    def finish(self) -> tuple[str, list[dict]]:
        out: list[dict] = []
        if self.object_start is not None:  # cut short: a call when its name is whole
            match = _CUT_CALL.match(self.text, self.object_start)
            name = _string(match.group(1)) if match is not None else None
            if name:
                out = self._call(ParsedCall(name, match.group(2)))
        if not self.calls:
            return self.text, []
        return "", out


def _string(literal: str) -> str | None:
    try:
        value = loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _object_call(text: str) -> ParsedCall | None:
    try:
        return call_from_object(loads(text))
    except ValueError:
        return None


class ToolStream:
    """One choice's text → (content, ``tool_calls`` deltas) for a request with tools."""

    def __init__(self, spec: ToolSpec, parser: ToolParser) -> None:
        if spec.choice == "named":
            self._impl = _NamedStream(spec.named)
        elif spec.choice == "required":
            self._impl = _RequiredStream(spec.max_calls)
        elif spec.choice == "auto":
            self._impl = _AutoStream(parser, spec.max_calls)
        else:
            self._impl = None
        self.made_calls = False

    def _out(self, content: str, calls: list[dict]) -> tuple[str, list[dict]]:
        self.made_calls = self.made_calls or bool(calls)
        return content, merge_tool_deltas(calls)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send now, ``tool_calls`` deltas to send now)."""
        if self._impl is None:
            return text, []
        return self._out(*self._impl.feed(text))

    def finish(self) -> tuple[str, list[dict]]:
        """At the end: (remaining content, remaining ``tool_calls`` deltas)."""
        if self._impl is None:
            return "", []
        return self._out(*self._impl.finish())

