"""deploy/: the monitoring material agrees with the code and with the real Kubernetes schemas.

Every Kubernetes object under deploy/k8s is validated offline against the Kubernetes OpenAPI
schemas that kubernetes-validate ships (strict: no unknown fields); objects of kinds it has no
schema for (Kustomization, the operator's ServiceMonitor) are checked field by field here. The
scrape annotations, ports and --metrics-listen flags agree; the HPA's metric is a documented one
through the prometheus-adapter rule; the Grafana dashboard parses and uses documented names only.
"""
from __future__ import annotations

import copy
import json
import re

import pytest

from deltaserve.cli import build_parser
from tests.support.metrics_scrape import documented_names
from tests.support.paths import REPO

yaml = pytest.importorskip("yaml", reason="PyYAML is not importable (transformers brings it)")
kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="kubernetes-validate is a dev dependency")

K8S = REPO / "deploy" / "k8s"
EXAMPLE = K8S / "examples" / "autoscaled-replicas"
MONITORING = K8S / "monitoring"
NO_SCHEMA = {"Kustomization", "ServiceMonitor"}


def _objects(directory) -> dict[str, tuple[str, dict]]:
    """"Kind/name" -> (file name, object) for every YAML document under `directory`."""
    out = {}
    for path in sorted(directory.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[f"{doc['kind']}/{doc['metadata']['name'] if 'metadata' in doc else path}"] = (
                str(path.relative_to(REPO)), doc)
    return out


def _pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def _container(obj: dict) -> dict:
    [ctr] = _pod_spec(obj)["containers"]
    return ctr


def _argv(ctr: dict, entrypoint: str) -> list[str]:
    """The deltaserve command line of a container: its image's entrypoint subcommand (the
    worker's /bin/sh wrapper execs `deltaserve worker` too), or its own `deltaserve` command."""
    command = ctr.get("command", [])
    if command[:1] == ["deltaserve"]:
        return [*command[1:], *ctr["args"]]
    return [entrypoint, *ctr["args"]]


def test_every_object_validates_against_the_kubernetes_schemas():
    version = kubernetes_validate.latest_version()
    checked = 0
    for key, (path, obj) in _objects(K8S).items():
        if obj["kind"] in NO_SCHEMA:
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 9     # the base (5) and the autoscaling example (4)
    # The validator is live: an unknown field and a wrong type are both rejected.
    _, hpa = _objects(EXAMPLE)["HorizontalPodAutoscaler/deltaserve-replica"]
    for corrupt in ({"minReplica": 1}, {"maxReplicas": "eight"}):
        bad = copy.deepcopy(hpa)
        bad["spec"].update(corrupt)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, version, strict=True)


@pytest.mark.parametrize("kind, name, entrypoint, ports", [
    ("Deployment", "deltaserve-scheduler", "scheduler", {"metrics"}),
    ("StatefulSet", "deltaserve-worker", "worker", {"metrics"}),
    ("Deployment", "deltaserve-replica", "", {"metrics", "worker-metrics"}),
])
def test_scrape_annotations_ports_and_flags_agree(kind, name, entrypoint, ports):
    _, obj = _objects(K8S)[f"{kind}/{name}"]
    annotations = obj["spec"]["template"]["metadata"]["annotations"]
    ctr = _container(obj)
    named = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == named["metrics"]
    args = build_parser().parse_args(_argv(ctr, entrypoint))
    assert args.metrics_listen == f"0.0.0.0:{named['metrics']}"
    if "worker-metrics" in ports:
        assert args.worker_metrics_listen == f"0.0.0.0:{named['worker-metrics']}"
    assert ports <= named.keys()


def test_service_monitor_scrapes_the_metrics_port_of_every_service():
    objects = _objects(K8S)
    _, monitor = objects["ServiceMonitor/deltaserve"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+s", endpoint["interval"])
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    services = [obj for key, (path, obj) in objects.items() if key.startswith("Service/")
                and path.rsplit("/", 1)[-1] in base]
    assert len(services) == 2
    for svc in services:   # the scheduler's and the workers' (headless: every pod)
        assert selector.items() <= svc["metadata"]["labels"].items()
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}


def test_monitoring_kustomization_builds_on_the_base_and_ships_the_dashboard():
    k = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert (MONITORING / k["resources"][0]).resolve() == K8S
    assert all((MONITORING / r).exists() for r in k["resources"])
    [generator] = k["configMapGenerator"]
    assert generator["files"] == ["grafana-dashboard.json"]
    assert generator["options"]["labels"] == {"grafana_dashboard": "1"}
    example = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())
    assert sorted(example["resources"]) == sorted(p.name for p in EXAMPLE.glob("*.yaml")
                                                  if p.name != "kustomization.yaml")


def test_hpa_scales_the_replicas_on_waiting_requests_through_the_adapter_rule():
    objects = _objects(EXAMPLE)
    _, hpa = objects["HorizontalPodAutoscaler/deltaserve-replica"]
    target = hpa["spec"]["scaleTargetRef"]
    assert f"{target['kind']}/{target['name']}" in objects
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    _, adapter = objects["ConfigMap/deltaserve-prometheus-adapter-rules"]
    [rule] = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    series = re.match(r"[a-z0-9_:]+", rule["seriesQuery"])[0]
    assert re.fullmatch(rule["name"]["matches"], series)
    assert series == "deltaserve:num_requests_waiting" in documented_names("deltaserve:")


def _dashboard_metric_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression, histogram suffixes dropped."""
    names = set(re.findall(r"deltaserve:[a-z0-9_:]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_grafana_dashboard_uses_documented_metrics_only():
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    documented = documented_names("deltaserve:")
    used = set()
    for panel in panels:
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"} and panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = _dashboard_metric_names(target["expr"])
            assert names and names <= documented, (panel["title"], names - documented)
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            used |= names
    # What an operator asks for first: throughput, latency percentiles, KV usage, queue,
    # preemptions, and each GPU's utilization and memory.
    assert {"deltaserve:generation_tokens_total", "deltaserve:time_to_first_token_seconds",
            "deltaserve:inter_token_latency_seconds", "deltaserve:kv_cache_usage_perc",
            "deltaserve:num_requests_waiting", "deltaserve:num_preemptions_total",
            "deltaserve:worker_gpu_utilization_ratio",
            "deltaserve:worker_gpu_memory_used_bytes"} <= used
    quantiles = [t["expr"] for p in panels for t in p["targets"] if "histogram_quantile" in t["expr"]]
    assert all("_bucket" in q and "by (le" in q for q in quantiles) and len(quantiles) >= 6
