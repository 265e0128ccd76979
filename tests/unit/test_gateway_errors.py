"""Gateway errors that need no Redis: validation (400), auth (401), body size (413), OpenAI's shape."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.errors import _param_of


@pytest.fixture
def client() -> TestClient:
    # No lifespan: nothing here may reach the broker.
    return TestClient(create_app(GatewayConfig(api_keys=["k"], max_body_bytes=2000)), raise_server_exceptions=False)


AUTH = {"Authorization": "Bearer k"}


def error_of(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_malformed_json(client):
    err = error_of(client.post("/v1/completions", content=b"{nope", headers={**AUTH, "content-type": "application/json"}),
                   400)
    assert err["code"] == "invalid_json" and err["param"] is None


@pytest.mark.parametrize("prompt", ["x", "x\\ud83d\\ude00", "x\\ud800", "x\\u00e9", "ünï"])
@pytest.mark.parametrize("open_, close", [("[", "]"), ('{"a":', "}")])
def test_deeply_nested_body_is_400(prompt, open_, close):
    """Nested past the parser's recursion, a body with a surrogate escape (parsed by
    body_checks) was a 500 RecursionError; without one (parsed by FastAPI) a 400 without a code."""
    client = TestClient(create_app(GatewayConfig(api_keys=["k"])), raise_server_exceptions=False)
    raw = f'{{"model": "m", "max_tokens": 2, "prompt": "{prompt}", "zz": {open_ * 10000}1{close * 10000}}}'
    r = client.post("/v1/completions", content=raw.encode(), headers={**AUTH, "content-type": "application/json"})
    err = error_of(r, 400)
    assert err["code"] == "invalid_json" and err["param"] is None, err
    assert "nested too deeply" in err["message"], err


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": "m", "prompt": "x", "top_p": 2}, "top_p"),
        ("/v1/completions", {"model": "m", "prompt": "x", "presence_penalty": -3}, "presence_penalty"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logit_bias": {"1": 500}}, "logit_bias[1]"),
        ("/v1/completions", {"model": "m", "prompt": [[1, -2]]}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "seed": 2**70}, "seed"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 3}]},
         "messages[0].content"),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user"}], "top_logprobs": 99}, "top_logprobs"),
    ],
)
def test_invalid_parameter_named(client, path, body, param):
    err = error_of(client.post(path, json=body, headers=AUTH), 400)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_missing_parameter(client):
    err = error_of(client.post("/v1/chat/completions", json={"model": "m"}, headers=AUTH), 400)
    assert err["param"] == "messages" and err["code"] == "missing_required_parameter"


def test_auth(client):
    error_of(client.post("/v1/completions", json={}), 401)
    error_of(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    error_of(client.get("/v1/models", headers={"Authorization": "Basic k"}), 401)


def test_body_limit(client):
    err = error_of(client.post("/v1/completions", json={"model": "m", "prompt": "x" * 5000}, headers=AUTH), 413)
    assert "2000 bytes" in err["message"]


def test_unknown_route_is_openai_shaped(client):
    error_of(client.get("/nope", headers=AUTH), 404)
    error_of(client.get("/nope"), 401)  # with a key set, only OPEN_PATHS answer without it
    error_of(client.get("/v1/completions", headers=AUTH), 405)


def test_param_of():
    assert _param_of(("body", "messages", 0, "content")) == "messages[0].content"
    assert _param_of(("body", "prompt", "str")) == "prompt"
    assert _param_of(("body",)) is None


def test_every_path_but_probes_and_docs_needs_the_key():
    """/tokenize and /detokenize need the API key like /v1/ (else anyone could spend the gateway's
    CPU tokenizing megabytes). Probes, metrics, the
    version and the API's documentation stay open (documented in docs/api.md)."""
    client = TestClient(create_app(GatewayConfig(api_keys=["k"])), raise_server_exceptions=False)
    for path in ("/tokenize", "/detokenize", "/v1/completions", "/v1/models", "/anything-else"):
        r = client.post(path, json={"prompt": "x", "tokens": [1]}) if path != "/v1/models" else client.get(path)
        err = error_of(r, 401)
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer", path
    for path in ("/version", "/openapi.json", "/docs", "/redoc"):
        assert client.get(path).status_code == 200, path
    # /health, /ping and /metrics read Redis (absent here): whatever they answer, not a 401
    for path in ("/health", "/ping", "/metrics"):
        assert client.get(path).status_code != 401, path
