"""Nesting is bounded in one place, before any work (``sluice.wire.limits.NESTING``): a request
parameter whose value nests objects and arrays deeper than the bound — a tool's parameters schema,
a response format's schema, ``structured_outputs``, ``chat_template_kwargs``, a message's tool
calls, an input item — is a 400 naming where, on every endpoint, never a 500. (A tool schema nested
200-300 levels, under the body's own depth guard, was a 500 "Maximum serialization depth exceeded"
on chat and on responses.) The real gateway app, a real Redis and the fake engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from sluice.wire import limits
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import assert_error
from tests.integration.test_gateway_support import MODEL

fake_engine = support.fake_engine
make_gateway = support.make_gateway
gateway = support.gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]

MESSAGES = [{"role": "user", "content": "hi"}]


def schema(levels: int) -> dict:
    """A JSON schema of ``levels`` nested objects (two containers a level: the object, its properties)."""
    value: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        value = {"type": "object", "properties": {"a": value}, "required": ["a"]}
    return value


def nested_list(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def chat_tool(params: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": params}}


CASES = [
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [chat_tool(schema(150))]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [chat_tool(schema(100))], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema(125)}}}, "response_format.json_schema.schema.properties"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"json": schema(125)}},
     "structured_outputs.json.properties.a"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"x": nested_list(300)}},
     "chat_template_kwargs.x[0][0]"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "x": nested_list(260)}]},
        *MESSAGES]}, "messages[0].tool_calls[0]"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema(140)}}}, "response_format.json_schema.schema.properties"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": schema(140)}},
     "structured_outputs.json.properties.a"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": schema(150)}]},
     "tools[0].parameters.properties"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": schema(125)}}},
     "text.format.schema.properties"),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": nested_list(300)}]}, "input[0].summary[0]"),
    ("/v1/conversations", {"items": [{"type": "reasoning", "summary": nested_list(300)}]}, "items[0].summary[0]"),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_a_too_deep_parameter_is_a_400_naming_it(gateway, fake_engine, path, body, param):
    r = httpx.post(f"{gateway.url}{path}", json={"model": MODEL, **body}, timeout=30)
    err = assert_error(r, 400, param=param, code="invalid_value")
    assert f"more than {limits.NESTING.max_levels} levels deep" in err["message"], err
    assert fake_engine.requests == []


def test_nesting_up_to_the_bound_is_served(gateway, fake_engine):
    """At the bound (a chat tool's parameters holding 60 nested arrays: 63 levels in ``tools``) the
    request is served, its parameters rendered, serialized into its record and stored: the bound
    sits well below what breaks anything after it."""
    deep = {"type": "object", "properties": {}, "x-deep": nested_list(60)}
    tools = [chat_tool(deep)]
    assert limits.NESTING.problem(tools, "tools") is None
    assert limits.NESTING.problem([chat_tool({**deep, "x-deep": nested_list(61)})], "tools") is not None
    r = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "tools": tools, "max_tokens": 8, "stream": True})
    assert r.status_code == 200, r.text
    flat = [{"type": "function", "name": "f", "parameters": deep}]
    r = httpx.post(f"{gateway.url}/v1/responses", timeout=60,
                   json={"model": MODEL, "input": "hi", "tools": flat, "max_output_tokens": 8})
    assert r.status_code == 200, r.text
    stored = httpx.get(f"{gateway.url}/v1/responses/{r.json()['id']}").json()
    assert stored["tools"][0]["parameters"] == deep
    r = httpx.post(f"{gateway.url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": "hi", "max_output_tokens": 8,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema(30)}}})
    assert r.status_code in (200, 400), r.text  # the constraint compiler may refuse it: never a 500
