"""How a Sluice process connects to Redis: clients whose connections heal after a Redis restart.

``redis.Redis.from_url`` builds its pool WITHOUT the retry policy that ``redis.Redis(...)`` has by
default, so a plain ``from_url`` client fails one command per stale pooled connection after Redis
restarts, however long after (issue 12, item 1). These options give every connection

- a retry with exponential backoff on ``ConnectionError``/``TimeoutError`` (a stale connection is
  dropped and reconnected, and the command re-sent, without the caller noticing);
- a PING before a command on a connection idle longer than ``HEALTH_CHECK_INTERVAL_S`` (a
  half-closed connection is replaced before a non-idempotent command such as XADD is written to it);
- TCP keepalive and bounded connect/read timeouts.

A pub/sub connection built from the same pool reconnects the same way, and redis-py resubscribes
its channels on reconnect; what was published while it was away is lost (pub/sub keeps nothing),
which is why the gateway audits its in-flight requests after a reconnect (``gateway/broker.py``).

While Redis stays down a command fails after about ``FAIL_AFTER_S`` seconds (the retries and the
connection attempts inside them), so callers answer 503 quickly instead of hanging.
"""

from __future__ import annotations

from typing import Any

RETRIES = 5  # per command
RETRY_BASE_S = 0.05
RETRY_CAP_S = 0.5
HEALTH_CHECK_INTERVAL_S = 2
SOCKET_CONNECT_TIMEOUT_S = 2.0
# The longest a command waits for a reply; generous because XREADGROUP BLOCK and big model cards
# travel on these connections. Blocking callers pass a smaller block than this.
SOCKET_TIMEOUT_S = 30.0
FAIL_AFTER_S = 2.0  # measured (about 1.7 s on localhost): how long a command keeps trying while Redis is down


def redis_options(*, asyncio: bool) -> dict[str, Any]:
    """Keyword arguments for ``Redis.from_url`` (``asyncio``: for ``redis.asyncio``)."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError, TimeoutError  # noqa: A004 - redis's own names

    if asyncio:
        from redis.asyncio.retry import Retry
    else:
        from redis.retry import Retry
    return {
        "retry": Retry(ExponentialBackoff(cap=RETRY_CAP_S, base=RETRY_BASE_S), RETRIES),
        "retry_on_error": [ConnectionError, TimeoutError, ConnectionResetError, BrokenPipeError],
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "socket_keepalive": True,
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
    }


def async_redis(url: str, **overrides: Any):
    """A ``redis.asyncio.Redis`` for ``url`` with healing connections."""
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url, **{**redis_options(asyncio=True), **overrides})


def sync_redis(url: str, **overrides: Any):
    """A ``redis.Redis`` for ``url`` with healing connections."""
    import redis

    return redis.Redis.from_url(url, **{**redis_options(asyncio=False), **overrides})
