"""deploy/docker and deploy/grpcurl: the Dockerfiles and the grpcurl examples agree with the code.

No Docker: each Dockerfile's entrypoint, user, installs and example flags are checked (every
`deltaserve` command line parsed by the real CLI parser); the scheduler image's packages are
checked against what the scheduler really imports; and examples.sh runs against a real
`deltaserve serve`. The Kubernetes manifests: test_deploy_k8s.py.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.support.deploy_cli import parse_strictly
from tests.support.grpc_harness import GRPCURL, REPO, SMALL_KV_GIB, child_env, free_port, wait_for

DOCKER = REPO / "deploy" / "docker"
EXAMPLES = REPO / "deploy" / "grpcurl" / "examples.sh"


# ---- helpers -------------------------------------------------------------------------------

def _dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    lines = [ln for ln in (DOCKER / name).read_text().splitlines()
             if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def _docker_run_examples(name: str) -> list[list[str]]:
    """The arguments after the image name in the Dockerfile's commented `docker run` examples."""
    text = re.sub(r"\\\n#\s*", " ", (DOCKER / name).read_text())
    image = "deltaserve-" + name.split(".")[1]
    runs = [shlex.split(m) for m in re.findall(r"^#\s*docker run (.*)$", text, re.M)]
    return [r[r.index(image) + 1:] for r in runs]


def _project() -> dict:
    """pyproject.toml's [project] table (tomllib: Python 3.11+)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_closure(requirements: list[str]) -> set[str]:
    """Distributions `requirements` pull in, transitively (extras not taken), as installed here."""
    seen, todo = set(), [_canonical(re.match(r"[\w.-]+", r)[0]) for r in requirements]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_canonical(re.match(r"[\w.-]+", r)[0]) for r in reqs if "extra ==" not in r]
    return seen


# ---- the images ----------------------------------------------------------------------------

def test_base_dependencies_leave_torch_to_the_worker_extra():
    project = _project()
    base = {_canonical(re.match(r"[\w.-]+", r)[0]) for r in project["dependencies"]}
    assert "torch" not in base and "triton" not in base
    assert "grpcio-health-checking" in base   # the worker's gRPC probes need it
    assert any(r.startswith("torch") for r in project["optional-dependencies"]["worker"])
    assert "triton" in project["optional-dependencies"]


@pytest.mark.parametrize("name, command, install", [
    ("Dockerfile.scheduler", "scheduler", "."),
    ("Dockerfile.worker", "worker", ".[worker,triton]"),
])
def test_dockerfile_entrypoint_user_install_and_example_flags(name, command, install):
    steps = _dockerfile(name)
    assert ("ENTRYPOINT", json.dumps(["deltaserve", command])) in steps
    [user] = [rest for ins, rest in steps if ins == "USER"]
    assert user not in ("root", "0")
    pip_installs = [shlex.split(part.split("pip install", 1)[1]) for ins, rest in steps
                    if ins == "RUN" for part in rest.split("&&") if "pip install" in part]
    assert [install] in [[a for a in args if not a.startswith("$")] for args in pip_installs]
    for ins, rest in steps:
        if ins == "COPY" and not rest.startswith("--"):
            assert (REPO / rest.split()[0]).exists(), rest
        if ins == "CMD":
            parse_strictly([command, *json.loads(rest)])
        for part in rest.split("&&") if ins == "RUN" else ():
            if part.split()[0] == "deltaserve":   # e.g. a `deltaserve worker --help` check
                parse_strictly(shlex.split(part.split(">")[0])[1:])
    examples = _docker_run_examples(name)
    assert examples
    for args in examples:
        parse_strictly([command, *args])
    if command == "scheduler":   # python:3.11-slim, and no torch anywhere in what it installs
        assert ("ARG", "PYTHON_IMAGE=python:3.11-slim") in steps
        assert not any("torch" in a for args in pip_installs for a in args)
    else:
        assert any(ins == "ARG" and rest.startswith("TORCH_SPEC=") for ins, rest in steps)
        assert "/dev/shm" in (DOCKER / name).read_text()


_IMPORT_PROBE = """
import json, sys
before = set(sys.modules)
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not in the scheduler image")
sys.meta_path.insert(0, Block())
from deltaserve.cli import build_parser
from engine_common.configuration.config import WorkerConfig
from scheduler_service.api.server import build_scheduler_server
build_parser().parse_args(["scheduler", "--model", MODEL, "--workers", "127.0.0.1:9"])
build_scheduler_server(["127.0.0.1:9"], "127.0.0.1:0", WorkerConfig(model_dir=MODEL))
new = {m.split(".")[0] for m in set(sys.modules) - before}
# Top-level modules with a file (a Cython runtime module, for one, has none).
print(json.dumps(sorted(m for m in new if getattr(sys.modules.get(m), "__file__", None))))
"""


def test_scheduler_image_holds_everything_the_scheduler_imports(served):
    """With only the packages the scheduler Dockerfile copies and the base dependencies (and
    theirs) importable, `deltaserve scheduler` builds its server: no torch, no worker side, no
    dev or worker extras. Optional imports that fail cleanly are allowed, as in the image."""
    copied = {rest.split()[0] for ins, rest in _dockerfile("Dockerfile.scheduler")
              if ins == "COPY" and (REPO / rest.split()[0]).is_dir()}
    packages = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    project = _project()
    allowed = _requirement_closure(project["dependencies"])
    owners = metadata.packages_distributions()
    foreign = {m for m, dists in owners.items() if not {_canonical(d) for d in dists} & allowed}
    blocked = sorted((packages - copied) | (foreign - packages) | {"torch", "transformers"})
    code = f"BLOCKED = {blocked!r}\nMODEL = {str(served['model'])!r}\n" + _IMPORT_PROBE
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(None),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = set(json.loads(out.stdout.splitlines()[-1])) - set(sys.stdlib_module_names)
    for module in imported - copied:
        dists = {_canonical(d) for d in owners.get(module, [])}
        assert dists & allowed, f"the scheduler imports {module} ({dists or 'no dist'}), " \
                                "which `pip install .` does not install"


# ---- examples.sh against a real server -----------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_cache_home):
    """`deltaserve serve` with the tiny model on free loopback ports; stopped at the end."""
    tmp = tmp_path_factory.mktemp("deploy-serve")
    port, worker_port = free_port(), free_port()
    log_path = tmp / "serve.log"
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--listen", f"127.0.0.1:{port}",
           "--worker-listen", f"127.0.0.1:{worker_port}", "--device", "cpu",
           "--model", "tiny", "--kv-cache-gib", SMALL_KV_GIB, "--metrics-listen", "127.0.0.1:0",
           "--openai-listen", "off"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env({"XDG_CACHE_HOME": tiny_cache_home(tmp / "cache")}))
    try:
        def ready():
            assert proc.poll() is None, log_path.read_text(errors="replace")
            return "DeltaServe ready on" in log_path.read_text(errors="replace")
        wait_for(ready, 120, "the ready line of deltaserve serve")
        yield {"target": f"127.0.0.1:{port}", "worker": f"127.0.0.1:{worker_port}",
               "model": tmp / "cache" / "deltaserve" / "tiny-qwen3"}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)   # drains, then stops the worker too
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_examples_script_runs_end_to_end(served):
    env = child_env({"TARGET": served["target"], "WORKER_TARGET": served["worker"]})
    env.pop("GRPCURL", None)
    if (REPO / ".venv" / "bin" / "grpcurl").is_file():   # exercise the script's .venv fallback
        venv_bin = str(REPO / ".venv" / "bin")
        env["PATH"] = os.pathsep.join(d for d in env["PATH"].split(os.pathsep)
                                      if d.rstrip("/") != venv_bin)
    elif Path(GRPCURL).is_file():
        env["GRPCURL"] = GRPCURL
    else:
        pytest.skip("no grpcurl binary (it comes with the dev extras)")
    out = subprocess.run(["bash", str(EXAMPLES)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for fragment in (
            "grpc.reflection.v1alpha.ServerReflection",          # list
            "service Generation {",                              # describe, with comments
            '"status": "SERVING"',                               # health
            '"numTokens": 6',                                    # Tokenize "Hello world"
            '"modelName": "tiny-qwen3"', '"maxLogprobs": 20',    # GetModelInfo
            '"numWorkersReady": 1',                              # GetServerStatus
            '"finishReason": "LENGTH"', '"timeToFirstTokenS"',   # streaming Generate
            '"requestId": "demo-1"', '"topLogprobs"', "same tokens:",
            '"numAborted": 1', '"finishReason": "ABORT"',        # Abort
            "Code: InvalidArgument", "sampling.top_p=1.5",       # the error example
            "Code: Unauthenticated"):                            # the worker's Info, no token
        assert fragment in text, f"{fragment!r} missing from:\n{text[-4000:]}"
