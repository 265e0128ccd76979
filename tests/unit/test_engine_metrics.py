"""The engine's Prometheus metrics: names, labels, private registries, timings, the HTTP server."""

from __future__ import annotations

import dataclasses
import socket
import threading

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from engine_service.core.outputs import EngineOutput, RequestMetrics
from engine_service.core.request import FinishReason
from engine_service.service.metrics import (
    NULL_METRICS,
    EngineMetrics,
    MetricsPortInUse,
    NullMetrics,
    check_port_free,
)
from engine_service.service.redis_io import _LoopBackoff
from sluice.wire import codec, contract
from sluice.wire.error_codes import Code
from sluice.wire.stats import EngineStats

# Every sample name the engine exports (docs/metrics.md documents each).
ENGINE_SAMPLES = {
    "sluice:num_requests_running", "sluice:num_requests_waiting", "sluice:num_requests_preempted",
    "sluice:kv_cache_usage_perc", "sluice:kv_cache_blocks_used", "sluice:kv_cache_blocks_total",
    "sluice:engine_draining",
    "sluice:num_preemptions_total", "sluice:prefix_cache_queries_total", "sluice:prefix_cache_hits_total",
    "sluice:prompt_tokens_total", "sluice:generation_tokens_total", "sluice:iterations_total",
    "sluice:request_success_total", "sluice:request_errors_total", "sluice:request_aborts_total",
    "sluice:reclaimed_requests_total", "sluice:redis_reconnects_total",
    "sluice:redis_published_batches_total", "sluice:redis_publish_retries_total", "sluice:redis_dropped_batches_total",
    "sluice:stream_trimmed_entries_total", "sluice:registry_pruned_engines_total", "sluice:orphaned_entries_total",
    "sluice:gateways_lost_total", "sluice:worker_requests_total", "sluice:queue_stolen_entries_total",
    *(f"sluice:{h}_{suffix}" for h in (
        "time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds", "request_stream_queue_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
        "request_generation_tokens", "engine_step_duration_seconds", "batch_size", "iteration_tokens_total",
    ) for suffix in ("bucket", "count", "sum")),
}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def samples(m: EngineMetrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(m: EngineMetrics, name: str, **labels) -> float:
    found = [s.value for s in samples(m).get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


SNAPSHOT = EngineStats(
    running=3, waiting=5, preempted_waiting=2, free_blocks=30, total_blocks=40,
    preemptions=7, prefix_cache_queries=640, prefix_cache_hits=128, prompt_tokens_total=900,
    generation_tokens_total=321, iterations=55, draining=False,
)


def test_every_metric_is_exported_with_model_and_engine_labels():
    m = EngineMetrics("smol", "e1", process_metrics=False).bind(lambda: SNAPSHOT)
    got = samples(m)
    missing = ENGINE_SAMPLES - set(got)
    assert not missing, f"not exported: {sorted(missing)}"
    for name, ss in got.items():
        if name.startswith("sluice:"):
            for s in ss:
                assert s.labels.get("model") == "smol" and s.labels.get("engine_id") == "e1", (name, s.labels)
    assert value(m, "sluice:num_requests_running") == 3
    assert value(m, "sluice:num_requests_waiting") == 5
    assert value(m, "sluice:num_requests_preempted") == 2
    assert value(m, "sluice:kv_cache_blocks_used") == 10
    assert value(m, "sluice:kv_cache_blocks_total") == 40
    assert value(m, "sluice:kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(m, "sluice:num_preemptions_total") == 7
    assert value(m, "sluice:prefix_cache_queries_total") == 640
    assert value(m, "sluice:prefix_cache_hits_total") == 128
    assert value(m, "sluice:prompt_tokens_total") == 900
    assert value(m, "sluice:generation_tokens_total") == 321
    # finish reasons and abort causes exist at 0 before anything happened (rate() needs them)
    for reason in ("stop", "length", "abort"):
        assert value(m, "sluice:request_success_total", finished_reason=reason) == 0
    for cause in ("cancel", "deadline", "drain"):
        assert value(m, "sluice:request_aborts_total", cause=cause) == 0


def test_the_cache_configuration_is_one_series_of_labels():
    m = EngineMetrics("smol", "e1", process_metrics=False).bind(lambda: SNAPSHOT)
    assert "sluice:cache_config_info" not in samples(m)  # nothing to say before an engine says it
    m.cache_config(block_size=16, cache_dtype="float32", num_blocks=100, enable_prefix_caching=True)
    m.cache_config(block_size=16, cache_dtype="bfloat16", num_blocks=200, enable_prefix_caching=False)
    (only,) = samples(m)["sluice:cache_config_info"]
    assert only.value == 1 and only.labels == {"model": "smol", "engine_id": "e1", "block_size": "16",
                                               "cache_dtype": "bfloat16", "num_blocks": "200",
                                               "enable_prefix_caching": "False"}


def test_registries_are_private_per_engine():
    a = EngineMetrics("m", "a").bind(lambda: SNAPSHOT)
    b = EngineMetrics("m", "b").bind(lambda: dataclasses.replace(SNAPSHOT, running=9))  # same names: no clash
    assert value(a, "sluice:num_requests_running") == 3
    assert value(b, "sluice:num_requests_running") == 9
    assert "process_resident_memory_bytes" in samples(a)
    assert REGISTRY.get_sample_value("sluice:kv_cache_usage_perc", {"model": "m", "engine_id": "a"}) is None


def test_an_unbound_engine_reports_zeros():
    m = EngineMetrics("m", "e", process_metrics=False)
    assert value(m, "sluice:kv_cache_usage_perc") == 0
    assert value(m, "sluice:num_requests_running") == 0


def _out(rid, tokens, n_out, reason=None, metrics=None, index=0):
    return EngineOutput(rid, tokens, index=index, finish_reason=reason, num_prompt_tokens=10,
                        num_output_tokens=n_out, metrics=metrics)


def test_request_timings_are_measured_at_the_engine():
    clock = Clock()
    m = EngineMetrics("m", "e", clock=clock, process_metrics=False)
    m.request_started("r1", 1)
    clock.t = 100.5
    m.outputs([_out("r1", [5], 1)])  # first token: TTFT 0.5
    clock.t = 100.7
    m.outputs([_out("r1", [6], 2)])  # gap 0.2
    clock.t = 101.0
    rm = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.1, first_token_time=100.5,
                        finished_time=101.0)
    m.outputs([_out("r1", [7], 3, FinishReason.LENGTH, rm)])  # gap 0.3, finished
    m.request_done("r1")
    assert value(m, "sluice:time_to_first_token_seconds_count") == 1
    assert value(m, "sluice:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(m, "sluice:inter_token_latency_seconds_count") == 2
    assert value(m, "sluice:inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert value(m, "sluice:e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert value(m, "sluice:request_queue_time_seconds_sum") == pytest.approx(0.1)
    assert value(m, "sluice:request_prefill_time_seconds_sum") == pytest.approx(0.4)
    assert value(m, "sluice:request_decode_time_seconds_sum") == pytest.approx(0.5)
    assert value(m, "sluice:time_per_output_token_seconds_sum") == pytest.approx(0.25)  # 0.5 s / 2 gaps
    assert value(m, "sluice:request_generation_tokens_sum") == 3
    assert value(m, "sluice:request_prompt_tokens_sum") == 10
    assert not m._live, "per-request state must be dropped when the request is done"
    # outputs of requests the metrics never saw start are ignored, not a crash
    m.outputs([_out("ghost", [1], 1)])
    assert value(m, "sluice:time_to_first_token_seconds_count") == 1


def test_requests_ended_without_an_output_still_get_their_e2e():
    clock = Clock()
    m = EngineMetrics("m", "e", clock=clock, process_metrics=False)
    m.request_started("cancelled", 2)
    m.request_started("handed-back", 1)
    clock.t = 102.0
    m.outputs([_out("cancelled", [1], 1, FinishReason.ABORT, index=0)])  # one completion reported its end
    m.request_done("cancelled")  # the other ended silently (e.g. a cancel)
    m.request_done("handed-back", ended=False)  # left for another engine: not an end
    assert value(m, "sluice:e2e_request_latency_seconds_count") == 2
    assert value(m, "sluice:e2e_request_latency_seconds_sum") == pytest.approx(4.0)
    assert not m._live


def test_n_completions_each_get_a_first_token():
    clock = Clock()
    m = EngineMetrics("m", "e", clock=clock, process_metrics=False)
    m.request_started("r", 2)
    clock.t = 100.25
    m.outputs([_out("r", [1], 1, index=0), _out("r", [2], 1, index=1)])
    assert value(m, "sluice:time_to_first_token_seconds_count") == 2
    assert value(m, "sluice:inter_token_latency_seconds_count") == 0


def test_step_events_aborts_and_io_counters():
    m = EngineMetrics("m", "e", process_metrics=False)
    m.step(0.02, 4, 100)
    m.step(0.001, 0, 0)  # an idle step still times, but has no batch
    assert value(m, "sluice:engine_step_duration_seconds_count") == 2
    assert value(m, "sluice:batch_size_count") == 1 and value(m, "sluice:batch_size_sum") == 4
    assert value(m, "sluice:iteration_tokens_total_sum") == 100
    m.events([
        codec.finished_event("a", 0, "stop"), codec.finished_event("b", 0, "length"),
        codec.finished_event("c", 0, "stop"), codec.error_event("d", "deadline_exceeded", "late", "e"),
    ])
    assert value(m, "sluice:request_success_total", finished_reason="stop") == 2
    assert value(m, "sluice:request_success_total", finished_reason="length") == 1
    assert value(m, "sluice:request_errors_total", code="deadline_exceeded") == 1
    m.aborted("cancel")
    m.aborted("drain", 3)
    assert value(m, "sluice:request_aborts_total", cause="cancel") == 1
    assert value(m, "sluice:request_aborts_total", cause="drain") == 3
    m.reclaimed(2)
    assert value(m, "sluice:reclaimed_requests_total") == 2
    m.redis_reconnected("reader")
    assert value(m, "sluice:redis_reconnects_total", connection="reader") == 1
    assert value(m, "sluice:redis_reconnects_total", connection="publisher") == 0


def test_error_codes_are_labelled_by_name_and_counters_read_the_io_and_worker_dicts():
    m = EngineMetrics("m", "e", process_metrics=False)
    codes = {s.labels["code"] for f in m.registry.collect() if f.name == "sluice:request_errors" for s in f.samples}
    assert codes == {c.value for c in Code if c.wire is not None}, codes  # never "1" ... "8"
    m.events([codec.error_event("x", contract.ERR_CONTEXT_LENGTH, "long", "e")])
    assert value(m, "sluice:request_errors_total", code="context_length_exceeded") == 1
    io_stats = {"dropped_batches": 0, "published_batches": 5}
    counters = {"invalid": 2, "handed_back": 1}
    m.bind(lambda: None, io_stats=io_stats, worker_counters=counters)
    io_stats["dropped_batches"] += 3  # read at scrape time: the dicts stay where they are counted
    assert value(m, "sluice:redis_dropped_batches_total") == 3
    assert value(m, "sluice:redis_published_batches_total") == 5
    assert value(m, "sluice:worker_requests_total", outcome="invalid") == 2
    assert value(m, "sluice:worker_requests_total", outcome="handed_back") == 1
    assert value(m, "sluice:worker_requests_total", outcome="cancelled") == 0


def test_backoff_reports_a_reconnect_only_after_a_failure():
    calls = []
    b = _LoopBackoff(on_recover=lambda: calls.append(1))
    b.ok()
    assert calls == []
    b.fail(threading.Event())
    b.ok()
    b.ok()
    assert calls == [1]


def test_null_metrics_accept_every_call():
    n: NullMetrics = NULL_METRICS
    n.request_started("r", 1, 1.0)
    n.step(0.1, 1, 1)
    n.outputs([_out("r", [1], 1)])
    n.events([codec.finished_event("r", 0, "stop")])
    n.aborted("cancel")
    n.reclaimed(1)
    n.redis_reconnected("reader")
    n.request_done("r")


def test_http_server_serves_the_registry_and_frees_its_port():
    m = EngineMetrics("m", "e").bind(lambda: SNAPSHOT)
    port = m.serve(0, "127.0.0.1")
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert r.status_code == 200
        assert 'sluice:num_requests_running{engine_id="e",model="m"} 3.0' in r.text
        # what Prometheus 2.x asks for: the names must not change with the format (they did with
        # prometheus-client's own server, which escaped `sluice:` to `sluice_` in OpenMetrics)
        prom_accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                       "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": prom_accept}, timeout=5)
        assert r.headers["content-type"].startswith("text/plain")
        assert 'sluice:kv_cache_blocks_total{engine_id="e",model="m"} 40.0' in r.text
        assert "sluice_kv_cache" not in r.text
        assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=5).status_code == 404
    finally:
        m.close()
    check_port_free(port, "127.0.0.1")  # closed means the port is free again


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(MetricsPortInUse, match=rf"--metrics-port {port}: .*already in use.*0 to turn"):
            check_port_free(port, "127.0.0.1")
        m = EngineMetrics("m", "e", process_metrics=False)
        with pytest.raises(MetricsPortInUse, match="already in use"):
            m.serve(port, "127.0.0.1")
        assert m.port is None


def test_tenant_gauges_have_a_bounded_label_count():
    from types import MappingProxyType

    from engine_service.core.fair_share import FairView, TenantLoad
    from engine_service.service.metrics import MAX_TENANT_LABELS, OTHER_TENANTS, tenant_gauges

    loads = {f"t{i:02d}": TenantLoad(1, 0.0, waiting=i, running=1) for i in range(MAX_TENANT_LABELS + 5)}
    loads[""] = TenantLoad(1, 0.0, waiting=100, running=2)
    view = FairView(MappingProxyType(loads))
    gauges = tenant_gauges(view)
    assert len(gauges) == MAX_TENANT_LABELS + 1 and gauges["default"] == (100, 2)
    kept = {name for name in gauges if name not in ("default", OTHER_TENANTS)}
    assert kept == {f"t{i:02d}" for i in range(6, MAX_TENANT_LABELS + 5)}  # the busiest
    assert gauges[OTHER_TENANTS] == (sum(range(6)), 6)  # the rest, summed
    assert sum(w for w, _ in gauges.values()) == sum(load.waiting for load in loads.values())
    m = EngineMetrics("smol", "e1", process_metrics=False).bind(lambda: SNAPSHOT, fair_view=lambda: view)
    text = m.render().decode()
    assert 'sluice:tenant_requests_waiting{engine_id="e1",model="smol",tenant="default"} 100.0' in text
    assert f'tenant="{OTHER_TENANTS}"' in text and text.count("sluice:tenant_requests_running{") == MAX_TENANT_LABELS + 1


def test_usage_counters_by_tenant_with_a_bounded_label_count():
    from engine_service.service.metrics import MAX_USAGE_TENANTS, OTHER_TENANTS
    from sluice.wire.usage import Usage

    m = EngineMetrics("smol", "e1", process_metrics=False)
    m.usage(Usage("team-a", "smol", 1, 10, 4, 8))
    m.usage(Usage("team-a", "smol", 1, 5, 0, 0))
    m.usage(Usage("", "smol", 1, 3, 2, 0))
    assert value(m, "sluice:tenant_requests_total", tenant="team-a") == 2
    assert value(m, "sluice:tenant_prompt_tokens_total", tenant="team-a") == 15
    assert value(m, "sluice:tenant_generation_tokens_total", tenant="team-a") == 4
    assert value(m, "sluice:tenant_cached_tokens_total", tenant="team-a") == 8
    assert value(m, "sluice:tenant_generation_tokens_total", tenant="default") == 2
    for i in range(MAX_USAGE_TENANTS + 10):
        m.usage(Usage(f"t{i}", "smol", 1, 1, 1, 0))
    tenants_seen = {s.labels["tenant"] for s in samples(m)["sluice:tenant_requests_total"]}
    assert len(tenants_seen) == MAX_USAGE_TENANTS + 1 and OTHER_TENANTS in tenants_seen
    assert value(m, "sluice:tenant_requests_total", tenant=OTHER_TENANTS) == 12  # 2 of the first 100 went to labels
