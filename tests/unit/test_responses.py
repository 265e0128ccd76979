"""The Responses API's pure parts: request validation (the 400s a process is not needed for), the
conversion to a chat request, and the event renderer (deterministic from the record and the
deltas alone, so that another gateway can render a replayed log the same)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gateway.errors import OpenAIError
from gateway.generation import Delta, TokenInfo
from gateway.responses import convert
from gateway.responses.models import CreateResponseRequest
from gateway.responses.render import ResponseRecord, ResponseRenderer

# --- request validation ------------------------------------------------------------------------


def make(**fields) -> CreateResponseRequest:
    return CreateResponseRequest.model_validate({"model": "m", "input": "hi", **fields})


@pytest.mark.parametrize("kind", ["web_search", "web_search_preview", "file_search", "computer_use_preview",
                                  "computer_use", "code_interpreter", "mcp", "image_generation", "local_shell"])
def test_hosted_tools_are_refused_naming_their_type(kind):
    with pytest.raises(ValidationError) as info:
        make(tools=[{"type": "function", "name": "f"}, {"type": kind}])
    message = str(info.value)
    assert f"tools[1] has type '{kind}'" in message and "hosted tool" in message


@pytest.mark.parametrize(("item", "needle"), [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}, "content[0] has type 'input_image'"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "'input_file'"),
    ({"type": "item_reference", "id": "x"}, "input[0] has type 'item_reference'"),
    ({"type": "computer_call_output", "call_id": "c"}, "'computer_call_output'"),
    ({"type": "function_call_output", "output": "x"}, "input[0].call_id is required"),
    ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0].arguments is required"),
    ({"role": "robot", "content": "x"}, "input[0].role"),
    (["not", "an", "object"], "input[0] must be an object"),
])
def test_bad_input_items_say_what_is_wrong(item, needle):
    with pytest.raises(ValidationError) as info:
        make(input=[item])
    assert needle in str(info.value)


def test_accepted_shapes():
    body = make(input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "out"},
        {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "zz"},
    ], tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "X", "schema": {"type": "object"}, "strict": True}})
    assert [i.type for i in body.input] == ["message", "message", "function_call", "function_call_output", "reasoning"]
    assert body.input[1].text() == "ab" and body.tool_choice.name == "f"
    assert body.store is True and body.background is False


@pytest.mark.parametrize("fields", [{"tool_choice": {"type": "file_search"}}, {"max_output_tokens": 0},
                                    {"temperature": 2.5}, {"top_p": 0}, {"metadata": {"k" * 65: "v"}},
                                    {"text": {"format": {"type": "grammar"}}}, {"store": "yes"}])
def test_refused_fields(fields):
    with pytest.raises(ValidationError):
        make(**fields)


# --- conversion ---------------------------------------------------------------------------------


def test_conversation_becomes_chat_messages_with_tool_calls_and_results():
    body = make(instructions="sys", input=[
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "r2"}]},
        {"type": "reasoning", "id": "rs", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done", "annotations": []}]},
    ])
    messages = convert.chat_messages(list(body.input), body.instructions)
    assert messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1", "name": "f"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2", "name": "g"},
        {"role": "assistant", "content": "done"},
    ]


def test_input_items_get_ids_and_round_trip_through_the_store_shape():
    body = make(input=[{"role": "user", "content": "q"},
                       {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_mine"}])
    items = convert.input_items(body)
    assert items[0]["id"].startswith("msg_") and items[0]["content"] == [{"type": "input_text", "text": "q"}]
    assert items[1]["id"] == "fc_mine"
    again = convert.parse_items(json.loads(json.dumps(items)))
    assert convert.chat_messages(again, None) == convert.chat_messages(list(body.input), None)
    assert convert.input_items(make(input="hello"))[0]["content"][0]["text"] == "hello"


def test_chat_request_carries_the_fields():
    body = make(max_output_tokens=20, temperature=0.5, top_p=0.9, parallel_tool_calls=False,
                tools=[{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}],
                tool_choice="required", text={"format": {"type": "json_object"}})
    chat = convert.chat_request(body, list(convert.parse_items(convert.input_items(body))))
    assert chat.max_completion_tokens == 20 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                              "parameters": {"type": "object"}}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.response_format == {"type": "json_object"}
    schema = make(text={"format": {"type": "json_schema", "name": "X", "schema": {"type": "object"}}})
    assert convert.chat_request(schema, convert.parse_items(convert.input_items(schema))).response_format == {
        "type": "json_schema", "json_schema": {"name": "X", "schema": {"type": "object"}}}


def test_chat_errors_are_renamed_to_the_responses_parameters():
    exc = convert.rename_error(OpenAIError(400, "response_format.json_schema.schema does not compile",
                                           param="response_format.json_schema.schema"))
    assert exc.param == "text.format.schema" and exc.message.startswith("text.format.schema")
    exc = convert.rename_error(OpenAIError(400, "Invalid 'messages' for the template; messages are ok",
                                           param="messages"))
    assert exc.param == "input" and exc.message == "Invalid 'input' for the template; messages are ok"
    exc = convert.rename_error(OpenAIError(400, "'tools[0].function.name' must be ...",
                                           param="tools[0].function.name"))
    assert exc.param == "tools[0].name" and exc.message.startswith("'tools[0].name'")


# --- the renderer -------------------------------------------------------------------------------


def record(**fields) -> ResponseRecord:
    base = {"id": "resp_abc", "request_id": "resp-abc", "created_at": 1700000000, "model": "m", "prompt": "",
            "tool_parser": "hermes", "reasoning_parser": None, "echo": {"instructions": "x"}}
    return ResponseRecord(**{**base, **fields})


def render(rec: ResponseRecord, deltas: list[Delta], usage=(5, 7)) -> tuple[list, ResponseRenderer]:
    r = ResponseRenderer(rec)
    events = r.start()
    for d in deltas:
        events += r.on_delta(d)
    events += r.finish({"prompt_tokens": usage[0], "completion_tokens": usage[1]}, completed_at=1700000001)
    return events, r


def dumped(events) -> list[dict]:
    return [e.model_dump(mode="json") for e in events]


TEXT = [Delta(0, "Hel", None), Delta(0, "lo", None), Delta(0, "!", None, "stop")]


def test_text_events_in_order_with_sequence_numbers():
    events, r = render(record(), TEXT)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final is r.response and final.status == "completed" and final.completed_at == 1700000001
    assert final.output[0].content[0].text == "Hello!" and final.output[0].id == "msg_abc_0"
    assert final.usage.input_tokens == 5 and final.usage.output_tokens == 7 and final.usage.total_tokens == 12
    assert final.instructions == "x" and final.created_at == 1700000000
    # the added item is the item as it was then (empty), the done item as it ended
    assert events[2].item.content == [] and events[2].item.status == "in_progress"
    assert events[9].item.content[0].text == "Hello!" and events[9].item.status == "completed"


def test_rendering_is_deterministic():
    """The same record and deltas give the same events, byte for byte (a replay renders the same)."""
    tools = {"chat_tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
             "chat_tool_choice": {"type": "function", "function": {"name": "f"}}}
    deltas = [Delta(0, '{"a"', None), Delta(0, ": 1}", None, "stop")]
    for rec, ds in ((record(), TEXT), (record(**tools), deltas)):
        assert dumped(render(rec, ds)[0]) == dumped(render(rec, ds)[0])


def test_forced_call_streams_arguments():
    rec = record(chat_tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                 chat_tool_choice={"type": "function", "function": {"name": "f"}})
    events, r = render(rec, [Delta(0, '{"a"', None), Delta(0, ": 1}", None, "stop")])
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    [call] = r.response.output
    assert (call.type, call.name, call.arguments, call.call_id, call.id) == (
        "function_call", "f", '{"a": 1}', "call_abc_0", "fc_abc_0")
    assert events[5].arguments == '{"a": 1}' and events[5].name == "f"


def test_auto_tool_calls_after_content_are_separate_items():
    rec = record(chat_tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                 chat_tool_choice="auto")
    text = 'Let me look.<tool_call>\n{"name": "f", "arguments": {"q": 1}}\n</tool_call>'
    events, r = render(rec, [Delta(0, text[:10], None), Delta(0, text[10:], None, "stop")])
    out = r.response.output
    assert [o.type for o in out] == ["message", "function_call"]
    assert out[0].content[0].text == "Let me look." and json.loads(out[1].arguments) == {"q": 1}
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert done == [0, 1]


def test_length_makes_an_incomplete_response():
    events, r = render(record(), [Delta(0, "cut", None, "length")])
    assert events[-1].type == "response.incomplete"
    assert r.response.status == "incomplete" and r.response.incomplete_details.reason == "max_output_tokens"
    assert r.response.output[0].status == "incomplete" and r.response.completed_at is None


def test_nothing_said_is_an_empty_message_and_failures_keep_what_was_said():
    events, r = render(record(), [Delta(0, "", None, "stop")])
    assert [o.content[0].text for o in r.response.output] == [""]
    rr = ResponseRenderer(record())
    rr.start()
    rr.on_delta(Delta(0, "partial", None))
    events = rr.fail("engine_lost", "gone", {"prompt_tokens": 1, "completion_tokens": 1})
    assert [e.type for e in events][-1] == "response.failed"
    assert rr.response.status == "failed" and rr.response.error.code == "engine_lost"
    assert rr.response.output[0].content[0].text == "partial" and rr.response.output[0].status == "incomplete"


def test_reasoning_becomes_a_reasoning_item():
    events, r = render(record(reasoning_parser="deepseek_r1"),
                       [Delta(0, "<think>hmm", None), Delta(0, "</think>Yes", None, "stop")])
    out = r.response.output
    assert [o.type for o in out] == ["reasoning", "message"]
    assert out[0].content[0].text == "hmm" and out[1].content[0].text == "Yes"
    assert "response.reasoning_text.delta" in [e.type for e in events]


def test_max_tool_calls_keeps_the_first_calls():
    tools = [{"type": "function", "function": {"name": f, "parameters": {"type": "object"}}} for f in ("f", "g")]
    calls = "".join(f'<tool_call>\n{{"name": "{f}", "arguments": {{"q": {i}}}}}\n</tool_call>'
                    for i, f in enumerate(("f", "g", "f")))
    deltas = [Delta(0, calls[:30], None), Delta(0, calls[30:], None, "stop")]
    for limit, names in ((None, ["f", "g", "f"]), (2, ["f", "g"]), (1, ["f"])):
        _, r = render(record(chat_tools=tools, chat_tool_choice="auto", max_tool_calls=limit), deltas)
        assert [o.name for o in r.response.output] == names, limit
    _, r = render(record(chat_tools=tools, chat_tool_choice="auto", parallel_tool_calls=False), deltas)
    assert [o.name for o in r.response.output] == ["f"]


def info(text: str, logprob: float) -> TokenInfo:
    return TokenInfo(0, text, text.encode(), logprob, [(text, logprob, text.encode()), ("x", -3.0, b"x")])


def test_logprobs_go_with_the_text_they_made():
    """Each output_text delta carries the logprobs of its tokens; a token whose text the output
    parser held back (a possible tool call's start) goes with the text it released; a call's
    tokens are not the output text's."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    deltas = [Delta(0, "Hi", [info("Hi", -0.1)]), Delta(0, " <", [info(" <", -0.2)]),
              Delta(0, "b>", [info("b>", -0.3)]),
              Delta(0, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', [info("<tool_call>", -0.4)],
                    "stop")]
    events, r = render(record(chat_tools=tools, chat_tool_choice="auto", logprobs=True), deltas)
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in text) == "Hi <b>"
    # " <" might open a tool call: held back, it goes out with "b>", and so do its logprobs
    assert [(e.delta, [lp["token"] for lp in e.logprobs]) for e in text] == [("Hi", ["Hi"]), (" <b>", [" <", "b>"])]
    message, call = r.response.output
    assert [lp["token"] for lp in message.content[0].logprobs] == ["Hi", " <", "b>"] and call.name == "f"
    assert message.content[0].logprobs[0] == {"token": "Hi", "bytes": [72, 105], "logprob": -0.1, "top_logprobs": [
        {"token": "Hi", "bytes": [72, 105], "logprob": -0.1}, {"token": "x", "bytes": [120], "logprob": -3.0}]}
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.logprobs == message.content[0].logprobs
    # not asked: none kept
    _, plain = render(record(), [Delta(0, "Hi", [info("Hi", -0.1)], "stop")])
    assert plain.response.output[0].content[0].logprobs == []


def test_record_round_trips():
    rec = record(chat_tools=[{"type": "function", "function": {"name": "f"}}], parallel_tool_calls=False)
    assert ResponseRecord.from_json(rec.to_json()) == rec
