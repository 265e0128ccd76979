"""pytest fixtures for a real Redis Cluster (``sluice_bench/redis_cluster.py``), for any test layer.

- ``redis_cluster`` (session): 3 masters + 3 replicas of local redis-server processes, started once.
- ``clean_redis_cluster`` (function): that cluster made whole again if a test left a node dead
  (restarted, converged), FLUSHALLed on every master and waited for until every node, replicas
  included, is empty; returns the ``LocalRedisCluster`` (``.url`` is the ``redis+cluster://`` URL).
- ``redis_cluster_factory`` (function): ``make(**options)`` starts a private cluster (a password,
  an ACL user, a failover that must not disturb the shared one, ...); every one is stopped after the
  test.

A conftest takes them in by importing them (pytest finds fixtures by name in the conftest's
namespace)::

    from tests.cluster_fixtures import clean_redis_cluster, redis_cluster, redis_cluster_factory  # noqa: F401

Without redis-server/redis-cli >= 7 these fixtures FAIL with what to install; they never skip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sluice_bench.redis_cluster import ClusterUnavailable, LocalRedisCluster


def start_cluster(**options: Any) -> LocalRedisCluster:
    """A started ``LocalRedisCluster(**options)``, or the test fails with why (never a skip)."""
    cluster = LocalRedisCluster(**options)
    try:
        return cluster.start()
    except (ClusterUnavailable, TimeoutError) as exc:
        pytest.fail(f"could not start a local Redis Cluster: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """The session's Redis Cluster (3 masters, 3 replicas, no persistence, no auth)."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def clean_redis_cluster(redis_cluster: LocalRedisCluster) -> LocalRedisCluster:
    """The session's cluster, whole and empty before the test."""
    try:
        redis_cluster.heal()
        redis_cluster.flushall()
    except (ClusterUnavailable, TimeoutError) as exc:
        pytest.fail(f"the shared Redis Cluster could not be restored: {exc}", pytrace=False)
    return redis_cluster


@pytest.fixture
def redis_cluster_factory() -> Iterator[Callable[..., LocalRedisCluster]]:
    """``make(**options)``: a private started cluster (options as ``LocalRedisCluster``)."""
    started: list[LocalRedisCluster] = []

    def make(**options: Any) -> LocalRedisCluster:
        cluster = start_cluster(**options)
        started.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()
