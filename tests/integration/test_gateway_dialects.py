"""The model's dialects over HTTP: a card that names a reasoning parser gives ``reasoning_content``
apart from ``content`` (streamed and not, the same), a constraint goes to the engine wrapped so it
applies to the answer only, and tool calls after the reasoning are read by the card's parser.
The gateway against a real Redis and the fake engine (which spells a fixed reply)."""

from __future__ import annotations

import json

import httpx
import pytest

from sluice.wire import codec, contract
from sluice.wire.card import ModelCard
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import sse_events
from tests.integration.test_gateway_support import MAX_MODEL_LEN, MODEL

fake_engine = support.fake_engine
make_gateway = support.make_gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]

THOUGHT = "Let me think: 2+2 is 4, so\n"
ANSWER = '{"answer": 4}'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture
def thinking(fake_engine, redis_client, model_dir, make_gateway):
    """A gateway for a model whose card names ``reasoning_parser`` (set per test), and a function
    that sets what the fake engine answers."""

    def start(parser: str, reply: str):
        card = ModelCard.from_model_dir(model_dir, name=MODEL, max_model_len=MAX_MODEL_LEN, vocab_size=49152,
                                        eos_token_ids=[2], reasoning_parser=parser)
        redis_client.hset(contract.model_card_key(MODEL), mapping=card.encode())
        fake_engine.reply_ids = fake_engine.tokenizer.encode(reply, add_special_tokens=False)
        return make_gateway()

    return start


def _chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "What is 2+2? Answer in JSON."}], **body}, timeout=30)


def _streamed(url: str, **body) -> tuple[str, str, list, str]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"model": MODEL, "stream": True, "messages": [
            {"role": "user", "content": "What is 2+2?"}], **body}, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp)
    reasoning = content = ""
    calls, finish = [], None
    for ev in events[:-1]:
        (choice,) = ev["choices"]
        delta = choice["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        indices = [c["index"] for c in delta.get("tool_calls") or []]
        assert len(indices) == len(set(indices)), delta
        calls += delta.get("tool_calls") or []
        finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


def test_reasoning_content_apart_from_content_streamed_and_not(thinking):
    gw = thinking("deepseek_r1", f"{THOUGHT}</think>\n\n{ANSWER}")
    resp = _chat(gw.url)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    assert choice["message"] == {"role": "assistant", "reasoning_content": THOUGHT, "content": ANSWER}
    assert choice["finish_reason"] == "stop"
    assert _streamed(gw.url) == (THOUGHT, ANSWER, [], "stop")
    # the openai SDK hands the field through
    from openai import OpenAI

    sdk = OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    message = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}]).choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)


def _tokens_until(tokenizer, ids: list[int], tag: str) -> int:
    """How many of ``ids`` it takes, decoded from the start, to spell ``tag``."""
    return next(k for k in range(1, len(ids) + 1) if tag in tokenizer.decode(ids[:k]))


def test_usage_counts_the_reasoning_tokens(thinking, fake_engine):
    gw = thinking("deepseek_r1", f"{THOUGHT}</think>\n\n{ANSWER}")
    ids = fake_engine.reply_ids
    want = _tokens_until(fake_engine.tokenizer, ids, "</think>")
    assert 0 < want < len(ids)  # the answer's tokens are not reasoning
    usage = _chat(gw.url).json()["usage"]
    assert usage["completion_tokens"] == len(ids)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": want}
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json={
            "model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "2+2?"}]}, timeout=30) as resp:
        events = sse_events(resp)
    assert events[-2]["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}
    from openai import OpenAI

    sdk = OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    got = sdk.responses.create(model=MODEL, input="2+2?")
    assert got.output_text == ANSWER and got.usage.output_tokens == len(ids)
    assert got.usage.output_tokens_details.reasoning_tokens == want
    # reasoning that max_tokens cuts: every token is reasoning
    cut = _chat(gw.url, max_tokens=3).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_a_model_without_reasoning_counts_none(thinking, fake_engine):
    gw = thinking("qwen3", f"{ANSWER} <think>not a thought</think>")  # no opening tag first: no reasoning
    usage = _chat(gw.url).json()["usage"]
    assert usage["completion_tokens"] == len(fake_engine.reply_ids)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_a_constraint_reaches_the_engine_wrapped_around_the_reasoning(thinking, fake_engine):
    gw = thinking("deepseek_r1", f"{THOUGHT}</think>\n\n{ANSWER}")
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    resp = _chat(gw.url, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert resp.status_code == 200, resp.text
    assert json.loads(resp.json()["choices"][0]["message"]["content"]) == {"answer": 4}
    sent = codec.structured_outputs_from_proto(fake_engine.requests[-1].params.structured_outputs)
    assert sent.kind == "grammar" and 'think_body[lazy]: THINK_TEXT "</think>"' in sent.grammar
    assert "answer: %json " in sent.grammar and '"answer": {"type": "integer"}' in sent.grammar


def test_a_model_without_a_reasoning_parser_keeps_the_think_text(thinking):
    gw = thinking("none", f"<think>{THOUGHT}</think>{ANSWER}")
    body = _chat(gw.url).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": f"<think>{THOUGHT}</think>{ANSWER}"}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}  # no parser, no reasoning


def test_tool_calls_after_the_reasoning(thinking, fake_engine):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    gw = thinking("qwen3", f"<think>{THOUGHT}</think>\n\n{call}")
    resp = _chat(gw.url, tools=[WEATHER])
    (choice,) = resp.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, None)
    (got,) = message["tool_calls"]
    assert got["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    reasoning, content, calls, finish = _streamed(gw.url, tools=[WEATHER])
    assert (reasoning, content, finish) == (THOUGHT, "", "tool_calls")
    assert [(c["index"], c["function"]) for c in calls] == [(0, got["function"])]
    # output the parser cannot read is content, never an error
    fake_engine.reply_ids = fake_engine.tokenizer.encode('<tool_call>{"name": "get_weather", "argu',
                                                         add_special_tokens=False)
    resp = _chat(gw.url, tools=[WEATHER])
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == '<tool_call>{"name": "get_weather", "argu'
