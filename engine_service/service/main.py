"""``sluice engine``: an engine process fed from Redis, with gRPC health and admin.

    sluice engine --model DIR --redis-url redis://:pw@host:6379/0 --grpc-port 50051

The step loop runs on the main thread and owns the model; Redis I/O runs on threads beside it
(see ``redis_io``). SIGTERM (or ``EngineAdmin.Drain``) drains: stop reading, report NOT_SERVING,
hand requests that emitted nothing back to the queue, finish the rest within the grace period,
exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

from engine_service.config import add_engine_arguments, engine_config_from_args
from engine_service.service.settings import ADMIN_TOKEN_ENV, LOOPBACK, ServiceSettings, default_engine_id
from sluice.wire import contract
from sluice.wire.card import ModelCard

log = logging.getLogger("sluice.engine")


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside [{low}, {high}]")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default="redis://localhost:6379/0", help="redis://, rediss:// (one server) or redis+cluster://host:port[,host:port...] (a Redis Cluster) URL, user and password included if any")
    parser.add_argument("--grpc-port", type=int, default=50051, help="port of gRPC health and EngineAdmin (0: none)")
    parser.add_argument("--grpc-host", default=LOOPBACK,
                        help="address of the gRPC server (default: %(default)s; 0.0.0.0 for all interfaces, "
                             "e.g. for Kubernetes' gRPC probes)")
    parser.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV) or None, metavar="TOKEN",
                        help=f"require `authorization: Bearer TOKEN` metadata on EngineAdmin.Drain "
                             f"(default: ${ADMIN_TOKEN_ENV}; unset: Drain is open to whoever reaches the port)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: off)")
    parser.add_argument("--metrics-host", default=LOOPBACK,
                        help="address of the metrics server (default: %(default)s; 0.0.0.0 for all interfaces)")
    parser.add_argument("--engine-id", default=None, help="consumer name and registry id (default: host-pid-random)")
    parser.add_argument("--max-queue-wait", type=float, default=0.0, help="refuse requests that waited longer than this many seconds (0: no limit)")
    parser.add_argument("--drain-grace-s", type=float, default=30.0, help="on SIGTERM, how long running requests may take to finish")
    parser.add_argument("--heartbeat-ttl", type=float, default=contract.HEARTBEAT_TTL_S, help="liveness key TTL; other engines reclaim after it lapses")
    parser.add_argument("--gateway-lost-after", type=float, default=contract.GATEWAY_LOST_AFTER_S,
                        help="abort the requests of a gateway whose liveness key has been missing this many "
                             "seconds (it crashed; 0: never)")
    parser.add_argument("--queue-shards", type=_int_in(1, contract.MAX_QUEUE_SHARDS), default=contract.DEFAULT_QUEUE_SHARDS,
                        help="streams the model's request queue is sharded into, published on the model card "
                             "(gateways follow the card; engines serve every shard any engine published)")
    parser.add_argument("--shard-prefix-blocks", type=_int_in(0, 1 << 16), default=contract.DEFAULT_SHARD_PREFIX_BLOCKS,
                        help="full KV blocks at the start of a prompt whose tokens choose its queue shard "
                             "(published on the model card)")
    parser.add_argument("--steal-after-ms", type=_int_in(0, 3_600_000), default=contract.DEFAULT_STEAL_AFTER_MS,
                        help="take another shard's entries once the oldest has waited this long (ms), "
                             "when this engine has room")
    parser.add_argument("--log-level", default="INFO")
    # Benchmarks only (engine_service.model.stub; refused unless $SLUICE_BENCH_STUB_MODEL=1): no --help line.
    parser.add_argument("--stub-model", action="store_true", help=argparse.SUPPRESS)
    add_engine_arguments(parser)


def settings_from_args(args: argparse.Namespace) -> ServiceSettings:
    return ServiceSettings(
        redis_url=args.redis_url,
        grpc_port=args.grpc_port,
        grpc_host=args.grpc_host,
        admin_token=args.admin_token,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        engine_id=args.engine_id or default_engine_id(),
        max_queue_wait=args.max_queue_wait,
        drain_grace_s=args.drain_grace_s,
        heartbeat_ttl_s=args.heartbeat_ttl,
        gateway_lost_after_s=args.gateway_lost_after,
        heartbeat_interval_s=min(contract.HEARTBEAT_INTERVAL_S, args.heartbeat_ttl / 3),
        queue_shards=args.queue_shards,
        shard_prefix_blocks=args.shard_prefix_blocks,
        steal_after_ms=args.steal_after_ms,
    )


def model_card(engine: Any, name: str, settings: ServiceSettings | None = None) -> ModelCard:
    """The card this engine publishes (``sluice.wire.card``: one encoder, one decoder), naming the
    tool-call and reasoning parsers of ``--tool-call-parser`` / ``--reasoning-parser`` (else detected)
    and the queue's sharding (``--queue-shards``, ``--shard-prefix-blocks``, the KV block size)."""
    config = getattr(engine, "config", None)  # test doubles of the engine have none
    settings = settings or ServiceSettings()
    return ModelCard.from_model_dir(engine.model_dir, name=name, max_model_len=engine.max_model_len,
                                    vocab_size=engine.vocab_size, eos_token_ids=list(engine.eos_token_ids),
                                    tool_call_parser=getattr(config, "tool_call_parser", None),
                                    reasoning_parser=getattr(config, "reasoning_parser", None),
                                    queue_shards=settings.queue_shards,
                                    block_size=getattr(config, "block_size", 16),
                                    shard_prefix_blocks=settings.shard_prefix_blocks)


class EngineService:
    """The engine, its Redis I/O, the step loop and (optionally) the gRPC server, wired together.

    ``run()`` runs the step loop on the calling thread; ``start_in_thread()`` is for in-process tests.
    """

    def __init__(self, engine: Any, settings: ServiceSettings, model: str | None = None,
                 metrics: Any = None) -> None:
        """``metrics``: an ``EngineMetrics`` to report to; by default one is made, and served on
        ``settings.metrics_port``, when that port is set (``MetricsPortInUse`` when it is taken)."""
        from engine_service.service.redis_io import RedisIO
        from engine_service.service.worker import Worker, new_inbox

        self.engine = engine
        self.settings = settings
        self.model = model or engine.model_name
        self.worker: Worker | None = None
        self.io = RedisIO(settings, self.model, new_inbox(), model_card(engine, self.model, settings).encode(), self._load)
        self.worker = Worker(engine, self.io, settings, self.model)
        self.admin = None
        if settings.grpc_port:
            from engine_service.service.admin import AdminServer

            self.admin = AdminServer(self.worker, settings.engine_id, self.model, settings.grpc_port,
                                     settings.grpc_host, token=settings.admin_token)
        self.metrics = metrics
        if self.metrics is None and settings.metrics_port:
            from engine_service.service.metrics import EngineMetrics

            self.metrics = EngineMetrics(self.model, settings.engine_id)
            self.metrics.serve(settings.metrics_port, settings.metrics_host)
        if self.metrics is not None:
            self.metrics.bind(self.worker.snapshot, io_stats=self.io.stats, worker_counters=self.worker.counters,
                              shard_depth=self.io.shard_depth, fair_view=self.worker.fair_view,
                              spec_decode=lambda: getattr(getattr(engine, "scheduler", None), "spec_stats", None))
            self.worker.metrics = self.io.metrics = self.metrics
            cache_dtype = getattr(engine, "kv_cache_dtype", None)
            if cache_dtype is not None:  # an LLMEngine (the tests' fakes have no cache)
                self.metrics.cache_config(block_size=engine.config.block_size,
                                          cache_dtype=str(cache_dtype).removeprefix("torch."),
                                          num_blocks=engine.scheduler.block_pool.num_total_blocks,
                                          enable_prefix_caching=engine.config.enable_prefix_caching)
        self._thread: threading.Thread | None = None

    def _load(self) -> dict[str, Any]:
        if self.worker is None:
            return {}
        info = self.worker.snapshot().load()
        if self.admin is not None:
            info["grpc_port"] = self.admin.port
        return info

    def run(self) -> int:
        if self.admin is not None:
            self.admin.start()

        def start_io() -> None:
            self.io.start()
            name_os_threads()

        try:
            # health turns SERVING before the engine registers in Redis (io.start): whoever sees the
            # engine listed may probe it at once and must not read NOT_SERVING
            self.worker.run(on_start=start_io)
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        import time

        flush = 10.0
        if self.worker.drain_end is not None:  # stay inside the drain's grace period
            flush = max(0.5, self.worker.drain_end - time.monotonic() - 0.3)
        self.io.stop(flush_timeout=flush)
        if self.admin is not None:
            self.admin.stop(grace=0.2)
        if self.metrics is not None:
            self.metrics.close()

    # --- in-process use (tests) ---
    def start_in_thread(self) -> EngineService:
        self._thread = threading.Thread(target=self.run, name="sluice-step-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.worker.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)


# OpenMP threads that wait for work sleep instead of spinning (set before torch loads its OpenMP
# runtime; $OMP_WAIT_POLICY, when set, wins). A served engine shares the CPUs with the gateway,
# Redis and whatever else runs there: a spinning thread burns the CPU they need, and a thread
# preempted by them stalls its peers' spin at every barrier (docs/performance.md, the serving path).
OMP_WAIT_POLICY = "PASSIVE"


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("redis").setLevel(logging.INFO)  # its DEBUG lines are connection chatter
    # --cpus first, before torch (and its OpenMP runtime, which reads the affinity it starts with)
    # loads and before any thread starts: CPUs it may not use, or a list that names none, stop it
    if getattr(args, "cpus", None) is not None:
        from sluice.cpu_placement import check_cpus, pin_process

        try:
            cpus = check_cpus(args.cpus, "--cpus")
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        try:  # the engine pins again, to the same CPUs, and sets the compute threads
            pin_process(cpus)
        except ValueError as exc:
            log.error("--cpus: %s", exc)
            return 2
    settings = settings_from_args(args)
    from engine_service.engine import LLMEngine
    from engine_service.service.metrics import MetricsPortInUse, check_port_free
    from sluice.wire.connection import RedisURLError, check_url

    try:  # a URL of the wrong topology stops the engine now, not after loading the model
        if not check_url(settings.redis_url):
            log.warning("Redis at %s does not answer yet; will keep trying", _redact(settings.redis_url))
    except RedisURLError as exc:
        log.error("%s", exc)
        return 2
    from engine_service.config import SpeculativeConfig

    try:  # a speculative configuration that cannot work stops the engine now, naming the knob
        spec = SpeculativeConfig.parse(getattr(args, "speculative_config", None))
        if spec is not None:
            spec.check(args.max_num_batched_tokens)
    except ValueError as exc:
        log.error("--speculative-config: %s", exc)
        return 2
    try:  # so does a number of scheduler steps that cannot work
        from engine_service.config import check_num_scheduler_steps

        check_num_scheduler_steps(getattr(args, "num_scheduler_steps", 1), spec is not None)
    except ValueError as exc:
        log.error("--num-scheduler-steps: %s", exc)
        return 2
    try:
        if settings.metrics_port:  # fail now, not after loading the model
            check_port_free(settings.metrics_port, settings.metrics_host)
            from prometheus_client import disable_created_metrics

            disable_created_metrics()  # no `_created` twin for every counter and histogram
        log.info("engine %s: loading the model", settings.engine_id)
        config = engine_config_from_args(args)
        config.stub_model = bool(getattr(args, "stub_model", False))
        engine = LLMEngine(config)
        service = EngineService(engine, settings, args.served_model_name or engine.model_name)
    except MetricsPortInUse as exc:
        log.error("%s", exc)
        return 2
    except RuntimeError as exc:
        from engine_service.model.stub import StubModelRefused

        if not isinstance(exc, StubModelRefused):
            raise
        log.error("%s", exc)
        return 2

    install_drain_signals(service.worker)
    from sluice.heap import freeze_startup_heap

    log.info("engine %s: %d start-up objects frozen out of the garbage collector's walks", settings.engine_id,
             freeze_startup_heap())
    log.info("engine %s serving %r from %s", settings.engine_id, service.model, _redact(settings.redis_url))
    code = service.run()
    log.info("engine %s stopped", settings.engine_id)
    return code


def install_drain_signals(worker: Any) -> None:
    """SIGTERM and SIGINT drain the engine; a second SIGINT stops it without waiting. Python runs
    the handler in the main thread, the step loop's, between any two of its bytecodes: it only
    puts a note into the worker's inbox, whose put is reentrant (worker.new_inbox), and leaves the
    logging to the loop (a log line written from here, while the loop is writing one, meets
    stderr's buffer in use and raises into the loop)."""

    def on_signal(signum: int, frame: Any) -> None:
        if worker.draining and signum == signal.SIGINT:
            worker.request_stop(cause="second interrupt")
            return
        worker.request_drain(cause=f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def name_os_threads() -> None:
    """Give this process's Python threads their names at the OS level too (``top -H``, per-thread
    CPU in ``/proc/PID/task/TID``: what ``sluice bench serving-path`` reads to split the engine's
    CPU between the step loop and the Redis I/O threads). Linux only; a failure changes nothing."""
    for thread in threading.enumerate():
        tid = getattr(thread, "native_id", None)
        if tid is None or thread is threading.main_thread():
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm", "w") as f:
                f.write(thread.name[:15])
        except OSError:
            pass


def _redact(url: str) -> str:
    from sluice.wire.connection import redact

    return redact(url)
