"""Logged responses with real processes (Redis, one engine, gateways): a background response and a
stored foreground one whose creating gateway is kill -9'd mid-generation run on (detached: the
engine's lost-gateway rule leaves them alone), are finished, retrieved and continued through
another gateway, and streamed again from their event log after any sequence number; a background
response is cancelled from a gateway that did not create it."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from openai import OpenAI

from sluice.wire import contract
from sluice.wire import stored_response as sr
from sluice.wire.connection import connect
from tests.e2e.conftest import extra_gateway

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]

RUNNING = ("queued", "in_progress")


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_ended(c: OpenAI, response_id: str, timeout: float = 300.0):
    end = time.monotonic() + timeout
    while True:
        resp = c.responses.retrieve(response_id)
        if resp.status not in RUNNING or time.monotonic() > end:
            return resp
        time.sleep(0.5)


def stream_events(url: str, response_id: str, after: int | None = None) -> list[dict]:
    params = {"stream": "true"} | ({"starting_after": str(after)} if after is not None else {})
    with httpx.stream("GET", f"{url}/v1/responses/{response_id}", params=params, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]


def test_background_response_outlives_its_gateway_kill9(stack, tmp_path):
    with extra_gateway(stack.redis_url, tmp_path / "doomed-gateway.log") as (proc, url):
        queued = client(url).responses.create(model=stack.model_name, input="Write a long story about the sea.",
                                              background=True, max_output_tokens=24, temperature=0)
        assert queued.status == "queued" and queued.background
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
    other = client(stack.gateway_urls[0])
    done = wait_ended(other, queued.id)
    took = time.monotonic() - killed
    # not aborted (an abort would make it "cancelled"): ended by max_output_tokens or the model
    assert done.status in ("completed", "incomplete"), (done.status, done.error, stack.dump_logs())
    assert done.output_text and done.usage.output_tokens > 0
    if done.status == "incomplete":
        assert done.usage.output_tokens == 24
    assert took > 0
    # streamed again from its log on either gateway: every event, then exactly those after any number
    events = stream_events(stack.gateway_urls[1], queued.id)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == f"response.{done.status}"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == done.output_text
    assert [e["sequence_number"] for e in stream_events(stack.gateway_urls[0], queued.id, after=4)] == \
        list(range(5, len(events)))


def test_a_foreground_response_outlives_its_gateway_kill9(stack, tmp_path):
    """Create (streamed, not background) on gateway A, kill -9 A once tokens flow; on B: continue
    it (B finishes it from its log first), retrieve it, stream it again."""
    with extra_gateway(stack.redis_url, tmp_path / "doomed-gateway.log") as (proc, url):
        seen, response_id = "", None
        with httpx.stream("POST", f"{url}/v1/responses", timeout=300, json={
                "model": stack.model_name, "input": "Write a long story about the sea.", "stream": True,
                "max_output_tokens": 48, "temperature": 0}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                response_id = response_id or event["response"]["id"]
                if event["type"] == "response.output_text.delta":
                    seen += event["delta"]
                    if len(seen) > 5:  # mid-generation, its client still connected
                        proc.send_signal(signal.SIGKILL)
                        proc.wait(10)
                        break
        assert proc.returncode == -signal.SIGKILL and response_id
    other = client(stack.gateway_urls[0])
    end = time.monotonic() + 300
    while stack.engine_stats().running and time.monotonic() < end:  # the engine runs it to its end
        time.sleep(0.2)
    stored = connect(stack.redis_url)
    try:  # as stored: nobody has finished it yet
        assert stored.hget(contract.response_key(response_id), sr.F_STATUS) == b"in_progress"
    finally:
        stored.close()
    # continued at once: B finishes it from its log, then builds on its output
    follow = other.responses.create(model=stack.model_name, previous_response_id=response_id,
                                    input="Now a title for it.", max_output_tokens=8, temperature=0)
    assert follow.status in ("completed", "incomplete"), (follow.status, follow.error, stack.dump_logs())
    done = other.responses.retrieve(response_id)
    # not cancelled (its client never left), not failed: ended by max_output_tokens or the model
    assert done.status in ("completed", "incomplete"), (done.status, done.error, stack.dump_logs())
    assert done.output_text.startswith(seen) and len(done.output_text) > len(seen)
    assert follow.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens
    events = stream_events(stack.gateway_urls[1], response_id, after=2)
    assert [e["sequence_number"] for e in events] == list(range(3, 3 + len(events)))
    assert events[-1]["type"] == f"response.{done.status}"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == done.output_text


def test_background_response_cancelled_from_another_gateway(stack):
    creator, canceller = client(stack.gateway_urls[1]), client(stack.gateway_urls[0])
    queued = creator.responses.create(model=stack.model_name, input="Tell me a very long story.", background=True,
                                      max_output_tokens=1500)
    end = time.monotonic() + 120
    while stack.engine_stats().running == 0 and time.monotonic() < end:
        time.sleep(0.1)
    assert stack.engine_stats().running == 1
    cancelled = canceller.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    end = time.monotonic() + 20
    while time.monotonic() < end:
        stats = stack.engine_stats()
        if stats.running == 0 and stats.free_blocks == stats.total_blocks:
            break
        time.sleep(0.1)
    assert stats.running == 0 and stats.free_blocks == stats.total_blocks, stats
    assert creator.responses.retrieve(queued.id).status == "cancelled"
