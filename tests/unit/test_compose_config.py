"""compose.yaml as Compose resolves it (``docker-compose config``, no daemon needed): the default
stack is Redis, an engine, gateways and HAProxy on ``redis://redis:6379/0`` without auth; the
``cluster`` profile adds a 3-node Redis Cluster and the job that makes it; REDIS_PASSWORD and
SLUICE_REDIS_URL reach every process that needs them. (tests/e2e/test_compose.py runs the default
stack; tests/integration/test_cluster_deploy_files.py runs the cluster node config and init script.)
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.docker_support import compose_command

REPO = Path(__file__).resolve().parents[2]
DEFAULT_STACK = {"redis", "engine", "gateway", "lb"}
CLUSTER_NODES = ["redis-c1", "redis-c2", "redis-c3"]
CLUSTER_URL = "redis+cluster://redis-c1:6379,redis-c2:6379,redis-c3:6379"


def _config(*args: str, **env: str) -> dict:
    """``compose [--profile ...] config`` resolved with only ``env`` set of Sluice's variables."""
    cmd = compose_command()
    if cmd is None:
        pytest.fail("neither `docker compose` nor `docker-compose` is installed; run .ci/setup-docker.sh", pytrace=False)
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLUICE_", "REDIS_", "COMPOSE_", "GATEWAY_", "TORCH_"))}
    proc = subprocess.run(
        [*cmd, "-f", str(REPO / "compose.yaml"), "-p", "sluice-config-test", *args, "config"],
        cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


URL_WITH_PASSWORD = "redis+cluster://:pw123@redis-c1:6379,redis-c2:6379,redis-c3:6379"


@pytest.fixture(scope="module")
def default() -> dict:
    return _config()


@pytest.fixture(scope="module")
def cluster() -> dict:
    """The cluster profile with a password and the cluster URL set."""
    return _config("--profile", "cluster", SLUICE_REDIS_URL=URL_WITH_PASSWORD, REDIS_PASSWORD="pw123")


def test_default_stack_is_unchanged_by_the_cluster_profile(default: dict) -> None:
    services = default["services"]
    # the services that start without a profile are the stack as it was
    assert {n for n, s in services.items() if not s.get("profiles")} == DEFAULT_STACK
    for name in (*CLUSTER_NODES, "redis-cluster-init"):
        assert services[name]["profiles"] == ["cluster"], name
    # engines and gateways on the standalone Redis, no auth; the URL in their environment
    for name in ("engine", "gateway"):
        assert services[name]["environment"]["SLUICE_REDIS_URL"] == "redis://redis:6379/0"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert _arg(services["redis"]["command"], "--requirepass") == ""  # empty: no password
    assert "--appendonly" in services["redis"]["command"]
    # no named volume only the cluster uses: Compose v1 creates every named volume on any `up`
    assert set(default["volumes"]) == {"models", "redis-data", "prometheus"}


def test_pull_policies(default: dict) -> None:
    for name, service in default["services"].items():
        expected = "build" if "build" in service else "if_not_present"
        assert service.get("pull_policy") == expected, name


def test_cluster_profile_makes_a_three_master_cluster(cluster: dict) -> None:
    services = cluster["services"]
    conf = REPO / "deploy" / "redis" / "cluster-node.conf"
    for name in CLUSTER_NODES:
        node = services[name]
        assert node["image"] == "redis:7"
        command = node["command"]
        assert command[:2] == ["redis-server", "/usr/local/etc/redis/cluster-node.conf"]
        # clients are told the service name, which resolves on the compose network
        assert _arg(command, "--cluster-announce-hostname") == name
        mounts = node["volumes"]
        assert any(str(m).startswith(f"{conf}:/usr/local/etc/redis/cluster-node.conf") for m in mounts), mounts
        assert "/data" in mounts  # nodes.conf and the AOF survive a restart
        assert "healthcheck" in node and node["restart"] == "unless-stopped"
    init = services["redis-cluster-init"]
    assert init["command"] == [f"{n}:6379" for n in CLUSTER_NODES]
    assert init["entrypoint"] == ["sh", "/usr/local/bin/redis-cluster-init.sh"]
    assert {n: d["condition"] for n, d in init["depends_on"].items()} == dict.fromkeys(CLUSTER_NODES, "service_healthy")
    assert init["restart"] == "no"
    assert init["environment"]["REDIS_CLUSTER_REPLICAS"] == "0"
    assert any(str(m).startswith(str(REPO / "deploy" / "redis" / "cluster-init.sh")) for m in init["volumes"])
    # the URL the docs give names exactly these nodes
    assert CLUSTER_URL in (REPO / "compose.yaml").read_text()
    assert CLUSTER_URL in (REPO / "docs" / "deploy.md").read_text()
    text = conf.read_text()
    for line in ("cluster-enabled yes", "cluster-preferred-endpoint-type hostname", "appendonly yes", "dir /data"):
        assert line in text.splitlines(), line


def test_redis_url_and_password_reach_every_process(cluster: dict) -> None:
    services = cluster["services"]
    for name in ("engine", "gateway"):  # as $SLUICE_REDIS_URL: the password is on no command line
        assert services[name]["environment"]["SLUICE_REDIS_URL"] == URL_WITH_PASSWORD
        assert not any("pw123" in str(word) for word in services[name]["command"]), services[name]["command"]
    assert _arg(services["redis"]["command"], "--requirepass") == "pw123"
    for name in CLUSTER_NODES:
        command = services[name]["command"]
        assert _arg(command, "--requirepass") == "pw123" and _arg(command, "--masterauth") == "pw123"
    # health checks and the init job authenticate through the environment
    for name in ("redis", *CLUSTER_NODES, "redis-cluster-init"):
        assert services[name]["environment"]["REDIS_PASSWORD"] == "pw123", name
    for name in ("redis", *CLUSTER_NODES):
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL" and "REDISCLI_AUTH" in test[1] and "PONG" in test[1]


def test_cluster_init_script_is_valid_sh() -> None:
    script = REPO / "deploy" / "redis" / "cluster-init.sh"
    subprocess.run(["sh", "-n", str(script)], check=True, timeout=30)
