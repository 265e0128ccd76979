"""No silent ignoring: every request parameter of every endpoint is served, or refused with a 400
naming it (OpenAI's own answer to a parameter it does not know). The walk takes the openai SDK's
own request types for chat completions, completions and responses, and sends each of their fields
with a value: a field the gateway serves is answered 200, one it does not a 400 whose ``param``
is that field. A field the SDK adds fails the walk until it is classified here. Then what the
served fields do: the output's logprobs of a response (``include`` with ``top_logprobs``), a
completions request that only scores its prompt (``echo`` with ``max_tokens: 0``, as lm-eval sends),
and error messages free of template artefacts. The real gateway app, a real Redis and the fake
engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import assert_error
from tests.integration.test_gateway_support import MODEL, REPLY

fake_engine = support.fake_engine
make_gateway = support.make_gateway
gateway = support.gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]

OK, REFUSED = "served", "refused"
USER = [{"role": "user", "content": "hi"}]
CHAT_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
RESPONSE_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}

# field -> (what the gateway does with it, a value, the other fields it needs)
CHAT: dict[str, tuple[str, Any, dict]] = {
    "audio": (REFUSED, {"voice": "alloy", "format": "wav"}, {}),
    "frequency_penalty": (OK, 0.5, {}),
    "function_call": (REFUSED, "auto", {}),
    "functions": (REFUSED, [{"name": "f"}], {}),
    "logit_bias": (OK, {"100": 1}, {}),
    "logprobs": (OK, True, {}),
    "max_completion_tokens": (OK, 4, {}),
    "max_tokens": (OK, 4, {}),
    "messages": (OK, USER, {}),
    "metadata": (REFUSED, {"k": "v"}, {}),
    "modalities": (OK, ["text"], {}),
    "model": (OK, MODEL, {}),
    "moderation": (REFUSED, {"model": "omni-moderation-latest"}, {}),
    "n": (OK, 2, {}),
    "parallel_tool_calls": (OK, False, {"tools": [CHAT_TOOL]}),
    "prediction": (REFUSED, {"type": "content", "content": "x"}, {}),
    "presence_penalty": (OK, 0.5, {}),
    "prompt_cache_key": (REFUSED, "key", {}),
    "prompt_cache_options": (REFUSED, {}, {}),
    "prompt_cache_retention": (REFUSED, "24h", {}),
    "reasoning_effort": (REFUSED, "low", {}),
    "response_format": (OK, {"type": "json_object"}, {}),
    "safety_identifier": (REFUSED, "user-1", {}),
    "seed": (OK, 7, {}),
    "service_tier": (OK, "auto", {}),
    "stop": (OK, ["zzz"], {}),
    "store": (OK, False, {}),
    "stream": (OK, True, {}),
    "stream_options": (OK, {"include_usage": True}, {"stream": True}),
    "temperature": (OK, 0.5, {}),
    "tool_choice": (OK, "auto", {"tools": [CHAT_TOOL]}),
    "tools": (OK, [CHAT_TOOL], {}),
    "top_logprobs": (OK, 2, {"logprobs": True}),
    "top_p": (OK, 0.9, {}),
    "user": (OK, "user-1", {}),
    "verbosity": (REFUSED, "low", {}),
    "web_search_options": (REFUSED, {}, {}),
}
COMPLETIONS: dict[str, tuple[str, Any, dict]] = {
    "best_of": (OK, 1, {}),
    "echo": (OK, True, {}),
    "frequency_penalty": (OK, 0.5, {}),
    "logit_bias": (OK, {"100": 1}, {}),
    "logprobs": (OK, 2, {}),
    "max_tokens": (OK, 4, {}),
    "model": (OK, MODEL, {}),
    "n": (OK, 2, {}),
    "presence_penalty": (OK, 0.5, {}),
    "prompt": (OK, "hi", {}),
    "seed": (OK, 7, {}),
    "stop": (OK, ["zzz"], {}),
    "stream": (OK, True, {}),
    "stream_options": (OK, {"include_usage": True}, {"stream": True}),
    "suffix": (REFUSED, "the end", {}),
    "temperature": (OK, 0.5, {}),
    "top_p": (OK, 0.9, {}),
    "user": (OK, "user-1", {}),
}
RESPONSES: dict[str, tuple[str, Any, dict]] = {
    "background": (OK, True, {}),
    "context_management": (REFUSED, [{"type": "compaction"}], {}),
    "conversation": (OK, "<conversation>", {}),
    "include": (OK, ["message.output_text.logprobs"], {}),
    "input": (OK, "hi", {}),
    "instructions": (OK, "Be brief.", {}),
    "max_output_tokens": (OK, 16, {}),
    "max_tool_calls": (OK, 1, {"tools": [RESPONSE_TOOL]}),
    "metadata": (OK, {"k": "v"}, {}),
    "model": (OK, MODEL, {}),
    "moderation": (REFUSED, {"model": "omni-moderation-latest"}, {}),
    "parallel_tool_calls": (OK, False, {"tools": [RESPONSE_TOOL]}),
    "previous_response_id": (OK, "<response>", {}),
    "prompt": (REFUSED, {"id": "pmpt_123"}, {}),
    "prompt_cache_key": (REFUSED, "key", {}),
    "prompt_cache_options": (REFUSED, {}, {}),
    "prompt_cache_retention": (REFUSED, "24h", {}),
    "reasoning": (REFUSED, {"effort": "low"}, {}),
    "safety_identifier": (REFUSED, "user-1", {}),
    "service_tier": (OK, "default", {}),
    "store": (OK, False, {}),
    "stream": (OK, True, {}),
    "stream_options": (OK, {"include_obfuscation": False}, {"stream": True}),
    "temperature": (OK, 0.5, {}),
    "text": (OK, {"format": {"type": "text"}}, {}),
    "tool_choice": (OK, "required", {"tools": [RESPONSE_TOOL]}),
    "tools": (OK, [RESPONSE_TOOL], {}),
    "top_logprobs": (OK, 2, {"include": ["message.output_text.logprobs"]}),
    "top_p": (OK, 0.9, {}),
    "truncation": (OK, "auto", {}),
    "user": (OK, "user-1", {}),
}

ENDPOINTS = {
    "/v1/chat/completions": (chat_create_params.CompletionCreateParamsStreaming, CHAT,
                             {"model": MODEL, "messages": USER, "max_tokens": 4}),
    "/v1/completions": (completion_create_params.CompletionCreateParamsStreaming, COMPLETIONS,
                        {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
    "/v1/responses": (response_create_params.ResponseCreateParamsStreaming, RESPONSES,
                      {"model": MODEL, "input": "hi", "max_output_tokens": 16}),
}


def sdk_fields(params_type: type) -> set[str]:
    return set(params_type.__required_keys__ | params_type.__optional_keys__)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_every_sdk_field_is_classified(path):
    params_type, table, _ = ENDPOINTS[path]
    assert sdk_fields(params_type) == set(table), "classify the openai SDK's new (or gone) fields in this walk"


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_every_sdk_field_is_served_or_refused_by_name(gateway, fake_engine, path):
    params_type, table, minimal = ENDPOINTS[path]
    c = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=30)
    refs = {"<response>": c.responses.create(model=MODEL, input="hi", max_output_tokens=4).id,
            "<conversation>": c.conversations.create().id}
    for field in sorted(sdk_fields(params_type)):
        kind, value, needs = table[field]
        body = {**minimal, **needs, field: refs.get(value, value) if isinstance(value, str) else value}
        r = httpx.post(f"{gateway.url}{path}", json=body, timeout=30)
        if kind == OK:
            assert r.status_code == 200, (field, r.text)
        else:
            err = assert_error(r, 400, param=field, code="unsupported_parameter")
            assert err["message"].startswith(f"Unsupported parameter: '{field}' is not supported: "), err
            assert "{" not in err["message"], err


@pytest.mark.parametrize("path", [*ENDPOINTS, "/v1/conversations", "/tokenize", "/detokenize"])
def test_a_parameter_no_endpoint_has_is_refused_by_name(gateway, fake_engine, path):
    others = {"/v1/conversations": {}, "/tokenize": {"model": MODEL, "prompt": "hi"},
              "/detokenize": {"model": MODEL, "tokens": [1]}}
    body = others[path] if path in others else ENDPOINTS[path][2]
    err = assert_error(httpx.post(f"{gateway.url}{path}", json={**body, "frobnicate": 1}, timeout=30), 400,
                       param="frobnicate", code="unknown_parameter")
    assert err["message"] == "Unknown parameter: 'frobnicate'."
    assert fake_engine.requests == []


REFUSED_VALUES = [
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"frob": 1}}, "stream_options.frob"),
    ("/v1/completions", {"best_of": 3, "n": 2}, "best_of"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/responses", {"include": ["reasoning.encrypted_content"]}, "include"),
    ("/v1/responses", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/responses", {"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ("/v1/responses", {"max_tool_calls": 0}, "max_tool_calls"),
    ("/v1/responses", {"service_tier": "priority"}, "service_tier"),
    ("/v1/responses", {"text": {"verbosity": "low"}}, "text.verbosity"),
    ("/v1/responses", {"text": {"format": {"type": "text"}, "frob": 1}}, "text.frob"),
    ("/v1/responses", {"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ("/v1/responses", {"conversation": {"id": "conv_1", "frob": 1}}, "conversation.frob"),
    ("/v1/responses", {"tools": [RESPONSE_TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto"}},
     "tool_choice"),
]


@pytest.mark.parametrize(("path", "extra", "param"), REFUSED_VALUES, ids=[f"{p}-{x}" for p, _, x in REFUSED_VALUES])
def test_values_sluice_does_not_serve_are_refused_by_name(gateway, fake_engine, path, extra, param):
    err = assert_error(httpx.post(f"{gateway.url}{path}", json={**ENDPOINTS[path][2], **extra}, timeout=30), 400,
                       param=param)
    assert "{{" not in err["message"] and "}}" not in err["message"], err  # no template artefact
    assert fake_engine.requests == []


def test_error_messages_carry_no_template_artefacts(gateway):
    err = assert_error(httpx.post(f"{gateway.url}/v1/responses", timeout=30, json={
        "model": MODEL, "input": "hi", "tools": [RESPONSE_TOOL], "tool_choice": {"type": "allowed_tools"}}), 400,
        param="tool_choice")
    assert "'allowed_tools' is not supported" in err["message"]
    assert '{"type": "function", "name": ...}' in err["message"] and "{{" not in err["message"]
    err = assert_error(httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}), 400)
    assert '{"type": "text", "text": "..."}' in err["message"] and "{{" not in err["message"]


# --- what the served fields do -----------------------------------------------------------------


def test_response_output_logprobs_streamed_stored_and_replayed(make_gateway, fake_engine):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: each output_text delta
    carries its tokens' logprobs, the final text all of them; the stored response and its replay
    from the log (another gateway) have the same."""
    gw1, gw2 = make_gateway(), make_gateway()
    c = OpenAI(base_url=f"{gw1.url}/v1", api_key="unused", max_retries=0, timeout=30)
    with c.responses.stream(model=MODEL, input="hi", include=["message.output_text.logprobs"], top_logprobs=2,
                            max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert fake_engine.requests[-1].params.logprobs == 2
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp for e in deltas for lp in e.logprobs]
    part = final.output[0].content[0]
    assert part.text == REPLY and final.top_logprobs == 2
    assert [lp.token for lp in part.logprobs] == [lp.token for lp in streamed]
    assert len(part.logprobs) == len(fake_engine.reply_ids)
    assert all(lp.logprob == -0.25 and len(lp.top_logprobs) == 2 for lp in part.logprobs)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    stored = OpenAI(base_url=f"{gw2.url}/v1", api_key="unused", max_retries=0).responses.retrieve(final.id)
    kept = stored.output[0].content[0]
    assert kept.text == part.text and [lp.model_dump() for lp in kept.logprobs] == [lp.model_dump()
                                                                                 for lp in part.logprobs]
    with httpx.stream("GET", f"{gw2.url}/v1/responses/{final.id}", params={"stream": "true"}, timeout=30) as r:
        replayed = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    again = [lp for e in replayed if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert again == [lp.model_dump(exclude_none=True) for lp in streamed]
    # without the include, no logprobs are asked of the engine
    plain = c.responses.create(model=MODEL, input="hi", max_output_tokens=8)
    assert not fake_engine.requests[-1].params.HasField("logprobs") and plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("stream", [False, True])
def test_completions_echo_with_max_tokens_0_scores_the_prompt(gateway, fake_engine, stream):
    """lm-eval's loglikelihood request: the prompt back with its logprobs (the first position has
    none), and no generated text (the engine ran one token, as vLLM's does)."""
    body = {"model": MODEL, "prompt": "The capital of France is Paris", "echo": True, "logprobs": 1,
            "max_tokens": 0, "temperature": 0, "stream": stream}
    r = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    prompt_ids = list(fake_engine.requests[-1].prompt_token_ids)
    assert fake_engine.requests[-1].params.max_tokens == 1 and fake_engine.requests[-1].params.prompt_logprobs == 1
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        text = "".join(ch["text"] for chunk in chunks for ch in chunk["choices"])
        tokens = [t for chunk in chunks for ch in chunk["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
        values = [v for chunk in chunks for ch in chunk["choices"] if ch["logprobs"]
                  for v in ch["logprobs"]["token_logprobs"]]
        finish = [ch["finish_reason"] for chunk in chunks for ch in chunk["choices"] if ch["finish_reason"]]
    else:
        [choice] = r.json()["choices"]
        text, tokens, values = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
        finish = [choice["finish_reason"]]
    assert text == fake_engine.tokenizer.decode(prompt_ids) and text.endswith("The capital of France is Paris")
    assert len(tokens) == len(values) == len(prompt_ids)
    assert values[0] is None and values[1:] == [-0.5] * (len(prompt_ids) - 1)
    assert finish == ["length"]
