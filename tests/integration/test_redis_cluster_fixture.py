"""The Redis Cluster fixtures themselves (sluice_bench/redis_cluster.py): a real cluster of redis-server
processes, proved real by what only a cluster does (keys spread over the masters, CROSSSLOT,
failover), with auth when asked. Clients here are redis-py's own ``RedisCluster``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from sluice_bench.redis_cluster import ClusterUnavailable, LocalRedisCluster
from tests import cluster_fixtures

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis]


def _keys_on(cluster: LocalRedisCluster, master, count: int, prefix: str) -> list[str]:
    """``count`` keys of distinct slots that ``master`` serves."""
    keys, slots = [], set()
    i = 0
    while len(keys) < count:
        key = f"{prefix}{i}"
        i += 1
        slot = cluster.slot_of(key)
        if slot not in slots and cluster.master_for(key) is master:
            keys.append(key)
            slots.add(slot)
    return keys


def test_three_masters_each_with_a_replica(redis_cluster: LocalRedisCluster) -> None:
    masters, replicas = redis_cluster.masters(), redis_cluster.replicas()
    assert len(masters) == 3 and len(replicas) == 3
    assert {n.port for n in masters}.isdisjoint(n.port for n in replicas)
    for master in masters:
        assert len(redis_cluster.replicas_of(master)) == 1
    # the URL names every node, in the convention the Sluice processes take
    assert redis_cluster.url == "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster.nodes)
    assert redis_cluster.startup_nodes == [("127.0.0.1", n.port) for n in redis_cluster.nodes]
    # every node really runs in cluster mode, Redis >= 7 (sharded pub/sub)
    for node in redis_cluster.nodes:
        info = redis_cluster.node_client(node).info("server")
        assert info["redis_mode"] == "cluster"
        assert int(str(info["redis_version"]).split(".")[0]) >= 7
        assert node.port != node.bus_port


def test_keys_spread_over_the_three_masters(clean_redis_cluster: LocalRedisCluster) -> None:
    cluster = clean_redis_cluster
    client = cluster.client()
    try:
        for i in range(300):
            client.set(f"sluice:test:{i}", i)
        per_master = {m.port: cluster.node_client(m).dbsize() for m in cluster.masters()}
        assert len(per_master) == 3 and all(per_master.values()), per_master
        assert sum(per_master.values()) == 300
        # master_for (which kill_master uses) names the node that holds the key
        for i in range(0, 300, 37):
            key = f"sluice:test:{i}"
            assert cluster.node_client(cluster.master_for(key)).get(key) == str(i).encode()
    finally:
        client.close()


def test_cross_slot_multi_is_refused(clean_redis_cluster: LocalRedisCluster) -> None:
    cluster = clean_redis_cluster
    master = cluster.masters()[0]
    a, b = _keys_on(cluster, master, 2, "sluice:xs:")
    node = cluster.node_client(master)
    pipe = node.pipeline(transaction=True)  # MULTI / SET / SET / EXEC on the node that owns both
    pipe.set(a, 1)
    pipe.set(b, 2)
    with pytest.raises(redis.exceptions.ClusterCrossSlotError):  # the server's CROSSSLOT reply
        pipe.execute()
    assert node.exists(a) == 0 and node.exists(b) == 0  # the transaction did not run
    # the same transaction on keys of one hash tag (one slot) runs
    tag = "{sluice:xs}"
    owner = cluster.node_client(cluster.master_for(tag))
    pipe = owner.pipeline(transaction=True)
    pipe.set(f"{tag}:a", 1)
    pipe.set(f"{tag}:b", 2)
    assert pipe.execute() == [True, True]


def test_failover_promotes_a_replica_and_keeps_an_acknowledged_write(redis_cluster_factory) -> None:
    cluster: LocalRedisCluster = redis_cluster_factory()
    key = "sluice:failover:key"
    client = cluster.client()  # made before the failover: it must follow the new topology
    try:
        master = cluster.master_for(key)
        replica_ports = {n.port for n in cluster.replicas_of(master)}
        direct = cluster.node_client(master)
        pipe = direct.pipeline(transaction=False)  # one connection: WAIT covers the SET before it
        pipe.set(key, b"before")
        pipe.execute_command("WAIT", 1, 0)
        assert pipe.execute() == [True, 1]

        killed = cluster.kill_master(key)
        assert killed is master and not killed.alive
        promoted = cluster.wait_for_failover(timeout=60)
        assert promoted.port in replica_ports
        assert cluster.master_for(key) is promoted
        assert len(cluster.masters()) == 3

        assert client.get(key) == b"before"
        fresh = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.startup_nodes])
        try:
            assert fresh.get(key) == b"before"
            fresh.set(key, b"after")
        finally:
            fresh.close()

        # the old master comes back as the replica of its successor, with the new data
        cluster.restart_node(killed)
        assert [n.port for n in cluster.replicas_of(promoted)] == [killed.port]
        assert len(cluster.masters()) == 3 and len(cluster.replicas()) == 3
        replica = cluster.node_client(killed, single_connection_client=True)
        replica.execute_command("READONLY")  # read on the replica itself, no redirection
        assert replica.get(key) == b"after"
    finally:
        client.close()


def test_heal_restarts_dead_nodes(redis_cluster_factory) -> None:
    cluster: LocalRedisCluster = redis_cluster_factory()
    replica = cluster.replicas()[0]
    replica.proc.kill()
    replica.proc.wait()
    assert len(cluster.live_nodes()) == 5
    cluster.heal()
    assert len(cluster.live_nodes()) == 6
    assert len(cluster.masters()) == 3 and len(cluster.replicas()) == 3


def test_flushall_empties_masters_and_replicas(clean_redis_cluster: LocalRedisCluster) -> None:
    cluster = clean_redis_cluster
    client = cluster.client()
    try:
        for i in range(50):
            client.set(f"sluice:flush:{i}", i)
    finally:
        client.close()
    for master in cluster.masters():
        cluster.node_client(master).execute_command("WAIT", 1, 5000)
    assert all(cluster.node_client(n).dbsize() for n in cluster.replicas())
    cluster.flushall()
    assert [cluster.node_client(n).dbsize() for n in cluster.nodes] == [0] * 6


@pytest.mark.parametrize("username", [None, "sluice"], ids=["requirepass", "acl-user"])
def test_a_client_without_the_password_is_refused(redis_cluster_factory, username: str | None) -> None:
    password = "s3cret/pass:word@"  # characters a URL must escape
    cluster: LocalRedisCluster = redis_cluster_factory(password=password, username=username)
    assert cluster.url.startswith(f"redis+cluster://{username or ''}:s3cret%2Fpass%3Aword%40@127.0.0.1:")
    # fresh ClusterNode objects for every client: redis-py caches a node's connection on them
    def nodes() -> list[ClusterNode]:
        return [ClusterNode(h, p) for h, p in cluster.startup_nodes]

    for credentials in ({}, {"password": "wrong"}, {"username": username or "default", "password": "wrong"}):
        with pytest.raises(redis.RedisClusterException, match="invalid username-password|authenticated"):
            RedisCluster(startup_nodes=nodes(), **credentials)
        with pytest.raises(redis.AuthenticationError):
            # no retries: redis-py would retry an AuthenticationError (a ConnectionError) with backoff
            redis.Redis(host="127.0.0.1", port=cluster.nodes[0].port, retry=Retry(NoBackoff(), 0), **credentials).ping()
    client = RedisCluster(startup_nodes=nodes(), username=username, password=password)
    try:
        assert client.set("sluice:auth", b"v") and client.get("sluice:auth") == b"v"
        client.spublish("sluice:auth:channel", b"x")  # sharded pub/sub is allowed to the user
    finally:
        client.close()
    # the replicas authenticated to their masters (masterauth / masteruser)
    for replica in cluster.replicas():
        assert cluster.node_client(replica).info("replication")["master_link_status"] == "up"


def test_start_without_redis_server_fails_and_says_what_to_install() -> None:
    cluster = LocalRedisCluster(redis_server="/nonexistent/redis-server")
    with pytest.raises(ClusterUnavailable, match="setup-docker.sh"):
        cluster.start()
    with pytest.raises(pytest.fail.Exception, match="could not start a local Redis Cluster"):
        cluster_fixtures.start_cluster(redis_server="/nonexistent/redis-server")


def test_tls_cluster_speaks_only_tls(redis_cluster_factory) -> None:
    cluster: LocalRedisCluster = redis_cluster_factory(tls=True)
    assert cluster.url.startswith("rediss+cluster://127.0.0.1:")
    port = cluster.nodes[0].port
    with pytest.raises(redis.ConnectionError):  # plain TCP on the node's port is not served
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0)).ping()
    client = cluster.client()  # TLS, verifying the nodes against cluster.ca_cert
    try:
        for i in range(60):
            client.set(f"sluice:tls:{i}", i)
        assert len({client.get_node_from_key(f"sluice:tls:{i}").name for i in range(60)}) == 3
    finally:
        client.close()
    # replication runs over TLS too
    for replica in cluster.replicas():
        assert cluster.node_client(replica).info("replication")["master_link_status"] == "up"
    # a process that only says ssl=True (as a rediss URL does) verifies against SSL_CERT_FILE
    code = (
        "import sys; from redis.cluster import ClusterNode, RedisCluster; "
        "print(RedisCluster(startup_nodes=[ClusterNode('127.0.0.1', int(sys.argv[1]))], ssl=True).ping())"
    )
    for env, ok in (({}, False), ({"SSL_CERT_FILE": str(cluster.ca_cert)}, True)):
        proc = subprocess.run([sys.executable, "-c", code, str(port)], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=60)
        assert (proc.returncode == 0) is ok, proc.stderr[-2000:]
