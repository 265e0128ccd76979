"""``gateway.body_shape`` and ``gateway.request_body.parse``: a body's counts, nesting and size in
values are refused on the parsed JSON, naming the parameter, at exactly the limits of
``sluice.wire.limits``; the prepare pool's flags reach ``GatewayConfig``."""

from __future__ import annotations

import argparse
import json

import pytest

from gateway import body_shape
from gateway.errors import OpenAIError
from gateway.main import add_arguments, config_from_args
from gateway.protocol import ChatCompletionRequest
from gateway.request_body import parse
from gateway.responses.models import CreateResponseRequest
from sluice.wire import limits

MSG = {"role": "user", "content": "x"}


def _nested(depth: int) -> list:
    """A list ``depth`` levels deep (the root counts as one)."""
    out: list = []
    for _ in range(depth - 1):
        out = [out]
    return out


def _refusal(data, model: str = "ChatCompletionRequest") -> tuple[str | None, str]:
    err = body_shape.check(data, model)
    assert err is not None and err.status == 400
    return err.param, err.message


@pytest.mark.parametrize(("body", "model", "param"), [
    ({"messages": [MSG] * (limits.MESSAGES.max_items + 1)}, "ChatCompletionRequest", "messages"),
    ({"messages": [MSG] * 100_000}, "TokenizeRequest", "messages"),
    ({"messages": [MSG, {"role": "user", "content": [{"type": "text", "text": "x"}] * 257}]},
     "ChatCompletionRequest", "messages[1].content"),
    ({"messages": [MSG], "tools": [{}] * (limits.TOOLS.max_items + 1)}, "ChatCompletionRequest", "tools"),
    ({"input": [MSG] * (limits.INPUT_ITEMS.max_items + 1)}, "CreateResponseRequest", "input"),
    ({"input": [MSG, MSG, {"role": "user", "content": [{"type": "input_text", "text": "x"}] * 257}]},
     "CreateResponseRequest", "input[2].content"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{}] * 257}]},
     "CreateResponseRequest", "input[0].output"),
    ({"input": "x", "tools": [{}] * 129}, "CreateResponseRequest", "tools"),
])
def test_counts_over_the_limit_are_refused_naming_the_parameter(body, model, param) -> None:
    got, message = _refusal(body, model)
    assert got == param and f"{param} may have at most" in message


def test_counts_at_the_limit_pass() -> None:
    assert body_shape.check({"messages": [MSG] * limits.MESSAGES.max_items,
                             "tools": [{}] * limits.TOOLS.max_items}, "ChatCompletionRequest") is None
    assert body_shape.check({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 256}]},
                            "CreateResponseRequest") is None
    # a model without counts of its own gets the walk only
    assert body_shape.check({"messages": [MSG] * 10_000}, "CompletionRequest") is None


def test_nesting_and_values_are_bounded_for_any_body() -> None:
    deepest = limits.NESTING.max_levels
    assert body_shape.check({"response_format": _nested(deepest)}, "CompletionRequest") is None
    param, message = _refusal({"response_format": _nested(deepest + 1)}, "CompletionRequest")
    assert param.startswith("response_format") and f"more than {deepest} levels deep" in message
    most = limits.BODY_VALUES.max_items
    assert body_shape.check({"junk": [0] * (most - 2)}, "CompletionRequest") is None  # root + junk's list
    param, message = _refusal({"junk": [0] * (most - 1)}, "CompletionRequest")
    assert param is None and "at most 262144 JSON values" in message
    assert body_shape.check("a string", "CompletionRequest") is None  # pydantic says what is wrong with it


def _refused(raw: bytes, model=ChatCompletionRequest) -> OpenAIError:
    with pytest.raises(OpenAIError) as exc:
        parse(None, model, raw, True)
    assert exc.value.status == 400
    return exc.value


def test_parse_refuses_like_fastapi_and_bounds_before_pydantic() -> None:
    assert _refused(b'{"model": ').code == "invalid_json"
    assert _refused(b"[" * 100_000 + b"]" * 100_000).code == "invalid_json"  # deeper than the parser recurses
    assert _refused(b'\xff{}').code == "invalid_json"  # not UTF-8
    assert _refused(b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}').param == \
        "messages[0].content"
    assert _refused(b"[]").message == "The request body must be a JSON object."
    err = _refused(b'{"model": "m"}')
    assert (err.code, err.param) == ("missing_required_parameter", "messages")
    err = _refused(json.dumps({"model": "m", "input": [MSG] * 100_000}).encode(), CreateResponseRequest)
    assert err.param == "input" and "at most 2048" in err.message
    body = parse(None, ChatCompletionRequest, json.dumps({"model": "m", "messages": [MSG]}).encode(), True)
    assert isinstance(body, ChatCompletionRequest) and body.messages[0].content == "x"


def test_the_prepare_pool_flags_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args([]))
    assert (cfg.prepare_pool_workers, cfg.prepare_pool_queue, cfg.prepare_pool_threshold_bytes) == (2, 8, 65536)
    cfg = config_from_args(parser.parse_args(["--prepare-pool-workers", "0", "--prepare-pool-queue", "3",
                                              "--prepare-pool-threshold-bytes", "1024"]))
    assert (cfg.prepare_pool_workers, cfg.prepare_pool_queue, cfg.prepare_pool_threshold_bytes) == (0, 3, 1024)
