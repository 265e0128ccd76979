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

# Probed or scraped every few seconds (load balancers, kubelets, Prometheus): their access lines
# would bury the requests in the log, so they are logged at debug level only, and when they fail.
QUIET_PATHS = frozenset({"/health", "/ping", "/metrics"})


class QuietProbes(logging.Filter):
    """Drops uvicorn's access line of a successful ``QUIET_PATHS`` request unless debug logging is on.
    Uvicorn's access record carries ``(client, method, path, http_version, status)`` as its args."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5 or logging.getLogger("uvicorn.access").isEnabledFor(
                logging.DEBUG):
            return True
        path = str(args[2]).split("?", 1)[0]
        try:
            ok = int(args[4]) < 400
        except (TypeError, ValueError):
            return True
        return not (path in QUIET_PATHS and ok)

# On SIGTERM uvicorn stops accepting, then waits this long for open responses (streams) to
# finish before it cancels them: the drain a rolling restart gets.
GRACEFUL_SHUTDOWN_S = 5


def log_config() -> dict:
    """Uvicorn's logging configuration with ``QuietProbes`` on its access handler: uvicorn applies
    it in every worker process, where a filter added here would not reach."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["quiet_probes"] = {"()": f"{__name__}.QuietProbes"}
    config["handlers"]["access"]["filters"] = ["quiet_probes"]
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    parser.add_argument("--redis-url", default=os.environ.get("SLUICE_REDIS_URL", d.redis_url),
                        help="Redis holding the queues and model cards: redis://, rediss:// or "
                             "redis+cluster://host:port[,host:port...] for a Redis Cluster (default: %(default)s)")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (default: 1)")
    parser.add_argument("--api-key", action="append", default=[], dest="api_keys", metavar="KEY",
                        help="require `Authorization: Bearer KEY` on /v1 (repeatable; also $SLUICE_API_KEY)")
    parser.add_argument("--max-queue-len", type=int, default=None,
                        help="answer 429 when a model's queue holds this many requests (default: no limit)")
    parser.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                        help="a request's deadline from its arrival; 504 past it (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                        help="413 for larger request bodies (default: %(default)s)")
    parser.add_argument("--retry-after-s", type=int, default=d.retry_after_s,
                        help="Retry-After of a 429 (default: %(default)s)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render a `chat_template` sent with a chat request (vLLM's flag; default: refuse "
                             "it with a 400, the model's template is used when none is sent)")
    parser.add_argument("--resumable-streams", action=argparse.BooleanOptionalAction, default=d.resumable_streams,
                        help="log streamed chat/completions requests in Redis so that their SSE events carry "
                             "`id:` and a client resumes on any gateway with Last-Event-ID (default: on)")
    parser.add_argument("--event-log-ttl-s", type=int, default=d.event_log_ttl_s,
                        help="how long a request's event log is kept after the request ends, for resumes "
                             "(default: %(default)s)")
    parser.add_argument("--responses-ttl-s", type=float, default=d.responses_ttl_s,
                        help="how long Redis keeps a stored /v1/responses response after it ended "
                             "(default: %(default)s)")
    parser.add_argument("--prepare-pool-workers", type=int, default=d.prepare_pool_workers,
                        help="processes that prepare large requests (parse, chat template, tokenize) off the "
                             "event loop; 0: everything on the loop (default: %(default)s)")
    parser.add_argument("--prepare-pool-queue", type=int, default=d.prepare_pool_queue,
                        help="large requests that may wait for a busy prepare pool; one more is refused with "
                             "429 gateway_busy (default: %(default)s)")
    parser.add_argument("--prepare-pool-threshold-bytes", type=int, default=d.prepare_pool_threshold_bytes,
                        help="a request body (or stored Responses history) this large is prepared in the pool "
                             "(default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    keys = list(args.api_keys)
    if not keys and os.environ.get("SLUICE_API_KEY"):
        keys = [os.environ["SLUICE_API_KEY"]]
    return GatewayConfig(
        redis_url=args.redis_url,
        api_keys=keys,
        max_queue_len=args.max_queue_len,
        request_timeout_s=args.request_timeout_s,
        max_body_bytes=args.max_body_bytes,
        retry_after_s=args.retry_after_s,
        trust_request_chat_template=args.trust_request_chat_template,
        resumable_streams=args.resumable_streams,
        event_log_ttl_s=args.event_log_ttl_s,
        responses_ttl_s=args.responses_ttl_s,
        prepare_pool_workers=args.prepare_pool_workers,
        prepare_pool_queue=args.prepare_pool_queue,
        prepare_pool_threshold_bytes=args.prepare_pool_threshold_bytes,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    from sluice.wire.connection import RedisURLError, check_url

    try:  # a URL of the wrong topology stops the gateway now, with the flag named
        check_url(config.redis_url)
    except RedisURLError as exc:
        logging.getLogger("sluice.gateway").error("%s", exc)
        return 2
    os.environ[ENV_VAR] = config.to_json()  # the workers build their app from it (app_factory)
    metrics_dir = None
    if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        metrics_dir = tempfile.mkdtemp(prefix="sluice-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        uvicorn.run(
            "gateway.app:app_factory",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level=args.log_level,
            log_config=log_config(),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0
