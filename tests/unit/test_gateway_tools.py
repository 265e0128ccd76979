"""The gateway's structured-output and tool-call helpers (no model, no Redis): request validation,
constraints, rendering. The parsers and the streams: test_tool_parsers.py, test_reasoning_parsers.py."""

from __future__ import annotations

import json

import pytest

from gateway import tool_parsers, tools
from gateway.errors import OpenAIError
from sluice.structured import StructuredOutputError, StructuredOutputsParams, compile_grammar
from sluice.wire import codec

FN = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _error(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


def test_response_format_kinds_and_errors():
    assert tools.constraint_for({"type": "text"}, None) is None
    assert tools.constraint_for({"type": "json_object"}, None).kind == "json_object"
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    c = tools.constraint_for({"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                     "strict": True}}, None)
    assert c.kind == "json" and list(json.loads(c.json)["properties"]) == ["b", "a"]  # order kept
    assert _error(tools.constraint_for, {"type": "yaml"}, None).param == "response_format.type"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    assert _error(tools.constraint_for, bad, None).param == "response_format.json_schema.schema"
    assert _error(tools.constraint_for, None, {"regex": "("}).param == "structured_outputs.regex"
    assert _error(tools.constraint_for, None, {"bogus": 1}).param == "structured_outputs"
    assert _error(tools.constraint_for, None, {"regex": "a", "choice": ["a"]}).param == "structured_outputs"
    assert _error(tools.constraint_for, {"type": "json_object"}, {"regex": "a"}).param == "response_format"
    assert tools.constraint_for(None, {"grammar": 'root ::= "yes" | "no"'}).kind == "grammar"  # GBNF
    assert tools.constraint_for(None, {"grammar": 'start: "yes" | "no"'}).kind == "grammar"  # Lark


def test_constraint_round_trips_the_wire():
    for so in ({"json": {"type": "object"}}, {"json_object": True}, {"regex": "[0-9]+"},
               {"choice": ["a", "b"]}, {"grammar": 'start: "x"'}):
        params = StructuredOutputsParams.from_dict(so)
        msg = codec.sampling_params_to_proto({"structured_outputs": params, "max_tokens": 4})
        back = codec.sampling_kwargs_from_proto(msg)["structured_outputs"]
        assert back.key == params.key
    assert "structured_outputs" not in codec.sampling_kwargs_from_proto(codec.sampling_params_to_proto({}))
    with pytest.raises(StructuredOutputError):
        compile_grammar("regex", "[")


def test_tool_choice_parsing_and_schemas():
    assert tools.parse_tools(None, None, None) is None
    assert tools.parse_tools([FN], None, None).choice == "auto"
    named = tools.parse_tools([FN], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.choice == "named" and tools.tool_constraint(named).key[1] == json.dumps(FN["function"]["parameters"])
    req = tools.parse_tools([FN], "required", False)
    schema = json.loads(tools.tool_constraint(req).json)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == ["get_weather"]
    assert _error(tools.parse_tools, [FN], "sometimes", None).param == "tool_choice"
    assert _error(tools.parse_tools, None, "required", None).param == "tool_choice"
    assert _error(tools.parse_tools, [{"type": "code_interpreter"}], None, None).param == "tools[0]"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    assert _error(tools.parse_tools, [bad], "required", None).param == "tools"


@pytest.mark.model
def test_messages_with_tools_render_through_the_default_block(ours):
    spec = tools.parse_tools([FN], "auto", None)
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "21C", "tool_call_id": "c1"},
    ]
    messages = tools.render_messages(history, spec, False, tool_parsers.get("hermes"))
    text = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\n21C\n</tool_response>" in text
    kept = tools.render_messages(history, spec, True, tool_parsers.get("hermes"))
    assert kept[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"} and kept[2]["role"] == "tool"
