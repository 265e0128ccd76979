"""The files compose's ``cluster`` profile and deploy/k8s/cluster run, run here on local processes:
three redis-server with ``deploy/redis/cluster-node.conf`` and a password, made into a cluster by
``deploy/redis/cluster-init.sh`` (a second run leaves it alone), and clients told the announced
hostname, as compose's and the StatefulSet's DNS names are."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from sluice_bench.redis_cluster import SETUP_HINT, free_ports

REPO = Path(__file__).resolve().parents[2]
NODE_CONF = REPO / "deploy" / "redis" / "cluster-node.conf"
INIT = REPO / "deploy" / "redis" / "cluster-init.sh"
PASSWORD = "init-test-pw"

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis]


@pytest.fixture
def three_nodes(tmp_path: Path):
    """Three redis-server processes on NODE_CONF (``dir`` moved into tmp), not yet a cluster."""
    conf = tmp_path / "cluster-node.conf"
    text = NODE_CONF.read_text()
    assert "dir /data\n" in text
    conf.write_text(text.replace("dir /data\n", "dir .\n"))
    ports = free_ports(6)
    procs, nodes = [], []
    try:
        for i in range(3):
            port, bus = ports[2 * i], ports[2 * i + 1]
            node_dir = tmp_path / f"n{i}"
            node_dir.mkdir()
            try:
                procs.append(subprocess.Popen(
                    ["redis-server", str(conf), "--port", str(port), "--cluster-port", str(bus),
                     "--bind", "127.0.0.1", "--cluster-announce-hostname", "localhost",
                     "--requirepass", PASSWORD, "--masterauth", PASSWORD, "--logfile", "redis.log"],
                    cwd=node_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                ))
            except FileNotFoundError:
                pytest.fail(SETUP_HINT, pytrace=False)
            nodes.append(f"localhost:{port}")
        yield nodes
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _init(nodes: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(INIT), *nodes], capture_output=True, text=True, timeout=90,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "REDIS_PASSWORD": PASSWORD, "REDIS_CLUSTER_WAIT_S": "60"},
    )


def test_init_script_makes_the_cluster_once(three_nodes: list[str]) -> None:
    first = _init(three_nodes)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "creating a cluster of 3 nodes" in first.stdout
    assert PASSWORD not in first.stdout + first.stderr
    # every node is ok right when the job exits (what starts after it finds the cluster whole)
    for node in three_nodes:
        client = redis.Redis(host="127.0.0.1", port=int(node.rsplit(":", 1)[1]), password=PASSWORD)
        assert client.cluster("info")["cluster_state"] == "ok"
        # clients are told the announced hostname, not the address (compose / k8s DNS names)
        slots = client.execute_command("CLUSTER", "SLOTS")
        assert {s[2][0] for s in slots} == {b"localhost"}
        client.close()

    again = _init(three_nodes)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already serves 16384 slots" in again.stdout and "creating" not in again.stdout

    client = RedisCluster(startup_nodes=[ClusterNode("localhost", int(three_nodes[0].rsplit(":", 1)[1]))],
                          password=PASSWORD)
    try:
        for i in range(60):
            client.set(f"sluice:init:{i}", i)
        assert len({client.get_node_from_key(f"sluice:init:{i}").name for i in range(60)}) == 3
    finally:
        client.close()


def test_init_script_fails_when_a_node_never_answers(three_nodes: list[str]) -> None:
    missing = f"127.0.0.1:{free_ports(1)[0]}"
    proc = subprocess.run(
        ["sh", str(INIT), *three_nodes[:2], missing], capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "REDIS_PASSWORD": PASSWORD, "REDIS_CLUSTER_WAIT_S": "2"},
    )
    assert proc.returncode == 1
    assert f"{missing} did not pass 'answers'" in proc.stderr
