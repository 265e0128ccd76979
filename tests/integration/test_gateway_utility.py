"""vLLM's utility endpoints on the gateway (POST /tokenize, /detokenize, GET /version, /ping) and
the /v1/models entries, against a real Redis and the contract-following fake engine."""

from __future__ import annotations

import time

import httpx
import pytest

import sluice
from sluice.text.tokenizer import Tokenizer
from sluice.wire import card as wire_card
from sluice.wire import contract
from sluice.wire.connection import connect
from sluice.wire.registry import EngineEntry
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import assert_error
from tests.integration.test_gateway_support import MAX_MODEL_LEN, MODEL

fake_engine = support.fake_engine
gateway = support.gateway
make_gateway = support.make_gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! 你好"}]


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_tokenize_prompt(gateway, tok) -> None:
    text = "The capital of France is"
    r = httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tok.encode(text, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] is None
    # model may be left out while one model is served; token strings on request
    r = httpx.post(f"{gateway.url}/tokenize",
                   json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text, add_special_tokens=False)
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert body["token_strs"][0] == "The"


def test_tokenize_messages_uses_the_chat_template(gateway, tok) -> None:
    r = httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    expected_text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant\n" in expected_text  # SmolLM2's template, with the generation prompt
    assert r.json()["tokens"] == tok.encode(expected_text, add_special_tokens=False)
    # without the generation prompt / continuing the final (assistant) message
    r = httpx.post(f"{gateway.url}/tokenize",
                   json={"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False})
    no_gen = r.json()["tokens"]
    assert no_gen == tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=False), add_special_tokens=False)
    assert len(no_gen) < r.json()["count"] + 10 and no_gen != tok.encode(expected_text, add_special_tokens=False)
    partial = [*MESSAGES, {"role": "assistant", "content": "Hello th"}]
    r = httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL, "messages": partial,
                                                     "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert tok.decode(r.json()["tokens"]).endswith("Hello th")


def test_tokenize_messages_matches_what_chat_completions_sends(gateway, fake_engine) -> None:
    """/tokenize of messages gives exactly the prompt a chat completion enqueues for the engine."""
    messages = [{"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    tokens = httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    r = httpx.post(f"{gateway.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": messages, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert list(fake_engine.requests[-1].prompt_token_ids) == tokens
    assert r.json()["usage"]["prompt_tokens"] == len(tokens)
    # and a prompt: what /v1/completions sends
    tokens = httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL, "prompt": "Once upon"}).json()["tokens"]
    r = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert list(fake_engine.requests[-1].prompt_token_ids) == tokens


def test_detokenize_round_trip(gateway, tok) -> None:
    text = "Hello world! 你好, 🙂 ünïcödé"
    ids = tok.encode(text, add_special_tokens=False)
    r = httpx.post(f"{gateway.url}/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}
    assert httpx.post(f"{gateway.url}/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    # special tokens are kept, as vLLM's detokenize does
    im_start = tok.token_to_id("<|im_start|>")
    assert httpx.post(f"{gateway.url}/detokenize", json={"tokens": [im_start]}).json() == {"prompt": "<|im_start|>"}


@pytest.mark.parametrize(
    ("path", "body", "param", "code", "fragment"),
    [
        ("/tokenize", {"model": MODEL}, None, "invalid_value", "exactly one of 'prompt' and 'messages'"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "messages": MESSAGES}, None, "invalid_value", "exactly one"),
        ("/tokenize", {"model": MODEL, "messages": []}, "messages", "invalid_value", ""),
        ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt", "invalid_type", ""),
        ("/tokenize", {"model": MODEL, "messages": MESSAGES, "continue_final_message": True}, None,
         "invalid_value", "cannot both be true"),
        ("/tokenize", {"model": MODEL, "messages": MESSAGES, "chat_template": "{{ 'x' }}"}, "chat_template", None,
         "--trust-request-chat-template"),
        ("/tokenize", {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": 1}},
         "messages", None, "Invalid messages for the chat template"),
        ("/detokenize", {"model": MODEL}, "tokens", "missing_required_parameter", ""),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens[0]", "invalid_value", ""),
        ("/detokenize", {"model": MODEL, "tokens": [10**8]}, "tokens", "invalid_value", "out of the vocabulary"),
        ("/detokenize", {"model": MODEL, "tokens": "abc"}, "tokens", "invalid_type", ""),
    ],
)
def test_bad_input_is_a_clear_400(gateway, path, body, param, code, fragment) -> None:
    err = assert_error(httpx.post(f"{gateway.url}{path}", json=body), 400, param=param, code=code)
    assert fragment in err["message"]


def test_tokenize_refuses_only_text_no_prompt_of_the_model_could_be(gateway, tok) -> None:
    """/tokenize counts text past the context, up to the tokenizer's proven characters per token of it."""
    limit = MAX_MODEL_LEN * tok.max_chars_per_token
    longest = httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL, "prompt": " " * limit})
    assert longest.status_code == 200 and longest.json()["count"] > MAX_MODEL_LEN
    err = assert_error(httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL, "prompt": " " * (limit + 1)}),
                       400, param="prompt", code="invalid_value")
    assert f"at most {limit}" in err["message"]


def test_unknown_model_and_malformed_json(gateway) -> None:
    for path, body in (("/tokenize", {"model": "nope", "prompt": "x"}), ("/detokenize", {"model": "nope", "tokens": [1]})):
        assert_error(httpx.post(f"{gateway.url}{path}", json=body), 404, param="model", code="model_not_found")
    err = assert_error(httpx.post(f"{gateway.url}/tokenize", content=b"{not json",
                                  headers={"content-type": "application/json"}), 400, code="invalid_json")
    assert "JSON" in err["message"]


def test_model_is_required_when_several_are_served(gateway, fake_engine, redis_url) -> None:
    r = connect(redis_url)
    other = "other-model"
    try:
        # a second model with a live engine, registered as an engine does: card, models set,
        # registry entry and heartbeat key
        card = r.hgetall(contract.model_card_key(MODEL))
        card[wire_card.F_NAME.encode()] = other.encode()
        r.hset(contract.model_card_key(other), mapping=card)
        r.sadd(contract.MODELS_KEY, other)
        r.hset(contract.ENGINES_KEY, "fake-other",
               EngineEntry(engine_id="fake-other", model=other, heartbeat=time.time()).encode())
        r.set(contract.engine_key("fake-other"), b"1", ex=60)
        deadline = time.monotonic() + 10
        while {m["id"] for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]} != {MODEL, other}:
            assert time.monotonic() < deadline, "the gateway never listed the second model"
            time.sleep(0.2)
        err = assert_error(httpx.post(f"{gateway.url}/tokenize", json={"prompt": "x"}), 400, param="model",
                           code="missing_required_parameter")
        assert "2 models are served" in err["message"] and repr(MODEL) in err["message"]
        assert httpx.post(f"{gateway.url}/tokenize", json={"model": other, "prompt": "x"}).status_code == 200
    finally:
        r.delete(contract.model_card_key(other), contract.engine_key("fake-other"))
        r.hdel(contract.ENGINES_KEY, "fake-other")
        r.srem(contract.MODELS_KEY, other)
        r.close()


def test_version_and_ping(gateway, fake_engine) -> None:
    r = httpx.get(f"{gateway.url}/version")
    assert r.status_code == 200 and r.json() == {"version": sluice.__version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{gateway.url}/ping")
        assert r.status_code == 200 and r.content == b""
    fake_engine.kill()  # no live engine: /ping answers /health's 503 (it looks afresh each time)
    r = httpx.get(f"{gateway.url}/ping")
    assert_error(r, 503, code="no_engine")
    assert httpx.get(f"{gateway.url}/health").status_code == 503


def test_models_entries_have_max_model_len_and_owned_by(gateway) -> None:
    data = httpx.get(f"{gateway.url}/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL]
    entry = data[0]
    assert entry["object"] == "model" and entry["owned_by"] == "sluice"
    assert entry["max_model_len"] == MAX_MODEL_LEN
    assert entry["root"] == MODEL and isinstance(entry["created"], int)
    assert httpx.get(f"{gateway.url}/v1/models/{MODEL}").json() == entry


def test_openapi_documents_the_utility_endpoints() -> None:
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    paths = create_app(GatewayConfig()).openapi()["paths"]
    ok = paths["/tokenize"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/TokenizeResponse"}
    assert "/detokenize" in paths and "/version" in paths
    assert {"get", "post"} <= set(paths["/ping"])


def test_utility_endpoints_are_counted_in_metrics(gateway) -> None:
    httpx.post(f"{gateway.url}/tokenize", json={"prompt": "x"})
    text = httpx.get(f"{gateway.url}/metrics").text
    assert 'sluice_gateway:http_requests_total{endpoint="/tokenize",status="200"}' in text


# A template that writes the messages as "role: content|" and reads a chat_template_kwargs variable.
OWN_TEMPLATE = "{{ prefix }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"


def test_a_request_chat_template_is_refused_not_ignored(gateway, fake_engine) -> None:
    """A chat request's `chat_template` is never silently ignored (the model's rendered instead).
    Without --trust-request-chat-template it is a 400 naming it, as /tokenize answers."""
    r = httpx.post(f"{gateway.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "chat_template": OWN_TEMPLATE})
    err = assert_error(r, 400, param="chat_template")
    assert "--trust-request-chat-template" in err["message"]
    assert fake_engine.requests == []


def test_a_trusted_request_chat_template_is_rendered(make_gateway, fake_engine, tok) -> None:
    """With --trust-request-chat-template (vLLM's flag) the request's template and its
    chat_template_kwargs render the prompt, in chat completions and /tokenize alike."""
    gw = make_gateway(trust_request_chat_template=True)
    body = {"model": MODEL, "messages": MESSAGES, "chat_template": OWN_TEMPLATE,
            "chat_template_kwargs": {"prefix": "P> "}}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    want = tok.encode("P> system: You are terse.|user: Hi! 你好|", add_special_tokens=False)
    assert list(fake_engine.requests[-1].prompt_token_ids) == want
    assert httpx.post(f"{gw.url}/tokenize", json=body).json()["tokens"] == want
    # the model's template, with a kwarg it does not read, is unchanged by it
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                          "chat_template_kwargs": {"prefix": "P> "}}, timeout=30)
    assert r.status_code == 200, r.text
    assert list(fake_engine.requests[-1].prompt_token_ids) == tok.encode(
        tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    # a broken template is the client's: a 400 naming it
    err = assert_error(httpx.post(f"{gw.url}/v1/chat/completions",
                                  json={**body, "chat_template": "{% for %}", "max_tokens": 2}), 400,
                       param="chat_template")
    assert "syntax error" in err["message"]
