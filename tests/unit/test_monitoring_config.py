"""The monitoring files: the Grafana dashboard, its provisioning, the Prometheus configuration, and
how compose and the k8s manifests expose the engines' metrics port. Metric names are checked here
against what the engine's and the gateway's metric classes register; tests/e2e/test_metrics.py
checks them against what running processes export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from engine_service.service.metrics import EngineMetrics
from gateway.metrics import Metrics as GatewayMetrics
from tests.file_modules import load_file

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "sluice-dashboard.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "compose.yaml"
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__all"}
PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "max", "count", "without", "le"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict) -> list[dict]:
    return [p for p in d["panels"] if p["type"] != "row"]


def dashboard_exprs(d: dict | None = None) -> list[str]:
    return [t["expr"] for p in panels(d or dashboard()) for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects: identifiers followed by a selector or a range."""
    names = set(re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{", expr))
    names |= set(re.findall(r"\b(sluice(?:_gateway)?:[A-Za-z0-9_:]+)", expr))
    return names - PROMQL_WORDS


def sluice_names(names: set[str]) -> set[str]:
    """The metrics Sluice's own processes export; HAProxy's (the load balancer row) are checked
    against a running HAProxy in tests/integration/test_prometheus_config.py."""
    return {name for name in names if not name.startswith("haproxy_")}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """The sample names a registry can export (labelled families included before any sample)."""
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def exported_names() -> set[str]:
    engine = EngineMetrics("m", "e").registry
    gateway = CollectorRegistry()
    GatewayMetrics(gateway)
    return sample_names(engine) | sample_names(gateway)


def test_dashboard_json_is_what_the_builder_writes():
    module = load_file("deploy/grafana/build_dashboard.py")
    assert DASHBOARD.read_text() == module.render(), "stale: run python deploy/grafana/build_dashboard.py"


def test_dashboard_structure():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "model", "engine_id"} <= variables
    titles = " | ".join(p["title"] for p in panels(d)).lower()
    for topic in ("throughput", "time to first token", "time per output token", "kv-cache usage",
                  "queue depth", "preemptions", "errors/s by http code"):
        assert topic in titles, f"no panel about {topic}"
    for p in panels(d):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, (p["title"], g)
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            for var in re.findall(r"\$\{?([A-Za-z_]+)", t["expr"]):
                assert var in variables or var in GRAFANA_BUILTINS, f"{p['title']}: unknown variable ${var}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert t["expr"].count("{") == t["expr"].count("}"), t["expr"]


def test_dashboard_percentiles_use_histogram_quantile_over_buckets():
    exprs = dashboard_exprs()
    quantile = [e for e in exprs if "histogram_quantile" in e]
    assert any("time_to_first_token_seconds_bucket" in e for e in quantile)
    assert any("time_per_output_token_seconds_bucket" in e for e in quantile)
    for e in quantile:
        assert re.search(r"histogram_quantile\(0\.\d+, sum by \(le\) \(rate\(sluice(_gateway)?:\w+_bucket\{", e), e


def test_every_dashboard_metric_is_exported():
    exported = exported_names()
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert used, "no metric found in the dashboard"
    ours = sluice_names(used)
    assert ours != used and not ours - exported, f"the dashboard queries metrics nobody exports: {sorted(ours - exported)}"


def test_engine_and_gateway_metrics_are_told_apart_by_name():
    """No metric name is exported by both sides: the gateway's are ``sluice_gateway:*``."""
    engine = sample_names(EngineMetrics("m", "e").registry)
    gateway = CollectorRegistry()
    GatewayMetrics(gateway)
    gateway_names = sample_names(gateway)
    assert not engine & gateway_names, sorted(engine & gateway_names)
    assert all(n.startswith("sluice_gateway:") for n in gateway_names), sorted(gateway_names)
    assert all(n.startswith("sluice:") for n in engine if not n.startswith("process_")), sorted(engine)


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus():
    prov = ROOT / "deploy" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    dash = yaml.safe_load((prov / "dashboards" / "sluice.yaml").read_text())["providers"][0]
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/{DASHBOARD.name}:{dash['options']['path']}/{DASHBOARD.name}:ro" in mounts
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


def test_prometheus_scrapes_every_gateway_and_engine_on_their_compose_ports():
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]

    def dns(job: str) -> tuple[list[str], int]:
        sd = jobs[job]["dns_sd_configs"][0]
        assert sd["type"] == "A"
        return sd["names"], sd["port"]

    names, port = dns("sluice-gateway")
    assert names == ["gateway"] and "gateway" in services
    gw_cmd = services["gateway"]["command"]
    assert gw_cmd[gw_cmd.index("--port") + 1] == str(port)

    names, port = dns("sluice-lb")
    assert names == ["lb"] and "lb" in services
    assert "bind :8404" in (ROOT / "deploy" / "lb" / "haproxy.cfg").read_text()
    assert "use-service prometheus-exporter" in (ROOT / "deploy" / "lb" / "haproxy.cfg").read_text()

    names, port = dns("sluice-engine")
    assert names == ["engine"] and "engine" in services
    engine_cmd = services["engine"]["command"]
    assert engine_cmd[engine_cmd.index("--metrics-port") + 1] == str(port)
    assert str(port) in [str(p) for p in services["engine"]["expose"]]
    # the engine binds loopback by default: Prometheus dials it from another container
    assert engine_cmd[engine_cmd.index("--metrics-host") + 1] == "0.0.0.0"
    assert "--grpc-host" not in engine_cmd  # gRPC (Drain) stays on loopback, where the healthcheck asks
    assert "127.0.0.1:" in " ".join(services["engine"]["healthcheck"]["test"])

    prom = services["prometheus"]
    assert prom["profiles"] == ["monitoring"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert all(p.startswith("127.0.0.1:") for p in prom["ports"]), "publish on loopback only"
    # the default stack is unchanged: the monitoring services only come with their profile (and the
    # Redis Cluster's with `cluster`: tests/unit/test_compose_config.py)
    for name, svc in services.items():
        if name in ("prometheus", "grafana"):
            assert svc.get("profiles")
        elif svc.get("profiles") == ["cluster"]:
            assert name.startswith("redis-"), name
        else:
            assert not svc.get("profiles"), name


def test_kubernetes_engine_exposes_and_annotates_its_metrics_port():
    docs = [d for p in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    engine = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "sluice-engine")
    pod = engine["spec"]["template"]
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    port = int(container["args"][container["args"].index("--metrics-port") + 1])
    assert {"name": "metrics", "containerPort": port} in container["ports"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(port)
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "sluice-engine-metrics")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": port, "targetPort": "metrics"}]
    labels = pod["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
