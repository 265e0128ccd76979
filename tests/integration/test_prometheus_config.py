"""The monitoring files against a real Prometheus (the `prom/prometheus:v2.42.0` image compose's
`monitoring` profile uses; deploy/images/build-standins.sh builds it from Debian's package):
`promtool check config` accepts deploy/prometheus/prometheus.yml, Prometheus starts with it, and
every query of the Grafana dashboard parses and evaluates."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.docker_support import LOOPBACK, free_port, require_docker
from tests.unit.test_monitoring_config import PROMETHEUS, dashboard_exprs

IMAGE = "prom/prometheus:v2.42.0"
CONFIG_IN_CONTAINER = "/etc/prometheus/prometheus.yml"


@pytest.fixture(scope="module")
def docker_client():
    require_docker(IMAGE)
    import docker

    client = docker.from_env(timeout=60)
    try:
        yield client
    finally:
        client.close()


def _mount(path: Path) -> dict:
    return {str(path): {"bind": CONFIG_IN_CONTAINER, "mode": "ro"}}


def test_promtool_accepts_the_config(docker_client):
    out = docker_client.containers.run(
        IMAGE, ["check", "config", CONFIG_IN_CONTAINER], entrypoint="promtool",
        volumes=_mount(PROMETHEUS), remove=True, stdout=True, stderr=True,
    ).decode()
    assert "SUCCESS" in out, out


def test_promtool_rejects_a_broken_config(docker_client, tmp_path):
    # the check above can fail: a config with a typo in a key is refused
    bad = tmp_path / "prometheus.yml"
    bad.write_text(PROMETHEUS.read_text().replace("dns_sd_configs", "dns_sd_config", 1))
    bad.chmod(0o644)
    tmp_path.chmod(0o755)
    import docker

    with pytest.raises(docker.errors.ContainerError) as info:
        docker_client.containers.run(IMAGE, ["check", "config", CONFIG_IN_CONTAINER], entrypoint="promtool",
                                     volumes=_mount(bad), remove=True, stdout=True, stderr=True)
    assert "dns_sd_config" in str(info.value.stderr or b"", "utf-8", "replace") + str(info.value)


@pytest.fixture(scope="module")
def prometheus_url(docker_client) -> Iterator[str]:
    port = free_port()
    container = docker_client.containers.run(
        IMAGE, detach=True, volumes=_mount(PROMETHEUS), ports={"9090/tcp": (LOOPBACK, port)},
    )
    url = f"http://{LOOPBACK}:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            container.reload()
            assert container.status in ("created", "running"), container.logs().decode()[-2000:]
            time.sleep(0.5)
        else:
            pytest.fail("Prometheus never became ready:\n" + container.logs().decode()[-2000:])
        yield url
    finally:
        container.remove(force=True)


def grafana_to_promql(expr: str) -> str:
    """What Grafana sends: variables replaced by their "All" values and the rate interval."""
    return (expr.replace("$__rate_interval", "1m").replace('=~"$model"', '=~".*"')
            .replace('=~"$engine_id"', '=~".*"'))


def test_prometheus_loads_the_config_and_knows_the_jobs(prometheus_url):
    r = httpx.get(f"{prometheus_url}/api/v1/status/config", timeout=10)
    assert r.status_code == 200
    loaded = r.json()["data"]["yaml"]
    assert "job_name: sluice-gateway" in loaded and "job_name: sluice-engine" in loaded


def test_every_dashboard_query_parses_and_evaluates(prometheus_url):
    exprs = dashboard_exprs()
    assert len(exprs) > 20
    problems = []
    for expr in exprs:
        r = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": grafana_to_promql(expr)}, timeout=10)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            problems.append(f"{expr}\n  -> {body.get('error')}")
    assert not problems, "\n".join(problems)
    # and the check can fail: a malformed query is reported as such
    bad = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": "sum(rate(sluice:x[1m])"}, timeout=10)
    assert bad.json()["status"] == "error"
