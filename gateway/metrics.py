"""Prometheus metrics, named after vLLM's with a ``sluice_gateway:`` prefix of their own: the
engines export ``sluice:`` metrics of the same stem (``time_to_first_token_seconds``,
``num_requests_running``, ...) that measure something else (from the engine's arrival, in its
batch), so a name never means two things. docs/metrics.md lists them all.

With several uvicorn workers, ``sluice gateway`` points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh
directory before the workers start; each worker then writes its samples there and ``/metrics``
aggregates all workers (prometheus-client's multi-process mode).
"""

from __future__ import annotations

import os
import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sluice.wire import tenants
from sluice.wire.error_codes import Code

PREFIX = "sluice_gateway:"
# Tenant labels a process exports at most: past them, tenants share the label OTHER_TENANTS, so a
# deployment with many keys cannot blow up the number of series.
MAX_TENANT_LABELS = 100
OTHER_TENANTS = "other"
LOST_CODES = (Code.REQUEST_LOST.value, Code.REDIS_UNAVAILABLE.value)  # the broker's Lost codes

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0)


class QueueDepths(Collector):
    """A gauge per model whose values are replaced whole at each scrape (``set_all``): a model
    absent from the latest set has no series. Not a prometheus ``Gauge``: in multi-process mode a
    gauge's series live in the workers' files and cannot be removed."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name, self.documentation = name, documentation
        self._values: dict[str, float] = {}

    def set_all(self, values: dict[str, float]) -> None:
        self._values = dict(values)

    def collect(self):
        family = GaugeMetricFamily(self.name, self.documentation, labels=["model"])
        for model, value in sorted(self._values.items()):
            family.add_metric([model], value)
        yield family


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw = {"registry": registry} if registry is not None else {}
        p = PREFIX
        self.requests = Counter(
            f"{p}http_requests", "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"], **kw,
        )
        self.finished = Counter(
            f"{p}request_success", "Completions finished, by finish reason", ["finished_reason"], **kw
        )
        self.ttft = Histogram(
            f"{p}time_to_first_token_seconds", "Arrival at the gateway to the first generated token",
            buckets=_LATENCY_BUCKETS, **kw,
        )
        self.itl = Histogram(
            f"{p}inter_token_latency_seconds", "Time between successive token events of a request",
            buckets=_ITL_BUCKETS, **kw,
        )
        self.e2e = Histogram(
            f"{p}e2e_request_latency_seconds", "Arrival at the gateway to the last token",
            buckets=_E2E_BUCKETS, **kw,
        )
        self.queue_time = Histogram(
            f"{p}request_queue_time_seconds",
            "Enqueue (XADD) to the first event from an engine: queueing plus the prefill",
            buckets=_E2E_BUCKETS, **kw,
        )
        # Read from Redis by the process that answers the scrape, for the models Redis names now:
        # a model that was forgotten (nobody served it, docs/operations.md) is no longer exported.
        self.queue_depth = QueueDepths(f"{p}num_requests_waiting",
                                       "Requests in the model's Redis queue not yet taken by an engine")
        (registry if registry is not None else REGISTRY).register(self.queue_depth)
        self.running = Gauge(
            f"{p}num_requests_running", "Requests this gateway is serving now",
            multiprocess_mode="livesum", **kw,
        )
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of enqueued requests", **kw)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Generated tokens sent to clients", **kw)
        # the broker's (gateway/broker.py)
        self.redis_reconnects = Counter(
            f"{p}redis_reconnects", "Pub/sub connections to Redis re-established after a failure", **kw)
        self.inflight_audits = Counter(
            f"{p}inflight_audits", "Checks that the in-flight requests' queue entries still exist", **kw)
        self.requests_lost = Counter(
            f"{p}requests_lost", "Requests that cannot complete: their queue entry or output was lost with "
            "Redis (request_lost) or Redis stayed unavailable (redis_unavailable); answered 503",
            ["code"], **kw)
        # per tenant (labels bounded: tenant_label)
        self.tenant_requests = Counter(
            f"{p}tenant_requests", "HTTP requests answered, by tenant, endpoint and status code "
            f"(at most {MAX_TENANT_LABELS} tenant labels a process, the rest as '{OTHER_TENANTS}')",
            ["tenant", "endpoint", "status"], **kw)
        self.rate_limited = Counter(
            f"{p}tenant_rate_limited", "Requests refused with 429 by a tenant's limit, by tenant and limit "
            "(requests, tokens, tokens_too_large, concurrent, queued)", ["tenant", "limit"], **kw)
        self._tenant_labels: set[str] = set()
        self._tenant_lock = threading.Lock()
        # the prepare pool's (gateway/prepare_pool.py)
        self.prepare_jobs = Gauge(
            f"{p}prepare_pool_jobs", "Large requests' preparation jobs running or waiting in the prepare pool",
            multiprocess_mode="livesum", **kw)
        self.prepare_refused = Counter(
            f"{p}prepare_pool_refused", "Large requests refused because the prepare pool was full (429 gateway_busy)",
            **kw)
        # the labelled series an alert reads exist from the start, at zero
        for code in LOST_CODES:
            self.requests_lost.labels(code=code)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(finished_reason=reason)

    def tenant_label(self, tenant: str) -> str:
        """The label of ``tenant``: its id while fewer than MAX_TENANT_LABELS are in use, else OTHER_TENANTS."""
        name = tenants.label(tenant)
        if name in self._tenant_labels:
            return name
        with self._tenant_lock:
            if len(self._tenant_labels) < MAX_TENANT_LABELS:
                self._tenant_labels.add(name)
                return name
        return OTHER_TENANTS


METRICS = Metrics()


def render() -> tuple[bytes, str]:
    """The exposition text: this process's registry, or every worker's in multi-process mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(METRICS.queue_depth)  # this process's, read for this scrape
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
