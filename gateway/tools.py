"""Structured outputs and tool calling at the gateway (torch-free).

* ``constraint_for``: ``response_format`` (text / json_object / json_schema) and vLLM's
  ``structured_outputs`` become one ``StructuredOutputsParams``, checked to compile (a 400 naming
  the parameter otherwise) before anything is queued.
* Tools: ``tools`` are rendered through the chat template's ``tools`` variable when the template
  reads it, otherwise as the default system block below (Hermes-style ``<tool_call>`` JSON).
  ``tool_choice="required"`` constrains decoding to a JSON array of calls, a named function to its
  ``parameters`` schema (the output is the arguments); ``"auto"`` parses ``<tool_call>…</tool_call>``
  blocks out of free text; ``"none"`` leaves the text alone.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway import errors
from sluice.structured import StructuredOutputError, StructuredOutputsParams

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

DEFAULT_TOOLS_PROMPT = (
    "You can call functions. The available functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object inside tags, one per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)


def _bad(message: str, param: str) -> errors.OpenAIError:
    return errors.invalid(message, param=param, code="invalid_value")


def _checked(params: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    try:
        params.to_grammar()
    except StructuredOutputError as exc:
        raise _bad(str(exc).replace(f"structured_outputs.{params.kind}", param, 1)
                   if param != "structured_outputs" else str(exc), param) from None
    return params


def constraint_for(response_format: Any, structured_outputs: Any) -> StructuredOutputsParams | None:
    """The request's output constraint, or None. Raises a 400 naming the parameter."""
    if response_format is not None and structured_outputs is not None:
        if not (isinstance(response_format, dict) and response_format.get("type") == "text"):
            raise _bad("Give either 'response_format' or 'structured_outputs', not both.", "response_format")
    if structured_outputs is not None:
        try:
            params = StructuredOutputsParams.from_dict(structured_outputs)
        except StructuredOutputError as exc:
            raise _bad(str(exc), "structured_outputs") from None
        return _checked(params, f"structured_outputs.{params.kind}")
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'.", "response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("'response_format.json_schema' is required for type 'json_schema'.",
                       "response_format.json_schema")
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            schema = {"type": "object"}  # OpenAI allows a name-only json_schema: any object
        if not isinstance(schema, dict):
            raise _bad("'response_format.json_schema.schema' must be a JSON schema object.",
                       "response_format.json_schema.schema")
        return _checked(StructuredOutputsParams(json=schema), "response_format.json_schema.schema")
    raise _bad(f"Unsupported 'response_format' type {kind!r}; supported: 'text', 'json_object', 'json_schema'.",
               "response_format.type")


# --- tools ---------------------------------------------------------------------------------------


@dataclass
class ToolSpec:
    tools: list[dict]  # OpenAI's shape: {"type": "function", "function": {...}}
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True
    by_name: dict[str, dict] = field(default_factory=dict)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolSpec | None:
    if tools is None:
        if tool_choice not in (None, "none"):
            raise _bad("'tool_choice' needs 'tools'.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of function tools.", "tools")
    by_name: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise _bad(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}; "
                       "only function tools are supported.", f"tools[{i}]")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise _bad(f"'tools[{i}].function.name' must be 1-64 letters, digits, '_', '-' or '.'.",
                       f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"'tools[{i}].function.parameters' must be a JSON schema object.",
                       f"tools[{i}].function.parameters")
        by_name[name] = {"name": name, "description": fn.get("description", ""), "parameters": params}
    if not by_name:
        raise _bad("'tools' must not be empty.", "tools")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        return ToolSpec(tools, "auto", None, parallel, by_name)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad(f"Unsupported 'tool_choice' {tool_choice!r}; use 'none', 'auto', 'required' or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
        spec = ToolSpec(tools, tool_choice, None, parallel, by_name)
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in by_name:
            raise _bad(f"'tool_choice' names function {name!r}, which is not in 'tools'.", "tool_choice")
        spec = ToolSpec(tools, "named", name, parallel, by_name)
    else:
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
    if spec.constrained:
        _checked(tool_constraint(spec), "tools")
    return spec


def tool_constraint(spec: ToolSpec) -> StructuredOutputsParams:
    """The JSON schema decoding follows for ``required`` (an array of calls) or a named function
    (its parameters: the output is the arguments object)."""
    if spec.choice == "named":
        return StructuredOutputsParams(json=spec.by_name[spec.named]["parameters"])
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "arguments": fn["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, fn in spec.by_name.items()]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not spec.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _tool_function_list(spec: ToolSpec) -> list[dict]:
    return [{"type": "function", "function": fn} for fn in spec.by_name.values()]


def render_messages(messages: list[dict], spec: ToolSpec | None, template_reads_tools: bool) -> list[dict]:
    """Messages ready for the chat template. Assistant ``tool_calls`` and ``tool`` results are
    kept as structured fields for a template that reads ``tools`` (with ``arguments`` parsed, as
    Hugging Face templates expect); for one that does not, they become text: the calls as
    ``<tool_call>`` blocks, a tool result as a user turn wrapped in ``<tool_response>``."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if template_reads_tools:
            if calls:
                m["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _maybe_json(c["function"].get("arguments"))}}
                    for c in calls
                ]
            out.append(m)
            continue
        if m["role"] == "assistant" and calls:
            blocks = [f"{TOOL_CALL_OPEN}\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": _maybe_json(c["function"].get("arguments"))}
            ) + f"\n{TOOL_CALL_CLOSE}" for c in calls]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            m.pop("tool_calls", None)
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.pop("tool_call_id", None)
        out.append(m)
    if spec is not None and spec.choice != "none" and not template_reads_tools:
        block = DEFAULT_TOOLS_PROMPT.format(
            tools="\n".join(json.dumps(fn) for fn in spec.by_name.values()))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_tools(spec: ToolSpec | None) -> list[dict] | None:
    return _tool_function_list(spec) if spec is not None and spec.choice != "none" else None


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def extract_tool_calls(spec: ToolSpec, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished completion's text."""
    if spec.choice == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []  # cut short (length): not a call
        return None, [_call(spec.named, text)]
    if spec.choice == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(c["name"], c["arguments"]) for c in calls if isinstance(c, dict) and "name" in c]
    if spec.choice == "auto":
        return parse_hermes(text)
    return text, []


_HERMES = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks → calls;
    the text outside them is the content. A block that is not a JSON call stays in the content."""
    if TOOL_CALL_OPEN not in text:
        return text, []
    calls = []
    kept = []
    last = 0
    for match in _HERMES.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


class ToolStream:
    """Streaming for a request with tools: what is sure to be content goes out as content; a
    completion that is (or turns into) a tool call is held back and sent as ``tool_calls``
    deltas when it ends. A named function streams its arguments as they come."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.buffer = ""
        self.holding = spec.choice == "required"
        self.started = False  # named: the first delta (id, name) went out

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send now, tool_calls deltas to send now)."""
        spec = self.spec
        if spec.choice == "named":
            calls = []
            if not self.started:
                self.started = True
                calls.append({"index": 0, "id": new_call_id(), "type": "function",
                              "function": {"name": spec.named, "arguments": ""}})
            if text:
                calls.append({"index": 0, "function": {"arguments": text}})
            return "", calls
        if spec.choice == "none":
            return text, []
        self.buffer += text
        if self.holding:
            return "", []
        pos = self.buffer.find(TOOL_CALL_OPEN)
        if pos >= 0:
            self.holding = True
            out, self.buffer = self.buffer[:pos], self.buffer[pos:]
            return out, []
        keep = _partial_suffix(self.buffer, TOOL_CALL_OPEN)
        out = self.buffer[:len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        """At the end: (remaining content, tool_calls deltas)."""
        spec = self.spec
        if spec.choice in ("named", "none"):
            return "", []
        content, calls = extract_tool_calls(spec, self.buffer)
        self.buffer = ""
        deltas = [{"index": i, **c} for i, c in enumerate(calls)]
        return content or "", deltas

    @property
    def made_calls(self) -> bool:
        return self.spec.choice == "named" and self.started


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
