"""The gateway against a real Redis and a fake engine that follows the contract."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from sluice.wire import contract
from sluice.wire.connection import connect
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_support import MAX_MODEL_LEN, MODEL, REPLY
from tests.queue_helpers import inflight_pattern
from tests.waiting import wait_until

# the shared fixtures
fake_engine = support.fake_engine
gateway = support.gateway
make_gateway = support.make_gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]


def sse_events(resp: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, parsed (the final "[DONE]" kept as a string);
    `id:` lines (resumable streams: `<id>:<n>`) are checked to count the chunks from 1."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
        elif line.startswith("id: "):
            assert int(line.rpartition(":")[2]) == len(out) + 1, line
        else:
            assert line == "" or line.startswith(":"), line
    return out


def assert_error(resp: httpx.Response, status: int, param: str | None = "__any__", code: str | None = None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def reply_prefix(fake, k: int, offset: int = 0) -> str:
    ids = fake.reply_ids[offset:] + fake.reply_ids[:offset]
    return fake.tokenizer.decode(ids[:k], skip_special_tokens=True)


# --- happy paths -------------------------------------------------------------------------------


def test_completion_non_streaming(gateway, fake_engine):
    r = httpx.post(f"{gateway.url}/v1/completions",
                   json={"model": MODEL, "prompt": "Say hello", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == reply_prefix(fake_engine, 5)
    assert choice["finish_reason"] == "length"
    prompt_len = len(fake_engine.tokenizer.encode("Say hello"))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 5, "total_tokens": prompt_len + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # the fake engine caches nothing
    (req,) = fake_engine.requests
    assert req.params.max_tokens == 5 and req.params.temperature == 0
    assert req.deadline > time.time() and req.enqueue_time <= time.time()
    assert list(req.prompt_token_ids) == fake_engine.tokenizer.encode("Say hello")


def test_completion_full_reply_multibyte(gateway, fake_engine):
    r = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200})
    body = r.json()
    assert body["choices"][0]["text"] == REPLY
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == 2
    assert body["usage"]["prompt_tokens"] == 3


def test_completion_streaming_format_and_usage(gateway, fake_engine):
    payload = {"model": MODEL, "prompt": "Hi", "max_tokens": 200, "stream": True,
               "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=payload) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(fake_engine.reply_ids)
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == REPLY
    assert "\ufffd" not in text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_streaming_format(gateway, fake_engine):
    payload = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
               "max_completion_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=payload) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == reply_prefix(fake_engine, 8)
    (req,) = fake_engine.requests
    prompt = fake_engine.tokenizer.decode(req.prompt_token_ids)
    assert "Be brief." in prompt and "Hi" in prompt and prompt.rstrip().endswith("assistant")


def test_chat_non_streaming_n2_logprobs(gateway, fake_engine):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 2,
               "logprobs": True, "top_logprobs": 2}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=payload)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for c in body["choices"]:
        assert c["message"]["role"] == "assistant"
        assert c["message"]["content"] == reply_prefix(fake_engine, 6, offset=c["index"])
        content = c["logprobs"]["content"]
        assert len(content) == 6
        assert content[0]["logprob"] == -0.25 and len(content[0]["top_logprobs"]) == 2
        assert bytes(content[0]["bytes"]).decode() == content[0]["token"]
    assert body["usage"]["completion_tokens"] == 12


@pytest.mark.both_topologies
def test_completion_list_of_prompts_n2_streaming(gateway, fake_engine):
    payload = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=payload) as resp:
        events = sse_events(resp)
    by_index: dict[int, str] = {}
    finishes = {}
    for c in events[:-1]:
        ch = c["choices"][0]
        by_index[ch["index"]] = by_index.get(ch["index"], "") + ch["text"]
        if ch["finish_reason"]:
            finishes[ch["index"]] = ch["finish_reason"]
    assert sorted(by_index) == [0, 1, 2, 3]
    assert finishes == {i: "length" for i in range(4)}
    assert by_index[0] == by_index[2] == reply_prefix(fake_engine, 3)
    assert by_index[1] == by_index[3] == reply_prefix(fake_engine, 3, offset=1)
    assert len(fake_engine.requests) == 2


def test_completion_logprobs_and_echo(gateway, fake_engine):
    r = httpx.post(f"{gateway.url}/v1/completions",
                   json={"model": MODEL, "prompt": "Hi there", "max_tokens": 3, "logprobs": 1, "echo": True})
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == "Hi there" + reply_prefix(fake_engine, 3)
    lp = choice["logprobs"]
    n_prompt = len(fake_engine.tokenizer.encode("Hi there"))
    assert len(lp["tokens"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][-1] == -0.25
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["top_logprobs"][-1][lp["tokens"][-1]] == -0.25


def test_stop_string_across_tokens_cancels(gateway, fake_engine):
    # "world" spans token boundaries in the reply; the text stops right before it
    r = httpx.post(f"{gateway.url}/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": 200, "stop": ["orld!", "zzz"]})
    body = r.json()
    assert body["choices"][0]["text"] == "Hello w"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == "orld!"
    rid = fake_engine.requests[0].request_id
    assert fake_engine.wait_cancel(rid)
    assert body["usage"]["completion_tokens"] < len(fake_engine.reply_ids)


def test_stop_string_streaming_include_stop(gateway, fake_engine):
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stop": "你好", "stream": True,
               "include_stop_str_in_output": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=payload) as resp:
        events = sse_events(resp)
    text = "".join(c["choices"][0]["text"] for c in events[:-1])
    assert text == "Hello world! 你好"
    assert fake_engine.wait_cancel(fake_engine.requests[0].request_id)


@pytest.mark.both_topologies
def test_streaming_disconnect_cancels(make_gateway, fake_engine):
    # Not resumable: cancelled at once. (A resumable stream waits for a resume first:
    # tests/e2e/test_openai_sdk.py::test_disconnect_mid_stream_frees_kv_blocks.)
    gateway = make_gateway(resumable_streams=False)
    fake_engine.token_delay = 0.05
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=payload) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # close after the first chunk
    rid = fake_engine.requests[0].request_id
    assert fake_engine.wait_cancel(rid), "no Cancel published after the client went away"
    assert rid not in fake_engine.finished


def test_non_streaming_disconnect_cancels(gateway, fake_engine):
    fake_engine.hang = True

    def client():
        try:
            httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=0.5)
        except httpx.TimeoutException:
            pass

    t = threading.Thread(target=client)
    t.start()
    t.join()
    wait_until(lambda: fake_engine.requests, 5, "the request read by the engine")
    rid = fake_engine.requests[0].request_id
    assert fake_engine.wait_cancel(rid)
    assert redis_marker(gateway, rid)


def redis_marker(gw, rid: str) -> bool:

    r = connect(gw.config.redis_url)
    try:
        return bool(r.keys(contract.cancelled_key("*", rid)))
    finally:
        r.close()


def test_models_health_metrics(gateway, fake_engine):
    r = httpx.get(f"{gateway.url}/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert [m["id"] for m in data] == [MODEL] and data[0]["object"] == "model"
    assert data[0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{gateway.url}/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(httpx.get(f"{gateway.url}/v1/models/nope"), 404, code="model_not_found")
    assert httpx.get(f"{gateway.url}/health").status_code == 200
    httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    text = httpx.get(f"{gateway.url}/metrics").text
    for name in ("sluice_gateway:time_to_first_token_seconds_bucket", "sluice_gateway:inter_token_latency_seconds_bucket",
                 "sluice_gateway:e2e_request_latency_seconds_bucket", "sluice_gateway:request_queue_time_seconds_bucket",
                 "sluice_gateway:num_requests_waiting", "sluice_gateway:prompt_tokens_total", "sluice_gateway:generation_tokens_total",
                 'sluice_gateway:http_requests_total{endpoint="/v1/completions",status="200"}',
                 "sluice_gateway:request_success_total"):
        assert name in text, name
    fake_engine.kill()  # the key is gone on return: /health checks afresh
    assert_error(httpx.get(f"{gateway.url}/health"), 503)
    # /v1/models reads the liveness the gateway caches for up to a second
    wait_until(lambda: httpx.get(f"{gateway.url}/v1/models").json()["data"] == [], 5, "no model listed")


# --- the error matrix --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"model": MODEL, "prompt": "x", "temperature": 5}, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "x", "n": 100}, "n"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": MODEL, "prompt": "x", "logprobs": 50}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"model": MODEL, "prompt": [10**6]}, "prompt"),
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": MODEL, "prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"model": MODEL}, "prompt"),
        ({"prompt": "x"}, "model"),
    ],
)
def test_invalid_parameters_400(gateway, payload, param):
    err = assert_error(httpx.post(f"{gateway.url}/v1/completions", json=payload), 400, param=param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_chat_invalid_parameters_400(gateway, payload, param):
    assert_error(httpx.post(f"{gateway.url}/v1/chat/completions", json=payload), 400, param=param)


def test_malformed_json_400(gateway):
    r = httpx.post(f"{gateway.url}/v1/completions", content=b'{"model": "x", "prompt": ',
                   headers={"content-type": "application/json"})
    assert_error(r, 400, param=None, code="invalid_json")
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=b"[1, 2]",
                   headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_unknown_model_404(gateway):
    r = httpx.post(f"{gateway.url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert_error(r, 404, param="model", code="model_not_found")


def test_context_length_400(gateway):
    r = httpx.post(f"{gateway.url}/v1/completions",
                   json={"model": MODEL, "prompt": [5] * 200, "max_tokens": 100})
    err = assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    r = httpx.post(f"{gateway.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300}]})
    err = assert_error(r, 400, param="messages", code="context_length_exceeded")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]


def test_api_key_401(make_gateway, fake_engine):
    gw = make_gateway(api_keys=["sekret"])
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert_error(httpx.post(f"{gw.url}/v1/completions", json=payload), 401, code="invalid_api_key")
    assert_error(httpx.post(f"{gw.url}/v1/completions", json=payload, headers={"Authorization": "Bearer nope"}),
                 401)
    assert_error(httpx.get(f"{gw.url}/v1/models"), 401)
    ok = httpx.post(f"{gw.url}/v1/completions", json=payload, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200


def test_body_too_large_413(make_gateway, fake_engine):
    gw = make_gateway(max_body_bytes=1000)
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x" * 2000})
    assert_error(r, 413)

    def chunks():
        for _ in range(20):
            yield b" " * 100

    r = httpx.post(f"{gw.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413)


@pytest.mark.both_topologies
def test_queue_full_429(make_gateway, fake_engine, redis_client):
    """--max-queue-len counts the model's requests admitted and not yet started, on every gateway:
    two waiting on one gateway fill it for the other."""
    gw, other = make_gateway(max_queue_len=2, retry_after_s=3), make_gateway(max_queue_len=2)
    fake_engine.pause()  # nothing is read: the first two stay queued
    waiting = [threading.Thread(target=httpx.post, args=(f"{gw.url}/v1/completions",),
                                kwargs={"json": {"model": MODEL, "prompt": "x", "max_tokens": 2}, "timeout": 30})
               for _ in range(2)]
    for t in waiting:
        t.start()
    wait_until(lambda: redis_client.zcard(contract.model_queued_key(MODEL)) == 2, 10, "two queued")
    r = httpx.post(f"{other.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert_error(r, 429, code="queue_full")
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert_error(r, 429, code="queue_full")
    assert r.headers["retry-after"] == "3"
    fake_engine.paused = False  # they start, leave the queue, and end
    for t in waiting:
        t.join(30)
    wait_until(lambda: redis_client.zcard(contract.model_queued_key(MODEL)) == 0, 10, "the queue empty")
    r = httpx.post(f"{other.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_queue_limit_holds_under_a_burst(make_gateway, fake_engine, redis_client):
    """200 requests at once against --max-queue-len 10 on two gateways: exactly 10 are admitted
    (admission is one script in Redis: no read-then-enqueue window), the rest get 429."""
    gws = [make_gateway(max_queue_len=10, request_timeout_s=60), make_gateway(max_queue_len=10,
                                                                               request_timeout_s=60)]
    fake_engine.pause()

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as c:
            async def one(i: int) -> int:
                r = await c.post(f"{gws[i % 2].url}/v1/completions",
                                 json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                return r.status_code

            tasks = [asyncio.ensure_future(one(i)) for i in range(200)]
            await asyncio.sleep(0)
            while sum(t.done() for t in tasks) < 190:
                await asyncio.sleep(0.05)
            assert redis_client.zcard(contract.model_queued_key(MODEL)) == 10
            fake_engine.paused = False
            return await asyncio.gather(*tasks)

    codes = asyncio.run(burst())
    assert codes.count(200) == 10 and codes.count(429) == 190, sorted(set(codes))
    assert len(fake_engine.requests) == 10


def test_no_engine_503(gateway, fake_engine):
    fake_engine.kill()
    assert_error(httpx.get(f"{gateway.url}/health"), 503)  # a fresh look, which the gateway keeps
    r = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert_error(r, 503, code="no_engine")


def test_deadline_504(make_gateway, fake_engine):
    gw = make_gateway(request_timeout_s=0.5)
    fake_engine.hang = True
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert_error(r, 504, code="deadline_exceeded")
    assert fake_engine.wait_cancel(fake_engine.requests[0].request_id)
    r = httpx.post(f"{gw.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert_error(r, 504)


def test_engine_error_event(gateway, fake_engine):
    fake_engine.error = ("invalid_request", "bad things")
    r = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    err = assert_error(r, 400, code="invalid_request")
    assert err["message"] == "bad things"


def test_engine_lost_503(gateway, fake_engine, monkeypatch):
    from gateway import generation

    monkeypatch.setattr(generation, "LIVENESS_CHECK_S", 0.2)
    monkeypatch.setattr(generation, "NO_ENGINE_WAIT_S", 1.0)  # the bound untouched work waits for an engine
    fake_engine.hang = True
    result = {}

    def client():
        result["r"] = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=20)

    t = threading.Thread(target=client)
    t.start()
    wait_until(lambda: fake_engine.requests, 5, "the request read by the engine")
    fake_engine.kill()
    t.join(10)
    assert_error(result["r"], 503, code="engine_lost")
    assert result["r"].headers["retry-after"] == "1"


@pytest.mark.both_topologies
def test_a_silently_dropped_subscription_is_noticed_and_audited(gateway, fake_engine):
    """After a cluster failover redis-py's cluster pub/sub can lose the gateway's subscription
    without an error (its own move of the channel to the promoted node fails and is not retried):
    simulated by unsubscribing behind the broker's back. The broker's periodic check (nobody
    subscribed to its channel) subscribes again and audits: a request an engine had taken gets a
    retryable 503 within seconds instead of waiting for its deadline."""
    import asyncio

    fake_engine.hang = True  # taken by the engine, never answered: its events could be lost
    broker = gateway.app.state.broker
    result = {}

    def client():
        result["r"] = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=60)

    t = threading.Thread(target=client)
    t.start()
    wait_until(lambda: fake_engine.requests, 5, "the request read by the engine")
    loop = broker._reader.get_loop()
    asyncio.run_coroutine_threadsafe(broker._pubsub.sunsubscribe(broker._channel), loop).result(5)
    dropped = time.monotonic()
    t.join(30)
    assert_error(result["r"], 503, code="request_lost")
    assert result["r"].headers["retry-after"] == "1"
    assert time.monotonic() - dropped < 8, "the lost subscription was not noticed within seconds"
    assert broker.stats["reconnects"] == 1
    fake_engine.hang = False  # subscribed again: the next request is answered
    ok = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_queued_request_waits_for_a_restarted_engine(gateway, fake_engine, monkeypatch):
    """The only engine drains (or dies) while a request is queued, untouched: the request waits
    for an engine instead of failing at the first liveness check, and the restarted engine
    serves it."""
    from gateway import generation

    monkeypatch.setattr(generation, "LIVENESS_CHECK_S", 0.2)
    fake_engine.paused = True  # the request stays in the queue
    result = {}

    def client():
        result["r"] = httpx.post(f"{gateway.url}/v1/completions",
                                 json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=30)

    t = threading.Thread(target=client)
    t.start()
    r = connect(gateway.config.redis_url)
    wait_until(lambda: r.keys(inflight_pattern(MODEL)), 10, "the request enqueued")
    r.close()
    fake_engine.kill()  # gone: no liveness key, no heartbeat
    time.sleep(3.0)  # many liveness checks see no engine
    assert t.is_alive(), f"failed while queued: {result['r'].status_code} {result['r'].text}"
    fake_engine.heartbeat = True  # "restarted"
    fake_engine.paused = False
    t.join(20)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["choices"][0]["text"] == reply_prefix(fake_engine, 3)


@pytest.mark.both_topologies
def test_two_gateways_interleaved(make_gateway, fake_engine):
    from concurrent.futures import ThreadPoolExecutor

    gws = [make_gateway(), make_gateway()]
    fake_engine.token_delay = 0.01

    def one(i: int) -> tuple[int, str]:
        gw = gws[i % 2]
        payload = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 6, "stream": bool(i % 3 == 0)}
        if payload["stream"]:
            with httpx.stream("POST", f"{gw.url}/v1/completions", json=payload) as resp:
                events = sse_events(resp)
            return 200, "".join(c["choices"][0]["text"] for c in events[:-1])
        r = httpx.post(f"{gw.url}/v1/completions", json=payload)
        return r.status_code, r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(12)))
    assert all(status == 200 and text == reply_prefix(fake_engine, 6) for status, text in results)
    assert len(fake_engine.requests) == 12


def test_limits_shared_with_the_engine_refused_before_queueing(gateway, fake_engine):
    """sluice.wire.limits: what the engine would refuse, the gateway refuses first (400, nothing queued)."""
    from sluice.wire import limits

    too_many = list(range(limits.STOP_TOKEN_IDS.max_items + 1))
    r = httpx.post(f"{gateway.url}/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stop_token_ids": too_many})
    assert_error(r, 400)
    bias = {str(i): 1 for i in range(limits.LOGIT_BIAS.max_items + 1)}
    r = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                          "logit_bias": bias})
    assert_error(r, 400)
    assert not fake_engine.requests


def test_the_gateway_shards_by_prompt_prefix(gateway, fake_engine):
    """Chat requests of one tenant (system prompt) share a queue shard, a conversation's next turn
    stays on its shard, different tenants spread, and prompts that are all chat-template header
    (no system prompt, a short message) spread by request id instead of piling onto one shard."""
    def chat(messages: list[dict]) -> str:
        r = httpx.post(f"{gateway.url}/v1/chat/completions",
                       json={"model": MODEL, "messages": messages, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        return fake_engine.stream_of[fake_engine.requests[-1].request_id]

    def system(tenant: int) -> dict:
        return {"role": "system", "content": f"You are the assistant of tenant number {tenant}. " + "Be precise and kind. " * 40}

    tenants = {t: chat([system(t), {"role": "user", "content": f"question {q}"}]) for t in range(6) for q in range(2)}
    for t in range(6):
        assert len({chat([system(t), {"role": "user", "content": f"another question {q}"}]) for q in range(3)}) == 1
        assert chat([system(t), {"role": "user", "content": "x"}]) == tenants[t]
    assert len(set(tenants.values())) >= 3, tenants
    # a conversation: turn 2 carries turn 1 (and its answer) as its prefix
    turn1 = [system(99), {"role": "user", "content": "What is a shard?"}]
    first = chat(turn1)
    turn2 = [*turn1, {"role": "assistant", "content": "A part of a queue."}, {"role": "user", "content": "And a slot?"}]
    assert chat(turn2) == first
    # header-only prompts: no system prompt and a one-word message spread over several shards
    assert len({chat([{"role": "user", "content": "hi"}]) for _ in range(16)}) >= 4
