"""What kubectl would not catch: the parts of the rendered manifests find each other.

Services select pods and their ports exist, probes name ports the containers have, the images
are the ones docker-compose.yml builds, workers and front-ends find the leader the way the
schedulers publish it, secrets and config referenced exist, only the front-ends are reachable
from outside, scale-in leaves a worker the time of its drain, the autoscalers read metrics the
scheduler emits. Who holds which credentials: test_internal_tls.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import yaml

from tests.unit.deploy.credentials import CREDENTIAL_SECRETS
from tests.unit.deploy.rendering import (
    ROOT,
    VARIANTS,
    component,
    containers,
    env_of,
    long_running,
    named,
    of_kind,
    pod_labels,
    rendered,
    selects,
    volumes_of,
    workloads,
)

# made outside the manifests, named in docs/kubernetes.md: the Ingress's certificate, and each
# role's credentials (`splitserve credentials DIR --kubernetes-secrets FILE`, or cert-manager)
EXTERNAL_SECRETS = {"splitserve-tls", *CREDENTIAL_SECRETS}


def port_exists(container: dict, port) -> bool:
    return any(port in (p.get("name"), p["containerPort"]) for p in container.get("ports", []))


def pods_of(resources, selector: dict) -> list[dict]:
    return [w for w in workloads(resources) if selects(selector, pod_labels(w))]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_service_selects_pods_and_their_ports(variant):
    resources = rendered(variant)
    for service in of_kind(resources, "Service"):
        targets = pods_of(resources, service["spec"]["selector"])
        assert targets, f"Service {service['metadata']['name']} selects no workload's pods"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in targets:
                assert any(port_exists(c, target) for c in containers(w)), (
                    f"Service {service['metadata']['name']}: no port {target} on {component(w)}"
                )


@pytest.mark.parametrize("variant", VARIANTS)
def test_workload_selectors_match_their_pods(variant):
    resources = rendered(variant)
    for w in long_running(resources):  # a Job's selector is generated
        assert selects(w["spec"]["selector"]["matchLabels"], pod_labels(w))
    for pdb in of_kind(resources, "PodDisruptionBudget"):
        assert pods_of(resources, pdb["spec"]["selector"]["matchLabels"]), pdb["metadata"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_probe_names_a_port_of_its_container(variant):
    resources = rendered(variant)
    for job in of_kind(resources, "Job"):  # runs to its end: nothing to probe
        assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    for w in long_running(resources):
        for c in containers(w):
            probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
            assert "livenessProbe" in c, f"{c['name']} has no liveness probe"
            for probe in probes:
                for kind in ("httpGet", "tcpSocket", "grpc"):
                    if kind in probe:
                        assert port_exists(c, probe[kind]["port"]), (c["name"], probe)


def test_probes_are_the_ones_the_services_split():
    resources = rendered("cpu")
    front = containers(named(resources, "Deployment", "splitserve-frontend"))[0]
    assert front["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert front["livenessProbe"]["grpc"]["port"] == 50051  # the client port: no mutual TLS
    sched = containers(named(resources, "StatefulSet", "splitserve-scheduler"))[0]
    for kind in ("startupProbe", "readinessProbe"):
        command = sched[kind]["exec"]["command"]
        assert "--target=localhost:50052" in command
        assert "--service=splitserve.v1.WorkerLink" in command
    assert sched["livenessProbe"]["httpGet"]["path"] == "/health"
    etcd = containers(named(resources, "StatefulSet", "splitserve-etcd"))[0]
    assert "/health" in " ".join(etcd["readinessProbe"]["exec"]["command"])
    worker = containers(named(resources, "Deployment", "splitserve-worker"))[0]
    command = " ".join(worker["livenessProbe"]["exec"]["command"])
    assert "--etcd-leader" in command and "--no-stopped-process" in command
    # a failover (lease 2 s + takeover wait 3 s) is far shorter than the misses that restart it
    probe = worker["livenessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 30


def compose_images() -> set[str]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    images = {
        s["image"]
        for s in [*compose["services"].values(), compose["x-scheduler-image"]]
        if "image" in s
    }
    # ${VAR:-default} as compose reads it with the variable unset
    return {re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", i) for i in images}


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_are_the_ones_compose_builds(variant):
    images = compose_images()
    assert images == {"splitserve-scheduler:latest", "splitserve-worker:latest"}
    for w in workloads(rendered(variant)):
        for c in containers(w):
            assert c["image"] in images, c["image"]
            # loaded into the cluster (kind load, minikube image load), not pulled
            assert c["imagePullPolicy"] == "IfNotPresent"
        want = "splitserve-worker" if component(w) == "worker" else "splitserve-scheduler"
        assert containers(w)[0]["image"].startswith(want + ":")


def resolve_env(resources, container: dict, name: str) -> str:
    entry = env_of(container)[name]
    if "value" in entry:
        return entry["value"]
    ref = entry["valueFrom"]["configMapKeyRef"]
    return named(resources, "ConfigMap", ref["name"])["data"][ref["key"]]


def service_for(resources, address: str):
    """The Service behind HOST:PORT (HOST a Service name or POD.SERVICE) and the pods of it."""
    host, _, port = address.rpartition(":")
    name = host.split(".")[-1]
    services = [s for s in of_kind(resources, "Service") if s["metadata"]["name"] == name]
    if not services:
        return None, []
    (service,) = services
    assert int(port) in [p["port"] for p in service["spec"]["ports"]], address
    return service, pods_of(resources, service["spec"]["selector"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_workers_and_frontends_reach_the_leader_where_schedulers_publish_it(variant):
    resources = rendered(variant)
    sched_set = named(resources, "StatefulSet", "splitserve-scheduler")
    sched = containers(sched_set)[0]
    env = env_of(sched)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # the leader publishes ADVERTISE_HOST:WORKER_PORT in etcd; workers and front-ends dial it
    leader = f"{resolve_env(resources, sched, 'SPLITSERVE_ADVERTISE_HOST')}:" + resolve_env(
        resources, sched, "SPLITSERVE_WORKER_PORT"
    )
    assert leader == "$(POD_NAME).splitserve-scheduler:50052"
    service, pods = service_for(resources, leader)
    assert service is not None and pods == [sched_set]
    # per-pod names exist only under the StatefulSet's own headless Service
    assert service["spec"]["clusterIP"] == "None"
    assert sched_set["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert port_exists(sched, 50052)
    assert resolve_env(resources, sched, "SPLITSERVE_CLIENT_API") == "false"
    # everyone reads the leader from the same etcd
    etcd = resolve_env(resources, sched, "SPLITSERVE_ETCD")
    for name in ("splitserve-worker", "splitserve-frontend"):
        c = containers(named(resources, "Deployment", name))[0]
        assert resolve_env(resources, c, "SPLITSERVE_ETCD") == etcd
        assert "SPLITSERVE_SCHEDULER" not in env_of(c)  # --etcd wins; a fixed address would lie
    service, pods = service_for(resources, etcd)
    if "external-etcd" in variant:
        assert service is None
        assert [component(w) for w in workloads(resources)].count("etcd") == 0
    else:
        assert [component(p) for p in pods] == ["etcd"]
        assert pods[0]["spec"]["replicas"] == 3


def test_etcd_members_name_each_other_under_the_peer_service():
    resources = rendered("cpu")
    etcd = named(resources, "StatefulSet", "splitserve-etcd")
    script = containers(etcd)[0]["args"][0]
    peers = etcd["spec"]["serviceName"]
    members = re.findall(r"(splitserve-etcd-\d)=https://(splitserve-etcd-\d)\.\$PEERS:2380", script)
    assert f"PEERS={peers};" in script
    assert [m for m, _ in members] == [f"splitserve-etcd-{i}" for i in range(3)]
    assert all(a == b for a, b in members)
    assert etcd["metadata"]["name"] == "splitserve-etcd" and etcd["spec"]["replicas"] == 3
    assert named(resources, "Service", peers)["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("variant", VARIANTS)
def test_referenced_secrets_and_config_exist(variant):
    resources = rendered(variant)
    secrets = {s["metadata"]["name"]: s for s in of_kind(resources, "Secret")}
    maps = {m["metadata"]["name"]: m for m in of_kind(resources, "ConfigMap")}
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    for w in workloads(resources):
        for c in containers(w):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    s = secrets[ref["secretKeyRef"]["name"]]
                    assert ref["secretKeyRef"]["key"] in {**s.get("data", {}), **s["stringData"]}
                if "configMapKeyRef" in ref:
                    assert (
                        ref["configMapKeyRef"]["key"]
                        in maps[ref["configMapKeyRef"]["name"]]["data"]
                    )
        for volume in volumes_of(w).values():
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                assert name in secrets or (name in EXTERNAL_SECRETS and name in docs), name
    for ingress in of_kind(resources, "Ingress"):
        for tls in ingress["spec"]["tls"]:
            name = tls["secretName"]
            assert name in secrets or (name in EXTERNAL_SECRETS and name in docs), name


def test_secrets_reach_the_parts_that_check_them():
    resources = rendered("cpu")

    def secret_env(kind, name):
        c = containers(named(resources, kind, name))[0]
        return {
            e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
            for e in c["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        }

    # the API key to the parts that serve clients; no shared secret is left between the parts
    # (their certificates are the credentials: test_internal_tls.py)
    assert secret_env("Deployment", "splitserve-frontend") == {"SPLITSERVE_API_KEY": "api-key"}
    assert secret_env("StatefulSet", "splitserve-scheduler") == {"SPLITSERVE_API_KEY": "api-key"}
    assert secret_env("Deployment", "splitserve-worker") == {}
    (secret,) = of_kind(resources, "Secret")
    assert set(secret["stringData"]) == {"api-key"}
    for w in workloads(resources):
        assert "SPLITSERVE_WORKER_SECRET" not in env_of(containers(w)[0])


def policy_admits(policy: dict, source: SimpleNamespace, port) -> bool:
    """Does one NetworkPolicy let `source` (labels, or outside=True) in on `port`?"""
    for rule in policy["spec"].get("ingress", []):
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "ipBlock" in peer:
                if source.outside:
                    return True
            elif "namespaceSelector" in peer:
                if source.namespace_labels is not None and selects(
                    peer["namespaceSelector"].get("matchLabels", {}), source.namespace_labels
                ):
                    return True
            elif not source.outside and selects(
                peer["podSelector"].get("matchLabels", {}), source.labels
            ):
                return True
    return False


def admitted(resources, source: SimpleNamespace, target: dict, port_name: str) -> bool:
    labels = pod_labels(target)
    policies = [
        p
        for p in of_kind(resources, "NetworkPolicy")
        if selects(p["spec"]["podSelector"].get("matchLabels", {}), labels)
        and "Ingress" in p["spec"]["policyTypes"]
    ]
    assert policies, f"no NetworkPolicy covers {component(target)}: it would take anything"
    container = containers(target)[0]
    number = next(p["containerPort"] for p in container["ports"] if p["name"] == port_name)
    return any(
        policy_admits(p, source, port_name) or policy_admits(p, source, number) for p in policies
    )


def outside() -> SimpleNamespace:
    return SimpleNamespace(
        outside=True, labels={}, namespace_labels={"kubernetes.io/metadata.name": "elsewhere"}
    )


def inside(w: dict) -> SimpleNamespace:
    return SimpleNamespace(outside=False, labels=pod_labels(w), namespace_labels=None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies_leave_only_the_frontends_reachable_from_outside(variant):
    resources = rendered(variant)
    by_component = {component(w): w for w in workloads(resources)}
    for w in workloads(resources):
        for c in containers(w):
            for port in c.get("ports", []):
                reachable = admitted(resources, outside(), w, port["name"])
                assert reachable == (component(w) == "frontend"), (component(w), port["name"])
    # what must talk still can
    needed = [
        ("worker", "scheduler", "worker-link"),
        ("frontend", "scheduler", "worker-link"),
        ("scheduler", "scheduler", "worker-link"),
    ]
    if "etcd" in by_component:
        sources = ("scheduler", "frontend", "worker", "etcd", "etcd-auth")
        needed += [(src, "etcd", "client") for src in sources]
        needed += [("etcd", "etcd", "peer")]
    for src, dst, port in needed:
        assert admitted(resources, inside(by_component[src]), by_component[dst], port), (src, dst)
    # the workers take no connection at all
    assert not containers(by_component["worker"])[0].get("ports")
    # exposed Services and Ingresses lead to the front-ends only
    for service in of_kind(resources, "Service"):
        if service["spec"].get("type", "ClusterIP") in ("LoadBalancer", "NodePort"):
            assert [component(p) for p in pods_of(resources, service["spec"]["selector"])] == [
                "frontend"
            ]
    for ingress in of_kind(resources, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                service = named(resources, "Service", path["backend"]["service"]["name"])
                assert component(pods_of(resources, service["spec"]["selector"])[0]) == "frontend"


@pytest.mark.parametrize("variant", VARIANTS)
def test_scale_in_gives_a_worker_the_time_of_its_drain(variant):
    worker = named(rendered(variant), "Deployment", "splitserve-worker")
    drain = float(env_of(containers(worker)[0])["SPLITSERVE_DRAIN_TIMEOUT"]["value"])
    # the drain, then the hand-back and the process's exit
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 10


def test_gpu_overlay_asks_for_a_gpu_and_the_cpu_overlay_for_none():
    for variant, gpus in (("gpu", 1), ("cpu", 0)):
        resources = rendered(variant)
        for w in workloads(resources):
            for c in containers(w):
                limit = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)
                assert limit == (gpus if component(w) == "worker" else 0), (variant, c["name"])
                assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        device = env_of(containers(named(resources, "Deployment", "splitserve-worker"))[0])
        assert device["SPLITSERVE_DEVICE"]["value"] == ("cuda" if gpus else "cpu")


def scheduler_metric_names() -> set[str]:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler_svc.obs.worker_collector import WorkerCollector

    stats = SimpleNamespace(
        num_running=1, num_waiting=2, kv_usage=0.5, num_used_blocks=5, num_total_blocks=10
    )
    engine = SimpleNamespace(
        worker_stats=lambda: [(SimpleNamespace(lost=False, worker_id="w0"), stats)],
        num_waiting=3,
        requests={},
        model_name="m",
    )
    registry = CollectorRegistry()
    registry.register(WorkerCollector(engine))
    text = generate_latest(registry).decode()
    return {f.name for f in text_string_to_metric_families(text)}


def test_autoscalers_scale_the_workers_on_metrics_the_scheduler_emits():
    names = scheduler_metric_names()
    keda = named(rendered("gpu+keda"), "ScaledObject", "splitserve-worker")
    assert keda["spec"]["scaleTargetRef"]["name"] == "splitserve-worker"
    assert keda["spec"]["minReplicaCount"] >= 1  # the front-ends are ready only with a worker
    queries = [t["metadata"]["query"] for t in keda["spec"]["triggers"]]
    assert {t["type"] for t in keda["spec"]["triggers"]} == {"prometheus"}
    adapter = yaml.safe_load(
        (ROOT / "deploy/kubernetes/components/hpa/prometheus-adapter-values.yaml").read_text()
    )
    queries += [r["metricsQuery"] for r in adapter["rules"]["external"]]
    used = {n for q in queries for n in re.findall(r"splitserve:[a-z_]+", q)}
    assert used and used <= names, used - names
    hpa = named(rendered("cpu+hpa"), "HorizontalPodAutoscaler", "splitserve-worker")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "splitserve-worker"
    assert hpa["spec"]["minReplicas"] >= 1
    served = {r["name"]["as"] for r in adapter["rules"]["external"]}
    assert {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]} == served
    for scaler in (keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"], hpa["spec"]):
        down = scaler["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 60
        assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])
