"""The shape of a request body, bounded on the parsed JSON before pydantic (or anything else) walks it.

A 4 MiB body may hold 100,000 tiny messages or input items, a million numbers, or objects nested
hundreds deep: each costs the gateway Python work per entry (validation, conversion, the chat
template, moving it between processes) long before any rule about the prompt is reached.
pydantic's own ``max_length`` on a list does not help: it counts the items *after* validating them
("at most N items after validation"). So the counts that matter are read here with ``len()``, in
O(1) per list; a walk of each parameter bounds its nesting (``limits.NESTING``, the one depth
rule, naming the path where it nests too deep) and one bounds the number of JSON values; each bound
is one line of ``sluice.wire.limits`` (``BODY_SHAPE``, ``NESTING``) and a body over it is a 400
naming the parameter (``messages``, ``input[3].content``, ``tools[0].function.parameters``).

:func:`check` runs wherever the body is parsed (``gateway.request_body``): on the event loop for a
small body, in a prepare-pool worker for a large one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway import errors
from gateway.errors import OpenAIError
from sluice.wire import limits

Rule = Callable[[dict], "OpenAIError | None"]


def _too_many(size: limits.Size, items: Any, param: str) -> OpenAIError | None:
    if isinstance(items, list) and len(items) > size.max_items:
        return errors.from_problem(limits.invalid(param, size.count_problem(len(items), param)))
    return None


def _list_field(key: str, size: limits.Size) -> Rule:
    return lambda body: _too_many(size, body.get(key), key)


def _parts_of(key: str, fields: tuple[str, ...]) -> Rule:
    """Every entry of ``body[key]`` (a list of objects) keeps ``CONTENT_PARTS`` in each of ``fields``."""

    def rule(body: dict) -> OpenAIError | None:
        entries = body.get(key)
        if not isinstance(entries, list):
            return None
        for i, entry in enumerate(entries):
            if isinstance(entry, dict):
                for name in fields:
                    if problem := _too_many(limits.CONTENT_PARTS, entry.get(name), f"{key}[{i}].{name}"):
                        return problem
        return None

    return rule


_CHAT: tuple[Rule, ...] = (_list_field("messages", limits.MESSAGES), _list_field("tools", limits.TOOLS),
                           _parts_of("messages", ("content",)))
# The request models (by class name) and the counts their bodies keep. Others get the walk only.
RULES: dict[str, tuple[Rule, ...]] = {
    "ChatCompletionRequest": _CHAT,
    "TokenizeRequest": _CHAT,
    "CreateResponseRequest": (_list_field("input", limits.INPUT_ITEMS), _list_field("tools", limits.TOOLS),
                              _parts_of("input", ("content", "output"))),
}


def _first_upper(text: str) -> str:
    return text[:1].upper() + text[1:]


def _nesting(data: Any) -> OpenAIError | None:
    """Each parameter within ``limits.NESTING`` (the one depth rule): a 400 naming the path where
    one nests too deep. Each walk stops at its first step over the limit."""
    items = data.items() if isinstance(data, dict) else ((None, data),)
    for name, value in items:
        found = limits.NESTING.problem(value, None if name is None else str(name))
        if found is not None:
            return errors.invalid(_first_upper(found[1]) + ".", param=found[0])
    return None


def _values(data: Any) -> OpenAIError | None:
    """The number of JSON values, stopped at its first step over the limit (the nesting is bounded
    already, so the walk's stack is too)."""
    max_values = limits.BODY_VALUES.max_items
    values = 1
    stack: list[Any] = [data]
    while stack:
        node = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        values += len(children)
        if values > max_values:
            return errors.invalid(_first_upper(limits.BODY_VALUES.count_problem(values, at_least=True)) + ".")
        stack.extend(child for child in children if isinstance(child, dict | list))
    return None


def check(data: Any, model_name: str) -> OpenAIError | None:
    """The 400 for a parsed body (of the request model named ``model_name``) over a shape bound,
    else None. The counts come first (O(1) each), then the walks."""
    if not isinstance(data, dict | list):
        return None
    if isinstance(data, dict):
        for rule in RULES.get(model_name, ()):
            if problem := rule(data):
                return problem
    return _nesting(data) or _values(data)
