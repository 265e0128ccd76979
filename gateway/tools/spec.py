"""A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, validated into a
:class:`ToolSpec` (a 400 naming the parameter for anything malformed)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gateway.tools.constraint import checked, invalid_value, tool_constraint


@dataclass
class ToolSpec:
    tools: list[dict]  # OpenAI's shape: {"type": "function", "function": {...}}
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # parallel_tool_calls: false allows at most one call
    by_name: dict[str, dict] = field(default_factory=dict)
    limit: int | None = None  # at most this many calls (a response's max_tool_calls)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"

    @property
    def max_calls(self) -> int | None:
        most = None if self.parallel else 1
        return self.limit if most is None else min(most, self.limit or most)


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolSpec | None:
    if tools is None:
        if tool_choice not in (None, "none"):
            raise invalid_value("'tool_choice' needs 'tools'.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid_value("'tools' must be a list of function tools.", "tools")
    by_name: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise invalid_value(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}; "
                                "only function tools are supported.", f"tools[{i}]")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise invalid_value(f"'tools[{i}].function.name' must be 1-64 letters, digits, '_', '-' or '.'.",
                                f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid_value(f"'tools[{i}].function.parameters' must be a JSON schema object.",
                                f"tools[{i}].function.parameters")
        by_name[name] = {"name": name, "description": fn.get("description", ""), "parameters": params}
    if not by_name:
        raise invalid_value("'tools' must not be empty.", "tools")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        return ToolSpec(tools, "auto", None, parallel, by_name)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise invalid_value(f"Unsupported 'tool_choice' {tool_choice!r}; use 'none', 'auto', 'required' or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
        spec = ToolSpec(tools, tool_choice, None, parallel, by_name)
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in by_name:
            raise invalid_value(f"'tool_choice' names function {name!r}, which is not in 'tools'.", "tool_choice")
        spec = ToolSpec(tools, "named", name, parallel, by_name)
    else:
        raise invalid_value("'tool_choice' must be 'none', 'auto', 'required' or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
    if spec.constrained:
        checked(tool_constraint(spec), "tools")
    return spec
