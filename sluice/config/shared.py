"""Knobs that more than one section defines alike: each is written once here and used by every
section that has it (the engine service's and the gateway's ``redis_url``, say), so
``sluice serve`` holds one ``--redis-url`` for both its children."""

from __future__ import annotations

from typing import Any

from sluice.config.knobs import knob

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
REDIS_URL_ENV = "SLUICE_REDIS_URL"
REDIS_URL_HELP = ("the Redis holding the queues and model cards: redis://, rediss:// (TLS) or "
                  "redis+cluster://host:port[,host:port...] (a Redis Cluster), user and password in the URL if any")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def redis_url() -> Any:
    """``--redis-url``: a secret (its password), so it also takes ``--redis-url-file``."""
    return knob(DEFAULT_REDIS_URL, REDIS_URL_HELP, env=REDIS_URL_ENV, secret=True, metavar="URL")


def log_level() -> Any:
    return knob("info", "the least severe log records written (any case)", choices=LOG_LEVELS)
