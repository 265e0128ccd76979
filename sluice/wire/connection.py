"""THE way any Sluice process reaches Redis: one URL in, a configured client out.

Every process (engine, gateway, ``WireClient``, ``sluice serve``, benches, tests) calls
:func:`connect`; nothing else constructs a Redis client.

URLs
----
- ``redis://[user:password@]host:port[/db]`` and ``rediss://...`` (TLS): one Redis server.
- ``redis+cluster://[user:password@]host1:port1[,host2:port2,...]`` and ``rediss+cluster://...``:
  a Redis Cluster (or a managed cluster-mode Redis / Valkey). The hosts are seeds: the client
  learns the topology from any that answers and follows MOVED/ASK and failovers itself
  (redis-py's ``RedisCluster``). Cluster mode has no database number.

A URL that names the wrong topology (a cluster URL for a standalone server, or the reverse) is
refused by :func:`check_topology` with a message that names ``--redis-url`` and the scheme to use;
the processes call it at start.

Healing connections
-------------------
``redis.Redis.from_url`` builds its pool WITHOUT the retry policy that ``redis.Redis(...)`` has by
default, so a plain ``from_url`` client fails one command per stale pooled connection after Redis
restarts (issue 12, item 1). :func:`redis_options` gives every connection, in both topologies,

- redis-py's own retry with exponential backoff on ``ConnectionError``/``TimeoutError`` (a stale
  connection is dropped and reconnected and the command re-sent; on a cluster the client also
  refreshes its slot map, so a failed-over master's slots are found on the promoted replica);
- a PING before a command on a connection idle longer than ``HEALTH_CHECK_INTERVAL_S`` (a
  half-closed connection is replaced before a non-idempotent command such as XADD is written);
- TCP keepalive and bounded connect/read timeouts.

While Redis stays down a command fails after about ``FAIL_AFTER_S`` seconds (the retries and the
connection attempts inside them), so callers answer 503 quickly instead of hanging.

Pool size
---------
A process holds one pooled connection per command it awaits at once, plus one per pub/sub. redis-py
8 caps a pool at 100 connections and raises ``MaxConnectionsError`` past that, which a gateway
streaming a few hundred requests reaches in a burst: every command past the hundredth failed,
after its retries, as "Redis unavailable". :func:`connect` sets the cap to
``MAX_CONNECTIONS`` in both topologies, so concurrency, not a library default, decides how many
connections a process opens; Redis's own ``maxclients`` (10,000 by default) bounds the fleet.

Sharded pub/sub
---------------
Both topologies use SSUBSCRIBE/SPUBLISH (Redis >= 7), so there is one code path: on a cluster a
sharded message is delivered on the node that owns the channel's slot instead of being broadcast
to every node. :func:`read_shard_message` and :func:`refresh_topology` hide the two small API
differences redis-py has between its standalone and cluster pub/sub objects.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

RETRIES = 5  # per command
RETRY_BASE_S = 0.05
RETRY_CAP_S = 0.5
HEALTH_CHECK_INTERVAL_S = 2
SOCKET_CONNECT_TIMEOUT_S = 2.0
# The longest a command waits for a reply; generous because XREADGROUP BLOCK and big model cards
# travel on these connections. Blocking callers pass a smaller block than this.
SOCKET_TIMEOUT_S = 30.0
# Per process (per node on a cluster): above any burst the suite or a bench has produced (300 at once),
# below Redis's default maxclients of 10,000.
MAX_CONNECTIONS = 4096
FAIL_AFTER_S = 2.0  # measured (about 1.7 s on localhost): how long a command keeps trying while Redis is down

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
STANDALONE_SCHEMES = ("redis", "rediss", "unix")
URL_FLAG = "--redis-url"


def _transient_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import ClusterError, SlotNotCoveredError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return (RedisConnectionError, RedisTimeoutError, OSError, ClusterError, SlotNotCoveredError)


# "Redis is unavailable (for now)": a server down or restarting, or a cluster whose slot has no
# master yet (CLUSTERDOWN during a failover, a slot not covered). Callers retry or answer 503.
TRANSIENT_ERRORS = _transient_errors()


class RedisURLError(ValueError):
    """A Redis URL Sluice cannot use, or one naming the wrong topology; the message says why."""


@dataclass(frozen=True)
class RedisTarget:
    """What a URL names."""

    url: str
    cluster: bool
    nodes: tuple[tuple[str, int], ...] = ()  # cluster seeds
    username: str | None = None
    password: str | None = None
    tls: bool = False

    @property
    def display(self) -> str:
        """The URL without its password, for logs and error messages."""
        return redact(self.url)


def redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, hosts = rest.rpartition("@")
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{hosts}" if user else f"{scheme}://***@{hosts}"


def parse_url(url: str) -> RedisTarget:
    """Tell a cluster URL from a standalone one; parse a cluster URL's seeds and credentials."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise RedisURLError(f"{URL_FLAG} {url!r} is not a URL: expected redis://host:port or "
                            "redis+cluster://host:port[,host:port...]")
    if scheme in STANDALONE_SCHEMES:
        return RedisTarget(url=url, cluster=False, tls=scheme == "rediss")
    if scheme not in CLUSTER_SCHEMES:
        raise RedisURLError(f"{URL_FLAG} {redact(url)!r}: unknown scheme {scheme!r}; use redis://, rediss://, "
                            "redis+cluster:// or rediss+cluster://")
    authority, _, path = rest.partition("/")
    creds, _, hosts = authority.rpartition("@")
    if path.split("?", 1)[0].strip("/") not in ("", "0"):
        raise RedisURLError(f"{URL_FLAG} {redact(url)!r}: a Redis Cluster has only database 0")
    username = password = None
    if creds:  # as redis-py reads a URL's user info: user:password, :password or user
        user, has_pw, pw = creds.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if has_pw else None
    nodes = []
    for part in filter(None, (h.strip() for h in hosts.split(","))):
        host, colon, port = part.rpartition(":")
        if not colon:
            host, port = part, "6379"
        try:
            nodes.append((host.strip("[]"), int(port)))
        except ValueError:
            raise RedisURLError(f"{URL_FLAG} {redact(url)!r}: bad port in {part!r}") from None
    if not nodes:
        raise RedisURLError(f"{URL_FLAG} {redact(url)!r} names no cluster node (host:port[,host:port...])")
    return RedisTarget(url=url, cluster=True, nodes=tuple(nodes), username=username, password=password,
                       tls=CLUSTER_SCHEMES[scheme])


def redis_options(*, asyncio: bool) -> dict[str, Any]:
    """The healing-connection options every client gets (``asyncio``: for ``redis.asyncio``)."""
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


def connect(url: str, *, asyncio: bool = False, **overrides: Any) -> Any:
    """A client for ``url``: ``redis.Redis``/``redis.cluster.RedisCluster`` (or their
    ``redis.asyncio`` twins) with healing connections. ``overrides`` replace any option (e.g. a
    shorter ``socket_timeout``). A sync cluster client learns the topology here, so it raises
    when no seed answers; an asyncio one on its first command."""
    target = parse_url(url)
    options = {**redis_options(asyncio=asyncio), "max_connections": MAX_CONNECTIONS, **overrides}
    if options.get("retry") is None:
        options.pop("retry")
        options.pop("retry_on_error", None)
    if not target.cluster:
        if asyncio:
            import redis.asyncio as aioredis

            return aioredis.Redis.from_url(url, **options)
        import redis

        return redis.Redis.from_url(url, **options)
    cluster_options = {**options, "username": target.username, "password": target.password, "ssl": target.tls}
    if asyncio:
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes], **cluster_options)
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import RedisClusterException

    try:
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes], **cluster_options)
    except RedisClusterException as exc:
        raise _cluster_refused(target, exc) from exc


def is_cluster(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster as AsyncCluster
    from redis.cluster import RedisCluster

    return isinstance(client, (RedisCluster, AsyncCluster))


_AUTH_WORDS = ("invalid username-password", "wrongpass", "noauth", "authentication required",
               "must be called with the client already authenticated", "user is disabled")


def _auth_refused(target: RedisTarget, exc: Exception) -> RedisURLError | None:
    """A clear error when Redis refused the URL's credentials (None: some other failure)."""
    text = str(exc).lower()
    if not any(word in text for word in _AUTH_WORDS):
        return None
    return RedisURLError(f"{URL_FLAG} {target.display}: Redis refused the credentials ({str(exc).strip()}); "
                         "give the right user and password in the URL")


def _cluster_refused(target: RedisTarget, exc: Exception) -> Exception:
    auth = _auth_refused(target, exc)
    if auth is not None:
        return auth
    text = str(exc)
    if "cluster mode is not enabled" in text.lower() or "cluster support disabled" in text.lower():
        plain = target.url.replace("+cluster", "", 1).split(",")[0]
        return RedisURLError(f"{URL_FLAG} {target.display} is a cluster URL, but the server is a standalone Redis "
                             f"(cluster mode disabled): use {redact(plain)}")
    return exc


def _standalone_refused(target: RedisTarget) -> RedisURLError:
    scheme, _, rest = target.url.partition("://")
    return RedisURLError(f"{URL_FLAG} {target.display} points at a Redis Cluster node, which a standalone client "
                         f"cannot use (keys of other nodes' slots answer MOVED): use "
                         f"{redact(scheme + '+cluster://' + rest.split('/')[0])}")


def _cluster_enabled(info: dict) -> bool:
    return str(info.get("cluster_enabled", "0")) == "1"


def check_topology(client: Any, url: str) -> None:
    """Raise :class:`RedisURLError` when ``url``'s scheme does not match the server (sync client)."""
    target = parse_url(url)
    if target.cluster:
        return  # a cluster client cannot be built against a standalone server (see connect)
    if _cluster_enabled(client.info("cluster")):
        raise _standalone_refused(target)


def check_url(url: str) -> bool:
    """A process's start-up check of ``--redis-url``: raise :class:`RedisURLError` for a URL
    Sluice cannot use or one naming the wrong topology; False when no server answered (nothing
    could be checked: the process starts and its clients keep retrying), True when it matched."""
    target = parse_url(url)
    try:
        client = connect(url, socket_timeout=SOCKET_CONNECT_TIMEOUT_S, retry=None)
    except RedisURLError:
        raise
    except Exception:  # noqa: BLE001 - no seed answered; the process's own clients retry
        return False
    try:
        check_topology(client, url)
        return True
    except TRANSIENT_ERRORS as exc:  # an AuthenticationError is a ConnectionError to redis-py
        refused = _auth_refused(target, exc)
        if refused is not None:
            raise refused from exc
        return False
    finally:
        client.close()


async def check_topology_async(client: Any, url: str) -> None:
    """:func:`check_topology` for an asyncio client (a cluster one learns the topology here)."""
    from redis.exceptions import RedisClusterException

    target = parse_url(url)
    if target.cluster:
        try:
            await client.initialize()
        except RedisClusterException as exc:
            raise _cluster_refused(target, exc) from exc
        return
    if _cluster_enabled(await client.info("cluster")):
        raise _standalone_refused(target)


def _holds_no_node(pubsub: Any) -> bool:
    """A cluster pub/sub subscribed on no node at all (never yet, or redis-py dropped the node's
    connection after a failover): its read returns at once, so a read loop would spin."""
    nodes = getattr(pubsub, "node_pubsub_mapping", None)
    return nodes is not None and not nodes


def read_shard_message(pubsub: Any, timeout: float) -> Any:
    """The next sharded-channel message (or subscribe confirmation) of a sync pub/sub, either
    topology; None after ``timeout``."""
    if _holds_no_node(pubsub):
        time.sleep(timeout)
        return None
    return pubsub.get_sharded_message(ignore_subscribe_messages=False, timeout=timeout)


async def read_shard_message_async(pubsub: Any, timeout: float) -> Any:
    """:func:`read_shard_message` for a ``redis.asyncio`` pub/sub (its standalone class reads
    sharded messages with ``get_message``; the cluster one needs ``get_sharded_message``)."""
    if _holds_no_node(pubsub):
        await asyncio.sleep(timeout)
        return None
    reader = getattr(pubsub, "get_sharded_message", None) or pubsub.get_message
    return await reader(ignore_subscribe_messages=False, timeout=timeout)


async def shard_subscribers_async(client: Any, channel: str) -> int:
    """How many connections are subscribed to a sharded channel (asyncio client). On a cluster the
    question goes to the node that owns the channel's slot: redis-py would send it to one default
    node, which knows only its own subscribers."""
    options: dict[str, Any] = {}
    if is_cluster(client):
        options["target_nodes"] = client.get_node_from_key(channel)
    reply = await client.pubsub_shardnumsub(channel, **options)
    return sum(int(count) for _, count in reply)


def refresh_topology(client: Any) -> Any:
    """After a connection failure: make a cluster client re-learn which node owns which slot (a
    replica may have been promoted). Returns an awaitable for an asyncio client; a no-op on a
    standalone one."""
    manager = getattr(client, "nodes_manager", None)
    if manager is None:
        return _done() if _is_async(client) else None
    return manager.initialize()


def _is_async(client: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(client, "ping", None))


async def _done() -> None:
    return None
