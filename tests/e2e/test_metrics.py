"""Engine metrics against real processes: a `sluice engine` with a tiny KV pool and a gateway.

`curl engine:metrics-port/metrics` lists every engine metric; traffic moves running / waiting /
KV usage / preemptions / TTFT as it should; every query of the Grafana dashboard names a metric the
engine or the gateway exports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.wire.connection import connect
from tests.docker_support import free_port
from tests.e2e.conftest import Stack, start_stack, stop_stack
from tests.unit.test_engine_metrics import ENGINE_SAMPLES

pytestmark = [pytest.mark.model, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
# A tiny pool of small blocks: 16 blocks of 4 tokens. Four requests of ~12 prompt tokens are all
# admitted (3 blocks each), then each needs 3 more blocks to write 12 tokens: 24 > 16, so the
# youngest are preempted while the oldest finish. Small numbers keep the test quick on a busy CPU.
NUM_BLOCKS = 16
BLOCK_SIZE = 4
NUM_REQUESTS = 4
MAX_TOKENS = 12


class MetricsStack:
    def __init__(self, stack: Stack, metrics_port: int) -> None:
        self.stack = stack
        self.engine_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def scrape(self, url: str) -> dict[str, list]:
        r = httpx.get(url, timeout=10)
        assert r.status_code == 200, r.text
        out: dict[str, list] = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                out.setdefault(s.name, []).append(s)
        return out

    def engine(self) -> dict[str, list]:
        return self.scrape(self.engine_url)

    def gateway(self) -> dict[str, list]:
        return self.scrape(f"{self.stack.base_url}/metrics")


def value(samples: dict[str, list], name: str, **labels) -> float:
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def mstack(redis_url, model_dir, tmp_path_factory) -> Iterator[MetricsStack]:  # noqa: F811

    connect(redis_url).flushall()
    port = free_port()
    stack = start_stack(
        redis_url, Path(model_dir), tmp_path_factory.mktemp("metrics"), num_gateways=1,
        extra_engine_flags=["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(NUM_REQUESTS),
                            "--kv-cache-dtype", "bfloat16", "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                            "--engine-id", "metrics-e2e"],
    )
    try:
        yield MetricsStack(stack, port)
    finally:
        stop_stack(stack)


def test_engine_metrics_endpoint_lists_every_metric(mstack):
    samples = mstack.engine()
    missing = ENGINE_SAMPLES - set(samples)
    assert not missing, f"the engine does not export {sorted(missing)}"
    model = mstack.stack.model_name
    assert value(samples, "sluice:kv_cache_blocks_total", model=model, engine_id="metrics-e2e") == NUM_BLOCKS
    assert value(samples, "sluice:cache_config_info", model=model, engine_id="metrics-e2e", block_size=str(BLOCK_SIZE),
                 cache_dtype="bfloat16", num_blocks=str(NUM_BLOCKS), enable_prefix_caching="True") == 1
    assert "process_resident_memory_bytes" in samples


def test_traffic_moves_the_gauges_and_counters(mstack):
    before = mstack.engine()
    assert value(before, "sluice:num_requests_running") == 0
    assert value(before, "sluice:kv_cache_usage_perc") == 0

    peaks = {"sluice:num_requests_running": 0.0, "sluice:num_requests_waiting": 0.0,
             "sluice:num_requests_preempted": 0.0, "sluice:kv_cache_usage_perc": 0.0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            s = mstack.engine()
            for name in peaks:
                peaks[name] = max(peaks[name], value(s, name))
            time.sleep(0.05)

    def one(i: int) -> dict:
        r = httpx.post(f"{mstack.stack.base_url}/v1/completions", timeout=300, json={
            "model": mstack.stack.model_name, "prompt": f"Request number {i}: count slowly from one to fifty,",
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        })
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            usages = list(pool.map(one, range(NUM_REQUESTS)))
    finally:
        done.set()
        watcher.join(10)

    assert all(u["completion_tokens"] == MAX_TOKENS for u in usages)
    after = mstack.engine()

    # while the traffic ran: several requests in the batch, some waiting after a preemption, the
    # tiny pool (nearly) full; the preemption counter rose
    assert peaks["sluice:num_requests_running"] >= 2, peaks
    assert peaks["sluice:num_requests_waiting"] >= 1, peaks
    assert peaks["sluice:num_requests_preempted"] >= 1, peaks
    assert peaks["sluice:kv_cache_usage_perc"] >= 0.75, peaks
    assert value(after, "sluice:num_preemptions_total") > value(before, "sluice:num_preemptions_total")

    # afterwards: nothing runs or waits, every block is back
    assert value(after, "sluice:num_requests_running") == 0
    assert value(after, "sluice:num_requests_waiting") == 0
    assert value(after, "sluice:num_requests_preempted") == 0
    assert value(after, "sluice:kv_cache_usage_perc") == 0

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # one TTFT / e2e / TPOT per request, one ITL per later token, each finished by length
    assert delta("sluice:time_to_first_token_seconds_count") == NUM_REQUESTS
    assert delta("sluice:time_to_first_token_seconds_sum") > 0
    assert delta("sluice:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert delta("sluice:time_per_output_token_seconds_count") == NUM_REQUESTS
    assert delta("sluice:inter_token_latency_seconds_count") == NUM_REQUESTS * (MAX_TOKENS - 1)
    assert delta("sluice:request_success_total", finished_reason="length") == NUM_REQUESTS
    assert delta("sluice:generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    # recompute after preemption forwards prompts again: at least every prompt token once
    assert delta("sluice:prompt_tokens_total") >= sum(u["prompt_tokens"] for u in usages)
    assert delta("sluice:engine_step_duration_seconds_count") > 0
    assert delta("sluice:batch_size_sum") >= NUM_REQUESTS * MAX_TOKENS  # each token had its sequence scheduled
    assert delta("sluice:prefix_cache_queries_total") > 0


def test_every_dashboard_query_names_a_metric_the_processes_export(mstack):
    from tests.unit.test_monitoring_config import dashboard_exprs, metric_names, sluice_names

    r = httpx.post(f"{mstack.stack.base_url}/v1/completions", timeout=300, json={
        "model": mstack.stack.model_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    exported = set(mstack.engine()) | set(mstack.gateway())
    used = sluice_names(set().union(*(metric_names(e) for e in dashboard_exprs())))
    assert used and not used - exported, f"queried but not exported: {sorted(used - exported)}"
