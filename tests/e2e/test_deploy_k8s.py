"""deploy/k8s: the Kubernetes manifests agree with the code.

No cluster: every YAML file is parsed and the objects are cross-checked (labels, ports, probes,
names); every `deltaserve` command line is parsed by the real CLI parser (the worker's node-rank
wrapper is run by /bin/sh); deploy/README.md's recipe for the workers' Secret makes what a worker
accepts. The images and the grpcurl examples: test_deploy_images.py.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from scheduler_service.api.engine_flags import engine_settings
from engine_common.security.worker_auth import WorkerCredentials
from engine_common.wire.protos import GENERATION_SERVICE, WORKER_SERVICE
from tests.support.deploy_cli import parse_strictly
from tests.support.grpc_harness import REPO

yaml = pytest.importorskip("yaml", reason="PyYAML is not importable (transformers brings it)")

K8S = REPO / "deploy" / "k8s"
GPU = "nvidia.com/gpu"
MiB = 1 << 20


# ---- helpers -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    """The objects kustomization.yaml lists, by "Kind/name"."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    objects = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            objects[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return objects


def _workload(k8s, kind: str) -> tuple[dict, dict]:
    """(the one workload of `kind`, its only container)."""
    [obj] = [o for key, o in k8s.items() if key.startswith(kind + "/")]
    [ctr] = obj["spec"]["template"]["spec"]["containers"]
    return obj, ctr


def _port(ctr: dict, name_or_number) -> int:
    """A container port by name or number (KeyError when the container has no such port)."""
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    if isinstance(name_or_number, int):
        assert name_or_number in ports.values(), (name_or_number, ports)
        return name_or_number
    return ports[name_or_number]


def _listen_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _worker_argv(sts: dict, ctr: dict, ordinal: int, tmp_path) -> list[str]:
    """What the worker's /bin/sh wrapper really execs in pod <sts>-<ordinal>."""
    fake = tmp_path / "deltaserve"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "POD_NAME": f"{sts['metadata']['name']}-{ordinal}"}
    out = subprocess.run([*ctr["command"], *ctr["args"]], env=env, capture_output=True,
                         text=True, check=True, timeout=10)
    return out.stdout.splitlines()


def _quantity(text: str) -> int:
    """A Kubernetes binary quantity ("2Gi", "512Mi") in bytes."""
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text)).groups()
    return int(number) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[unit]


# ---- the Kubernetes objects ----------------------------------------------------------------

def test_every_yaml_parses_and_the_kustomization_lists_every_manifest(k8s):
    files = sorted((REPO / "deploy").rglob("*.y*ml"))
    assert len(files) >= 6
    for f in files:
        assert all(doc is not None for doc in yaml.safe_load_all(f.read_text())), f
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert {key.split("/")[0] for key in k8s} == {"StatefulSet", "Deployment", "Service",
                                                  "PersistentVolumeClaim", "NetworkPolicy"}
    for key, obj in k8s.items():   # namespace-agnostic: `kubectl apply -k ... -n NS`
        assert "namespace" not in obj["metadata"], key


def test_hostpath_overlay_patches_the_model_volume_of_the_base(k8s):
    overlay = yaml.safe_load((K8S / "overlays" / "hostpath" / "kustomization.yaml").read_text())
    assert (K8S / "overlays" / "hostpath" / overlay["resources"][0]).resolve() == K8S
    for item in overlay["patches"]:
        patch = yaml.safe_load(item["patch"])
        if "target" not in item:   # a strategic-merge delete of a base object
            assert f"{patch['kind']}/{patch['metadata']['name']}" in k8s
            continue
        base = k8s[f"{item['target']['kind']}/{item['target']['name']}"]
        for op in patch:   # JSON 6902: every path exists and replaces the same-named volume
            node = base
            for key in op["path"].strip("/").split("/"):
                node = node[int(key)] if isinstance(node, list) else node[key]
            assert node["name"] == op["value"]["name"] == "model"


def test_selectors_match_template_labels_and_services_select_one_workload(k8s):
    workloads = [_workload(k8s, "StatefulSet"), _workload(k8s, "Deployment")]
    for obj, _ in workloads:
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for key, svc in k8s.items():
        if not key.startswith("Service/"):
            continue
        chosen = [(obj, ctr) for obj, ctr in workloads if svc["spec"]["selector"].items()
                  <= obj["spec"]["template"]["metadata"]["labels"].items()]
        assert len(chosen) == 1, f"{key} selects {len(chosen)} workloads"
        for port in svc["spec"]["ports"]:
            assert _port(chosen[0][1], port["targetPort"]) == port["port"], (key, port)


def test_probes_are_native_grpc_on_the_served_port(k8s):
    for kind, ready_service in (("StatefulSet", WORKER_SERVICE),
                                ("Deployment", GENERATION_SERVICE)):
        _, ctr = _workload(k8s, kind)
        ready, live = ctr["readinessProbe"]["grpc"], ctr["livenessProbe"]["grpc"]
        assert ready["service"] == ready_service and live.get("service", "") == ""
        assert ready["port"] == live["port"] == _port(ctr, ready["port"])
        assert ready["port"] == _port(ctr, "worker" if kind == "StatefulSet" else "grpc")


def test_worker_wrapper_execs_deltaserve_worker_with_the_pod_ordinal(k8s, tmp_path):
    sts, ctr = _workload(k8s, "StatefulSet")
    replicas = sts["spec"]["replicas"]
    headless = k8s[f"Service/{sts['spec']['serviceName']}"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    for ordinal in range(replicas):
        argv = _worker_argv(sts, ctr, ordinal, tmp_path)
        assert argv[0] == "worker"
        args = parse_strictly(argv)
        assert args.node_rank == ordinal and args.nodes == replicas and args.device == "cuda"
        gpus = ctr["resources"]["limits"][GPU]
        assert args.local_ranks == gpus == ctr["resources"]["requests"][GPU]
        assert _listen_port(args.listen) == _port(ctr, "worker")


def test_scheduler_args_name_the_workers_and_fit_the_pod(k8s, tmp_path):
    sts, wctr = _workload(k8s, "StatefulSet")
    dep, ctr = _workload(k8s, "Deployment")
    args = parse_strictly(["scheduler", *ctr["args"]])
    worker_port = _listen_port(parse_strictly(_worker_argv(sts, wctr, 0, tmp_path)).listen)
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert args.workers.split(",") == [f"{name}-{i}.{service}:{worker_port}"
                                       for i in range(sts["spec"]["replicas"])]
    assert _listen_port(args.listen) == _port(ctr, "grpc")
    server = engine_settings(args, args.model).server
    assert server.dist_port == _port(wctr, "rendezvous")
    assert any(p["port"] == server.dist_port for p in k8s[f"Service/{service}"]["spec"]["ports"])
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > \
        server.grace_period_s
    assert GPU not in str(ctr["resources"])
    # The scheduler sends its --model path to the workers: same volume, same mount path.
    volumes = [{v["name"]: v for v in o["spec"]["template"]["spec"]["volumes"]} for o in (sts, dep)]
    mounts = [[m for m in c["volumeMounts"] if args.model.startswith(m["mountPath"] + "/")]
              for c in (wctr, ctr)]
    assert all(len(m) == 1 for m in mounts), mounts
    assert mounts[0][0]["mountPath"] == mounts[1][0]["mountPath"]
    assert volumes[0][mounts[0][0]["name"]] == volumes[1][mounts[1][0]["name"]]


def test_worker_protocol_is_authenticated_and_fenced_off(k8s, tmp_path):
    """The scheduler mounts the token's Secret and the workers its digest's (a worker pod holds
    nothing that drives another), each passed as --worker-token-file (readable by the pods'
    user through fsGroup); the worker's --model-root holds the scheduler's --model; and a
    NetworkPolicy lets only the scheduler reach the Worker port and only worker pods reach the
    rest (the unauthenticated rendezvous and NCCL)."""
    sts, wctr = _workload(k8s, "StatefulSet")
    dep, sctr = _workload(k8s, "Deployment")
    worker = parse_strictly(_worker_argv(sts, wctr, 0, tmp_path))
    scheduler = parse_strictly(["scheduler", *sctr["args"]])
    secrets = []
    for obj, ctr, args in ((sts, wctr, worker), (dep, sctr, scheduler)):
        spec = obj["spec"]["template"]["spec"]
        [mount] = [m for m in ctr["volumeMounts"]
                   if args.worker_token_file.startswith(m["mountPath"] + "/")]
        volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]["secret"]
        secrets.append((volume["secretName"], args.worker_token_file.rsplit("/", 1)[1]))
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
        assert volume["defaultMode"] & 0o040 and not volume["defaultMode"] & 0o007
    assert secrets == [("deltaserve-worker-token-digest", "digest"),
                       ("deltaserve-worker-token", "token")]
    assert not worker.listen.startswith("127.") and not getattr(worker, "insecure", False)
    assert scheduler.model.startswith(worker.model_root.rstrip("/") + "/")
    [policy] = [o for key, o in k8s.items() if key.startswith("NetworkPolicy/")]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    sources, open_ports = {}, []
    for rule in policy["spec"]["ingress"]:
        if "from" not in rule:          # open to anyone: only read-only metrics
            open_ports += [p["port"] for p in rule["ports"]]
            continue
        [peer] = rule["from"]
        selected = [o for o in (sts, dep) if peer["podSelector"]["matchLabels"].items()
                    <= o["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, rule
        sources[selected[0]["kind"]] = [p["port"] for p in rule.get("ports", [])]
    assert sources == {"Deployment": ["worker"], "StatefulSet": []}   # [] = every port
    assert open_ports == ["metrics"] and _port(wctr, "metrics")
    assert _port(wctr, "worker") == _listen_port(worker.listen)


def test_dev_shm_is_memory_backed_and_holds_the_rank_rings(k8s, tmp_path):
    from worker_service.ranks.rank_set import RankSetOptions

    sts, ctr = _workload(k8s, "StatefulSet")
    local_ranks = parse_strictly(_worker_argv(sts, ctr, 0, tmp_path)).local_ranks
    [mount] = [m for m in ctr["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    shm = volumes[mount["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    o = RankSetOptions()
    rings = o.ring_slots * o.ring_slot_bytes + local_ranks * o.reply_slots * o.reply_slot_bytes
    # The rings, plus room for NCCL's intra-node buffers.
    assert _quantity(shm["sizeLimit"]) >= max(rings + 512 * MiB, 1 << 30)


def test_the_readmes_digest_recipe_makes_what_a_worker_accepts(tmp_path):
    """deploy/README.md's shell pipeline for the workers' Secret, run as written on a token:
    a worker loading its output accepts the token and holds none."""
    readme = (REPO / "deploy" / "README.md").read_text()
    [pipeline] = re.findall(r'digest="sha256:\$\((.*?)\)"', readme)
    token = "0123456789abcdef" * 4
    hex_digest = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True,
                                env={"TOKEN": token, "PATH": "/usr/bin:/bin"},
                                check=True).stdout.strip()
    (tmp_path / "digest").write_text(f"sha256:{hex_digest}\n")
    auth = WorkerCredentials(worker_token_file=str(tmp_path / "digest")).load()
    assert auth.token is None and auth.accepts(f"Bearer {token}")
    assert not auth.accepts(f"Bearer {token}\n")
