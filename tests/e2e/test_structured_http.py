"""Structured outputs and tools over HTTP, against one real `sluice serve` (default model) per module.

Requests of a test are sent concurrently so the engine batches them: 50 JSON-schema prompts
streaming and 50 not, 50 json_object, 50 forced tool calls (25 "required", 25 named), the
errors a client gets before anything is queued, and LangChain's ``bind_tools`` and
``with_structured_output`` with the real client library.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI

from sluice_bench.structured import unbounded_cases, validates
from tests.docker_support import free_port
from tests.structured_cases import MAX_TOKENS, cases
from tests.waiting import wait_http

pytestmark = [pytest.mark.model, pytest.mark.redis]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
# A ceiling, not what the objects need: the longest of the 50 (a URL that repeats a fragment of
# digits until the 256-character string bound closes it) is about 280 tokens; most are under 100.
JSON_OBJECT_MAX_TOKENS = 384


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port, grpc_port = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice_cli.cli", "serve", "--model", str(model_dir), "--port", str(port),
         "--grpc-port", str(grpc_port), "--max-model-len", "1024"],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/health", timeout=300, procs=[proc], log=log_path)
        yield base, model_dir.name
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _aclient(base: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)


async def _stream_text(client: AsyncOpenAI, **kwargs) -> tuple[str, str, list]:
    text, finish, tool_deltas = "", None, []
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            tool_deltas.extend(choice.delta.tool_calls or [])
            finish = choice.finish_reason or finish
    return text, finish, tool_deltas


def test_fifty_json_schemas_streaming_and_not(server):
    base, model = server
    pairs = cases(50)

    def fmt(i, schema):
        return {"type": "json_schema", "json_schema": {"name": f"case{i}", "schema": schema, "strict": True}}

    async def main():
        client = _aclient(base)
        plain = [client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=MAX_TOKENS,
            response_format=fmt(i, s)) for i, (p, s) in enumerate(pairs)]
        streamed = [_stream_text(client, model=model, messages=[{"role": "user", "content": p}], temperature=0,
                                 max_tokens=MAX_TOKENS, response_format=fmt(i, s)) for i, (p, s) in enumerate(pairs)]
        return await asyncio.gather(*plain), await asyncio.gather(*streamed)

    plain, streamed = asyncio.run(main())
    ok_plain = ok_stream = 0
    for resp, (text, finish, _), (_, schema) in zip(plain, streamed, pairs, strict=True):
        jsonschema.validate(json.loads(resp.choices[0].message.content), schema)
        assert resp.choices[0].finish_reason == "stop"
        ok_plain += 1
        jsonschema.validate(json.loads(text), schema)
        assert finish == "stop"
        ok_stream += 1
    assert (ok_plain, ok_stream) == (50, 50)


def test_fifty_json_objects(server):
    base, model = server
    subjects = [p for p, _ in cases(50)]

    async def main():
        client = _aclient(base)
        return await asyncio.gather(*[client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p + " Use at most three short keys."}],
            temperature=0, max_tokens=JSON_OBJECT_MAX_TOKENS, response_format={"type": "json_object"})
            for p in subjects])

    objects = asyncio.run(main())
    # JSON mode's grammar is bounded (sluice.structured.JsonObjectLimits): it closes the loops the
    # greedy default model falls into on some of these prompts (an array repeating one item, the
    # same member again and again, a string repeating a fragment), so every object ends by itself.
    assert [r.choices[0].finish_reason for r in objects] == ["stop"] * 50
    assert sum(isinstance(json.loads(r.choices[0].message.content), dict) for r in objects) == 50
    assert max(r.usage.completion_tokens for r in objects) < JSON_OBJECT_MAX_TOKENS


def test_fifty_forced_tool_calls_required_and_named(server):
    base, model = server

    async def main():
        client = _aclient(base)
        calls = []
        for i in range(50):
            city = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo"][i % 5]
            if i % 2:
                calls.append(client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
                    tools=[WEATHER, ADD], tool_choice="required", temperature=0, max_tokens=MAX_TOKENS,
                    parallel_tool_calls=False))
            else:
                calls.append(client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Add {i} and {3 * i + 1}."}],
                    tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                    temperature=0, max_tokens=MAX_TOKENS))
        return await asyncio.gather(*calls)

    valid = 0
    for i, resp in enumerate(asyncio.run(main())):
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        if i % 2 == 0:
            assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
        valid += 1
    assert valid == 50


def test_streamed_tool_calls_and_tool_history(server):
    base, model = server
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)

    async def streams():
        c = _aclient(base)
        named = _stream_text(c, model=model, messages=[{"role": "user", "content": "Add 2 and 3."}],
                             tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                             temperature=0, max_tokens=40)
        required = _stream_text(c, model=model, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
        return await asyncio.gather(named, required)

    for text, finish, deltas in asyncio.run(streams()):
        assert finish == "tool_calls" and text == ""
        first = deltas[0]
        assert first.index == 0 and first.id.startswith("call_") and first.function.name in TOOL_SCHEMAS
        arguments = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[first.function.name])

    # a history with an assistant tool call and the tool's result is accepted and rendered
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    resp = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="auto",
                                          temperature=0, max_tokens=12)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_completions_structured_outputs_and_errors_before_queueing(server):
    base, model = server
    http = httpx.Client(base_url=base, timeout=600)
    reqs = {
        "regex": ({"regex": r"[A-Z][a-z]{2,8}"}, lambda t: t[0].isupper() and t[1:].isalpha()),
        "choice": ({"choice": ["red", "green", "blue"]}, lambda t: t in {"red", "green", "blue"}),
        "grammar": ({"grammar": 'start: "The answer is " NUM\nNUM: /[0-9]{1,3}/'},
                    lambda t: t.startswith("The answer is ") and t[14:].isdigit()),
        "json": ({"json": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
                 lambda t: isinstance(json.loads(t)["x"], int)),
    }
    for name, (so, check) in reqs.items():
        r = http.post("/v1/completions", json={"model": model, "prompt": "Q: Tell me something.\nA:",
                                               "max_tokens": 24, "temperature": 0, "structured_outputs": so})
        assert r.status_code == 200, r.text
        assert check(r.json()["choices"][0]["text"]), (name, r.json())
    r = http.post("/v1/completions", json={
        "model": model, "max_tokens": 48, "temperature": 0, "response_format": {"type": "json_object"},
        "prompt": "<|im_start|>user\nReply with a JSON object with keys name and city.<|im_end|>\n"
                  "<|im_start|>assistant\n"})
    assert isinstance(json.loads(r.json()["choices"][0]["text"]), dict), r.json()
    r = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 8, "messages": [
        {"role": "user", "content": "Pick"}], "structured_outputs": {"choice": ["up", "down"]}})
    assert r.json()["choices"][0]["message"]["content"] in ("up", "down")

    def error(path, body):
        r = http.post(path, json={"model": model, "max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    e = error("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}})
    assert e["param"] == "response_format.json_schema.schema" and "nope" in e["message"]
    e = error("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[a-"}})
    assert e["param"] == "structured_outputs.regex"
    e = error("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "start: ( "}})
    assert e["param"] == "structured_outputs.grammar"
    e = error("/v1/chat/completions", {**chat, "response_format": {"type": "xml"}})
    assert e["param"] == "response_format.type" and "xml" in e["message"]
    e = error("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert "only text content parts are supported" in e["message"]
    e = error("/v1/chat/completions", {**chat, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "missing"}}})
    assert e["param"] == "tool_choice"
    e = error("/v1/chat/completions", {**chat, "tools": [{"type": "retrieval"}]})
    assert e["param"] == "tools[0]"


def _clean(message: str) -> bool:
    """A message for a client: one line, none of the grammar engine's internal state."""
    return "\n" not in message and "<state>" not in message and "Parser: {" not in message and len(message) < 400


def test_constraints_the_engine_would_fail_on_are_400_before_queueing(server):
    """Constraints that compile but that the grammar engine fails on once decoding starts are a 400
    before queueing, never a 500 at the first sampled token: the gateway compiles them as the engine does
    (the model's vocabulary, the same resource limits, a walk to the shortest completion)."""
    base, model = server
    http = httpx.Client(base_url=base, timeout=600)
    recursive = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
                 "$ref": "#/$defs/a"}
    bad = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": recursive}}},
         "response_format.json_schema.schema"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": recursive}}, "structured_outputs.json"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {
            "grammar": "start: " + " | ".join(f'"w{i}"' for i in range(30000))}}, "structured_outputs.grammar"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(a{1000}){1000}"}},
         "structured_outputs.regex"),
        # a constraint whose shortest document does not fit in max_tokens
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "c", "schema": {
                "type": "object", "properties": {"k": {"const": "x" * 60}}, "required": ["k"]}}}}, "max_tokens"),
    ]
    for path, body, param in bad:
        r = http.post(path, json={"model": model, "max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["param"] == param and e["type"] == "invalid_request_error", e
        assert _clean(e["message"]), e["message"]
    # nothing reached the engine: it is still serving
    r = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_a_constraint_failure_mid_decode_is_a_400_for_that_request_alone(server):
    """A constraint whose shortest completion passes the door ("a") but whose other branch hits the
    grammar engine's row limit once decoding takes it (logit_bias steers the model there): that
    request alone ends, as a 400 with a one-line message; a request batched with it completes."""
    base, model = server
    tok_ids = {}
    http = httpx.Client(base_url=base, timeout=600)
    for ch in "bcw":
        r = http.post("/tokenize", json={"model": model, "prompt": ch, "add_special_tokens": False})
        (tok_ids[ch],) = r.json()["tokens"]
    grammar = 'start: "a" | "b" "c" x\nx: ' + " | ".join(f'"w{i}"' for i in range(3000))

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            late = client.post("/v1/completions", json={
                "model": model, "prompt": "Say something:", "max_tokens": 64, "temperature": 0,
                "structured_outputs": {"grammar": grammar}, "logit_bias": {str(t): 100 for t in tok_ids.values()}})
            fine = client.post("/v1/completions", json={
                "model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
                "ignore_eos": True})
            return await asyncio.gather(late, fine)

    late, fine = asyncio.run(main())
    assert late.status_code == 400, late.text
    e = late.json()["error"]
    assert e["code"] == "invalid_request" and "output constraint failed" in e["message"], e
    assert _clean(e["message"]), e["message"]
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 16


def test_langchain_bind_tools_and_with_structured_output(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    base, model = server
    llm = ChatOpenAI(model=model, base_url=f"{base}/v1", api_key="x", temperature=0, max_tokens=64,
                     max_retries=0, timeout=600)

    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city; unit is celsius or fahrenheit."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"} and call["id"]
    msg = llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Oslo, please.")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    person = llm.with_structured_output(Person).invoke("Invent a person.")
    assert isinstance(person, Person)


NOTES = {"type": "function", "function": {
    "name": "take_notes", "description": "Write down notes on a topic",
    "parameters": {"type": "object", "properties": {
        "topic": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}},
        "required": ["topic", "notes"]}}}


def test_the_token_budget_closes_schemas_and_forced_calls_streamed_and_not(server):
    """Unbounded schemas at temperature 0.7 with a max_tokens too small for what the model
    writes: every document still parses and validates, with finish_reason "stop" (forced tool
    calls: "tool_calls" with valid arguments), streamed and not; JSON mode and a regex too."""
    base, model = server
    pairs = unbounded_cases(10)

    def fmt(i, schema):
        return {"type": "json_schema", "json_schema": {"name": f"u{i}", "schema": schema}}

    async def main():
        client = _aclient(base)
        common = {"model": model, "temperature": 0.7, "max_tokens": 32}
        plain = [client.chat.completions.create(messages=[{"role": "user", "content": p}], seed=i,
                                                response_format=fmt(i, s), **common) for i, (p, s) in enumerate(pairs)]
        streamed = [_stream_text(client, messages=[{"role": "user", "content": p}], seed=i, response_format=fmt(i, s),
                                 **common) for i, (p, s) in enumerate(pairs)]
        tool_msgs = [{"role": "user", "content": "Take detailed notes on the history of Rome."}]
        named = {"type": "function", "function": {"name": "take_notes"}}
        tools_plain = [client.chat.completions.create(messages=tool_msgs, tools=[NOTES], tool_choice=choice, seed=i,
                                                      **common) for i, choice in enumerate([named, "required"])]
        tools_streamed = [_stream_text(client, messages=tool_msgs, tools=[NOTES], tool_choice=choice, seed=i,
                                       **common) for i, choice in enumerate([named, "required"])]
        json_mode = client.chat.completions.create(
            messages=[{"role": "user", "content": "Describe a city as JSON with many keys."}],
            response_format={"type": "json_object"}, **{**common, "max_tokens": 12})
        return await asyncio.gather(asyncio.gather(*plain), asyncio.gather(*streamed), asyncio.gather(*tools_plain),
                                    asyncio.gather(*tools_streamed), json_mode)

    plain, streamed, tools_plain, tools_streamed, json_mode = asyncio.run(main())
    for resp, (text, finish, _), (_, schema) in zip(plain, streamed, pairs, strict=True):
        choice = resp.choices[0]
        assert choice.finish_reason == "stop" and validates(choice.message.content, schema), choice
        assert resp.usage.completion_tokens <= 32
        assert finish == "stop" and validates(text, schema), text
    params = NOTES["function"]["parameters"]
    for resp in tools_plain:
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), params)
    for text, finish, deltas in tools_streamed:
        assert finish == "tool_calls" and text == ""
        arguments = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
        jsonschema.validate(json.loads(arguments), params)
    assert json_mode.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(json_mode.choices[0].message.content), dict)
    r = httpx.post(f"{base}/v1/completions", timeout=600, json={
        "model": model, "prompt": "Write a long sentence:", "max_tokens": 6, "temperature": 0.7, "seed": 1,
        "structured_outputs": {"regex": r"[a-z]+( [a-z]+)*\."}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"].endswith("."), choice
