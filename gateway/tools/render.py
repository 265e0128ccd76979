"""Tools and tool history into the chat template.

A template that reads ``tools`` gets them (and the history's ``tool_calls`` / ``tool`` turns) as
structured fields, as Hugging Face templates expect. For one that does not, the gateway writes
the model's dialect itself: a system block that lists the functions and teaches the call format
of the model's tool-call parser, past calls in that format, and tool results as user turns
wrapped in ``<tool_response>``.
"""

from __future__ import annotations

import json

from gateway.tool_parsers import ParsedCall, ToolParser
from gateway.tool_parsers.base import arguments_text, maybe_json
from gateway.tools.spec import ToolSpec


def template_tools(spec: ToolSpec | None) -> list[dict] | None:
    """The ``tools`` variable for a template that reads it (None: no tools offered)."""
    if spec is None or spec.choice == "none":
        return None
    return [{"type": "function", "function": fn} for fn in spec.by_name.values()]


def render_messages(messages: list[dict], spec: ToolSpec | None, template_reads_tools: bool,
                    parser: ToolParser) -> list[dict]:
    """Messages ready for the chat template (see the module doc)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if template_reads_tools:
            if calls:
                m["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in calls
                ]
            out.append(m)
            continue
        if m["role"] == "assistant" and calls:
            text = parser.format_calls([ParsedCall(c["function"]["name"], arguments_text(_arguments(c)))
                                        for c in calls])
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + [text])
            m.pop("tool_calls", None)
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.pop("tool_call_id", None)
        out.append(m)
    if spec is not None and spec.choice != "none" and not template_reads_tools:
        block = parser.instructions.format(tools="\n".join(json.dumps(fn) for fn in spec.by_name.values()))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _arguments(call: dict):
    """A history call's arguments, parsed (Hugging Face templates expect an object)."""
    value = call["function"].get("arguments")
    return maybe_json(value) if isinstance(value, str) else value
