"""The official openai SDK against real processes: Redis, one engine, two gateways."""

from __future__ import annotations

import asyncio
import time

import pytest
from openai import AsyncOpenAI, OpenAI

from engine_service import LLM, SamplingParams

# Redis Cluster changes what these check (sharded channels, hash-tagged queue, cross-node cancels):
# the module runs on both topologies.
pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.both_topologies, pytest.mark.redis]

PROMPTS = ["The capital of France is", "def add(a, b):", "List three fruits:", "Once upon a time"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), kv_cache_memory=128 << 20)


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_match_offline(stack, offline):
    want = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    c = client(stack.base_url)
    for prompt, ref in zip(PROMPTS, want, strict=True):
        resp = c.completions.create(model=stack.model_name, prompt=prompt, max_tokens=16, temperature=0)
        choice = resp.choices[0]
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_matches_offline_stream_and_not(stack, offline):
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=32))[0]
    c = client(stack.base_url)
    resp = c.chat.completions.create(model=stack.model_name, messages=CHAT, max_tokens=32, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)

    chunks = list(c.chat.completions.create(model=stack.model_name, messages=CHAT, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.outputs[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_streaming_completion_equals_offline(stack, offline):
    ref = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    stream = client(stack.gateway_urls[1]).completions.create(
        model=stack.model_name, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True)
    pieces = list(stream)
    assert "".join(p.choices[0].text for p in pieces if p.choices) == ref.text
    assert [p.choices[0].finish_reason for p in pieces if p.choices and p.choices[0].finish_reason] == ["length"]


def test_async_clients_interleaved_across_two_gateways(stack, offline):
    want = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))

    async def one(i: int, prompt: str) -> tuple[str, str]:
        url = stack.gateway_urls[i % 2]
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as ac:
            if i % 4 < 2:
                resp = await ac.completions.create(model=stack.model_name, prompt=prompt, max_tokens=12,
                                                   temperature=0)
                return prompt, resp.choices[0].text
            stream = await ac.completions.create(model=stack.model_name, prompt=prompt, max_tokens=12,
                                                 temperature=0, stream=True)
            return prompt, "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS * 2)))

    results = asyncio.run(main())
    expected = {p: r.outputs[0].text for p, r in zip(PROMPTS, want, strict=True)}
    for prompt, text in results:
        assert text == expected[prompt], prompt


def test_disconnect_mid_stream_frees_kv_blocks(stack):
    import httpx

    from sluice.wire import contract

    body = {"model": stack.model_name, "prompt": "Tell me a very long story.", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        r = http.send(http.build_request("POST", f"{stack.base_url}/v1/completions", json=body), stream=True)
        assert r.status_code == 200
        lines = r.iter_lines()  # keep the iterator alive: dropping it closes the connection
        chunks = 0
        while chunks < 3:
            chunks += next(lines).startswith("data: {")
        stats = stack.engine_stats()
        assert stats.running == 1 and stats.free_blocks < stats.total_blocks, stats
        r.close()  # the client goes away mid-stream
        closed = time.monotonic()
        # A resumable stream (the gateway's default) is not cancelled at once: its client may resume
        # it on any gateway (Last-Event-ID); nobody does, so it is after the resume window.
        # (Without --resumable-streams: at once, tests/e2e/test_resumable_streams.py.)
        time.sleep(1.0)
        assert stack.engine_stats().running == 1, "cancelled at once: the client could not have resumed"
        while time.monotonic() - closed < contract.RESUME_WINDOW_S + 8.0:
            stats = stack.engine_stats()
            if stats.running == 0 and stats.free_blocks == stats.total_blocks:
                break
            time.sleep(0.1)
        took = time.monotonic() - closed
    assert stats.running == 0 and stats.free_blocks == stats.total_blocks, stats
    assert took >= contract.RESUME_WINDOW_S - 1.0, took


def test_gateway_kill9_mid_stream_aborts_its_requests(stack, tmp_path):
    """A gateway that dies takes its clients' connections with it, and nobody is left to cancel
    their requests: the engine sees the gateway's liveness key stay gone and aborts them."""
    import signal

    import httpx

    from sluice.wire import contract
    from tests.e2e.conftest import extra_gateway

    with extra_gateway(stack.redis_url, tmp_path / "doomed-gateway.log") as (proc, url):
        body = {"model": stack.model_name, "prompt": "Tell me a very long story.", "max_tokens": 1800,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http:
            r = http.send(http.build_request("POST", f"{url}/v1/completions", json=body), stream=True)
            assert r.status_code == 200
            lines = r.iter_lines()
            chunks = 0
            while chunks < 3:
                chunks += next(lines).startswith("data: {")
            stats = stack.engine_stats()
            assert stats.running == 1 and stats.free_blocks < stats.total_blocks, stats
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            killed = time.monotonic()
            # 1800 tokens would take minutes; the key lapses after its TTL and the engine waits
            # GATEWAY_LOST_AFTER_S more (checking every second) before it gives up on the gateway.
            limit = contract.GATEWAY_HEARTBEAT_TTL_S + contract.GATEWAY_LOST_AFTER_S + 8.0
            while time.monotonic() - killed < limit:
                stats = stack.engine_stats()
                if stats.running == 0 and stats.free_blocks == stats.total_blocks:
                    break
                time.sleep(0.2)
            took = time.monotonic() - killed
            r.close()
    assert stats.running == 0 and stats.free_blocks == stats.total_blocks, (stats, stack.dump_logs())
    # Not before the key (refreshed every 1-1.5 s) could have lapsed and the engine had waited for
    # GATEWAY_LOST_AFTER_S: it was the liveness check, not a single missing look or anything else.
    assert took >= contract.GATEWAY_HEARTBEAT_TTL_S + contract.GATEWAY_LOST_AFTER_S - 2.0, took
    assert "is gone (no liveness key" in stack.logs[0].read_text(errors="replace")
