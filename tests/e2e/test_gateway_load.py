"""No request freezes a gateway (docs/gateway-load.md), against a real ``sluice gateway`` process and
the contract-following fake engine on a real Redis:

- a 3.9 MB prompt (one long chat message, or a completions prompt) is a 400
  ``context_length_exceeded`` decided by its length (the characters-per-token bound: its message
  gives the characters and a lower bound on the tokens, not a count — it was never tokenized), and
  100,000 tiny input items on ``/v1/responses`` are a 400 naming ``input`` at parse time;
- with the prepare pool full (one worker, no queue, held by a slow trusted chat template), further
  large bodies are refused at once with 429 ``gateway_busy`` and ``Retry-After``, while a small
  request (prepared on the event loop) and ``/health`` are answered.

How long the gateway's other clients wait meanwhile is measured, not asserted: ``sluice bench
gateway-stall``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import extra_gateway
from tests.integration.test_gateway_support import MAX_MODEL_LEN, MODEL, FakeEngine

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]

BIG = 3_900_000  # characters of a large body's text: under the 4 MiB body limit


@pytest.fixture
def engine(clean_redis, model_dir):
    e = FakeEngine(clean_redis, Path(model_dir)).start()
    yield e
    e.stop()


def _chat(text: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


def test_huge_bodies_are_refused_before_the_costly_work(clean_redis, engine, tmp_path) -> None:
    per_token = engine.tokenizer.max_chars_per_token
    with extra_gateway(clean_redis, tmp_path / "gateway.log") as (_, url):
        text = "All work and no play makes Jack a dull boy. " * (BIG // 44)
        for path, body, param in (("/v1/chat/completions", _chat(text), "messages"),
                                  ("/v1/completions", {"model": MODEL, "prompt": text}, "prompt")):
            r = httpx.post(f"{url}{path}", json=body, timeout=120)
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert (err["code"], err["param"]) == ("context_length_exceeded", param)
            assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
            chars, at_least = map(int, re.search(r"is (\d+) characters, which is at least (\d+) tokens",
                                                 err["message"]).groups())
            assert chars >= len(text) and at_least == -(-chars // per_token)  # its length, not a count
        items = [{"role": "user", "content": "x" * 8}] * 100_000
        body = json.dumps({"model": MODEL, "input": items}).encode()
        assert len(body) > 3_000_000
        r = httpx.post(f"{url}/v1/responses", content=body, headers={"content-type": "application/json"}, timeout=120)
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["param"] == "input" and "at most 2048" in r.json()["error"]["message"]
        ok = httpx.post(f"{url}/v1/chat/completions", json={**_chat("Hi"), "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert len(engine.requests) == 1  # only the small request reached the engine


# A trusted request template that keeps its prepare worker busy for seconds (a loop of loops).
SLOW_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(300) %}{% endfor %}{% endfor %}"
                 "{% for m in messages %}{{ m.content }}{% endfor %}")


def _jobs(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sluice_gateway:prepare_pool_jobs "):
            return float(line.split()[1])
    return 0.0


def test_a_full_prepare_pool_sheds_large_bodies_and_small_requests_still_pass(clean_redis, engine, tmp_path) -> None:
    flags = ["--prepare-pool-workers", "1", "--prepare-pool-queue", "0", "--prepare-pool-threshold-bytes", "65536",
             "--trust-request-chat-template", "--retry-after-s", "2"]
    with extra_gateway(clean_redis, tmp_path / "gateway.log", flags) as (_, url):
        # a 9 KB body (parsed on the loop) with an output constraint: prepared in the pool, one job
        slow = {**_chat("Hi " * 3000), "chat_template": SLOW_TEMPLATE, "response_format": {"type": "json_object"},
                "max_tokens": 64}

        def hold() -> None:
            try:
                httpx.post(f"{url}/v1/chat/completions", json=slow, timeout=300)
            except httpx.HTTPError:
                pass  # the gateway may stop first

        threading.Thread(target=hold, daemon=True).start()
        end = time.monotonic() + 60
        while _jobs(url) < 1:  # the slow request holds the pool's one place
            assert time.monotonic() < end, "the slow request never reached the prepare pool"
            time.sleep(0.05)
        big = _chat("All work and no play. " * (BIG // 22))
        for _ in range(3):
            r = httpx.post(f"{url}/v1/chat/completions", json=big, timeout=60)
            assert r.status_code == 429, r.text[:300]
            assert r.json()["error"]["code"] == "gateway_busy" and r.headers["retry-after"] == "2"
        small = httpx.post(f"{url}/v1/chat/completions", json={**_chat("Hi"), "max_tokens": 4}, timeout=60)
        assert small.status_code == 200, small.text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert _jobs(url) == 1  # still held: the refusals were at once, not after a wait
        refused = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
                   if line.startswith("sluice_gateway:prepare_pool_refused_total ")]
        assert refused and float(refused[0].split()[1]) == 3


def test_the_gateway_stall_bench_runs(tmp_path, capsys) -> None:
    """``sluice bench gateway-stall`` end to end, briefly: its own Redis, stub engine and gateways."""
    import argparse

    from sluice_bench import gateway_stall as bench_gateway_stall

    parser = argparse.ArgumentParser()
    bench_gateway_stall.add_arguments(parser)
    out = tmp_path / "stall.json"
    args = parser.parse_args(["--duration", "1", "--rounds", "1", "--streams", "2", "--attackers", "1",
                              "--body-mb", "0.3", "--items", "3000", "--max-tokens", "16", "--result-file", str(out)])
    assert bench_gateway_stall.run(args) == 0
    doc = json.loads(out.read_text())
    windows = {(r["gateway"], r["shape"]): r for r in doc["results"]}
    assert set(windows) == {(g, s) for g in ("pool-off", "pool-on") for s in ("quiet", "long-message", "many-items")}
    for (_, shape), r in windows.items():
        assert r["stream_chunks"] > 0 and r["health_probes"] > 0 and not r["stream_errors"]
        if shape != "quiet":
            assert set(r["attack_statuses"]) == {"400"}  # every large body answered, refused
    assert 1 <= len(doc["memory"]["pool-on"]["workers"]) <= 2 and not doc["memory"]["pool-off"]["workers"]
    assert "pool-on" in capsys.readouterr().out
