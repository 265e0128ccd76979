"""deploy/k8s/ and its Redis Cluster variant deploy/k8s/cluster/: every manifest is valid against
the Kubernetes schemas (offline, with kubernetes-validate's bundled schemas) and has the properties
operators rely on."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "deploy" / "k8s"
CLUSTER_DIR = K8S_DIR / "cluster"
K8S_VERSION = "1.30.0"  # gRPC probes are GA since 1.27; autoscaling/v2 since 1.23
CLUSTER_PODS = [f"redis-cluster-{i}.redis-cluster.sluice.svc.cluster.local:6379" for i in range(6)]


def _documents(directory: Path) -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((str(path.relative_to(K8S_DIR)), doc))
    return docs


BASE_DOCS = _documents(K8S_DIR)  # `kubectl apply -f deploy/k8s/` (not recursive)
CLUSTER_DOCS = _documents(CLUSTER_DIR)
DOCS = BASE_DOCS + CLUSTER_DOCS
# what `kubectl apply -f deploy/k8s/cluster/ -f 00-namespace.yaml -f 30-engine.yaml -f 40-gateway.yaml`
# applies: the cluster directory replaces 10-config.yaml and 20-redis.yaml
CLUSTER_STACK = [
    (s, d) for s, d in BASE_DOCS if s in ("00-namespace.yaml", "30-engine.yaml", "40-gateway.yaml")
] + CLUSTER_DOCS


def _find(kind: str, name: str, docs: list[tuple[str, dict]] = BASE_DOCS) -> dict:
    found = [doc for _, doc in docs if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} {name} (wanted one)"
    return found[0]


def _container(deployment: dict, name: str) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def _workloads(docs: list[tuple[str, dict]]) -> list[dict]:
    return [d for _, d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]


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
    assert CLUSTER_DOCS, f"no manifests in {CLUSTER_DIR}"
    for _, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "sluice", doc["metadata"]["name"]


def test_cluster_variant_replaces_only_the_redis_files() -> None:
    base = {(d["kind"], d["metadata"]["name"]) for s, d in BASE_DOCS if s not in ("10-config.yaml", "20-redis.yaml")}
    stack = [(d["kind"], d["metadata"]["name"]) for _, d in CLUSTER_STACK]
    assert len(stack) == len(set(stack)), "an object defined twice in the cluster stack"
    assert base <= set(stack)
    assert ("Deployment", "redis") not in stack and ("StatefulSet", "redis-cluster") in stack


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
    assert gateway["args"][0] == "gateway" and any(e["name"] == "SLUICE_REDIS_URL" for e in gateway["env"])
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


@pytest.mark.parametrize("stack", [BASE_DOCS, CLUSTER_STACK], ids=["standalone", "cluster"])
def test_variables_are_defined_before_use(stack: list[tuple[str, dict]]) -> None:
    """`$(VAR)` in command, args and env values expands only from the container's environment
    (envFrom, then env entries above it): every one must exist, or the literal text is passed."""
    config = _find("ConfigMap", "sluice-config", stack)["data"]
    for workload in _workloads(stack):
        pod = workload["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            env = set(config) if {"configMapRef": {"name": "sluice-config"}} in c.get("envFrom", []) else set()
            for entry in c.get("env", []):
                for var in re.findall(r"\$\((\w+)\)", entry.get("value", "")):
                    assert var in env, f"{workload['metadata']['name']}/{c['name']}: env {entry['name']} uses $({var}) before it is defined"
                env.add(entry["name"])
            for arg in c.get("command", []) + c.get("args", []):
                for var in re.findall(r"\$\((\w+)\)", arg):
                    assert var in env, f"{workload['metadata']['name']}/{c['name']}: $({var}) is not defined"


def test_pods_run_as_non_root() -> None:
    for workload in _workloads(DOCS):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, workload["metadata"]["name"]


def _redis_url(container: dict, config: dict) -> str:
    """The Redis URL a container runs with ($SLUICE_REDIS_URL, the --redis-url knob's variable),
    its $(VAR)s expanded (the password as PASSWORD); its command line names no Redis URL, so
    `ps` never shows the password."""
    env = {**config, "REDIS_PASSWORD": "PASSWORD"}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], entry["value"])
    words = container.get("command", []) + container["args"]
    assert "--redis-url" not in words and not any("REDIS" in w for w in words), words
    return env["SLUICE_REDIS_URL"]


def _password_from_secret(container: dict) -> None:
    entry = next(e for e in container["env"] if e["name"] == "REDIS_PASSWORD")
    assert entry["valueFrom"]["secretKeyRef"] == {"name": "sluice-redis", "key": "password"}


@pytest.mark.parametrize(
    "stack,url",
    [
        (BASE_DOCS, "redis://:PASSWORD@redis.sluice.svc.cluster.local:6379/0"),
        (CLUSTER_STACK, "redis+cluster://:PASSWORD@" + ",".join(CLUSTER_PODS)),
    ],
    ids=["standalone", "cluster"],
)
def test_sluice_pods_put_the_secret_password_in_their_redis_url(stack: list[tuple[str, dict]], url: str) -> None:
    config = _find("ConfigMap", "sluice-config", stack)["data"]
    for name, container in (("sluice-engine", "engine"), ("sluice-gateway", "gateway")):
        c = _container(_find("Deployment", name, stack), container)
        _password_from_secret(c)
        assert _redis_url(c, config) == url


def test_redis_servers_require_the_secret_password() -> None:
    redis = _container(_find("Deployment", "redis"), "redis")
    _password_from_secret(redis)
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    node = _container(_find("StatefulSet", "redis-cluster", CLUSTER_DOCS), "redis")
    _password_from_secret(node)
    for flag in ("--requirepass", "--masterauth"):  # replicas authenticate to their masters
        assert node["args"][node["args"].index(flag) + 1] == "$(REDIS_PASSWORD)"
    for c in (redis, node):  # health checks authenticate without the password on a command line
        probe = " ".join(c["readinessProbe"]["exec"]["command"])
        assert "REDISCLI_AUTH" in probe and "PONG" in probe
    job = _find("Job", "redis-cluster-create", CLUSTER_DOCS)["spec"]["template"]["spec"]["containers"][0]
    _password_from_secret(job)


def test_cluster_config_differs_from_the_standalone_one_only_in_where_redis_is() -> None:
    base = _find("ConfigMap", "sluice-config")["data"]
    cluster = _find("ConfigMap", "sluice-config", CLUSTER_DOCS)["data"]
    assert set(base) == set(cluster)
    assert {k for k in base if base[k] != cluster[k]} == {"REDIS_SCHEME", "REDIS_ADDRESS"}
    assert cluster["REDIS_SCHEME"] == "redis+cluster"
    assert cluster["REDIS_ADDRESS"].split(",") == CLUSTER_PODS


def test_redis_cluster_statefulset() -> None:
    sts = _find("StatefulSet", "redis-cluster", CLUSTER_DOCS)
    service = _find("Service", "redis-cluster", CLUSTER_DOCS)
    spec = sts["spec"]
    assert spec["replicas"] == len(CLUSTER_PODS) == 6
    assert spec["serviceName"] == service["metadata"]["name"]
    # headless, with DNS names before readiness (the nodes and the Job meet through them)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod_labels = spec["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert all(pod_labels.get(k) == v for k, v in spec["selector"]["matchLabels"].items())
    node = _container(sts, "redis")
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    assert ports == {"redis": 6379, "bus": 16379}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    # every pod announces its own DNS name, which is what the URL and the Job name
    args = node["args"]
    assert args[:2] == ["redis-server", "/etc/redis/cluster-node.conf"]
    announced = args[args.index("--cluster-announce-hostname") + 1]
    assert announced == "$(POD_NAME).redis-cluster.sluice.svc.cluster.local"
    pod_name = next(e for e in node["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert [announced.replace("$(POD_NAME)", f"{sts['metadata']['name']}-{i}") + ":6379" for i in range(6)] == CLUSTER_PODS
    # nodes.conf and the AOF on a claim of each pod's own; the config from the ConfigMap
    claims = {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in node["volumeMounts"]}
    assert mounts["data"] == "/data" and "data" in claims
    assert mounts["config"] == "/etc/redis"
    config_volume = next(v for v in spec["template"]["spec"]["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == "redis-cluster"
    pdb = _find("PodDisruptionBudget", "redis-cluster", CLUSTER_DOCS)
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"] == spec["selector"]


def test_redis_cluster_job_makes_three_masters_from_the_pod_names() -> None:
    job = _find("Job", "redis-cluster-create", CLUSTER_DOCS)
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["sh", "/etc/redis/cluster-init.sh"]
    assert c["args"] == CLUSTER_PODS
    env = {e["name"]: e.get("value") for e in c["env"]}
    replicas = int(env["REDIS_CLUSTER_REPLICAS"])
    assert len(CLUSTER_PODS) // (1 + replicas) == 3  # 3 masters, each with a replica
    assert pod["restartPolicy"] == "OnFailure"
    assert next(v for v in pod["volumes"] if v["name"] == "config")["configMap"]["name"] == "redis-cluster"


def test_redis_cluster_configmap_holds_the_deploy_redis_files() -> None:
    """The node config and the init script are the files compose mounts (one source of truth)."""
    data = _find("ConfigMap", "redis-cluster", CLUSTER_DOCS)["data"]
    assert data["cluster-node.conf"] == (REPO / "deploy" / "redis" / "cluster-node.conf").read_text()
    assert data["cluster-init.sh"] == (REPO / "deploy" / "redis" / "cluster-init.sh").read_text()


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_engine_admin_port_is_fenced() -> None:
    """The engine binds loopback by default, so the pod must ask for every
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
