"""``sluice gateway``: the OpenAI-compatible HTTP gateway under uvicorn.

Stateless: everything it knows of a model comes from the card an engine published in Redis, so
any number of replicas (``--workers`` processes here, or more hosts) serve any request.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile

from gateway.config import ENV_VAR, GatewayConfig
from sluice.config import KnobSet, from_args
from sluice.config import add_arguments as add_knob_arguments

# Probed or scraped every few seconds (load balancers, kubelets, Prometheus, `sluice serve` waiting
# for its gateway): their access lines would bury the requests in the log, so they are logged at
# debug level only, unless they fail with a server error other than /health's "not ready" 503.
QUIET_PATHS = frozenset({"/health", "/ping", "/metrics"})
NOT_READY = 503  # /health before an engine is alive: expected while a stack starts


class QuietProbes(logging.Filter):
    """Drops uvicorn's access line of a ``QUIET_PATHS`` request that did not fail (below 500, or
    503: not ready yet) unless debug logging is on. Uvicorn's access record carries ``(client,
    method, path, http_version, status)`` as its args."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5 or logging.getLogger("uvicorn.access").isEnabledFor(
                logging.DEBUG):
            return True
        path = str(args[2]).split("?", 1)[0]
        try:
            status = int(args[4])
        except (TypeError, ValueError):
            return True
        return not (path in QUIET_PATHS and (status < 500 or status == NOT_READY))


# Uvicorn's start and stop narration: the gateway's own ready line says what it serves and where.
STARTUP_CHATTER = ("Started server process", "Waiting for application startup", "Application startup complete",
                   "Uvicorn running on", "Started parent process", "Waiting for application shutdown",
                   "Application shutdown complete", "Finished server process", "Stopping parent process",
                   "Waiting for child process")


class QuietStartup(logging.Filter):
    """Drops uvicorn's ``STARTUP_CHATTER`` unless debug logging is on (errors always pass)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or logging.getLogger("uvicorn.error").isEnabledFor(logging.DEBUG):
            return True
        return not str(record.msg).startswith(STARTUP_CHATTER)


# On SIGTERM uvicorn stops accepting, then waits this long for open responses (streams) to
# finish before it cancels them: the drain a rolling restart gets.
GRACEFUL_SHUTDOWN_S = 5
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_config(level: str = "info") -> dict:
    """Uvicorn's logging configuration with ``QuietProbes`` on its access handler and
    ``QuietStartup`` on its error handler, and the gateway's own ``sluice.*`` loggers: uvicorn
    applies it in every worker process, where a filter or handler added here would not reach."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["quiet_probes"] = {"()": f"{__name__}.QuietProbes"}
    config["filters"]["quiet_startup"] = {"()": f"{__name__}.QuietStartup"}
    config["filters"]["redact_ids"] = {"()": "gateway.access_log.RedactIds"}
    config["handlers"]["access"]["filters"] = ["quiet_probes", "redact_ids"]
    config["handlers"]["default"]["filters"] = ["quiet_startup"]
    config["formatters"]["sluice"] = {"format": LOG_FORMAT}
    config["handlers"]["sluice"] = {"class": "logging.StreamHandler", "formatter": "sluice",
                                    "stream": "ext://sys.stderr"}
    config["loggers"]["sluice"] = {"handlers": ["sluice"], "level": level.upper(), "propagate": False}
    return config


# sluice gateway's knobs: GatewayConfig's (one definition each)
KNOBS = KnobSet("sluice gateway", [GatewayConfig])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_knob_arguments(parser, KNOBS)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The gateway's configuration from a parsed ``sluice gateway`` command line (flags, environment
    and ``--config`` applied: ``sluice.config``)."""
    return from_args(GatewayConfig, args)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    config = config_from_args(args)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    log = logging.getLogger("sluice.gateway")
    from sluice.ports import PortInUse, check_port_free
    from sluice.wire.connection import RedisURLError, check_url

    try:  # a URL of the wrong topology stops the gateway now, with the flag named
        check_url(config.redis_url)
    except RedisURLError as exc:
        log.error("%s", exc)
        return 2
    try:  # so does a port another process holds (uvicorn would exit 3 with a bare errno)
        check_port_free("--port", config.port, config.host)
    except PortInUse as exc:
        log.error("%s", exc)
        return 2
    from gateway.app import build_keyring

    try:  # a keys file that cannot be used stops the gateway now, naming the line
        build_keyring(config)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    os.environ[ENV_VAR] = config.to_json()  # the workers build their app from it (app_factory)
    metrics_dir = None
    if config.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        metrics_dir = tempfile.mkdtemp(prefix="sluice-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        uvicorn.run(
            "gateway.app:app_factory",
            factory=True,
            host=config.host,
            port=config.port,
            workers=config.workers,
            log_level=config.log_level,
            log_config=log_config(config.log_level),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0
