"""``/v1/responses`` against real processes (Redis, one engine on the default model, two gateways
sharing the Redis: tests/e2e/conftest.py) through the clients that speak it: the openai SDK's
``responses`` (plain, streamed, ``parse`` with a pydantic ``text_format``, a function tool through
a two-turn loop with ``previous_response_id``, retrieve / input_items / delete) and the OpenAI
Agents SDK's default model (``OpenAIResponsesModel``) running an agent with one function tool.
Also: the usage of both APIs counts the prompt tokens the engine's prefix cache served.

The 135M model's own skill decides nothing: every structured answer is forced (a named
``tool_choice`` or a JSON schema of enums and booleans, so that it completes within the budget).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Literal

import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]

MAX_TOKENS = 64


class Capital(BaseModel):
    city: Literal["Paris", "London", "Rome"]
    is_capital: bool


WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Look up the weather in a city.", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
}


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_create_plain_and_streamed_agree(stack) -> None:
    c = client(stack.base_url)
    kwargs = {"model": stack.model_name, "input": "Name a colour.", "max_output_tokens": 12, "temperature": 0}
    plain = c.responses.create(**kwargs)
    assert plain.status in ("completed", "incomplete") and plain.output_text
    assert 0 < plain.usage.output_tokens <= 12 and plain.usage.input_tokens > 0
    with c.responses.stream(**kwargs) as stream:  # (get_final_response() wants a `completed` one)
        events = list(stream)
    streamed = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{plain.status}"
    assert streamed.status == plain.status and streamed.id != plain.id
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == streamed.output_text == plain.output_text  # greedy: the same text either way
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    # any gateway serves the stored response
    other = client(stack.gateway_urls[1])
    assert other.responses.retrieve(plain.id).output_text == plain.output_text
    items = other.responses.input_items.list(plain.id)
    assert [i.content[0].text for i in items.data] == ["Name a colour."]
    other.responses.delete(plain.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(plain.id)


def test_parse_with_a_pydantic_text_format(stack) -> None:
    resp = client(stack.base_url).responses.parse(
        model=stack.model_name, input="Which city is the capital of France? Answer as JSON.", text_format=Capital,
        max_output_tokens=MAX_TOKENS, temperature=0)
    assert resp.status == "completed", resp
    assert isinstance(resp.output_parsed, Capital), resp
    assert Capital.model_validate_json(resp.output_text) == resp.output_parsed
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "Capital"


def test_function_tool_two_turn_loop_with_previous_response_id(stack) -> None:
    c = client(stack.base_url)
    first = c.responses.create(model=stack.model_name, input="What is the weather like in Paris?",
                               tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"},
                               max_output_tokens=MAX_TOKENS, temperature=0)
    assert first.status == "completed", first
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    args = json.loads(call.arguments)
    assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "London", "Rome")
    # the second turn on the OTHER gateway: the conversation comes from Redis
    result = f"Sunny, 21 degrees {args['unit']}"
    second = client(stack.gateway_urls[1]).responses.create(
        model=stack.model_name, previous_response_id=first.id, tools=[WEATHER_TOOL], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        max_output_tokens=16, temperature=0)
    assert second.previous_response_id == first.id and second.output_text
    assert all(o.type == "message" for o in second.output)
    # the conversation rebuilt from the store is the one a client sending the whole history gets:
    # the same prompt (token count) and, greedy, the same answer
    history = [{"role": "user", "content": "What is the weather like in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    explicit = c.responses.create(model=stack.model_name, input=history, tools=[WEATHER_TOOL], tool_choice="none",
                                  max_output_tokens=16, temperature=0, store=False)
    assert second.usage.input_tokens == explicit.usage.input_tokens
    assert second.output_text == explicit.output_text
    items = c.responses.input_items.list(second.id)
    assert [(i.type, i.call_id, i.output) for i in items.data] == [("function_call_output", call.call_id, result)]


def test_streamed_forced_function_call(stack) -> None:
    with client(stack.base_url).responses.stream(
            model=stack.model_name, input="What is the weather like in Rome?", tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=MAX_TOKENS,
            temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [call] = final.output
    assert call.type == "function_call" and done.name == call.name == "get_weather"
    assert deltas == done.arguments == call.arguments
    assert set(json.loads(call.arguments)) == {"city", "unit"}


def test_openai_agents_default_responses_model_with_one_tool(stack) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no traces exported to OpenAI
    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "London", "Rome"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Look up the weather in a city."""
        calls.append((city, unit))
        return f"Sunny, 21 degrees {unit} in {city}"

    openai_client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    agent = Agent(
        name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
        model=OpenAIResponsesModel(model=stack.model_name, openai_client=openai_client),
        # the first turn must call the tool; the SDK then resets tool_choice, and the second turn answers
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=MAX_TOKENS, temperature=0),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather like in Paris?", max_turns=3))
    assert len(calls) == 1, calls
    city, unit = calls[0]
    tool_items = [i for i in result.new_items if i.type == "tool_call_item"]
    assert len(tool_items) == 1 and tool_items[0].raw_item.name == "get_weather"
    assert json.loads(tool_items[0].raw_item.arguments) == {"city": city, "unit": unit}
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert [o.output for o in outputs] == [f"Sunny, 21 degrees {unit} in {city}"]
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2
    # every model call went through /v1/responses and was stored
    for raw in result.raw_responses:
        assert client(stack.gateway_urls[1]).responses.retrieve(raw.response_id).id == raw.response_id


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(stack) -> None:
    """The engine's prefix-cache hits reach the client: ``prompt_tokens_details.cached_tokens`` in
    chat usage and ``input_tokens_details.cached_tokens`` in a response's, from the request's first
    event, so that a completion the gateway ends on a stop string reports them too."""
    c = client(stack.base_url)
    system = f"You are a terse assistant for ticket {uuid.uuid4().hex}. " + "Answer in one short sentence. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
    kwargs = {"model": stack.model_name, "messages": messages, "max_tokens": 4, "temperature": 0}
    first = c.chat.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a prompt never seen
    again = c.chat.completions.create(**kwargs)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens == first.usage.prompt_tokens
    # ended by the gateway on a stop string while the engine still decodes: the count came first
    chunks = list(c.chat.completions.create(**{**kwargs, "max_tokens": 48}, stop=["e", "a", "o", " "], stream=True,
                                            stream_options={"include_usage": True}))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    # the Responses API, through a second gateway: the same prefix, the same engine's cache
    other = client(stack.gateway_urls[1])
    kwargs = {"model": stack.model_name, "instructions": system, "input": "Say hello.", "max_output_tokens": 4,
              "temperature": 0}
    response = other.responses.create(**kwargs)
    assert 16 <= response.usage.input_tokens_details.cached_tokens < response.usage.input_tokens
