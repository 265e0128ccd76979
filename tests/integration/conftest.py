"""Integration fixtures: a real Redis in a container (testcontainers, ``redis:7``).

- ``redis_server`` / ``redis_url`` (session): one Redis for the whole run, published on 127.0.0.1;
  ``redis_url`` is ``redis://localhost:<port>/0``.
- ``redis_client`` / ``clean_redis`` (function): the shared server flushed before the test, and a
  client to it.
- ``redis_topology`` (module): "standalone", or, for a test marked ``both_topologies``, each of
  "standalone" and "cluster" in turn (``pytest_generate_tests`` in tests/conftest.py); ``clean_redis``
  and ``redis_client`` then name / reach an emptied Redis of that topology: the shared container, or
  the session's 3-master Redis Cluster of local processes (``tests/cluster_fixtures.py``).
- ``restartable_redis`` (function): a Redis of the test's own on a fixed host port, with
  ``.restart()``, ``.stop()``/``.start()`` and ``.url`` that survives them — for tests of
  "Redis restarted mid-run".

Docker is required: without a daemon (or without the image) these fixtures FAIL with what to run
(`.ci/setup-docker.sh`), they do not skip. ``SLUICE_TEST_REDIS_URL`` points the shared fixtures at
an existing server instead (it is flushed between tests: use a throwaway one).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from sluice.wire.connection import connect
from tests.cluster_fixtures import clean_redis_cluster, redis_cluster, redis_cluster_factory  # noqa: F401
from tests.docker_support import DockerUnavailable, RedisServer, wait_for_redis

if TYPE_CHECKING:
    import redis


def _running(server: RedisServer) -> Iterator[RedisServer]:
    """Start ``server`` (failing the test, never skipping it, without Docker), yield it, remove it."""
    try:
        server.start()
    except DockerUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer | None]:
    """The session's Redis container (None when SLUICE_TEST_REDIS_URL names an external one)."""
    if os.environ.get("SLUICE_TEST_REDIS_URL"):
        yield None
        return
    yield from _running(RedisServer())


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer | None) -> str:
    """``redis://localhost:<port>/0`` of a Redis that answers PING."""
    url = os.environ.get("SLUICE_TEST_REDIS_URL") or redis_server.url  # type: ignore[union-attr]
    wait_for_redis(url, timeout=30)
    return url


@pytest.fixture
def clean_redis(redis_topology: str, request: pytest.FixtureRequest) -> str:
    """An emptied Redis of the test's topology (FLUSHALL before the test); returns its URL."""
    if redis_topology == "cluster":
        return request.getfixturevalue("clean_redis_cluster").url
    redis_url = request.getfixturevalue("redis_url")
    client = connect(redis_url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_url


@pytest.fixture
def redis_client(clean_redis: str) -> Iterator[redis.Redis]:
    """A client (decode_responses=False) to the freshly flushed shared Redis."""

    client = connect(clean_redis)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def restartable_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own on a fixed 127.0.0.1 port; ``.restart()`` keeps ``.url``."""
    yield from _running(RedisServer(fixed_port=True))
