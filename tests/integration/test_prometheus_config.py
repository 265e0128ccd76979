"""The monitoring files against a real Prometheus (the `prom/prometheus:v2.42.0` image compose's
`monitoring` profile uses; deploy/images/build-standins.sh builds it from Debian's package):
`promtool check config` accepts deploy/prometheus/prometheus.yml, Prometheus starts with it, and
every query of the Grafana dashboard parses and evaluates. The load balancer's job is scraped for
real: HAProxy (the `haproxy:2.6` image, deploy/lb/haproxy.cfg) runs beside Prometheus on a Docker
network under compose's service name `lb`, and every HAProxy series the dashboard selects is there."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.docker_support import LOOPBACK, free_port, require_docker
from tests.unit.test_monitoring_config import PROMETHEUS, dashboard_exprs

pytestmark = pytest.mark.docker

IMAGE = "prom/prometheus:v2.42.0"
LB_IMAGE = "haproxy:2.6"
CONFIG_IN_CONTAINER = "/etc/prometheus/prometheus.yml"
HAPROXY_CFG = Path(__file__).resolve().parents[2] / "deploy" / "lb" / "haproxy.cfg"


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
    """Prometheus with the repository's config, on a network where `lb` is a real HAProxy."""
    require_docker(LB_IMAGE)
    network = docker_client.networks.create(f"sluice-prom-{uuid.uuid4().hex[:8]}")
    lb = docker_client.containers.create(
        LB_IMAGE, ["haproxy", "-f", "/usr/local/etc/haproxy/haproxy.cfg"],
        volumes={str(HAPROXY_CFG): {"bind": "/usr/local/etc/haproxy/haproxy.cfg", "mode": "ro"}},
    )
    network.connect(lb, aliases=["lb"])
    lb.start()
    port = free_port()
    container = docker_client.containers.create(
        IMAGE, volumes=_mount(PROMETHEUS), ports={"9090/tcp": (LOOPBACK, port)},
    )
    network.connect(container)
    container.start()
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
        lb.remove(force=True)
        network.remove()


def grafana_to_promql(expr: str) -> str:
    """What Grafana sends: variables replaced by their "All" values and the rate interval."""
    return (expr.replace("$__rate_interval", "1m").replace('=~"$model"', '=~".*"')
            .replace('=~"$engine_id"', '=~".*"'))


def test_prometheus_loads_the_config_and_knows_the_jobs(prometheus_url):
    r = httpx.get(f"{prometheus_url}/api/v1/status/config", timeout=10)
    assert r.status_code == 200
    loaded = r.json()["data"]["yaml"]
    assert "job_name: sluice-gateway" in loaded and "job_name: sluice-engine" in loaded
    assert "job_name: sluice-lb" in loaded


def test_the_load_balancer_is_scraped_and_has_every_series_the_dashboard_selects(prometheus_url):
    selectors = sorted({m for e in dashboard_exprs() for m in re.findall(r"haproxy_\w+\{[^}]*\}", e)})
    assert len(selectors) >= 5, selectors
    deadline = time.monotonic() + 60
    while True:
        targets = httpx.get(f"{prometheus_url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        lb = [t for t in targets if t["labels"].get("job") == "sluice-lb"]
        missing = [s for s in selectors
                   if not httpx.get(f"{prometheus_url}/api/v1/query", params={"query": s}, timeout=10).json()["data"]["result"]]
        if lb and all(t["health"] == "up" for t in lb) and not missing:
            break
        assert time.monotonic() < deadline, f"lb targets {lb}; no series for {missing}"
        time.sleep(1)
    assert [t["labels"]["instance"].endswith(":8404") for t in lb] == [True]
    # and the check can fail: a series HAProxy does not export is not found
    none = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": 'haproxy_backend_active_servers{proxy="nope"}'},
                     timeout=10).json()["data"]["result"]
    assert none == []


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
