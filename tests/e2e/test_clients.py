"""The clients users run, against real processes (Redis, one engine on the default model, two
gateways; tests/e2e/conftest.py): the openai SDK's helpers (``.parse()``, ``.stream()`` with a
named tool), instructor (TOOLS and JSON_SCHEMA modes), pydantic-ai with a native structured
output, the OpenAI Agents SDK's chat-completions model with one tool, langchain-openai
(``with_structured_output``, ``bind_tools``) and litellm.

Each test asserts what the client hands back (a parsed object, a tool call with its arguments),
not only that it did not raise. The 135M model's own skill decides nothing: every structured
answer is forced, by a named ``tool_choice`` or a JSON schema, whose values are enums and booleans
so that the constrained output always completes within ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]

QUESTION = [{"role": "user", "content": "Which city is the capital of France? Answer as JSON."}]
WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]
MAX_TOKENS = 64


class Capital(BaseModel):
    city: Literal["Paris", "London", "Rome"]
    is_capital: bool


class GetWeather(BaseModel):
    """Look up the weather in a city."""

    city: Literal["Paris", "London", "Rome"]
    unit: Literal["celsius", "fahrenheit"]


def openai_client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def async_openai_client(stack) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def assert_capital(value) -> None:
    assert isinstance(value, Capital), value
    assert value.city in ("Paris", "London", "Rome") and isinstance(value.is_capital, bool)


# --- the openai SDK's helpers -------------------------------------------------------------------
def test_openai_parse_returns_the_model(stack) -> None:
    resp = openai_client(stack).chat.completions.parse(
        model=stack.model_name, messages=QUESTION, response_format=Capital, max_tokens=MAX_TOKENS, temperature=0)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop", resp
    assert_capital(message.parsed)
    assert Capital.model_validate_json(message.content) == message.parsed
    assert message.refusal is None


def test_openai_stream_helper_with_a_named_tool(stack) -> None:
    """``chat.completions.stream()`` accumulates the streamed tool call into a parsed one: it needs
    exactly one ``tool_calls`` entry per index per chunk."""
    import openai

    tool = openai.pydantic_function_tool(GetWeather)
    with openai_client(stack).chat.completions.stream(
        model=stack.model_name, messages=WEATHER, tools=[tool], max_tokens=MAX_TOKENS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1 and done[0].name == "GetWeather", [e.type for e in events]
    calls = final.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1, final
    call = calls[0]
    assert call.function.name == "GetWeather" and call.id
    assert isinstance(call.function.parsed_arguments, GetWeather), call
    assert json.loads(call.function.arguments) == call.function.parsed_arguments.model_dump()
    assert done[0].parsed_arguments == call.function.parsed_arguments


# --- instructor -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(stack, mode) -> None:
    """TOOLS sends the model as a named tool with a forced tool_choice; JSON_SCHEMA as a
    response_format json_schema. Either way the gateway constrains decoding to the schema."""
    import instructor

    client = instructor.from_openai(openai_client(stack), mode=getattr(instructor.Mode, mode))
    capital, completion = client.chat.completions.create_with_completion(
        model=stack.model_name, messages=QUESTION, response_model=Capital, max_tokens=MAX_TOKENS, temperature=0,
        max_retries=0)
    assert_capital(capital)
    message = completion.choices[0].message
    if mode == "TOOLS":
        assert completion.choices[0].finish_reason == "tool_calls", completion
        assert [c.function.name for c in message.tool_calls] == ["Capital"]
        sent = message.tool_calls[0].function.arguments
    else:
        sent = message.content
    # instructor hands back its own subclass of the model: compare the values
    assert Capital.model_validate_json(sent).model_dump() == capital.model_dump()


# --- pydantic-ai ------------------------------------------------------------------------------
def test_pydantic_ai_native_output(stack) -> None:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.profiles.openai import OpenAIModelProfile
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        stack.model_name, provider=OpenAIProvider(openai_client=async_openai_client(stack)),
        # a model name OpenAI does not know: say what the server supports (json_schema outputs)
        profile=OpenAIModelProfile(supports_json_schema_output=True, supports_json_object_output=True))
    agent = Agent(model, output_type=NativeOutput(Capital))
    result = agent.run_sync(QUESTION[0]["content"], model_settings={"max_tokens": MAX_TOKENS, "temperature": 0})
    assert_capital(result.output)
    # what went over the wire: a response_format json_schema answered with its JSON
    response = result.all_messages()[-1]
    assert Capital.model_validate_json(response.parts[0].content) == result.output


# --- the OpenAI Agents SDK --------------------------------------------------------------------
def test_openai_agents_chat_completions_model_with_one_tool(stack) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no traces exported to OpenAI
    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "London", "Rome"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Look up the weather in a city."""
        calls.append((city, unit))
        return f"Sunny, 21 degrees {unit} in {city}"

    agent = Agent(
        name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=stack.model_name, openai_client=async_openai_client(stack)),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=MAX_TOKENS, temperature=0),
        tool_use_behavior="stop_on_first_tool",  # the tool's answer is the run's answer
    )
    result = asyncio.run(Runner.run(agent, WEATHER[0]["content"], max_turns=2))
    assert len(calls) == 1, calls
    city, unit = calls[0]
    assert result.final_output == f"Sunny, 21 degrees {unit} in {city}"
    tool_items = [i for i in result.new_items if i.type == "tool_call_item"]
    assert len(tool_items) == 1 and tool_items[0].raw_item.name == "get_weather"
    assert json.loads(tool_items[0].raw_item.arguments) == {"city": city, "unit": unit}


# --- langchain-openai -------------------------------------------------------------------------
def chat_model(stack):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", model=stack.model_name,
                      max_tokens=MAX_TOKENS, temperature=0, max_retries=0, timeout=300)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(stack, method) -> None:
    structured = chat_model(stack).with_structured_output(Capital, method=method, include_raw=True)
    out = structured.invoke(QUESTION[0]["content"])
    assert out["parsing_error"] is None, out
    assert_capital(out["parsed"])
    raw = out["raw"]
    if method == "function_calling":  # a forced call of the schema as a tool
        assert [c["name"] for c in raw.tool_calls] == ["Capital"]
        assert Capital(**raw.tool_calls[0]["args"]) == out["parsed"]
    else:
        assert Capital.model_validate_json(raw.content) == out["parsed"]


def test_langchain_bind_tools(stack) -> None:
    # strict: the schema closes the object (additionalProperties false), so the constrained call
    # cannot grow extra keys until max_tokens cuts it
    model = chat_model(stack).bind_tools([GetWeather], tool_choice="GetWeather", strict=True)
    message = model.invoke(WEATHER[0]["content"])
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"]
    assert GetWeather(**call["args"]).model_dump() == call["args"]
    assert message.response_metadata["finish_reason"] == "tool_calls"


# --- litellm ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list
    import litellm

    litellm.telemetry = False
    return litellm


def test_litellm_completion_and_forced_tool(stack, litellm) -> None:
    kwargs = {"model": f"openai/{stack.model_name}", "api_base": f"{stack.base_url}/v1", "api_key": "unused",
              "temperature": 0, "num_retries": 0}
    # plain text: the same greedy answer the openai SDK gets
    resp = litellm.completion(messages=QUESTION, max_tokens=12, **kwargs)
    want = openai_client(stack).chat.completions.create(model=stack.model_name, messages=QUESTION, max_tokens=12,
                                                        temperature=0)
    assert resp.choices[0].message.content == want.choices[0].message.content
    assert resp.choices[0].message.content
    assert resp.usage.completion_tokens == want.usage.completion_tokens
    # a forced tool call
    # a closed object (additionalProperties false): the forced call cannot grow extra keys
    parameters = {**GetWeather.model_json_schema(), "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "GetWeather", "description": "Look up the weather in a city.",
                                             "parameters": parameters}}
    resp = litellm.completion(messages=WEATHER, tools=[tool], max_tokens=MAX_TOKENS,
                              tool_choice={"type": "function", "function": {"name": "GetWeather"}}, **kwargs)
    calls = resp.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "GetWeather"
    GetWeather.model_validate_json(calls[0].function.arguments)
    assert resp.choices[0].finish_reason == "tool_calls"
