"""A forced tool call through the official openai SDK, streamed (its ``chat.completions.stream()``
helper and the raw chunks) and not, against real processes: Redis, one engine on the default
model, gateways. Streamed and not must give the same call, also when ``max_tokens`` cuts it."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]


class Add(BaseModel):
    a: int
    b: int


TOOL = openai.pydantic_function_tool(Add, name="add")  # strict: the SDK parses the arguments
NAMED = {"type": "function", "function": {"name": "add"}}
MESSAGES = [{"role": "user", "content": "Add 2 and 3."}]


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _assembled(chunks) -> tuple[str, list[tuple[int, str | None, str]], str | None]:
    """(content, [(index, name, arguments)], finish_reason) a client builds from raw chunks, checking
    that no chunk holds two ``tool_calls`` entries with the same index."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            entries = choice.delta.tool_calls or []
            assert len({e.index for e in entries}) == len(entries), entries  # one entry per index
            content += choice.delta.content or ""
            for e in entries:
                name, args = calls.get(e.index, (None, ""))
                calls[e.index] = (name or (e.function.name if e.function else None),
                                  args + ((e.function.arguments or "") if e.function else ""))
            finish = choice.finish_reason or finish
    return content, [(i, *calls[i]) for i in sorted(calls)], finish


def test_the_stream_helper_gives_the_named_call_the_plain_response_gives(stack):
    c = client(stack.base_url)
    kwargs = {"model": stack.model_name, "messages": MESSAGES, "tools": [TOOL], "tool_choice": NAMED,
              "temperature": 0, "max_tokens": 40}
    plain = c.chat.completions.create(**kwargs).choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.content is None
    (want,) = plain.message.tool_calls
    Add.model_validate_json(want.function.arguments)

    with c.chat.completions.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    (got,) = final.choices[0].message.tool_calls
    assert (got.id.startswith("call_"), got.function.name, got.function.arguments) == \
        (True, "add", want.function.arguments)
    assert got.function.parsed_arguments == Add.model_validate_json(want.function.arguments)
    # each arguments delta the helper reports is new text, and together they are the arguments
    deltas = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert all(deltas) and "".join(deltas) == want.function.arguments, deltas
    (done,) = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done.arguments == want.function.arguments

    content, calls, finish = _assembled(c.chat.completions.create(stream=True, **kwargs))
    assert (content, calls, finish) == ("", [(0, "add", want.function.arguments)], "tool_calls")


def test_a_forced_call_too_long_for_max_tokens_is_refused_and_a_tight_one_closes(stack):
    """A forced call knows its token budget: below the call's shortest completion,
    max_tokens is a 400 naming it before anything is queued, streamed or not; at exactly that
    budget the call is steered to close, its arguments parse, and streamed and plain agree (no
    call is ever cut short, so none differs between the two)."""
    c = client(stack.gateway_urls[-1])
    kwargs = {"model": stack.model_name, "messages": MESSAGES, "tools": [TOOL], "tool_choice": NAMED,
              "temperature": 0}
    shortest = None
    for budget in range(1, 64):
        try:
            plain = c.chat.completions.create(max_tokens=budget, **kwargs).choices[0]
        except openai.BadRequestError as exc:
            assert exc.param == "max_tokens", exc
            with pytest.raises(openai.BadRequestError) as streamed:  # the same refusal when streamed
                list(c.chat.completions.create(max_tokens=budget, stream=True, **kwargs))
            assert streamed.value.param == "max_tokens"
            continue
        shortest = budget
        break
    assert shortest is not None and shortest > 3, shortest  # {"a":..,"b":..} takes more than 3 tokens
    assert plain.finish_reason == "tool_calls" and plain.message.content is None
    (call,) = plain.message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    content, calls, finish = _assembled(c.chat.completions.create(stream=True, max_tokens=shortest, **kwargs))
    assert (content, calls, finish) == ("", [(0, "add", call.function.arguments)], "tool_calls")
