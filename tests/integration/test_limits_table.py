"""Every limit of ``sluice.wire.limits.TABLE``, broken on purpose at each layer it names, is refused
with the same words: at the HTTP edge (a 400 whose ``param`` names the field), in the offline API
(``SamplingParams``' ``ValueError``, the scheduler's door) and at the engine on a raw queue entry (an
error event). The rules that need the model (an empty prompt, the context length on both endpoints,
ids outside the vocabulary, ``min_tokens`` over ``max_tokens``) are walked the same way.

The cases are generated from the table, so a limit added there is walked without touching this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from engine_service.core.request import Request
from engine_service.core.sampling_params import SamplingParams
from engine_service.core.scheduler import RequestRejected
from engine_service.service.io_types import Entry
from sluice.wire import codec, limits
from sluice.wire.error_codes import Code
from tests.integration import test_gateway_support as support
from tests.integration.test_engine_service_worker import FakeEngine, start, stop, terminal, wait_for
from tests.integration.test_gateway_support import MAX_MODEL_LEN, MODEL

pytestmark = [pytest.mark.model, pytest.mark.redis]

fake_engine = support.fake_engine
gateway = support.gateway
make_gateway = support.make_gateway

ENGINE_MODEL_LEN = 64


@dataclass
class Case:
    """One way to break ``limit``: the value given to its parameter, and the message expected."""

    name: str
    limit: limits.Bound | limits.Size
    value: Any

    @property
    def param(self) -> str:
        return self.limit.param

    def message(self) -> str:
        items = [self.value] if self.limit is limits.STOP and isinstance(self.value, str) else self.value
        msg = self.limit.problem(items)
        assert msg is not None, f"{self.name}: {self.value!r} does not break {self.limit}"
        return msg


def _outside(bound: limits.Bound) -> list[Any]:
    step = 1 if bound.integer else 0.5
    below = bound.low if bound.low_open else bound.low - step
    return [below, bound.high + step]


def cases() -> list[Case]:
    out = []
    for limit in limits.TABLE:
        if isinstance(limit, limits.Bound):
            if limit is limits.LOGIT_BIAS_VALUE:
                out += [Case(f"{limit.param}[{v}]", limit, v) for v in _outside(limit)]
            else:
                out += [Case(f"{limit.param}={v}", limit, v) for v in _outside(limit)]
        else:
            out.append(Case(f"{limit.param} x{limit.max_items + 1}", limit, _items(limit, limit.max_items + 1)))
            if limit.max_chars is not None:
                out.append(Case(f"{limit.param} {limit.max_chars + 1} chars", limit, "s" * (limit.max_chars + 1)))
    return out


def _items(limit: limits.Size, n: int) -> Any:
    if limit is limits.LOGIT_BIAS:
        return {i: 1.0 for i in range(n)}
    if limit is limits.REQUEST_ID:
        return "r" * n
    if limit is limits.STOP:
        return [f"stop{i}" for i in range(n)]
    if limit is limits.PROMPTS:
        return [[1, 2]] * n
    return list(range(n))  # token ids


CASES = cases()


def test_every_limit_is_walked():
    """The generator covers the whole table: each limit below and above (or one entry too many)."""
    walked = {id(c.limit) for c in CASES}
    assert walked == {id(limit) for limit in limits.TABLE}
    for limit in limits.TABLE:
        assert limit.layers, limit


# --- the HTTP edge -----------------------------------------------------------------------------


def _http_body(case: Case) -> dict:
    body: dict[str, Any] = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
    if case.limit is limits.LOGIT_BIAS_VALUE:
        body["logit_bias"] = {"5": case.value}
    elif case.limit is limits.LOGIT_BIAS:
        body["logit_bias"] = {str(k): v for k, v in case.value.items()}
    elif case.limit is limits.PROMPTS:
        body["prompt"] = case.value
    else:
        body[case.param] = case.value
    return body


def test_http_edge_refuses_each_limit_naming_the_field(gateway, fake_engine):
    url = f"{gateway.url}/v1/completions"
    walked = 0
    for case in CASES:
        if limits.HTTP not in case.limit.layers:
            continue
        walked += 1
        r = httpx.post(url, json=_http_body(case))
        assert r.status_code == 400, (case.name, r.text)
        err = r.json()["error"]
        assert err["param"] is not None and err["param"].startswith(case.param), (case.name, err)
        assert case.message() in err["message"], (case.name, err)
        assert err["code"] == Code.INVALID_VALUE, (case.name, err)
    assert walked >= 25
    # chat's names for two of them
    chat = f"{gateway.url}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    for field, bound in (("top_logprobs", limits.LOGPROBS), ("max_completion_tokens", limits.MAX_TOKENS)):
        bad = bound.high + 1
        r = httpx.post(chat, json={"model": MODEL, "messages": msgs, "logprobs": True, field: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert bound.problem(bad, field) in r.json()["error"]["message"]
    assert not fake_engine.requests  # nothing was queued


def test_http_edge_rules_that_need_the_model(gateway, fake_engine):
    url = f"{gateway.url}/v1/completions"
    chat = f"{gateway.url}/v1/chat/completions"
    vocab = 49152

    def refused(u: str, body: dict, param: str, problem: limits.Problem, code: str) -> None:
        r = httpx.post(u, json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == code, err
        assert problem.message in err["message"], (err, problem)

    refused(url, {"prompt": []}, "prompt", limits.invalid("prompt", limits.EMPTY_PROMPT), "invalid_value")
    refused(url, {"prompt": [1, vocab]}, "prompt", limits.check_prompt([1, vocab], vocab), "invalid_value")
    refused(url, {"prompt": [1], "stop_token_ids": [vocab]}, "stop_token_ids",
            limits.check_token_ids("stop_token_ids", [vocab], vocab), "invalid_value")
    refused(url, {"prompt": [1], "logit_bias": {str(vocab): 1}}, "logit_bias",
            limits.check_token_ids("logit_bias", [vocab], vocab), "invalid_value")
    refused(url, {"prompt": [1], "max_tokens": 3, "min_tokens": 4}, "min_tokens",
            limits.check_sampling({"max_tokens": 3, "min_tokens": 4}), "invalid_value")
    # the context-length rule, the same on both endpoints (and with max_tokens unset)
    long = [1] * (MAX_MODEL_LEN - 10)
    refused(url, {"prompt": long, "max_tokens": 11}, "prompt",
            limits.check_context(len(long), 11, MAX_MODEL_LEN, "prompt"), "context_length_exceeded")
    refused(url, {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": None}, "prompt",
            limits.check_context(MAX_MODEL_LEN, None, MAX_MODEL_LEN, "prompt"), "context_length_exceeded")
    text = "hello " * (MAX_MODEL_LEN + 10)
    r = httpx.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "messages"
    assert "which leaves no room for the completion" in r.json()["error"]["message"]
    r = httpx.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                               "max_completion_tokens": MAX_MODEL_LEN})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "This model's maximum context length is 256 tokens. However, you requested" in r.json()["error"]["message"]
    assert not fake_engine.requests


# --- the offline API -----------------------------------------------------------------------------


def _offline_kwargs(case: Case) -> dict:
    if case.limit is limits.LOGIT_BIAS_VALUE:
        return {"logit_bias": {5: case.value}}
    return {case.param: case.value}


def test_offline_api_refuses_each_limit_naming_the_field():
    walked = 0
    for case in CASES:
        if limits.OFFLINE not in case.limit.layers:
            continue
        walked += 1
        with pytest.raises(ValueError) as err:
            SamplingParams(**_offline_kwargs(case))
        assert str(err.value).startswith(case.param), case.name
        assert str(err.value) == case.message(), case.name
    assert walked >= 24
    with pytest.raises(ValueError) as err:
        SamplingParams(max_tokens=3, min_tokens=4)
    assert str(err.value) == limits.check_sampling({"max_tokens": 3, "min_tokens": 4}).message


def test_offline_door_applies_the_prompt_and_context_rules():
    from tests.unit.test_scheduler import make_scheduler

    sched, _ = make_scheduler(num_blocks=1000, block_size=16, max_model_len=ENGINE_MODEL_LEN)
    for prompt, max_tokens in (([], 4), ([1] * 60, 5), ([1] * ENGINE_MODEL_LEN, None)):
        want = (limits.check_prompt(prompt, None)
                or limits.check_context(len(prompt), max_tokens, ENGINE_MODEL_LEN))
        params = SamplingParams(max_tokens=max_tokens)
        with pytest.raises(RequestRejected) as err:
            sched.add_request(Request(f"r{len(prompt)}", prompt, params))
        assert (err.value.code, str(err.value)) == (want.code, want.message)


# --- the engine, on raw queue entries ------------------------------------------------------------


class SizedEngine(FakeEngine):
    max_model_len = ENGINE_MODEL_LEN


def _entry(name: str, prompt: list[int] | None = None, **params: Any) -> Entry:
    req = codec.make_request(name, "m", [1, 2, 3] if prompt is None else prompt,
                             {"temperature": 0.0, "max_tokens": 4}, reply_to="g")
    for key, value in params.items():
        if key == "logit_bias":
            req.params.logit_bias.update(value)
        elif key == "stop_token_ids":
            req.params.stop_token_ids.extend(value)
        else:
            setattr(req.params, key, value)
    return Entry(f"{name}-entry".encode(), req)


def _engine_entry(case: Case) -> Entry | None:
    """The entry breaking ``case``, or None when the wire's types cannot carry the value."""
    try:
        if case.limit is limits.REQUEST_ID:
            e = _entry("x")
            e.request.request_id = case.value
            return e
        if case.limit is limits.LOGIT_BIAS_VALUE:
            return _entry(case.name, logit_bias={5: case.value})
        return _entry(case.name, **{case.param: case.value})
    except (ValueError, TypeError):
        return None


def test_engine_refuses_each_limit_on_a_raw_entry():
    worker, io, thread = start(SizedEngine())
    sent: dict[str, Case] = {}
    for case in CASES:
        if limits.ENGINE not in case.limit.layers:
            continue
        e = _engine_entry(case)
        if e is None:  # e.g. logprobs=-1 on a uint32: the wire itself keeps that bound
            continue
        sent[e.request.request_id] = case
        io.inbox.put(e)
    rules = {
        "empty": (_entry("empty", prompt=[]), limits.invalid("prompt", limits.EMPTY_PROMPT)),
        "vocab": (_entry("vocab", prompt=[1, FakeEngine.vocab_size]),
                  limits.check_prompt([1, FakeEngine.vocab_size], FakeEngine.vocab_size)),
        "ctx": (_entry("ctx", prompt=[1] * 60, max_tokens=5), limits.check_context(60, 5, ENGINE_MODEL_LEN)),
        "min": (_entry("min", max_tokens=3, min_tokens=4), limits.check_sampling({"max_tokens": 3, "min_tokens": 4})),
    }
    for e, _ in rules.values():
        io.inbox.put(e)
    covered = {id(c.limit) for c in sent.values()}
    assert covered == {id(lim) for lim in limits.TABLE if limits.ENGINE in lim.layers}
    wait_for(lambda: all(terminal(io.events(rid)) for rid in [*sent, *rules]))
    stop(worker, thread)
    for rid, case in sent.items():
        (ev,) = io.events(rid)
        assert ev.error.code == Code.INVALID_REQUEST.wire, case.name
        assert ev.error.message == case.message(), (case.name, ev.error.message)
    for rid, (_, want) in rules.items():
        (ev,) = io.events(rid)
        assert (ev.error.code, ev.error.message) == (want.code.wire, want.message), rid
    assert not worker.engine.reqs


@pytest.mark.parametrize("state", ["cancelled", "gateway_lost"])
def test_engine_checks_limits_before_any_per_n_work(state):
    """A queue entry with n = 1,000,000 whose request is cancelled (or whose gateway is gone) is
    refused in the same step with ONE error event: the limits come before the per-completion abort
    events, so nothing loops over an n nobody checked."""
    worker, io, thread = start(SizedEngine())
    e = _entry("huge", n=1_000_000)
    setattr(e, state, True)
    io.inbox.put(e)
    io.inbox.put(_entry("next", max_tokens=2))
    wait_for(lambda: terminal(io.events("next")) and terminal(io.events("huge")))
    stop(worker, thread)
    (ev,) = io.events("huge")
    assert ev.error.code == Code.INVALID_REQUEST.wire and ev.error.message == limits.N.problem(1_000_000)
    assert b"huge-entry" in io.acks()
    # within the limit, a cancelled entry still ends every completion with "abort"
    worker, io, thread = start(SizedEngine())
    e = _entry("small", n=3)
    setattr(e, state, True)
    io.inbox.put(e)
    wait_for(lambda: len(io.events("small")) == 3)
    stop(worker, thread)
    assert sorted(ev.index for ev in io.events("small")) == [0, 1, 2]
    assert all(codec.finish_reason_name(ev.finished.finish_reason) == "abort" for ev in io.events("small"))
