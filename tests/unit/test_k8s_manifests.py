"""deploy/k8s/: every manifest is valid against the Kubernetes schemas (offline, with
kubernetes-validate's bundled schemas) and has the properties operators rely on."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.30.0"  # gRPC probes are GA since 1.27; autoscaling/v2 since 1.23


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


DOCS = _documents()


def _find(kind: str, name: str) -> dict:
    for _, doc in DOCS:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in {K8S_DIR}")


def _container(deployment: dict, name: str) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def test_manifests_exist() -> None:
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in DOCS}
    for expected in [
        ("Namespace", "sluice"),
        ("ConfigMap", "sluice-config"),
        ("PersistentVolumeClaim", "sluice-models"),
        ("Deployment", "redis"),
        ("Service", "redis"),
        ("Deployment", "sluice-engine"),
        ("Deployment", "sluice-gateway"),
        ("Service", "sluice-gateway"),
        ("HorizontalPodAutoscaler", "sluice-gateway"),
    ]:
        assert expected in kinds


@pytest.mark.parametrize(
    "source,doc", DOCS, ids=[f"{s}:{d['kind']}/{d['metadata']['name']}" for s, d in DOCS]
)
def test_valid_against_kubernetes_schema(source: str, doc: dict) -> None:
    # strict: unknown fields are errors too (a typo in a probe would otherwise pass silently)
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_rejects_a_broken_manifest() -> None:
    """The validator really checks (guards against a no-op validation)."""
    doc = yaml.safe_load(yaml.safe_dump(_find("Deployment", "sluice-gateway")))
    doc["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    doc = yaml.safe_load(yaml.safe_dump(_find("Deployment", "sluice-gateway")))
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_everything_in_one_namespace() -> None:
    for _, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "sluice", doc["metadata"]["name"]


def test_services_select_their_pods() -> None:
    for service_name, deployment_name, port_name in [
        ("sluice-gateway", "sluice-gateway", "http"),
        ("redis", "redis", "redis"),
    ]:
        service = _find("Service", service_name)
        deployment = _find("Deployment", deployment_name)
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        selector = service["spec"]["selector"]
        assert selector and all(pod_labels.get(k) == v for k, v in selector.items()), (service_name, selector)
        # the Deployment's own selector matches its template too
        match = deployment["spec"]["selector"]["matchLabels"]
        assert all(pod_labels.get(k) == v for k, v in match.items())
        # targetPort names a port the pod declares
        ports = [p for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
        pod_ports = {p["name"] for p in ports} | {p["containerPort"] for p in ports}
        assert service["spec"]["ports"][0]["targetPort"] in pod_ports
        assert port_name in pod_ports


def test_hpa_targets_the_gateway_deployment() -> None:
    hpa = _find("HorizontalPodAutoscaler", "sluice-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", "sluice-gateway")
    _find("Deployment", ref["name"])
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert hpa["spec"]["metrics"], "the HPA needs a metric"
    # HPA CPU utilisation needs a CPU request on the target's containers
    assert _container(_find("Deployment", "sluice-gateway"), "gateway")["resources"]["requests"]["cpu"]


def test_gateway_probes_and_config() -> None:
    gateway = _container(_find("Deployment", "sluice-gateway"), "gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in gateway
    assert gateway["args"][0] == "gateway" and "--redis-url" in gateway["args"]
    assert {"configMapRef": {"name": "sluice-config"}} in gateway["envFrom"]


def test_engine_requests_a_gpu_with_grpc_probes_and_a_drain() -> None:
    deployment = _find("Deployment", "sluice-engine")
    pod = deployment["spec"]["template"]["spec"]
    engine = _container(deployment, "engine")
    resources = engine["resources"]
    assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
    assert str(resources["requests"]["nvidia.com/gpu"]) == "1"
    grpc_port = next(p["containerPort"] for p in engine["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["grpc"]["port"] == grpc_port, probe
    assert str(grpc_port) in engine["args"]
    pre_stop = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert "drain" in pre_stop
    # the pod's grace period covers the drain the preStop hook waits for
    drain_wait = float(pre_stop[-1])
    assert pod["terminationGracePeriodSeconds"] > drain_wait
    # the model volume is the PVC, mounted where SLUICE_CACHE_DIR points
    config = _find("ConfigMap", "sluice-config")["data"]
    volume = next(v for v in pod["volumes"] if v["name"] == "models")
    assert volume["persistentVolumeClaim"]["claimName"] == "sluice-models"
    assert {"name": "models", "mountPath": config["SLUICE_CACHE_DIR"]} in engine["volumeMounts"]


def test_args_only_reference_configmap_keys() -> None:
    """`$(VAR)` in args expands only from the container's environment: every one must exist."""
    import re

    config = _find("ConfigMap", "sluice-config")["data"]
    for name in ("sluice-engine", "sluice-gateway"):
        pod = _find("Deployment", name)["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            env = {e["name"] for e in c.get("env", [])}
            if {"configMapRef": {"name": "sluice-config"}} in c.get("envFrom", []):
                env |= set(config)
            for arg in c.get("args", []):
                for var in re.findall(r"\$\((\w+)\)", arg):
                    assert var in env, f"{name}/{c['name']}: $({var}) is not defined"


def test_pods_run_as_non_root() -> None:
    for name in ("sluice-engine", "sluice-gateway", "redis"):
        pod = _find("Deployment", name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_engine_admin_port_is_fenced() -> None:
    """Issue 26 item 5: the engine binds loopback by default, so the pod must ask for every
    interface where the kubelet's probes and Prometheus dial the pod IP; other pods may reach only
    the metrics port (NetworkPolicy), and Drain takes the sluice-admin Secret's token."""
    deployment = _find("Deployment", "sluice-engine")
    engine = _container(deployment, "engine")
    assert _arg(engine["args"], "--grpc-host") == "0.0.0.0"
    assert _arg(engine["args"], "--metrics-host") == "0.0.0.0"
    token = next(e for e in engine["env"] if e["name"] == "SLUICE_ADMIN_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "sluice-admin", "key": "token", "optional": True}
    policy = _find("NetworkPolicy", "sluice-engine")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert all(pod_labels.get(k) == v for k, v in selector.items())
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    allowed = [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert allowed == ["metrics"], allowed
    grpc_port = next(p["containerPort"] for p in engine["ports"] if p["name"] == "grpc")
    assert grpc_port not in allowed and "grpc" not in allowed
