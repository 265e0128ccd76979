"""The Redis fixtures themselves: a real server, flushed between tests, restartable on its port."""

from __future__ import annotations

import time

import pytest
import redis

from sluice.wire.connection import connect

pytestmark = [pytest.mark.docker, pytest.mark.redis]


def test_redis_url_is_local_and_answers(redis_url: str) -> None:
    assert redis_url.startswith("redis://localhost:") and redis_url.endswith("/0")
    client = connect(redis_url)
    try:
        assert client.ping()
        version = client.info("server")["redis_version"]
        assert int(version.split(".")[0]) >= 7, version
        assert client.config_get("protected-mode")["protected-mode"] == "no"
    finally:
        client.close()


def test_set_get_and_stream(redis_client: redis.Redis) -> None:
    redis_client.set("sluice:test:key", b"value")
    assert redis_client.get("sluice:test:key") == b"value"
    redis_client.xgroup_create("sluice:test:stream", "engines", id="0", mkstream=True)
    redis_client.xadd("sluice:test:stream", {"payload": b"\x00\xff"})
    entries = redis_client.xreadgroup("engines", "e1", {"sluice:test:stream": ">"}, count=10)
    assert entries[0][1][0][1] == {b"payload": b"\x00\xff"}


def test_flushed_between_tests(redis_client: redis.Redis) -> None:
    # the previous test's keys are gone
    assert redis_client.dbsize() == 0, redis_client.keys("*")[:10]  # a writer that outlived its test


def test_restart_keeps_port_and_comes_back(restartable_redis) -> None:
    url_before = restartable_redis.url
    client = connect(url_before, socket_timeout=2, socket_connect_timeout=1)
    client.set("k", "v")

    restartable_redis.stop()
    with pytest.raises(redis.exceptions.ConnectionError):
        connect(url_before, socket_connect_timeout=0.5, retry=None).ping()

    t0 = time.monotonic()
    restartable_redis.start()
    assert restartable_redis.url == url_before
    # redis-py reconnects on the next command; a clean stop saved the snapshot
    assert client.ping()
    assert client.get("k") == b"v"
    assert time.monotonic() - t0 < 30

    restartable_redis.restart(hard=True)  # a crash: writes since the last snapshot are lost
    assert restartable_redis.url == url_before
    assert client.ping()
    client.close()
