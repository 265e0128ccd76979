"""The one way every process reaches Redis (``sluice.wire.connection``), against real servers: a
URL of the wrong topology stops a process at start with the flag named; a cluster URL reaches
every node's keys; bad URLs are refused before anything connects."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.wire import contract
from sluice.wire.connection import RedisURLError, check_url, connect, is_cluster, parse_url, redact

pytestmark = [pytest.mark.docker, pytest.mark.redis]

CLI = [sys.executable, "-m", "sluice_cli.cli"]


def test_urls_are_parsed_and_bad_ones_refused() -> None:
    target = parse_url("redis+cluster://app:p%40ss@h1:7000,h2:7001")
    assert target.cluster and target.nodes == (("h1", 7000), ("h2", 7001))
    assert (target.username, target.password) == ("app", "p@ss")
    assert parse_url("rediss+cluster://h1").tls and parse_url("rediss+cluster://h1").nodes == (("h1", 6379),)
    assert not parse_url("rediss://:pw@h:1/0").cluster
    assert redact("redis+cluster://app:secret@h1:1,h2:2") == "redis+cluster://app:***@h1:1,h2:2"
    for bad, words in (("http://h:1", "unknown scheme"), ("localhost:6379", "not a URL"),
                       ("redis+cluster://h1:1/2", "database 0"), ("redis+cluster://h1:x", "bad port"),
                       ("redis+cluster://", "names no cluster node")):
        with pytest.raises(RedisURLError, match=words) as info:
            parse_url(bad)
        assert "--redis-url" in str(info.value)


def test_a_standalone_url_for_a_cluster_node_is_refused(redis_cluster) -> None:
    host, port = redis_cluster.startup_nodes[0]
    with pytest.raises(RedisURLError) as info:
        check_url(f"redis://{host}:{port}/0")
    message = str(info.value)
    assert "--redis-url" in message and "Redis Cluster" in message and f"redis+cluster://{host}:{port}" in message


def test_a_cluster_url_for_a_standalone_server_is_refused(redis_url) -> None:
    cluster_url = redis_url.replace("redis://", "redis+cluster://", 1).rsplit("/", 1)[0]
    with pytest.raises(RedisURLError) as info:
        check_url(cluster_url)
    message = str(info.value)
    assert "--redis-url" in message and "standalone" in message and "redis://" in message


def test_matching_urls_pass_and_unreachable_ones_are_not_guessed(redis_url, redis_cluster) -> None:
    assert check_url(redis_url) is True
    assert check_url(redis_cluster.url) is True
    assert check_url("redis://127.0.0.1:1/0") is False  # nothing answers: the process starts and retries


def test_a_cluster_client_reaches_every_node(clean_redis_cluster) -> None:
    client = connect(clean_redis_cluster.url)
    try:
        assert is_cluster(client)
        models = [f"model-{i}" for i in range(30)]
        for model in models:
            client.xadd(contract.request_stream(model, 0), {contract.REQUEST_FIELD: b"x"})
        owners = {clean_redis_cluster.master_for(contract.request_stream(m, 0)).port for m in models}
        assert len(owners) == 3, "the queues of 30 models should land on all three masters"
        assert all(client.xlen(contract.request_stream(m, 0)) == 1 for m in models)
        # and one model's queue shards spread over the masters too
        shards = contract.request_streams("one-model", contract.DEFAULT_QUEUE_SHARDS)
        assert len({clean_redis_cluster.master_for(s).port for s in shards}) == 3
    finally:
        client.close()


@pytest.mark.parametrize("program", ["gateway", "engine"])
def test_processes_stop_at_start_on_the_wrong_topology(program, redis_cluster, tmp_path) -> None:
    host, port = redis_cluster.startup_nodes[0]
    args = [*CLI, program, "--redis-url", f"redis://{host}:{port}/0"]
    if program == "gateway":
        args += ["--port", "0"]
    else:  # refused before the model is loaded: a directory that holds none is never read
        args += ["--model", str(tmp_path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--redis-url" in proc.stderr and "redis+cluster://" in proc.stderr


def test_wrong_credentials_stop_a_process_at_start(redis_cluster_factory) -> None:
    cluster = redis_cluster_factory(password="s3cret", username="app", replicas_per_master=0)
    assert check_url(cluster.url) is True
    host, port = cluster.startup_nodes[0]
    for url in (cluster.url.replace("s3cret", "nope"), cluster.url.replace("app:s3cret@", ""),
                f"redis://app:nope@{host}:{port}/0"):
        with pytest.raises(RedisURLError, match="refused the credentials") as info:
            check_url(url)
        assert "s3cret" not in str(info.value) and "nope" not in str(info.value)  # never a password in a log
    proc = subprocess.run([*CLI, "gateway", "--redis-url", cluster.url.replace("s3cret", "nope"), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "refused the credentials" in proc.stderr, proc.stderr


@pytest.mark.both_topologies
def test_a_burst_past_redis_pys_default_pool_cap_is_served(clean_redis) -> None:
    """A gateway awaits hundreds of commands at once in a burst, and a WireClient holds one pub/sub
    per open request. On one Redis, redis-py 8 capped the pool at 100 connections and failed every
    command past it; on a cluster, redis-py 8.1's asyncio client let a burst of new connections end
    in ``AttributeError`` (a write on a connection closed under it, redis-py #4287; 8.2 raises a
    retried ``ConnectionError``), which no retry layer catches."""
    import asyncio

    async def burst() -> list:
        client = connect(clean_redis, asyncio=True)
        try:
            # Every command takes its connection before the first reply arrives: 300 at once.
            return await asyncio.gather(*(client.set(f"burst:{{t}}:{i}", b"x" * 1000) for i in range(300)),
                                        return_exceptions=True)
        finally:
            await client.aclose()

    results = asyncio.run(burst())
    assert [r for r in results if r is not True] == []
    client = connect(clean_redis)
    pubsubs = []
    try:
        for i in range(150):
            pubsub = client.pubsub()
            pubsub.ssubscribe(contract.events_channel(f"burst-{i}"))
            pubsubs.append(pubsub)
        assert client.get("burst:{t}:299") == b"x" * 1000
    finally:
        for pubsub in pubsubs:
            pubsub.close()
        client.close()
