"""The engine's metrics as the service reports them, against a real Redis (testcontainers), scraped
over HTTP from the engine's metrics server: cancels, deadlines and bad entries are counted by cause
and code, a dead engine's entry reclaimed here counts as a reclaim, a Redis restart as reconnects.
(Queue gauges, KV usage, preemptions and latencies under traffic: tests/e2e/test_metrics.py.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_service.service.main import EngineService
from engine_service.service.settings import ServiceSettings
from sluice.wire import codec, contract
from sluice.wire.client import WireClient

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]


@pytest.fixture(scope="module")
def llm(model_dir):
    from engine_service import LLM

    return LLM(model_dir, num_blocks=128, max_model_len=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    return llm.get_tokenizer().encode("The river is")


def start(llm, url: str) -> EngineService:
    settings = ServiceSettings(redis_url=url, engine_id=f"metrics-{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=3.0,
                               metrics_port=0, drain_grace_s=10.0)
    from engine_service.service.metrics import EngineMetrics

    metrics = EngineMetrics(llm.engine.model_name, settings.engine_id)
    metrics.serve(0, "127.0.0.1")
    svc = EngineService(llm.engine, settings, metrics=metrics).start_in_thread()
    WireClient.from_url(url).wait_for_engine(svc.model, timeout=30)
    return svc


def stop(svc: EngineService, llm) -> None:
    svc.stop()
    if svc.worker.live:
        llm.engine.abort_request(list(svc.worker.live))
    svc.metrics.close()


def scrape(svc: EngineService) -> dict[tuple, float]:
    text = httpx.get(f"http://127.0.0.1:{svc.metrics.port}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model", "engine_id")}
            out[(s.name, *sorted(labels.items()))] = s.value
    return out


def metric(svc: EngineService, name: str, **labels) -> float:
    return scrape(svc).get((name, *sorted(labels.items())), 0.0)


def wait_for(svc: EngineService, name: str, at_least: float, timeout: float = 30.0, **labels) -> float:
    end = time.monotonic() + timeout
    while True:
        v = metric(svc, name, **labels)
        if v >= at_least or time.monotonic() > end:
            return v
        time.sleep(0.1)


@pytest.fixture
def service(llm, clean_redis) -> Iterator[EngineService]:
    svc = start(llm, clean_redis)
    try:
        yield svc
    finally:
        stop(svc, llm)


def test_cancels_deadlines_and_bad_entries_are_counted(service, redis_client, prompt):
    client = WireClient(redis_client)
    model = service.model
    # cancel during the run
    handle = client.submit(model, prompt, {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True})
    next(e for e in handle.events(timeout=60) if e.token_ids)
    handle.cancel()
    assert handle.collect(timeout=30).finish_reason == "abort"
    # a deadline that passes while it runs
    late = client.submit(model, prompt, {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True},
                         deadline=time.time() + 1.0).collect(timeout=60)
    assert late.error_code == contract.ERR_DEADLINE
    # an entry for another model: invalid_request
    bad = codec.make_request(f"bad-{uuid.uuid4().hex}", "no-such-model", prompt, {"max_tokens": 2},
                             reply_to=client.new_reply_id())
    sub = client.listen(bad)
    client.redis.xadd(contract.request_stream(model, 0), codec.encode_request(bad))
    sub.close()
    # one that finishes normally
    ok = client.submit(model, prompt, {"temperature": 0.0, "max_tokens": 3}).collect(timeout=60)
    assert ok.finish_reason == "length"

    assert wait_for(service, "sluice:request_errors_total", 1, code="invalid_request") == 1
    assert metric(service, "sluice:request_aborts_total", cause="cancel") == 1
    assert metric(service, "sluice:request_aborts_total", cause="deadline") == 1
    assert metric(service, "sluice:request_errors_total", code="deadline_exceeded") == 1
    assert metric(service, "sluice:request_success_total", finished_reason="abort") == 1
    assert metric(service, "sluice:request_success_total", finished_reason="length") == 1
    # TTFT: the cancelled, the late and the normal request each had a first token
    assert metric(service, "sluice:time_to_first_token_seconds_count") == 3
    # e2e: each of them ended, however it ended (the refused one never started)
    assert metric(service, "sluice:e2e_request_latency_seconds_count") == 3
    assert metric(service, "sluice:num_requests_running") == 0
    assert metric(service, "sluice:kv_cache_usage_perc") == 0


def test_an_entry_reclaimed_from_a_dead_engine_is_counted(llm, clean_redis, redis_client, prompt):
    client = WireClient(redis_client)
    model = llm.engine.model_name
    stream = contract.request_stream(model, 0)
    # before any engine runs: a consumer with no liveness key takes an entry and "dies" holding it
    redis_client.xgroup_create(stream, contract.CONSUMER_GROUP, id="0", mkstream=True)
    request = codec.make_request(f"orphan-{uuid.uuid4().hex}", model, prompt, {"temperature": 0.0, "max_tokens": 3},
                                 reply_to=client.new_reply_id())
    sub = client.listen(request)
    client.enqueue(request, shard=0)
    taken = redis_client.xreadgroup(contract.CONSUMER_GROUP, "dead-engine", {stream: ">"}, count=1)
    assert taken and taken[0][1], "the dead consumer did not get the entry"
    sub.close()
    svc = start(llm, clean_redis)
    try:
        assert wait_for(svc, "sluice:reclaimed_requests_total", 1) == 1
        assert wait_for(svc, "sluice:request_success_total", 1, finished_reason="length") == 1
    finally:
        stop(svc, llm)


def test_a_redis_restart_counts_reconnects(llm, restartable_redis, prompt):
    svc = start(llm, restartable_redis.url)
    try:
        assert sum(v for k, v in scrape(svc).items() if k[0] == "sluice:redis_reconnects_total") == 0
        # down longer than a command's own retries (about 1.3 s) and two heartbeats: every
        # connection sees the outage, whatever the machine's load
        restartable_redis.restart(hard=True, downtime=4.0)
        client = WireClient.from_url(restartable_redis.url)
        client.wait_for_engine(svc.model, timeout=30)
        result = client.submit(svc.model, prompt, {"temperature": 0.0, "max_tokens": 3}).collect(timeout=60)
        assert result.finish_reason == "length"
        end = time.monotonic() + 20
        while True:
            got = {dict([k[1]])["connection"]: v for k, v in scrape(svc).items()
                   if k[0] == "sluice:redis_reconnects_total"}
            if got.get("reader", 0) >= 1 and got.get("housekeeper", 0) >= 1 or time.monotonic() > end:
                break
            time.sleep(0.2)
        assert got["reader"] >= 1 and got["housekeeper"] >= 1, got
    finally:
        stop(svc, llm)
