"""The engine's Prometheus metrics, served on its own HTTP port (``--metrics-port``).

Names follow vLLM's with a ``sluice:`` prefix (``vllm:num_requests_running`` becomes
``sluice:num_requests_running``); every series carries ``model`` and ``engine_id`` labels. The
gateway's metrics have a prefix of their own (``sluice_gateway:``), so no name means two things.
docs/metrics.md lists them all.

Two kinds of sources, so nothing is counted twice:

- **read at scrape time** from the step loop's snapshot (``Worker.snapshot()``, refreshed after every
  step): queue gauges, KV blocks, and the counters the scheduler and the engine already keep
  (preemptions, prefix-cache queries and hits, prompt and generation tokens, iterations), and the
  I/O threads' and the step loop's own counters (``RedisIO.stats``: batches published, retried and
  dropped, i.e. lost events; ``Worker.counters``: refusals, cancels, hand-backs);
- **observed as they happen** by the step loop and the I/O threads, through the small interface of
  ``NullMetrics`` (the default everywhere, so the worker and ``RedisIO`` run without metrics):
  per-request latencies measured at the engine, step duration and batch size, finishes by reason,
  errors by code, aborts, reclaims and Redis reconnects.

Each ``EngineMetrics`` has its own ``CollectorRegistry`` (nothing in prometheus-client's global
one), so several engines in one process — tests — never clash.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine_service.core.fair_share import EMPTY_VIEW, FairView
from sluice.ports import PortInUse, port_error
from sluice.ports import check_port_free as check_ports_free
from sluice.wire import codec, tenants
from sluice.wire.error_codes import Code
from sluice.wire.stats import EngineStats

log = logging.getLogger("sluice.engine.metrics")

LABELS = ("model", "engine_id")

# vLLM's buckets, so dashboards built for vLLM read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                 160.0, 320.0, 640.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

FINISH_REASONS = ("stop", "length", "abort")
ABORT_CAUSES = ("cancel", "deadline", "drain", "gateway_lost")
IO_THREADS = ("reader", "canceller", "publisher", "housekeeper")
# the codes an engine sends (the proto's ErrorCode), by name: the `code` label's values
ERROR_CODES = tuple(c.value for c in Code if c.wire is not None)
# RedisIO.stats keys -> (metric, help); "reclaimed" is sluice:reclaimed_requests, counted as it happens
IO_COUNTERS = {
    "published_batches": ("sluice:redis_published_batches", "Batches of events and XACKs sent to Redis"),
    "publish_retries": ("sluice:redis_publish_retries", "Publish round trips retried while Redis was unavailable"),
    "dropped_batches": ("sluice:redis_dropped_batches",
                        "Batches of events dropped after 60 s without Redis (publish_retry_s): LOST events (their "
                        "requests' clients get request_lost or a deadline)"),
    "trimmed": ("sluice:stream_trimmed_entries", "Acknowledged entries trimmed from the request stream"),
    "pruned_engines": ("sluice:registry_pruned_engines", "Registry entries of dead engines removed"),
    "orphans": ("sluice:orphaned_entries", "Own pending entries taken back (their XACK was lost)"),
    "gateways_lost": ("sluice:gateways_lost", "Gateways found gone (liveness key missing): their requests aborted"),
    "stolen": ("sluice:queue_stolen_entries",
               "Entries this engine took from queue shards it does not own (waited past --steal-after-ms, "
               "or their owner is gone or saturated)"),
}
# the labels of sluice:cache_config_info (vLLM's vllm:cache_config_info; num_blocks for num_gpu_blocks)
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "num_blocks", "enable_prefix_caching")
# Worker.counters keys: the `outcome` label's values of sluice:worker_requests
WORKER_OUTCOMES = ("invalid", "cancelled", "deadline", "engine_lost", "handed_back", "gateway_lost")
# The per-tenant gauges' `tenant` label: the tenants holding the most requests get their own (the
# default tenant's is "default"), at most this many; the rest are summed under OTHER_TENANTS, which
# no tenant id can be (an id starts with a letter or a digit): a series count bounded whatever the
# number of API keys.
MAX_TENANT_LABELS = 20
OTHER_TENANTS = "_other"
# The usage counters' tenant labels: counters cannot fold a tenant into OTHER_TENANTS later, so the
# first this many tenants an engine sees keep a label and the rest share OTHER_TENANTS.
MAX_USAGE_TENANTS = 100


class MetricsPortInUse(PortInUse):
    """The metrics port could not be bound; the message says which and what to do."""


class NullMetrics:
    """What the step loop and the I/O threads report. Every method is a no-op here; ``EngineMetrics``
    records. Callers never need to check whether metrics are on."""

    def request_started(self, request_id: str, n: int, enqueue_time: float = 0.0) -> None:
        """A request entered the engine (``enqueue_time``: the gateway's wall-clock XADD time)."""

    def request_done(self, request_id: str, ended: bool = True) -> None:
        """Every completion of the request has its terminal event (``ended``), or the request left
        this engine without one (handed back to the queue on drain: ``ended=False``)."""

    def step(self, duration_s: float, num_seqs: int, num_tokens: int) -> None:
        """One engine step ran ``num_seqs`` sequences, ``num_tokens`` tokens, in ``duration_s``."""

    def outputs(self, outputs: Iterable[Any]) -> None:
        """A step's ``EngineOutput``s: first tokens, inter-token gaps, finished completions."""

    def events(self, events: Iterable[Any]) -> None:
        """Wire ``Event``s about to be published: finishes by reason, errors by code."""

    def aborted(self, cause: str, n: int = 1) -> None:
        """Requests the engine stopped before their end: ``cancel``, ``deadline``, ``drain`` or
        ``gateway_lost``."""

    def usage(self, used: Any) -> None:
        """What one ended request used (``sluice.wire.usage.Usage``): its tenant's counters."""

    def reclaimed(self, n: int) -> None:
        """Pending entries claimed from dead engines."""

    def redis_reconnected(self, connection: str) -> None:
        """An I/O thread's Redis connection came back after a failure."""


NULL_METRICS = NullMetrics()


METRICS_PORT_HINT = "choose another port, or 0 to turn the metrics server off"


def _port_error(port: int, host: str, exc: OSError) -> Exception:
    error = port_error("--metrics-port", port, host, exc, METRICS_PORT_HINT)
    return MetricsPortInUse(str(error)) if isinstance(error, PortInUse) else error


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise ``MetricsPortInUse`` now if ``host:port`` cannot be bound (before a long model load)."""
    try:
        check_ports_free("--metrics-port", port, host, METRICS_PORT_HINT)
    except PortInUse as exc:
        raise MetricsPortInUse(str(exc)) from exc.__cause__


class _SnapshotCollector:
    """Gauges and counters read from the worker's latest snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineStats | None], labels: tuple[str, str]) -> None:
        self.snapshot = snapshot
        self.labels = list(labels)

    def describe(self) -> list:
        return []  # collected lazily: the snapshot source may not exist yet at registration

    def collect(self):
        s = self.snapshot() or EngineStats()
        lv = self.labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, float(value))
            return c

        yield gauge("sluice:num_requests_running", "Requests in the engine's running batch", s.running)
        yield gauge("sluice:num_requests_waiting",
                    "Requests waiting in the engine for admission (preempted ones included)", s.waiting)
        yield gauge("sluice:num_requests_preempted",
                    "Waiting requests that ran and were preempted (recompute), a subset of waiting",
                    s.preempted_waiting)
        yield gauge("sluice:kv_cache_usage_perc", "KV-cache usage: used blocks / total blocks (0 to 1)",
                    s.kv_cache_usage)
        yield gauge("sluice:kv_cache_blocks_used", "KV blocks referenced by requests", s.used_blocks)
        yield gauge("sluice:kv_cache_blocks_total", "KV blocks in the pool", s.total_blocks)
        yield gauge("sluice:engine_draining", "1 while the engine drains (no new requests), else 0",
                    1.0 if s.draining else 0.0)
        yield counter("sluice:num_preemptions", "Preemptions by recompute (the scheduler's count)",
                      s.preemptions)
        yield counter("sluice:prefix_cache_queries", "Prefix-cache queries, in tokens (looked up at admission)",
                      s.prefix_cache_queries)
        yield counter("sluice:prefix_cache_hits", "Prefix-cache hits, in tokens (served from the cache)",
                      s.prefix_cache_hits)
        yield counter("sluice:prompt_tokens",
                      "Prompt tokens prefilled (forwarded; recompute after preemption included, cache hits not)",
                      s.prompt_tokens_total)
        yield counter("sluice:generation_tokens", "Tokens generated (sampled)", s.generation_tokens_total)
        yield counter("sluice:iterations", "Engine steps that scheduled work", s.iterations)


class _CountersCollector:
    """The I/O threads' and the step loop's own counters (``RedisIO.stats``, ``Worker.counters``),
    read at scrape time: the dicts stay the one place they are counted."""

    def __init__(self, labels: tuple[str, str]) -> None:
        self.labels = list(labels)
        self.io_stats: dict[str, int] = {}
        self.worker_counters: dict[str, int] = {}
        self.shard_depth: dict[int, int] = {}

    def describe(self) -> list:
        return []

    def collect(self):
        for key, (name, doc) in IO_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, float(self.io_stats.get(key, 0)))
            yield c
        c = CounterMetricFamily("sluice:worker_requests",
                                "Requests the step loop refused, ended early or handed back, by outcome",
                                labels=[*LABELS, "outcome"])
        for outcome in WORKER_OUTCOMES:
            c.add_metric([*self.labels, outcome], float(self.worker_counters.get(outcome, 0)))
        yield c
        g = GaugeMetricFamily("sluice:queue_shard_depth",
                              "Entries of each queue shard no engine has read yet (as this engine last saw them)",
                              labels=[*LABELS, "shard"])
        for shard, depth in sorted(dict(self.shard_depth).items()):
            g.add_metric([*self.labels, str(shard)], float(depth))
        yield g


class _TenantsCollector:
    """Each tenant's waiting and running requests in the engine, from the worker's ``FairView``
    after its last step, with the label count bounded (``MAX_TENANT_LABELS``)."""

    def __init__(self, labels: tuple[str, str]) -> None:
        self.labels = list(labels)
        self.source: Callable[[], FairView] = lambda: EMPTY_VIEW

    def describe(self) -> list:
        return []

    def collect(self):
        loads = tenant_gauges(self.source())
        for name, doc, i in (
            ("sluice:tenant_requests_waiting", "Requests waiting in the engine, by tenant (preempted ones included)", 0),
            ("sluice:tenant_requests_running", "Requests in the engine's running batch, by tenant", 1),
        ):
            g = GaugeMetricFamily(name, doc, labels=[*LABELS, "tenant"])
            for tenant, values in loads.items():
                g.add_metric([*self.labels, tenant], float(values[i]))
            yield g


def tenant_gauges(view: FairView, cap: int = MAX_TENANT_LABELS) -> dict[str, tuple[int, int]]:
    """label -> (waiting, running): the ``cap`` tenants holding the most requests by name, the
    others summed under ``OTHER_TENANTS``."""
    ranked = sorted(view.tenants.items(), key=lambda kv: (-(kv[1].waiting + kv[1].running), kv[0]))
    out = {tenants.label(name): (load.waiting, load.running) for name, load in ranked[:cap]}
    if len(ranked) > cap:
        rest = ranked[cap:]
        out[OTHER_TENANTS] = (sum(load.waiting for _, load in rest), sum(load.running for _, load in rest))
    return out


class _SpecDecodeCollector:
    """Speculative decoding's counters (vLLM's names), read from the scheduler's ``SpecDecodeStats``
    at scrape time; zero when the engine does not speculate."""

    def __init__(self, labels: tuple[str, str]) -> None:
        self.labels = list(labels)
        self.source: Callable[[], Any] = lambda: None

    def describe(self) -> list:
        return []

    def collect(self):
        s = self.source()
        for name, doc, attr in (
            ("sluice:spec_decode_num_drafts", "Draft chunks verified (speculative decoding)", "num_drafts"),
            ("sluice:spec_decode_num_draft_tokens", "Tokens drafted", "num_draft_tokens"),
            ("sluice:spec_decode_num_accepted_tokens", "Drafted tokens accepted", "num_accepted_tokens"),
        ):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, float(getattr(s, attr, 0)))
            yield c
        c = CounterMetricFamily("sluice:spec_decode_num_accepted_tokens_per_pos",
                                "Drafted tokens accepted, by position in the draft (0: the first)",
                                labels=[*LABELS, "position"])
        for pos, count in enumerate(getattr(s, "num_accepted_tokens_per_pos", ())):
            c.add_metric([*self.labels, str(pos)], float(count))
        yield c


class _Live:
    __slots__ = ("arrival", "last_token", "n", "num_ended")

    def __init__(self, arrival: float, n: int) -> None:
        self.arrival = arrival
        self.n = n
        self.num_ended = 0  # completions whose end the engine reported (e2e observed)
        self.last_token: dict[int, float] = {}  # completion index -> time of its latest token


class EngineMetrics(NullMetrics):
    """The engine's metrics on a private registry. ``bind(snapshot)`` points the gauges at the
    worker's snapshot; ``serve(port)`` exposes them over HTTP."""

    def __init__(self, model: str, engine_id: str, *, clock: Callable[[], float] = time.monotonic,
                 process_metrics: bool = True) -> None:
        self.model = model
        self.engine_id = engine_id
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        if process_metrics:
            ProcessCollector(registry=self.registry)
        self._snapshot: Callable[[], EngineStats | None] = lambda: None
        self.registry.register(_SnapshotCollector(lambda: self._snapshot(), (model, engine_id)))
        self._counters = _CountersCollector((model, engine_id))
        self.registry.register(self._counters)
        self._spec = _SpecDecodeCollector((model, engine_id))
        self.registry.register(self._spec)
        self._tenants = _TenantsCollector((model, engine_id))
        self.registry.register(self._tenants)
        self._server = None
        self._live: dict[str, _Live] = {}
        r = self.registry
        lv = {"model": model, "engine_id": engine_id}

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(**lv)

        self.ttft = hist("sluice:time_to_first_token_seconds",
                         "Arrival at the engine to the completion's first token", TTFT_BUCKETS)
        self.tpot = hist("sluice:time_per_output_token_seconds",
                         "Mean time per output token after the first, per finished completion", TPOT_BUCKETS)
        self.itl = hist("sluice:inter_token_latency_seconds",
                        "Time between successive tokens of a completion", ITL_BUCKETS)
        self.e2e = hist("sluice:e2e_request_latency_seconds",
                        "Arrival at the engine to the completion's end", REQUEST_BUCKETS)
        self.queue_time = hist("sluice:request_queue_time_seconds",
                               "Arrival at the engine to first scheduled (time in the engine's waiting queue)",
                               QUEUE_BUCKETS)
        self.stream_time = hist("sluice:request_stream_queue_time_seconds",
                                "Gateway XADD to the engine reading the entry (time in the Redis stream; "
                                "wall clocks of two hosts)", QUEUE_BUCKETS)
        self.prefill_time = hist("sluice:request_prefill_time_seconds",
                                 "First scheduled to first token", REQUEST_BUCKETS)
        self.decode_time = hist("sluice:request_decode_time_seconds",
                                "First token to the completion's end", REQUEST_BUCKETS)
        self.prompt_len = hist("sluice:request_prompt_tokens", "Prompt length of finished completions",
                               TOKEN_BUCKETS)
        self.gen_len = hist("sluice:request_generation_tokens", "Tokens generated by finished completions",
                            TOKEN_BUCKETS)
        self.step_time = hist("sluice:engine_step_duration_seconds",
                              "Wall time of one engine step (schedule, forward, sample)", STEP_BUCKETS)
        self.batch_size = hist("sluice:batch_size", "Sequences scheduled in one engine step", BATCH_BUCKETS)
        self.step_tokens = hist("sluice:iteration_tokens_total", "Tokens forwarded in one engine step",
                                TOKEN_BUCKETS)

        self._cache_config_family = Gauge(
            "sluice:cache_config_info", "1, with the KV cache's configuration as labels (vLLM's vllm:cache_config_info)",
            [*LABELS, *CACHE_CONFIG_LABELS], registry=r)
        self._labels = lv

        success = Counter("sluice:request_success", "Completions finished, by finish reason",
                          [*LABELS, "finished_reason"], registry=r)
        self._success = {reason: success.labels(**lv, finished_reason=reason) for reason in FINISH_REASONS}
        self._success_family = success
        self._errors_family = Counter("sluice:request_errors",
                                      "Error events sent to clients, by error code (sluice.wire.error_codes)",
                                      [*LABELS, "code"], registry=r)
        self._errors = {code: self._errors_family.labels(**lv, code=code) for code in ERROR_CODES}
        aborts = Counter("sluice:request_aborts", "Requests the engine stopped before their end, by cause",
                         [*LABELS, "cause"], registry=r)
        self._aborts = {cause: aborts.labels(**lv, cause=cause) for cause in ABORT_CAUSES}
        self._reclaimed = Counter("sluice:reclaimed_requests",
                                  "Pending entries of dead engines claimed by this one",
                                  LABELS, registry=r).labels(**lv)
        reconnects = Counter("sluice:redis_reconnects",
                             "Redis connections re-established after a failure, by I/O thread",
                             [*LABELS, "connection"], registry=r)
        self._reconnects = {name: reconnects.labels(**lv, connection=name) for name in IO_THREADS}
        self._reconnects_family = reconnects
        self._lv = lv
        # each tenant's use (sluice.wire.usage, also counted in Redis): the first MAX_USAGE_TENANTS
        # tenants seen get a label of their own, the rest share OTHER_TENANTS
        self._usage_families = {
            name: Counter(metric, doc, [*LABELS, "tenant"], registry=r)
            for name, metric, doc in (
                ("requests", "sluice:tenant_requests",
                 "Requests that ended here, by tenant (cancelled and failed ones included)"),
                ("prompt_tokens", "sluice:tenant_prompt_tokens", "Prompt tokens of the requests that ended here, by tenant"),
                ("generation_tokens", "sluice:tenant_generation_tokens",
                 "Tokens generated for the requests that ended here, by tenant"),
                ("cached_tokens", "sluice:tenant_cached_tokens", "Prompt tokens served from the prefix cache, by tenant"))}
        self._usage_labels: set[str] = set()

    # ---------------------------------------------------------------- wiring
    def bind(self, snapshot: Callable[[], EngineStats | None], *, io_stats: dict[str, int] | None = None,
             worker_counters: dict[str, int] | None = None,
             shard_depth: dict[int, int] | None = None,
             spec_decode: Callable[[], Any] | None = None,
             fair_view: Callable[[], FairView] | None = None) -> EngineMetrics:
        """Read gauges and scheduler counters from ``snapshot()`` (e.g. ``Worker.snapshot``), the
        I/O and step-loop counters from ``RedisIO.stats`` and ``Worker.counters``, the queue
        shards' depths from ``RedisIO.shard_depth``, speculative decoding's from ``spec_decode()``
        (the scheduler's ``SpecDecodeStats``), and the tenants' gauges from ``fair_view()``
        (``Worker.fair_view``)."""
        self._snapshot = snapshot
        if fair_view is not None:
            self._tenants.source = fair_view
        if spec_decode is not None:
            self._spec.source = spec_decode
        if io_stats is not None:
            self._counters.io_stats = io_stats
        if worker_counters is not None:
            self._counters.worker_counters = worker_counters
        if shard_depth is not None:
            self._counters.shard_depth = shard_depth
        return self

    def cache_config(self, *, block_size: int, cache_dtype: str, num_blocks: int,
                     enable_prefix_caching: bool) -> EngineMetrics:
        """Export the KV cache's configuration: one series of ``sluice:cache_config_info``, value 1."""
        self._cache_config_family.clear()
        self._cache_config_family.labels(**self._labels, block_size=str(block_size), cache_dtype=cache_dtype,
                                         num_blocks=str(num_blocks),
                                         enable_prefix_caching=str(bool(enable_prefix_caching))).set(1)
        return self

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port) from a daemon thread; returns the
        port. Raises ``MetricsPortInUse`` when the address is taken.

        Always the Prometheus text format (0.0.4), whatever the scraper's Accept header, as the
        gateway serves it: prometheus-client's own server answers Prometheus' OpenMetrics request
        with ``sluice:`` sample names escaped to ``sluice_`` (client 0.26), so the same metric
        would be stored under two names depending on who exposed it."""
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from prometheus_client import CONTENT_TYPE_LATEST

        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: no log
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True  # TIME_WAIT after a restart; a live listener still refuses

        if ":" in host:
            import socket

            Server.address_family = socket.AF_INET6
        try:
            self._server = Server((host, port), Handler)
        except OSError as exc:
            raise _port_error(port, host, exc) from exc
        threading.Thread(target=self._server.serve_forever, name="sluice-metrics", daemon=True).start()
        bound = self._server.server_address[1]
        log.debug("metrics on http://%s:%d/metrics", host, bound)  # the engine's ready line says it
        return bound

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---------------------------------------------------------------- the step loop
    def request_started(self, request_id: str, n: int, enqueue_time: float = 0.0) -> None:
        self._live[request_id] = _Live(self.clock(), max(1, n))
        if enqueue_time > 0:
            self.stream_time.observe(max(0.0, time.time() - enqueue_time))

    def request_done(self, request_id: str, ended: bool = True) -> None:
        live = self._live.pop(request_id, None)
        if live is None or not ended:
            return
        # completions ended without an engine output (cancelled, expired, failed): their e2e too
        now = self.clock()
        for _ in range(live.n - live.num_ended):
            self.e2e.observe(now - live.arrival)

    def step(self, duration_s: float, num_seqs: int, num_tokens: int) -> None:
        self.step_time.observe(duration_s)
        if num_seqs:
            self.batch_size.observe(num_seqs)
            self.step_tokens.observe(num_tokens)

    def outputs(self, outputs: Iterable[Any]) -> None:
        now = self.clock()
        live_map = self._live
        for out in outputs:
            live = live_map.get(out.request_id)
            if live is None:
                continue
            if out.new_token_ids:
                last = live.last_token.get(out.index)
                if last is None:
                    self.ttft.observe(now - live.arrival)
                else:
                    self.itl.observe(now - last)
                live.last_token[out.index] = now
            if out.finish_reason is None:
                continue
            live.last_token.pop(out.index, None)
            live.num_ended += 1
            self.e2e.observe(now - live.arrival)
            m = out.metrics
            if m is not None:
                if m.first_scheduled_time is not None:
                    self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
                    if m.first_token_time is not None:
                        self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
                if m.first_token_time is not None and m.finished_time is not None:
                    decode = max(0.0, m.finished_time - m.first_token_time)
                    self.decode_time.observe(decode)
                    if out.num_output_tokens > 1:
                        self.tpot.observe(decode / (out.num_output_tokens - 1))
            self.prompt_len.observe(out.num_prompt_tokens)
            self.gen_len.observe(out.num_output_tokens)

    def events(self, events: Iterable[Any]) -> None:
        for event in events:
            if event.HasField("finished"):
                reason = codec.finish_reason_name(event.finished.finish_reason) or "stop"
                child = self._success.get(reason)
                if child is None:
                    child = self._success[reason] = self._success_family.labels(**self._lv, finished_reason=reason)
                child.inc()
            elif event.HasField("error"):
                code = Code.from_wire(event.error.code).value
                child = self._errors.get(code)
                if child is None:
                    child = self._errors[code] = self._errors_family.labels(**self._lv, code=code)
                child.inc()

    def aborted(self, cause: str, n: int = 1) -> None:
        if n > 0:
            self._aborts[cause].inc(n)

    def usage(self, used: Any) -> None:
        label = tenants.label(used.tenant)
        if label not in self._usage_labels:
            if len(self._usage_labels) < MAX_USAGE_TENANTS:
                self._usage_labels.add(label)
            else:
                label = OTHER_TENANTS
        for name, value in (("requests", used.requests), ("prompt_tokens", used.prompt_tokens),
                            ("generation_tokens", used.completion_tokens), ("cached_tokens", used.cached_tokens)):
            if value:
                self._usage_families[name].labels(**self._lv, tenant=label).inc(value)

    # ---------------------------------------------------------------- the I/O threads

    def reclaimed(self, n: int) -> None:
        if n > 0:
            self._reclaimed.inc(n)

    def redis_reconnected(self, connection: str) -> None:
        child = self._reconnects.get(connection)
        if child is None:
            child = self._reconnects_family.labels(**self._lv, connection=connection)
        child.inc()
