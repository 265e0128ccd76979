"""Tool-call parsers (gateway.tool_parsers) and the tool streams (gateway.tools.stream), on text.

Every case runs whole (the non-streamed answer), then split in two at every position, then one
character at a time: what a client assembles from the chunks (content concatenated, ``tool_calls``
merged by index) must be the non-streamed answer, and no chunk may hold two ``tool_calls``
entries with the same index (the openai SDK's ``.stream()`` helper corrupts the arguments then).
"""

from __future__ import annotations

import json

import pytest

from gateway import tool_parsers, tools
from gateway.chat_output import ChatOutputStream, Dialects, parse_chat_output
from gateway.tool_parsers.base import ParsedCall
from sluice.wire import dialects

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def spec_of(choice="auto", parallel=None):
    return tools.parse_tools([WEATHER, ADD], choice, parallel)


def whole(parser: str, text: str, spec=None, finish: str = "stop"):
    stream = ChatOutputStream(Dialects(tool_parsers.get(parser), None), spec or spec_of(), "")
    out = parse_chat_output(stream, text)
    return out.content, [(c["function"]["name"], c["function"]["arguments"]) for c in out.tool_calls], \
        stream.finish_reason(finish)


def streamed(parser: str, pieces: list[str], spec=None, finish: str = "stop"):
    """What a client assembles from the chunks of ``pieces`` (None content: nothing sent)."""
    stream = ChatOutputStream(Dialects(tool_parsers.get(parser), None), spec or spec_of(), "")
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        out = stream.feed(piece)
        if i == len(pieces) - 1:
            out += stream.finish()
        indices = [d["index"] for d in out.tool_calls]
        assert len(indices) == len(set(indices)), out.tool_calls  # one entry per index per chunk
        content += out.content
        deltas += out.tool_calls
    calls = tools.merge_tool_deltas(deltas)
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], \
        stream.finish_reason(finish)


def splits(text: str):
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text) or [""]


def check(parser: str, text: str, content, calls, spec=None, finish="stop"):
    """``text`` gives ``content`` and ``calls`` ((name, arguments) pairs), whole and streamed."""
    want_finish = "tool_calls" if calls and finish == "stop" else finish
    got = whole(parser, text, spec, finish)
    assert got == (content, calls, want_finish), got
    for pieces in splits(text):
        got_content, got_calls, got_finish = streamed(parser, pieces, spec, finish)
        assert (got_content or None if calls else got_content, got_calls, got_finish) == \
            (content, calls, want_finish), pieces


def args(**kw) -> str:
    return json.dumps(kw)


def test_the_registry_holds_the_names_the_engine_accepts():
    assert set(tool_parsers.PARSERS) == set(dialects.TOOL_CALL_PARSERS)
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(tool_parsers.PARSERS)
    assert all(tool_parsers.get(n).name == n for n in tool_parsers.PARSERS)
    with pytest.raises(KeyError, match="known: hermes, llama3_json, mistral, pythonic"):
        tool_parsers.get("xlam")


def test_hermes():
    rome, nice = args(city="Rome"), args(city="Nice")
    check("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
          '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Nice"}}</tool_call>',
          "Let me check.", [("get_weather", rome), ("get_weather", nice)])
    check("hermes", "no calls here, a < b\n", "no calls here, a < b\n", [])
    check("hermes", '<tool_call>{"name": "add", "arguments": {}}</tool_call>\nDone.', "Done.", [("add", "{}")])
    # an unclosed block at the end still counts when its JSON is whole (a stop string ate the tag)
    check("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}', None, [("add", args(a=1))])
    # what the parser cannot read is content, never an error
    check("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", [])
    check("hermes", 'x <tool_call>{"name": "add", "argu', 'x <tool_call>{"name": "add", "argu', [],
          finish="length")
    check("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', [])


def test_llama3_json():
    check("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
          [("get_weather", args(city="Rome"))])
    check("llama3_json", '<|python_tag|>{"name": "add", "parameters": {}}; {"name": "get_weather", '
          '"parameters": {"city": "Oslo"}}', None, [("add", "{}"), ("get_weather", args(city="Oslo"))])
    check("llama3_json", '\n {"name": "add", "arguments": {"a": 2}}\n', None, [("add", args(a=2))])
    check("llama3_json", 'Sure: {"name": "add", "parameters": {}}', 'Sure: {"name": "add", "parameters": {}}', [])
    check("llama3_json", '{"not": "a call"}', '{"not": "a call"}', [])
    check("llama3_json", '{"name": "add", "parameters": {"a"', '{"name": "add", "parameters": {"a"', [],
          finish="length")
    check("llama3_json", " \n", " \n", [])


def test_mistral():
    check("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', None,
          [("get_weather", args(city="Rome"))])
    check("mistral", 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {}}, {"name": "get_weather", '
          '"arguments": {"city": "Lima"}}]', "Sure.", [("add", "{}"), ("get_weather", args(city="Lima"))])
    # the v11 tokenizer's form, with and without [ARGS]
    check("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]add{"a": 1}', None,
          [("get_weather", args(city="Rome")), ("add", args(a=1))])
    # [TOOL_CALLS] is a special token, skipped by default: a list of calls opening the output
    check("mistral", '[{"name": "add", "arguments": {"q": [1]}}]', None, [("add", args(q=[1]))])
    check("mistral", "[1, 2, 3] are [numbers]", "[1, 2, 3] are [numbers]", [])
    check("mistral", '[TOOL_CALLS][{"name": "add", "argu', '[TOOL_CALLS][{"name": "add", "argu', [], finish="length")


def test_pythonic():
    check("pythonic", '[get_weather(city="Rome"), add(a=1, b=2.5, flags=[true, None], opts={"k": "v"})]', None,
          [("get_weather", args(city="Rome")), ("add", json.dumps({"a": 1, "b": 2.5, "flags": [True, None],
                                                                  "opts": {"k": "v"}}))])
    check("pythonic", "<|python_start|>[add()]<|python_end|>", None, [("add", "{}")])
    for text in ("[1, 2]", "Hello [add()]", "[add(1)]", '[__import__("os").system("x")]', "[add(a=b)]",
                 "[add(a=1", "[]"):
        check("pythonic", text, text, [])


@pytest.mark.parametrize("name", dialects.TOOL_CALL_PARSERS)
def test_a_dialect_reads_back_what_it_writes(name):
    """A history's calls are written in the dialect (for templates that do not read ``tools``),
    and the model is taught the same format: the parser reads them back."""
    parser = tool_parsers.get(name)
    calls = [ParsedCall("get_weather", args(city="Rome")), ParsedCall("add", args(a=1, b=[2, "x"]))]
    text = parser.format_calls(calls)
    check(name, text, None, [(c.name, json.dumps(json.loads(c.arguments))) for c in calls])
    assert "{tools}" in parser.instructions


def test_parallel_tool_calls_false_gives_at_most_one_call():
    one = spec_of("auto", False)
    check("hermes", '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", '
          '"arguments": {"city": "X"}}</tool_call>', None, [("add", "{}")], spec=one)
    check("pythonic", '[add(), get_weather(city="X")]', None, [("add", "{}")], spec=one)
    req = spec_of("required", False)
    check("hermes", '[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {"a": 1}}]', None,
          [("add", "{}")], spec=req)


def test_required_streams_each_call_when_its_object_closes():
    req = spec_of("required")
    text = '[{"name": "get_weather", "arguments": {"city": "a}b{\\"c"}}, {"name": "add", "arguments": {"a": [1]}}]'
    check("hermes", text, None, [("get_weather", args(city='a}b{"c')), ("add", args(a=[1]))], spec=req)
    stream = ChatOutputStream(Dialects(tool_parsers.get("hermes"), None), req, "")
    first = stream.feed(text[:text.index("}}") + 2])
    assert [c["function"]["name"] for c in first.tool_calls] == ["get_weather"]  # before the list ends
    # cut by max_tokens: a call whose name is whole is returned with the arguments so far
    check("hermes", '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"ci', None,
          [("add", args(a=1)), ("get_weather", '{"ci')], spec=req, finish="length")
    # cut before any name is whole: no call; the text is the content, streamed or not
    check("hermes", '[{"name": "get_wea', '[{"name": "get_wea', [], spec=req, finish="length")


def test_named_call_streams_its_arguments_in_one_entry_per_chunk():
    named = tools.parse_tools([WEATHER], NAMED, None)
    check("hermes", '{"city": "Oslo"}', None, [("get_weather", '{"city": "Oslo"}')], spec=named)
    stream = ChatOutputStream(Dialects(tool_parsers.get("hermes"), None), named, "")
    first = stream.feed('{"ci').tool_calls
    # one entry: id, type, name and the first arguments together (two with index 0 broke the SDK)
    assert len(first) == 1 and first[0]["id"].startswith("call_")
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert stream.feed('ty"').tool_calls == [{"index": 0, "function": {"arguments": 'ty"'}}]
    # a forced call cut by max_tokens is a tool call with the arguments so far, streamed or not
    check("hermes", '{"city": "Os', None, [("get_weather", '{"city": "Os')], spec=named, finish="length")
    check("hermes", "", None, [("get_weather", "")], spec=named, finish="length")


def test_tool_choice_none_leaves_the_text_alone():
    check("hermes", '<tool_call>{"name": "add", "arguments": {}}</tool_call>',
          '<tool_call>{"name": "add", "arguments": {}}</tool_call>', [], spec=spec_of("none"))


@pytest.mark.parametrize("name", dialects.TOOL_CALL_PARSERS)
def test_output_nested_too_deeply_is_content_not_an_error(name):
    deep = "[" * 5000 + "]" * 5000
    texts = {"hermes": f"<tool_call>{deep}</tool_call>", "llama3_json": '{"name": "add", "parameters": ' + deep + "}",
             "mistral": f"[TOOL_CALLS]{deep}", "pythonic": f"[add(a={deep})]"}
    out = parse_chat_output(ChatOutputStream(Dialects(tool_parsers.get(name), None), spec_of(), ""), texts[name])
    assert (out.content, out.tool_calls) == (texts[name], [])
    req = parse_chat_output(ChatOutputStream(Dialects(tool_parsers.get(name), None), spec_of("required"), ""),
                            '[{"name": "add", "arguments": ' + deep + "}]")
    assert req.tool_calls == [] and req.content.startswith('[{"name": "add"')
    # a client's history with such arguments renders (as the string it is)
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": deep}}]}]
    assert tools.render_messages(history, spec_of(), False, tool_parsers.get(name))[1]["content"]


# whole calls of each dialect, and pieces of markers and JSON around them
CALLS = ['<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', '{"name": "add", "parameters": {"a": 1}}',
         '[TOOL_CALLS][{"name": "add", "arguments": {}}]', '[TOOL_CALLS]add[ARGS]{"b": 2}', '[add(a=1), add()]',
         '<think>why</think>\n', '{"a": "}{"}']
FRAGMENTS = CALLS * 4 + ['<tool_call>', '</tool_call>', '{"name": "add", "arguments": {"a": 1}}', '[TOOL_CALLS]', "[ARGS]",
             '<|python_tag|>', '[add(a=1)]', '{"name": "get_weather", "parameters": {}}', "add", " ", "\n", "x",
             "[", "]", "{", "}", '"', ";", ",", "<", "<think>", "</think>", "<tool_", "call>", "(", ")", "=1"]


@pytest.mark.parametrize("name", dialects.TOOL_CALL_PARSERS)
@pytest.mark.parametrize("reasoner", [None, "deepseek_r1", "qwen3"])
def test_any_text_parses_and_streams_the_same_split_anywhere(name, reasoner):
    """Random texts of the dialects' pieces: never an exception, and the chunks of a stream split at
    random places assemble to the non-streamed answer, for every tool_choice."""
    import random

    from gateway import reasoning

    rng = random.Random(f"{name}-{reasoner}")
    named = tools.parse_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, None)
    specs = [spec_of(), spec_of("auto", False), spec_of("required"), named, None]
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 6)))
        for spec in specs:
            dialect = Dialects(tool_parsers.get(name), reasoning.get(reasoner))
            out = parse_chat_output(ChatOutputStream(dialect, spec, ""), text)
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream = ChatOutputStream(dialect, spec, "")
            got = stream.feed("")
            for piece in pieces:
                more = stream.feed(piece)
                assert len({d["index"] for d in more.tool_calls}) == len(more.tool_calls)
                got += more
            got += stream.finish()
            calls = [{k: v for k, v in c.items() if k not in ("index", "id")} for c in got.tool_calls]
            assert calls == [{k: v for k, v in c.items() if k != "id"} for c in out.tool_calls], (text, pieces)
            assert (got.reasoning if stream.thought else None) == out.reasoning_content, (text, pieces)
            assert (got.content or None if (calls or stream.thought) else got.content) == out.content, (text, pieces)
