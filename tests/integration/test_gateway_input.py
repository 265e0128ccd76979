"""Hostile and sloppy input gets a clear 400, never a 500: the real
gateway app with a real Redis and the contract-following fake engine.

Before: a lone surrogate in a message's content was a 500 "Internal error: TypeError" (the
tokenizer), in ``model`` a 500 UnicodeEncodeError (a Redis key); ``max_tokens: true`` was read as
1; a prompt ``[-1]`` and an ``image_url`` part were told "Input should be a valid string"; a body
without Content-Type was told "The request body must be a JSON object".
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import assert_error
from tests.integration.test_gateway_support import MODEL

fake_engine = support.fake_engine
make_gateway = support.make_gateway
gateway = support.gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]

JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post_raw(gw, path: str, raw: str | bytes, headers: dict | None = None) -> httpx.Response:
    body = raw.encode() if isinstance(raw, str) else raw
    return httpx.post(f"{gw.url}{path}", content=body, headers=JSON if headers is None else headers, timeout=30)


# bodies with a lone surrogate (json.dumps writes it as a "\\udXXX" escape), and the param the 400 names
SURROGATES = [
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "x\udfff"}]}]},
     "messages[0].content[0].text"),
    (CHAT, {"model": "a\ud800b", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x\udc00"}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": ["ok", "\ud83d"]}, "prompt[1]"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": ["\ud800"]}, "stop[0]"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "user": "\ude00"}, "user"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"\ud800": 1}}, "logit_bias"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "some_future_field": {"deep": ["\ud800"]}},
     "some_future_field.deep[0]"),
]


def test_lone_surrogates_are_400_naming_the_field(gateway, fake_engine):
    for path, body, param in SURROGATES:
        raw = json.dumps(body)
        assert "\\ud" in raw
        err = assert_error(post_raw(gateway, path, raw), 400, param=param, code="invalid_value")
        assert "lone UTF-16 surrogate" in err["message"], err
    assert fake_engine.requests == []


def test_valid_surrogate_pairs_and_utf8_pass(gateway, fake_engine):
    # json.dumps escapes an emoji as a surrogate PAIR: valid, and tokenized as the emoji
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi 🙂 ünï"}], "max_tokens": 2})
    assert "\\ud83d\\ude42" in raw
    r = post_raw(gateway, CHAT, raw, {"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    prompt = fake_engine.tokenizer.decode(fake_engine.requests[0].prompt_token_ids)
    assert "hi 🙂 ünï" in prompt
    r = post_raw(gateway, COMPLETIONS, json.dumps({"model": MODEL, "prompt": "ünï 你好", "max_tokens": 2},
                                                  ensure_ascii=False))
    assert r.status_code == 200, r.text


def test_invalid_utf8_is_400(gateway, fake_engine):
    for raw in (b'{"model": "m", "prompt": "\xff"}', b'{"model": "m", "prompt": "\xed\xa0\x80"}'):
        err = assert_error(post_raw(gateway, COMPLETIONS, raw), 400, param=None, code="invalid_json")
        assert "UTF-8" in err["message"]


TYPE_CASES = [
    ({"max_tokens": True}, "max_tokens", "an integer"),
    ({"max_tokens": "5"}, "max_tokens", "an integer"),
    ({"max_tokens": 5.0}, "max_tokens", "an integer"),
    ({"n": True}, "n", "an integer"),
    ({"logprobs": True}, "logprobs", "an integer"),
    ({"seed": False}, "seed", "an integer"),
    ({"top_k": True}, "top_k", "an integer"),
    ({"min_tokens": True}, "min_tokens", "an integer"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]", "an integer"),
    ({"temperature": True}, "temperature", "a number"),
    ({"logit_bias": {"5": True}}, "logit_bias[5]", "a number"),
    ({"stream": "yes"}, "stream", "a boolean"),
    ({"echo": 1}, "echo", "a boolean"),
    ({"stream_options": {"include_usage": "true"}, "stream": True}, "stream_options.include_usage", "a boolean"),
]


def test_no_type_coercion(gateway, fake_engine):
    for extra, param, expected in TYPE_CASES:
        err = assert_error(httpx.post(f"{gateway.url}{COMPLETIONS}", json={"model": MODEL, "prompt": "x", **extra}),
                           400, param=param, code="invalid_type")
        assert f"expected {expected}" in err["message"], err
    assert fake_engine.requests == []


def test_chat_ints_are_strict_too(gateway, fake_engine):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for extra, param in (({"max_completion_tokens": True}, "max_completion_tokens"),
                         ({"top_logprobs": True, "logprobs": True}, "top_logprobs"),
                         ({"logprobs": 1}, "logprobs")):
        assert_error(httpx.post(f"{gateway.url}{CHAT}", json={**base, **extra}), 400, param=param,
                     code="invalid_type")
    ok = httpx.post(f"{gateway.url}{CHAT}", json={**base, "max_tokens": 3, "temperature": 1})  # int for a float
    assert ok.status_code == 200, ok.text


def test_prompt_token_ids_out_of_range(gateway, fake_engine):
    for prompt, where, value in (([-1], "prompt[0]", "-1"), ([5, 2**31], "prompt[1]", str(2**31)),
                                 ([[1, 2], [3, -7]], "prompt[1][1]", "-7")):
        err = assert_error(httpx.post(f"{gateway.url}{COMPLETIONS}", json={"model": MODEL, "prompt": prompt}), 400,
                           param="prompt")
        assert "token ids must be between 0 and 2147483647" in err["message"], err
        assert f"{where} is {value}" in err["message"], err
        assert "valid string" not in err["message"]
    err = assert_error(httpx.post(f"{gateway.url}{COMPLETIONS}", json={"model": MODEL, "prompt": [1, True]}), 400,
                       param="prompt")
    assert "prompt[1] is a boolean" in err["message"]
    err = assert_error(httpx.post(f"{gateway.url}{COMPLETIONS}", json={"model": MODEL, "prompt": {"a": 1}}), 400,
                       param="prompt")
    assert "list of token ids" in err["message"]
    # out of the model's vocabulary (but a valid id): the card's check, after validation
    err = assert_error(httpx.post(f"{gateway.url}{COMPLETIONS}", json={"model": MODEL, "prompt": [10**6]}), 400,
                       param="prompt")
    assert "out of the vocabulary" in err["message"]


def test_only_text_content_parts(gateway, fake_engine):
    def chat(content):
        return httpx.post(f"{gateway.url}{CHAT}",
                          json={"model": MODEL, "messages": [{"role": "user", "content": content}]})

    err = assert_error(chat([{"type": "text", "text": "look:"},
                             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), 400,
                       param="messages[0].content")
    assert "only text content parts are supported" in err["message"] and "'image_url'" in err["message"]
    err = assert_error(chat([{"type": "text"}]), 400, param="messages[0].content")
    assert '"type": "text"' in err["message"]
    err = assert_error(chat(5), 400, param="messages[0].content", code="invalid_type")
    assert "got an integer" in err["message"]
    assert fake_engine.requests == []


def test_body_without_json_content_type(gateway, fake_engine):
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2})
    for headers, got in (({}, "no Content-Type header"),
                         ({"content-type": "application/x-www-form-urlencoded"},  # what `curl -d` sends
                          "application/x-www-form-urlencoded"),
                         ({"content-type": "text/plain"}, "text/plain")):
        err = assert_error(post_raw(gateway, COMPLETIONS, body, headers), 400, param=None,
                           code="unsupported_media_type")
        assert "`Content-Type: application/json`" in err["message"] and got in err["message"], err
    assert fake_engine.requests == []
    assert post_raw(gateway, COMPLETIONS, body, {"content-type": "Application/JSON"}).status_code == 200


def test_openapi_lists_the_error_responses():
    """/openapi.json: every generation endpoint documents 400/401/404/413/429/503/504 with OpenAI's
    error body, and no 422 (the gateway answers validation errors with a 400)."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    schema = create_app(GatewayConfig()).openapi()
    components = schema["components"]["schemas"]
    assert set(components["ErrorResponse"]["properties"]) == {"error"}
    info = components["ErrorInfo"]["properties"]
    assert set(info) == {"message", "type", "param", "code"}
    for path in (COMPLETIONS, CHAT):
        responses = schema["paths"][path]["post"]["responses"]
        assert sorted(responses) == ["200", "400", "401", "404", "413", "429", "503", "504"], sorted(responses)
        for status in ("400", "401", "404", "413", "429", "503", "504"):
            assert responses[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in components and "ValidationError" not in components


def test_503s_carry_retry_after(gateway, fake_engine):
    fake_engine.kill()
    assert httpx.get(f"{gateway.url}/health").status_code == 503  # a fresh look, which the gateway keeps
    r = httpx.post(f"{gateway.url}{COMPLETIONS}", json={"model": MODEL, "prompt": "x"})
    assert_error(r, 503, code="no_engine")
    assert r.headers["retry-after"] == "1"


def test_deeply_nested_body_is_400(gateway, fake_engine):
    """Nested past the parser's recursion: a 400, with the surrogate-pair escape (body_checks parses
    it, where a RecursionError must not become a 500) and without it."""
    for prompt in ("x\\ud83d\\ude00", "x"):
        raw = f'{{"model": "{MODEL}", "max_tokens": 2, "prompt": "{prompt}", "zz": {"[" * 10000}1{"]" * 10000}}}'
        err = assert_error(post_raw(gateway, COMPLETIONS, raw), 400, param=None, code="invalid_json")
        assert "nested too deeply" in err["message"], err
    assert fake_engine.requests == []
