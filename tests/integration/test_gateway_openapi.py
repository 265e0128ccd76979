"""/openapi.json documents the response bodies of both generation endpoints, and what the gateway
sends matches those models (bodies and stream chunks alike)."""

from __future__ import annotations

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.protocol import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
)
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import sse_events
from tests.integration.test_gateway_support import MODEL

pytestmark = pytest.mark.redis

fake_engine = support.fake_engine
gateway = support.gateway
make_gateway = support.make_gateway


def test_openapi_documents_generation_responses() -> None:
    schema = create_app(GatewayConfig()).openapi()
    components = schema["components"]["schemas"]
    for path, body, chunk in (("/v1/completions", "CompletionResponse", "CompletionStreamResponse"),
                              ("/v1/chat/completions", "ChatCompletionResponse", "ChatCompletionStreamResponse")):
        content = schema["paths"][path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{body}"}
        assert content["text/event-stream"]["schema"] == {"$ref": f"#/components/schemas/{chunk}"}
        assert {"id", "object", "created", "model", "choices", "usage"} <= set(components[body]["properties"])
        assert "choices" in components[chunk]["properties"]
        assert schema["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    # every reference resolves
    import json
    import re

    refs = set(re.findall(r"#/components/schemas/([\w.-]+)", json.dumps(schema)))
    assert refs <= set(components), refs - set(components)


@pytest.mark.model
def test_responses_match_their_models(gateway) -> None:
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{gateway.url}/v1/completions", json={**base, "prompt": "Hi", "logprobs": 2, "echo": True})
    assert r.status_code == 200, r.text
    assert CompletionResponse.model_validate(r.json()).choices[0].logprobs is not None
    r = httpx.post(f"{gateway.url}/v1/chat/completions",
                   json={**base, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    assert ChatCompletionResponse.model_validate(r.json()).choices[0].message.content
    for path, extra, model in (("/v1/completions", {"prompt": "Hi", "logprobs": 1}, CompletionStreamResponse),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
                                ChatCompletionStreamResponse)):
        with httpx.stream("POST", f"{gateway.url}{path}",
                          json={**base, **extra, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        chunks = [model.model_validate(e) for e in events[:-1]]
        assert chunks[-1].usage is not None and chunks[-1].choices == []
        assert all("usage" in e for e in events[:-1])  # include_usage: null on every other chunk
