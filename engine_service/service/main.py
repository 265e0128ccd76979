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

from engine_service.config import EngineConfig, engine_config_from_args
from engine_service.service.settings import ServiceSettings
from sluice.config import KnobSet, from_args
from sluice.config import add_arguments as add_knob_arguments
from sluice.wire import contract
from sluice.wire.card import ModelCard

log = logging.getLogger("sluice.engine")


# sluice engine's knobs: the engine service's, then the engine's (one definition each)
KNOBS = KnobSet("sluice engine", [ServiceSettings, EngineConfig])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_knob_arguments(parser, KNOBS)
    # Benchmarks only (engine_service.model.stub; refused unless $SLUICE_BENCH_STUB_MODEL=1): no --help line.
    parser.add_argument("--stub-model", action="store_true", help=argparse.SUPPRESS)


def settings_from_args(args: argparse.Namespace) -> ServiceSettings:
    """The service's settings from a parsed ``sluice engine`` command line (flags, environment and
    ``--config`` applied: ``sluice.config``)."""
    settings = from_args(ServiceSettings, args)
    settings.heartbeat_interval_s = min(contract.HEARTBEAT_INTERVAL_S, settings.heartbeat_ttl_s / 3)
    return settings


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
            log.info("%s", self.ready_line())

        try:
            # health turns SERVING before the engine registers in Redis (io.start): whoever sees the
            # engine listed may probe it at once and must not read NOT_SERVING
            self.worker.run(on_start=start_io)
        finally:
            self.shutdown()
        return 0

    def ready_line(self) -> str:
        """What this engine serves and where: one line, once it takes requests."""
        engine = self.engine
        what = f"engine {self.settings.engine_id} ready: model {self.model!r}"
        model_dir = getattr(engine, "model_dir", None)
        if model_dir is not None and getattr(model_dir, "name", None) != self.model:
            what += f" from {model_dir}"
        device, dtype = getattr(engine, "device", None), getattr(engine, "dtype", None)
        if device is not None and dtype is not None:
            kv = str(getattr(engine, "kv_cache_dtype", dtype)).removeprefix("torch.")
            what += f" on {device}, {str(dtype).removeprefix('torch.')}"
            if kv != str(dtype).removeprefix("torch."):
                what += f" (KV cache {kv})"
        where = [f"queue on {_redact(self.settings.redis_url)}"]
        if self.admin is not None:
            where.append(f"gRPC health/admin on {self.admin.host}:{self.admin.port}"
                         + (" (Drain needs the admin token)" if self.settings.admin_token else ""))
        if self.metrics is not None and getattr(self.metrics, "port", None):
            where.append(f"metrics on http://{self.settings.metrics_host}:{self.metrics.port}/metrics")
        return f"{what}; {', '.join(where)}"

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
    from engine_service.service.admin import GRPC_PORT_HINT
    from engine_service.service.metrics import check_port_free
    from sluice.ports import PortInUse
    from sluice.ports import check_port_free as check_ports_free
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
    try:  # a port that is taken stops the engine now, naming its flag, not after loading the model
        check_ports_free("--grpc-port", settings.grpc_port, settings.grpc_host, GRPC_PORT_HINT)
        if settings.metrics_port:
            check_port_free(settings.metrics_port, settings.metrics_host)
            from prometheus_client import disable_created_metrics

            disable_created_metrics()  # no `_created` twin for every counter and histogram
        log.info("engine %s: loading the model", settings.engine_id)
        config = engine_config_from_args(args)
        config.stub_model = bool(getattr(args, "stub_model", False))
        engine = LLMEngine(config)
        service = EngineService(engine, settings, args.served_model_name or engine.model_name)
    except PortInUse as exc:
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
