"""``/v1/responses`` on the real gateway app with a real Redis and the contract-following fake
engine (``test_gateway_support``: it spells ``REPLY`` token by token): the openai SDK's
``responses`` client against two gateways sharing one Redis (any gateway serves any call), the
stored conversation a ``previous_response_id`` continues (function calls and their outputs
included, read back from the prompt the engine received), and every refusal in OpenAI's error
shape. The real model's runs are in tests/e2e/test_responses.py.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from sluice.wire import contract
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import assert_error
from tests.integration.test_gateway_support import MODEL, REPLY

fake_engine = support.fake_engine
make_gateway = support.make_gateway
gateway = support.gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]


def client(gw) -> OpenAI:
    return OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def post(gw, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, timeout=30)


def prompt_of(engine, i: int = -1) -> str:
    return engine.tokenizer.decode(engine.requests[i].prompt_token_ids)


def test_create_retrieve_list_delete_across_gateways(make_gateway, fake_engine, redis_client):
    gw1, gw2 = make_gateway(), make_gateway()
    resp = client(gw1).responses.create(model=MODEL, input="Say hello", instructions="Be brief.",
                                        metadata={"k": "v"}, temperature=0)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "completed" and resp.error is None and resp.incomplete_details is None
    assert resp.output_text == REPLY
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert [c.type for c in message.content] == ["output_text"]
    assert resp.usage.output_tokens == len(fake_engine.reply_ids)
    assert resp.usage.input_tokens == len(fake_engine.requests[0].prompt_token_ids)
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.instructions == "Be brief." and resp.metadata == {"k": "v"} and resp.temperature == 0
    prompt = prompt_of(fake_engine)
    assert "Be brief." in prompt and "Say hello" in prompt
    # stored in Redis under the contract's key, with a TTL; served by the other gateway
    key = contract.response_key(resp.id)
    assert 0 < redis_client.ttl(key) <= 24 * 3600
    again = client(gw2).responses.retrieve(resp.id)
    assert again.model_dump() == resp.model_dump()
    # a stored response ran logged: its events stream again from any gateway, after any number
    with httpx.stream("GET", f"{gw2.url}/v1/responses/{resp.id}", params={"stream": "true"}, timeout=30) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == again.model_dump(
        mode="json", exclude_none=True)["output"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == REPLY
    assert fake_engine.requests[0].log_events and fake_engine.requests[0].detached
    assert_error(httpx.get(f"{gw2.url}/v1/responses/{resp.id}", params={"starting_after": 3}), 400,
                 param="starting_after")
    items = client(gw2).responses.input_items.list(resp.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say hello")]
    assert items.data[0].id.startswith("msg_") and items.has_more is False
    raw = httpx.get(f"{gw2.url}/v1/responses/{resp.id}/input_items").json()
    assert raw["object"] == "list" and raw["first_id"] == raw["last_id"] == items.data[0].id
    # delete on one gateway: gone on both
    r = httpx.delete(f"{gw1.url}/v1/responses/{resp.id}")
    assert r.status_code == 200 and r.json() == {"id": resp.id, "object": "response", "deleted": True}
    assert not redis_client.exists(key)
    for gw in (gw1, gw2):
        with pytest.raises(openai.NotFoundError):
            client(gw).responses.retrieve(resp.id)
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")):
        err = assert_error(httpx.request(method, f"{gw2.url}/v1/responses/{resp.id}{path}"), 404, code="not_found")
        assert resp.id in err["message"]


def test_stream_events_and_the_stored_response_agree(gateway, fake_engine):
    with client(gateway).responses.stream(model=MODEL, input="Say hello", max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    assert final.output_text == REPLY and final.status == "completed"
    assert final.usage.output_tokens == len(fake_engine.reply_ids)
    stored = client(gateway).responses.retrieve(final.id)
    assert (stored.id, stored.status, stored.output_text, stored.usage) == (final.id, "completed", REPLY, final.usage)
    assert [o.id for o in stored.output] == [o.id for o in final.output]


def test_stream_raw_sse_carries_event_names(gateway, fake_engine):
    with httpx.stream("POST", f"{gateway.url}/v1/responses",
                      json={"model": MODEL, "input": "hi", "stream": True, "store": False}, timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    events, names = [], []
    for line in lines:
        field, _, value = line.partition(": ")
        assert field in ("event", "data"), line  # no `id:`: see gateway.responses.service._sse
        if field == "event":
            names.append(value)
        else:
            events.append(json.loads(value))
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["store"] is False
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert events[-1]["response"]["output"] == done
    # store: false keeps nothing
    assert_error(httpx.get(f"{gateway.url}/v1/responses/{events[0]['response']['id']}"), 404)


def test_max_output_tokens_makes_an_incomplete_response(gateway, fake_engine):
    resp = client(gateway).responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.usage.output_tokens == 3
    with client(gateway).responses.stream(model=MODEL, input="hi", max_output_tokens=3) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_forced_function_call_then_previous_response_id_continues_with_calls(gateway, fake_engine):
    c = client(gateway)
    first = c.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL],
                               tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert call.arguments == REPLY  # the fake engine ignores the constraint: its text is the arguments
    assert first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"
    second = c.responses.create(model=MODEL, previous_response_id=first.id,
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": "SUNNY-21C"}])
    assert second.previous_response_id == first.id and second.output_text == REPLY
    prompt = prompt_of(fake_engine)
    # the rebuilt conversation: the first input, the call with its arguments, its output
    assert "Weather in Paris?" in prompt and "get_weather" in prompt and "SUNNY-21C" in prompt
    assert prompt.index("Weather in Paris?") < prompt.index("SUNNY-21C")
    # a third turn sees the second's answer too (the chain is stored whole)
    c.responses.create(model=MODEL, previous_response_id=second.id, input="And tomorrow?")
    prompt = prompt_of(fake_engine)
    result_at = prompt.index("SUNNY-21C")
    # the second turn's answer sits between the tool result and the new question
    assert prompt.index("Weather in Paris?") < result_at < prompt.index(REPLY, result_at) < prompt.index("And tomorrow?")


def test_streamed_function_call_events(gateway, fake_engine):
    with client(gateway).responses.stream(model=MODEL, input="Weather?", tools=[WEATHER_TOOL],
                                          tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    # the fake engine's text is no JSON call list: the forced `required` output has no call and is content
    assert final.output_text == REPLY or any(o.type == "function_call" for o in final.output)


def test_history_items_in_the_input(gateway, fake_engine):
    """The Agents SDK's way: no previous_response_id, the whole history as items."""
    body = {"model": MODEL, "tools": [WEATHER_TOOL], "input": [
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}',
         "id": "fc_1", "status": "completed"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "RAINY"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It rains.",
                                                               "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
    ]}
    r = post(gateway, body)
    assert r.status_code == 200, r.text
    prompt = prompt_of(fake_engine)
    order = [prompt.index(s) for s in ("Weather in Rome?", "Rome\"", "RAINY", "It rains.", "Thanks")]
    assert order == sorted(order), prompt
    items = httpx.get(f"{gateway.url}/v1/responses/{r.json()['id']}/input_items", params={"order": "asc"}).json()
    assert [i["type"] for i in items["data"]] == ["message", "function_call", "reasoning", "function_call_output",
                                                  "message", "message"]
    assert items["data"][1]["id"] == "fc_1"
    page = httpx.get(f"{gateway.url}/v1/responses/{r.json()['id']}/input_items",
                     params={"order": "asc", "limit": 2, "after": "fc_1"}).json()
    assert [i["type"] for i in page["data"]] == ["reasoning", "function_call_output"] and page["has_more"] is True
    url = f"{gateway.url}/v1/responses/{r.json()['id']}/input_items"
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "nope"}, "after"), ({"limit": "x"}, "limit")):
        assert_error(httpx.get(url, params=params), 400, param=param)


def test_structured_text_format_goes_through_the_constraint_path(gateway, fake_engine):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
              "required": ["city"], "additionalProperties": False}
    r = post(gateway, {"model": MODEL, "input": "Capital?", "max_output_tokens": 40,
                       "text": {"format": {"type": "json_schema", "name": "Capital", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert fake_engine.requests[-1].params.HasField("structured_outputs")
    assert r.json()["text"]["format"]["name"] == "Capital"
    r = post(gateway, {"model": MODEL, "input": "JSON?", "text": {"format": {"type": "json_object"}}})
    assert r.status_code == 200 and fake_engine.requests[-1].params.HasField("structured_outputs")


# --- refusals ---------------------------------------------------------------------------------

BAD = [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "'file_search'"),
    ({"input": "hi", "tools": [{"type": "computer_use_preview"}]}, "tools", "'computer_use_preview'"),
    ({"input": "hi", "tools": [{"type": "code_interpreter"}]}, "tools", "'code_interpreter'"),
    ({"input": "hi", "tools": [{"type": "mcp", "server_label": "x"}]}, "tools", "'mcp'"),
    ({"input": "hi", "tools": [{"type": "image_generation"}]}, "tools", "'image_generation'"),
    ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "'web_search_preview'"),
    ({"input": "hi", "store": False, "background": True}, "background", "store"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "'input_image'"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "call_id"),
    ({"input": []}, "input", "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature", "temperature"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "tools"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "nope"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema", "text.format.schema"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id", "resp_nope"),
    ({"input": "hi", "max_output_tokens": 100000}, "input", "maximum context length"),
]


@pytest.mark.parametrize(("extra", "param", "needle"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_are_openai_errors_naming_the_parameter(gateway, fake_engine, extra, param, needle):
    r = post(gateway, {"model": MODEL, **extra})
    status = 404 if param == "previous_response_id" else 400
    err = assert_error(r, status, param=param)
    assert needle in err["message"], err
    assert fake_engine.requests == []


def test_previous_response_still_running_is_400(gateway, fake_engine, redis_client):
    """While a response runs it is stored ``in_progress`` (continuing it is a 400, cancelling a
    non-background one too); a client that leaves ends it ``failed`` in the store."""
    fake_engine.hang = True
    results: list = []

    def leave_early() -> None:
        try:
            httpx.post(f"{gateway.url}/v1/responses", json={"model": MODEL, "input": "hi"}, timeout=4)
        except httpx.ReadTimeout as exc:
            results.append(exc)

    t = threading.Thread(target=leave_early)
    t.start()
    try:
        keys = wait_for(lambda: redis_client.keys("sluice:{resp:*"))
        rid = keys[0].decode().split("{resp:")[1].rstrip("}")
        running = httpx.get(f"{gateway.url}/v1/responses/{rid}").json()
        assert running["status"] == "in_progress" and running["output"] == [] and running["id"] == rid
        cfg = gateway.config  # its deadline, then the event log's window (any gateway may catch it up)
        assert cfg.request_timeout_s < redis_client.ttl(keys[0]) <= cfg.request_timeout_s + cfg.event_log_ttl_s + 60
        err = assert_error(post(gateway, {"model": MODEL, "input": "next", "previous_response_id": rid}), 400,
                           param="previous_response_id")
        assert "in_progress" in err["message"]
        err = assert_error(httpx.post(f"{gateway.url}/v1/responses/{rid}/cancel"), 400, param="response_id")
        assert "background" in err["message"]
    finally:
        t.join(30)
    assert results, "the client should have timed out"
    gone = wait_for(lambda: (r := httpx.get(f"{gateway.url}/v1/responses/{rid}").json())["status"] != "in_progress"
                    and r)
    assert gone["status"] == "failed" and gone["error"]["code"] == "client_disconnected"
    assert fake_engine.wait_cancel(rid.replace("resp_", "resp-"))


def wait_for(check, timeout: float = 10.0):
    end = time.time() + timeout
    while time.time() < end:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_api_keys_apply_to_every_responses_route(make_gateway, fake_engine):
    gw = make_gateway(api_keys=["sekret"])
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x"), ("POST", "/v1/responses/resp_x/cancel"),
                         ("GET", "/v1/responses/resp_x/input_items")):
        kwargs = {"json": {"model": MODEL, "input": "hi"}} if method == "POST" else {}
        assert_error(httpx.request(method, f"{gw.url}{path}", **kwargs), 401, code="invalid_api_key")
    ok = OpenAI(base_url=f"{gw.url}/v1", api_key="sekret", max_retries=0, timeout=30)
    resp = ok.responses.create(model=MODEL, input="hi")
    assert ok.responses.retrieve(resp.id).id == resp.id


def test_openapi_documents_the_responses_routes(gateway):
    schema = httpx.get(f"{gateway.url}/openapi.json").json()
    paths = schema["paths"]
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
            "/v1/responses/{response_id}/input_items"} <= set(paths)
    components = schema["components"]["schemas"]
    assert {"CreateResponseRequest", "ResponseObject", "FunctionTool", "InputItemList", "OutputItemEvent",
            "TextDeltaEvent", "ResponseLifecycleEvent"} <= set(components)
    assert "422" not in paths["/v1/responses"]["post"]["responses"]


def test_openai_agents_streamed_run_reads_the_event_stream(gateway, fake_engine):
    """The Agents SDK's default model, streamed (``Runner.run_streamed``): it builds its result from
    our events alone (the real model's tool loop is in tests/e2e/test_responses.py)."""
    import asyncio

    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    agent = Agent(name="echo", instructions="Answer.", model=OpenAIResponsesModel(
        model=MODEL, openai_client=AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)))

    async def run():
        result = Runner.run_streamed(agent, "Say hello")
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert result.final_output == REPLY
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    [raw] = result.raw_responses
    assert client(gateway).responses.retrieve(raw.response_id).output_text == REPLY


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_error_is_the_http_error_and_a_failed_stored_response(gateway, fake_engine, redis_client, stream):
    fake_engine.error = ("kv_cache_too_small", "needs more KV cache")
    err = assert_error(post(gateway, {"model": MODEL, "input": "hi", "stream": stream}), 400,
                       code="kv_cache_too_small")
    assert "KV cache" in err["message"]
    [key] = redis_client.keys("sluice:{resp:*")
    rid = key.decode().split("{resp:")[1].rstrip("}")
    stored = httpx.get(f"{gateway.url}/v1/responses/{rid}").json()
    assert stored["status"] == "failed" and stored["error"] == {"code": "kv_cache_too_small",
                                                                 "message": "needs more KV cache"}
