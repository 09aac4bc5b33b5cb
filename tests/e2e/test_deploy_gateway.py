"""deploy/: the gateway in front of N replicas agrees with the replicas' manifests and with the
real gateway's command line (smg's own argument parser), like tests/e2e/test_deploy_k8s.py does
for the replica. No Docker and no cluster. (tests/e2e/test_gateway.py checks the probe paths against
a running gateway.)"""
from __future__ import annotations

import json
import re
import shlex
from urllib.parse import urlparse

import pytest

from tests.support.grpc_harness import REPO

yaml = pytest.importorskip("yaml", reason="PyYAML is not importable (transformers brings it)")

K8S = REPO / "deploy" / "k8s"
GATEWAY = K8S / "gateway"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile.gateway"


def smg_args(argv: list[str]):
    """smg's RouterArgs for `smg launch ARGV`, parsed by smg itself."""
    launch_router = pytest.importorskip("smg.launch_router",
                                        reason="smg is not installed (a dev extra)")
    try:
        return launch_router.parse_router_args(argv)
    except SystemExit as e:
        pytest.fail(f"smg launch rejects {argv}: exit {e.code}")


def load(folder, name: str) -> list[dict]:
    return list(yaml.safe_load_all((folder / name).read_text()))


@pytest.fixture(scope="module")
def gateway_objects() -> dict[str, dict]:
    kustomization = yaml.safe_load((GATEWAY / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {f.name for f in GATEWAY.glob("*.yaml")} - {
        "kustomization.yaml"}
    return {f"{d['kind']}/{d['metadata']['name']}": d
            for name in kustomization["resources"] for d in load(GATEWAY, name)}


@pytest.fixture(scope="module")
def replica_service() -> dict:
    """The base's scheduler Service: what every replica namespace exposes."""
    [svc] = [d for d in load(K8S, "scheduler-service.yaml") if d["kind"] == "Service"]
    return svc


def _container(objects) -> tuple[dict, dict]:
    dep = objects["Deployment/deltaserve-gateway"]
    [ctr] = dep["spec"]["template"]["spec"]["containers"]
    return dep, ctr


def test_gateway_args_are_smg_launch_flags_naming_every_replica(gateway_objects,
                                                                replica_service):
    _, ctr = _container(gateway_objects)
    args = smg_args(ctr["args"])
    assert args.policy == "cache_aware"
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert args.port == ports["http"] and args.prometheus_port == ports["metrics"]
    assert args.host == args.prometheus_host == "0.0.0.0"
    urls = [urlparse(u) for u in args.worker_urls]
    assert len(urls) >= 2, "N replicas behind one gateway"
    [svc_port] = [p["port"] for p in replica_service["spec"]["ports"] if p["name"] == "grpc"]
    namespaces = []
    for url in urls:
        name, namespace, *rest = url.hostname.split(".")
        assert (url.scheme, name, rest, url.port) == (
            "grpc", replica_service["metadata"]["name"], ["svc", "cluster", "local"], svc_port)
        namespaces.append(namespace)
    assert len(set(namespaces)) == len(namespaces), "one replica per namespace"
    for key, obj in gateway_objects.items():   # namespace-agnostic, like the base
        assert "namespace" not in obj["metadata"], key


def test_gateway_drains_within_the_pods_termination_grace(gateway_objects):
    # smg waits --shutdown-grace-period-secs (180 by default) for its open streams after
    # SIGTERM, after a settle window of up to 5 s; Kubernetes kills the pod after
    # terminationGracePeriodSeconds (30 by default): a rolling update of the gateway cut every
    # OpenAI stream older than that mid-stream, while the replicas drain theirs for
    # --grace-period (20 s) within 45 s.
    dep, ctr = _container(gateway_objects)
    args = smg_args(ctr["args"])
    pod_grace = dep["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    assert 5 + args.shutdown_grace_period_secs < pod_grace
    [replica] = [d for d in load(K8S, "scheduler-deployment.yaml") if d["kind"] == "Deployment"]
    replica_args = replica["spec"]["template"]["spec"]["containers"][0]["args"]
    replica_grace = float(replica_args[replica_args.index("--grace-period") + 1])
    assert args.shutdown_grace_period_secs >= replica_grace   # the replica's streams finish


def test_gateway_metrics_are_scraped_where_it_serves_them(gateway_objects):
    dep, ctr = _container(gateway_objects)
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"] == smg_args(
        ctr["args"]).prometheus_port


def test_gateway_service_selects_the_gateway_pod_on_its_ports(gateway_objects):
    dep, ctr = _container(gateway_objects)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = gateway_objects["Service/deltaserve-gateway"]
    assert svc["spec"]["selector"].items() <= labels.items()
    names = {p["name"] for p in ctr["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
    # A replica's pods (scheduler, worker) are not selected by the gateway Service.
    for name in ("scheduler-deployment.yaml", "worker-statefulset.yaml"):
        [obj] = [d for d in load(K8S, name) if d["kind"] in ("Deployment", "StatefulSet")]
        pod_labels = obj["spec"]["template"]["metadata"]["labels"]
        assert not svc["spec"]["selector"].items() <= pod_labels.items()


def test_gateway_probes_are_http_on_the_api_port(gateway_objects):
    _, ctr = _container(gateway_objects)
    for probe, path in (("readinessProbe", "/readiness"), ("livenessProbe", "/liveness")):
        assert ctr[probe]["httpGet"] == {"path": path, "port": "http"}


def test_gateway_dockerfile_installs_the_pinned_smg_and_its_example_parses():
    text = DOCKERFILE.read_text()
    assert 'ENTRYPOINT ["smg", "launch"]' in text
    [user] = re.findall(r"^USER (\S+)$", text, re.M)
    assert user not in ("root", "0")
    [spec] = re.findall(r"^ARG SMG_SPEC=(\S+)$", text, re.M)
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    assert spec in dev, "the image and the tests run the same gateway release"
    example = re.sub(r"\\\n#\s*", " ", text)
    [run] = re.findall(r"^#\s*docker run (.*)$", example, re.M)
    argv = shlex.split(run)
    smg_args(argv[argv.index("deltaserve-gateway") + 1:])
    assert json.loads(re.findall(r"^CMD (.*)$", text, re.M)[0]) == ["--help"]
