"""The prepare pool over HTTP (``gateway.prepare_pool``, ``gateway.preparation``): a request prepared
in a worker process gets exactly what the same request prepared on the event loop gets — the same
prompt token ids at the engine on chat (tools, a reasoning model's template), completions and
responses, the same /tokenize answer, and the same 400 for every bad body — and the body-shape
bounds refuse oversized bodies naming the parameter. Two gateways on one Redis and the fake
engine: one without a pool, one that sends every body to its pool (threshold 0)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from sluice.wire import contract, limits
from sluice.wire.card import ModelCard
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import assert_error
from tests.integration.test_gateway_support import MAX_MODEL_LEN, MODEL

fake_engine = support.fake_engine
make_gateway = support.make_gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
# A reasoning model's template in Qwen3's manner: tools in a system block, calls as <tool_call>, the
# answer opened with <think> unless enable_thinking is false.
REASONING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}{{ m.content or '' }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{%- if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{%- endif %}{%- endif %}"
)


@pytest.fixture
def pair(make_gateway, fake_engine):
    """(a gateway preparing on its event loop, one preparing every request in its pool)."""
    loop = make_gateway(prepare_pool_workers=0)
    pooled = make_gateway(prepare_pool_workers=1, prepare_pool_threshold_bytes=0)
    return loop, pooled


def _ids_at_engine(engine, gw, path: str, body: dict) -> list[list[int]]:
    """The prompt ids the engine received for ``body`` (and the output constraint, when there is one)."""
    before = len(engine.requests)
    r = httpx.post(f"{gw.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    # one engine request per prompt, read from their queue shards in any order: in prompt order
    reqs = sorted(engine.requests[before:], key=lambda req: (len(req.request_id), req.request_id))
    constraint = [req.params.structured_outputs.SerializeToString() for req in reqs
                  if req.params.HasField("structured_outputs")]
    return [list(req.prompt_token_ids) for req in reqs] + constraint


CHAT = [
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! 你好 🙂"}]},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Part one. "},
                                                    {"type": "text", "text": "Part two."}]},
                  {"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]},
    {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": "{\"city\": \"Oslo\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"}],
     "tools": [WEATHER], "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "Continue: once upon"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "Weather in Lima?"}], "tools": [WEATHER], "tool_choice": "required"},
    {"messages": [{"role": "user", "content": "A person."}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}}}},
]


def test_chat_and_completions_prompt_ids_are_the_same_from_the_pool(pair, fake_engine) -> None:
    loop, pooled = pair
    for extra in CHAT:
        body = {"model": MODEL, "max_tokens": 40, **extra}
        assert _ids_at_engine(fake_engine, loop, "/v1/chat/completions", body) == \
            _ids_at_engine(fake_engine, pooled, "/v1/chat/completions", body), extra
    for prompt, extra in (("Once upon a time", {}), (["First prompt", "Second, ünïcödé 🙂"], {}), ([1, 2, 3, 4], {}),
                          ([[5, 6], [7, 8, 9]], {}), ("Sky blue?", {"structured_outputs": {"choice": ["yes", "no"]}})):
        body = {"model": MODEL, "max_tokens": 40, "prompt": prompt, **extra}
        assert _ids_at_engine(fake_engine, loop, "/v1/completions", body) == \
            _ids_at_engine(fake_engine, pooled, "/v1/completions", body), prompt
    assert pooled.app.state.prepare_pool.completed > 0  # the pool did the work


def test_a_reasoning_model_template_gives_the_same_ids_from_the_pool(pair, fake_engine, redis_client, model_dir) -> None:
    card = dataclasses.replace(
        ModelCard.from_model_dir(model_dir, name=MODEL, max_model_len=MAX_MODEL_LEN, vocab_size=49152,
                                 eos_token_ids=[2]),
        chat_template=REASONING_TEMPLATE, reasoning_parser="qwen3", tool_call_parser="hermes")
    redis_client.hset(contract.model_card_key(MODEL), mapping=card.encode())
    loop, pooled = pair
    for extra in (*CHAT, {"messages": [{"role": "user", "content": "2+2?"}],
                          "chat_template_kwargs": {"enable_thinking": False}}):
        body = {"model": MODEL, "max_tokens": 40, **extra}
        got = _ids_at_engine(fake_engine, loop, "/v1/chat/completions", body)
        assert got == _ids_at_engine(fake_engine, pooled, "/v1/chat/completions", body), extra
        if extra.get("add_generation_prompt", True):  # the card's template was the one rendered
            assert "<think>" in fake_engine.tokenizer.decode(got[0])


def test_responses_prompt_ids_are_the_same_from_the_pool(pair, fake_engine) -> None:
    loop, pooled = pair
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    first = httpx.post(f"{loop.url}/v1/responses", json={"model": MODEL, "input": "Weather in Rome?",
                                                         "tools": [tool], "max_output_tokens": 2}, timeout=60)
    assert first.status_code == 200, first.text
    bodies = [
        {"input": "Say hi", "instructions": "Be brief."},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
                   {"type": "function_call", "call_id": "c9", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
                   {"type": "function_call_output", "call_id": "c9", "output": "Rain"}], "tools": [tool]},
        {"input": "And tomorrow?", "previous_response_id": first.json()["id"], "tools": [tool]},
        {"input": "Weather in Lima?", "tools": [tool], "tool_choice": "required"},
        {"input": "A person.", "text": {"format": {"type": "json_schema", "name": "p", "schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}}}},
    ]
    for extra in bodies:
        body = {"model": MODEL, "max_output_tokens": 40, **extra}
        assert _ids_at_engine(fake_engine, loop, "/v1/responses", body) == \
            _ids_at_engine(fake_engine, pooled, "/v1/responses", body), extra


def test_tokenize_answers_are_the_same_from_the_pool(pair) -> None:
    loop, pooled = pair
    for body in ({"prompt": "Hello there, 🙂"}, {"messages": CHAT[0]["messages"], "tools": [WEATHER]},
                 {"prompt": "x", "add_special_tokens": False, "return_token_strs": True}):
        body = {"model": MODEL, **body}
        a = httpx.post(f"{loop.url}/tokenize", json=body, timeout=60)
        b = httpx.post(f"{pooled.url}/tokenize", json=body, timeout=60)
        assert a.status_code == b.status_code == 200 and a.json() == b.json()


def _over(size: limits.Size) -> int:
    return size.max_items + 1


def _nested(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


BAD = [
    ("/v1/chat/completions", b'{"model": "m", "messages": [', None),  # malformed JSON
    ("/v1/chat/completions", b'{"model": "m", "messages": "\\ud800"}', None),  # a lone surrogate
    ("/v1/chat/completions", b'\xff\xfe{}', None),  # not UTF-8
    ("/v1/chat/completions", b"[1, 2]", None),  # not an object
    ("/v1/chat/completions", b"[" * 5000 + b"]" * 5000, None),  # deeper than the parser recurses
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 99}, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object", "x": _nested(limits.NESTING.max_levels)}},
     None),  # deeper than the body's bound
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * _over(limits.MESSAGES)},
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "x"}] * _over(limits.CONTENT_PARTS)}]}, "messages[1].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [WEATHER] * _over(limits.TOOLS)}, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "junk": [0] * 300_000},
     None),  # over the number of JSON values
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 30_000}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"add_generation_prompt": 1}}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                  "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "x"}] * _over(limits.INPUT_ITEMS)}, "input"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "x"}] * _over(limits.CONTENT_PARTS)}]}, "input[0].output"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "image", "url": "x"}]}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "word " * 30_000}, "input"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 30_000}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["short", "word " * 3_000]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(MAX_MODEL_LEN + 1))}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": " " * 100_000}, "prompt"),
]


def test_bad_bodies_get_the_same_400_from_the_pool(pair, fake_engine) -> None:
    loop, pooled = pair
    for i, (path, body, param) in enumerate(BAD):
        answers = []
        for gw in (loop, pooled):
            if isinstance(body, bytes):
                r = httpx.post(f"{gw.url}{path}", content=body, headers={"content-type": "application/json"},
                               timeout=60)
            else:
                r = httpx.post(f"{gw.url}{path}", json=body, timeout=60)
            assert r.status_code == 400, (i, path, r.text[:300])
            err = assert_error(r, 400)
            if param is not None:
                assert err["param"] == param, (i, err)
            answers.append(r.json())
        assert answers[0] == answers[1], i
    assert not fake_engine.requests  # nothing was queued


def test_a_prompt_over_the_context_by_its_length_alone_is_refused_before_tokenizing(pair, fake_engine) -> None:
    """The message says what the characters-per-token bound saw (a lower bound on the tokens), not a
    token count: the text was never tokenized."""
    per_token = fake_engine.tokenizer.max_chars_per_token
    text = "word " * 30_000
    for gw in pair:
        err = assert_error(httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": text}, timeout=60),
                           400, param="prompt", code="context_length_exceeded")
        assert f"is {len(text)} characters, which is at least {-(-len(text) // per_token)} tokens" in err["message"]
        assert "leaving no room for the completion" in err["message"]
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    # under the bound, the text is tokenized and the exact count refused
    text = "word " * (MAX_MODEL_LEN * per_token // 10)
    err = assert_error(httpx.post(f"{pair[1].url}/v1/completions", json={"model": MODEL, "prompt": text}, timeout=60),
                       400, param="prompt", code="context_length_exceeded")
    assert f"{len(fake_engine.tokenizer.encode(text)) + 16} tokens" in err["message"]
