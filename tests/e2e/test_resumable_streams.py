"""Resumable streams with real processes: Redis, one engine, gateways. A chat completion
stream whose gateway is kill -9'd resumes on another gateway with Last-Event-ID, every chunk once,
in order; replays of finished streams; the errors of a bad Last-Event-ID; --no-resumable-streams.
(A logged stream whose client goes away without resuming frees the engine after the resume window:
tests/e2e/test_openai_sdk.py::test_disconnect_mid_stream_frees_kv_blocks.)

The engine's side (the log, its TTLs, leases, detached requests) is in
tests/integration/test_event_log.py.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from sluice.wire import contract
from sluice.wire.connection import connect
from tests.e2e.conftest import extra_gateway

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def chat_body(stack, **extra) -> dict:
    return {"model": stack.model_name, "messages": CHAT, "stream": True, "seed": 11, "temperature": 0.8, **extra}


class SSE:
    """An open SSE response read event by event: (id or None, data)."""

    def __init__(self, http: httpx.Client, url: str, body: dict, headers: dict | None = None) -> None:
        self.response = http.send(http.build_request("POST", url, json=body, headers=headers), stream=True)
        self.lines = self.response.iter_lines()  # kept: dropping it closes the connection

    def __iter__(self):
        event_id = None
        for line in self.lines:
            if line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                yield event_id, line[5:].strip()
                event_id = None


def text_of(events: list[tuple[str | None, str]]) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                out.append(choice["delta"].get("content") or "")
    return "".join(out)


def finish_of(events: list[tuple[str | None, str]]) -> str | None:
    reasons = [c["finish_reason"] for _, d in events if d != "[DONE]" for c in json.loads(d)["choices"]
               if c.get("finish_reason")]
    return reasons[-1] if reasons else None


def seq(event_id: str) -> int:
    return int(event_id.rpartition(":")[2])


def test_chat_stream_resumed_on_another_gateway_after_kill9(stack, tmp_path):
    """Uninterrupted on one gateway; then the same request on a gateway that is kill -9'd after three
    chunks, resumed on a third with the last id it sent: the same text, every chunk once, in order,
    ended by max_tokens (the resuming gateway's lease kept the engine from aborting it)."""
    body = chat_body(stack, max_tokens=48, ignore_eos=True)
    with httpx.Client(timeout=120) as http:
        reference = list(SSE(http, f"{stack.gateway_urls[1]}/v1/chat/completions", body))
        assert finish_of(reference) == "length" and reference[-1][1] == "[DONE]"
        ids = [i for i, _ in reference[:-1]]
        assert all(ids) and [seq(i) for i in ids] == list(range(1, len(ids) + 1)), ids

        with extra_gateway(stack.redis_url, tmp_path / "doomed-gateway.log") as (proc, url):
            before = []
            for event in SSE(http, f"{url}/v1/chat/completions", body):
                before.append(event)
                if len(before) == 3:
                    break
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        last = before[-1][0]
        assert last is not None and seq(last) == 3
        after = list(SSE(http, f"{stack.gateway_urls[0]}/v1/chat/completions", body,
                         headers={"Last-Event-ID": last}))
    assert after[-1][1] == "[DONE]", after[-3:]
    resumed = before + after
    assert [seq(i) for i, _ in resumed[:-1]] == list(range(1, len(resumed))), "lost or repeated chunks"
    assert {json.loads(d)["id"] for _, d in resumed[:-1]} == {last.rpartition(":")[0]}
    assert text_of(resumed) == text_of(reference), stack.dump_logs()
    assert finish_of(resumed) == "length"


def test_replay_of_a_finished_stream_and_bad_ids(stack):
    body = chat_body(stack, max_tokens=12)
    url0, url1 = (f"{u}/v1/chat/completions" for u in stack.gateway_urls)
    with httpx.Client(timeout=120) as http:
        full = list(SSE(http, url0, body))
        assert full[-1][1] == "[DONE]"
        ids = [i for i, _ in full[:-1]]
        # a finished stream replays from its log, on any gateway, after any of its ids
        rest = list(SSE(http, url1, body, headers={"Last-Event-ID": ids[1]}))
        assert rest == full[2:]
        assert list(SSE(http, url1, body, headers={"Last-Event-ID": ids[-1]})) == [(None, "[DONE]")]

        def error(headers: dict, url: str = url1, payload: dict = body) -> tuple[int, dict]:
            r = http.post(url, json=payload, headers=headers)
            return r.status_code, r.json()["error"]

        status, err = error({"Last-Event-ID": "not an id"})
        assert status == 400 and err["param"] == "Last-Event-ID" and err["type"] == "invalid_request_error", err
        status, err = error({"Last-Event-ID": "chatcmpl-0123456789abcdef:3"})
        assert status == 404 and err["param"] == "Last-Event-ID" and err["code"] == "not_found", err
        # a chat stream's id on the completions route is no stream there
        completions = {"model": stack.model_name, "prompt": "x", "stream": True}
        status, err = error({"Last-Event-ID": ids[1]}, f"{stack.base_url}/v1/completions", completions)
        assert status == 404, err
        # expired: the log and its record are gone (their TTL: tests/integration/test_event_log.py)
        record_id = ids[0].rpartition(":")[0]
        connect(stack.redis_url).delete(contract.record_key(record_id), contract.log_key(record_id))
        status, err = error({"Last-Event-ID": ids[1]})
        assert status == 404 and err["code"] == "not_found", err


def test_completion_stream_resumes_too(stack):
    body = {"model": stack.model_name, "prompt": "The sea is", "max_tokens": 10, "stream": True, "seed": 3,
            "temperature": 0.8, "echo": True}
    with httpx.Client(timeout=120) as http:
        full = list(SSE(http, f"{stack.base_url}/v1/completions", body))
        assert all(i for i, _ in full[:-1]) and full[-1] == (None, "[DONE]")
        rest = list(SSE(http, f"{stack.gateway_urls[1]}/v1/completions", body,
                        headers={"Last-Event-ID": full[0][0]}))
    assert rest == full[1:]


def test_not_resumable_gateway(stack, tmp_path):
    """--no-resumable-streams: no ids, no log, and a client that goes away cancels at once."""
    with extra_gateway(stack.redis_url, tmp_path / "plain-gateway.log", ["--no-resumable-streams"]) as (_, url):
        with httpx.Client(timeout=60) as http:
            stream = SSE(http, f"{url}/v1/chat/completions", chat_body(stack, max_tokens=1800, ignore_eos=True))
            events = iter(stream)
            first = [next(events) for _ in range(3)]
            assert all(i is None for i, _ in first)
            record_id = json.loads(first[0][1])["id"]
            assert not connect(stack.redis_url).exists(contract.log_key(record_id))
            stream.response.close()
            closed = time.monotonic()
            while time.monotonic() - closed < 5.0:
                stats = stack.engine_stats()
                if stats.running == 0 and stats.free_blocks == stats.total_blocks:
                    break
                time.sleep(0.05)
        assert stats.running == 0 and stats.free_blocks == stats.total_blocks, stats
