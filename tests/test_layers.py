"""The layers of the tree, enforced: an AST import graph of every module (imports made inside
functions included) must have no cycle, between modules or between folders, and no import the
layer table forbids.

A room is a module prefix; a module belongs to the longest room that prefixes it. A module may
import its own room and the rooms listed for it, nothing else of ours (third-party imports are not
checked here; tests/unit/scheduler_service/test_torch_free.py keeps torch out of the scheduler).
The table has no exception: a room may import only rooms listed before it, so every arrow points
down. docs/architecture.md draws the same table.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine_common.runtime.graph_components import strongly_connected

ROOT = Path(__file__).resolve().parents[1]
# The top-level packages, lowest first: each imports only those before it.
PACKAGES = ("dswire", "engine_common", "kernels", "scheduler_service", "worker_service",
            "deltaserve", "bench")

# engine_common's folders, lowest first: each imports only those before it; wire alone the stubs.
_ENGINE_COMMON = ("engine_common.request", "engine_common.configuration", "engine_common.runtime",
                  "engine_common.constraints", "engine_common.model_files", "engine_common.text",
                  "engine_common.security", "engine_common.wire")
_EC = _ENGINE_COMMON
_COMMON = ("dswire", "engine_common") + _ENGINE_COMMON
_WORKER_LEAVES = ("worker_service.config", "worker_service.device_info",
                  "worker_service.failures", "worker_service.parallel_state")
_SCHEDULER = ("scheduler_service.errors", "scheduler_service.core", "scheduler_service.workers",
              "scheduler_service.engine", "scheduler_service.api")
# One step's data, lowest first: the batch a worker holds, the step's staged inputs, sampling.
_STEP_DATA = ("worker_service.batch", "worker_service.step", "worker_service.sample")
_WORKER = _WORKER_LEAVES + ("worker_service.layers", "worker_service.models",
                            "worker_service.lora") + _STEP_DATA + (
    "worker_service.runner", "worker_service.ranks", "worker_service.service")

# room -> the rooms it may import (besides itself), each listed before it: lower layers come first.
LAYERS: dict[str, tuple[str, ...]] = {
    "dswire": (),                                       # generated stubs: the bottom layer
    "engine_common": (),                                # package __init__ files: empty
    "engine_common.request": (),                        # sampling knobs, params, diff bounds
    "engine_common.configuration": _EC[:1],             # declared settings, the configs
    "engine_common.runtime": _EC[:2],                   # paths, GC, big stacks, /metrics
    "engine_common.constraints": _EC[:3],               # structured-output constraints
    "engine_common.model_files": (),                    # config.json, GGUF metadata
    "engine_common.text": _EC[:5],                      # tokenizers, chat templates
    "engine_common.security": _EC[:6],                  # TLS, the worker's credentials
    "engine_common.wire": ("dswire",) + _EC[:7],        # the diff, its codec, the stubs
    "kernels": (),
    "scheduler_service": (),                            # package __init__ files: empty
    "worker_service": (),
    "scheduler_service.errors": _COMMON,
    "scheduler_service.core": _COMMON + ("scheduler_service.errors",),
    "scheduler_service.workers": _COMMON + ("scheduler_service.errors",),
    "scheduler_service.engine": _COMMON + _SCHEDULER[:3],
    "scheduler_service.api": _COMMON + _SCHEDULER[:4],
    **{leaf: _COMMON for leaf in _WORKER_LEAVES},
    "worker_service.layers": _COMMON + _WORKER_LEAVES + ("kernels",),
    "worker_service.models": _COMMON + _WORKER_LEAVES + ("kernels", "worker_service.layers"),
    "worker_service.lora": _COMMON + _WORKER_LEAVES + ("kernels", "worker_service.layers",
                                                       "worker_service.models"),
    "worker_service.batch": _COMMON + _WORKER_LEAVES,
    "worker_service.step": _COMMON + _WORKER_LEAVES + ("kernels",) + _STEP_DATA[:1],
    "worker_service.sample": _COMMON + _WORKER_LEAVES + ("kernels",) + _STEP_DATA[:2],
    "worker_service.runner": _COMMON + _WORKER[:10] + ("kernels",),
    "worker_service.ranks": _COMMON + _WORKER[:11],
    "worker_service.service": _COMMON + _WORKER[:12],
    "deltaserve.client": _COMMON,
    "deltaserve.llm_inputs": _COMMON,
    "deltaserve.llm_executor": _COMMON + _WORKER[:11] + ("kernels",),
    "deltaserve.llm_chat": _COMMON,
    "deltaserve.llm_interrupt": (),
    "deltaserve.llm_embed": _COMMON,
    "deltaserve.llm_score": _COMMON,
    "deltaserve.llm_lora": _COMMON + _SCHEDULER[:4] + _WORKER[:7],
    "deltaserve.llm_requests": _COMMON + _SCHEDULER[:2] + ("deltaserve.llm_inputs",),
    "deltaserve.llm": _COMMON + _SCHEDULER[:4] + _WORKER[:11] + ("kernels",
                                                                 "deltaserve.llm_inputs",
                                                                 "deltaserve.llm_executor",
                                                                 "deltaserve.llm_chat",
                                                                 "deltaserve.llm_interrupt",
                                                                 "deltaserve.llm_embed",
                                                                 "deltaserve.llm_score",
                                                                 "deltaserve.llm_lora",
                                                                 "deltaserve.llm_requests"),
    "deltaserve.default_model": _COMMON + ("worker_service.models",),
    "deltaserve.chat": _COMMON + ("deltaserve.client",),
    "deltaserve.child_process": (),
    "deltaserve.smg_argv": (),
    "deltaserve.hub_cache": (),
    "deltaserve.gateway_checks": _COMMON,
    "deltaserve.vllm_lists": _COMMON + ("deltaserve.hub_cache",),   # a leaf: MODEL in the cache
    "deltaserve.openai_gateway": _COMMON + ("deltaserve.child_process",
                                            "deltaserve.smg_argv",
                                            "deltaserve.gateway_checks",
                                            "deltaserve.vllm_lists"),
    "deltaserve.flag_names": _COMMON + _SCHEDULER + ("deltaserve.openai_gateway",),
    "deltaserve.vllm_flags": _COMMON,
    "deltaserve.vllm_config_file": ("deltaserve.vllm_flags",),
    "deltaserve.embedded": _COMMON + _SCHEDULER + ("deltaserve.default_model",
                                                   "worker_service.models",
                                                   "deltaserve.child_process",
                                                   "deltaserve.hub_cache",
                                                   "deltaserve.openai_gateway",
                                                   "deltaserve.vllm_flags"),
    "deltaserve": (),                                   # the package __init__: empty
    "deltaserve.cli": ("*",),                           # may import every room listed before it
    # Above the CLI: `deltaserve bench` is an entry point the bench declares, not an import.
    "bench": _COMMON + _SCHEDULER + _WORKER + ("kernels", "deltaserve.llm",
                                                "deltaserve.default_model", "deltaserve.embedded",
                                                "deltaserve.child_process"),
}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def collect_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    return {module_name(root, p): p for pkg in packages for p in (root / pkg).rglob("*.py")}


def _imported_names(mod: str, path: Path):
    """Every dotted name an import statement of `mod` may refer to, anywhere in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".")[:-1] if path.name != "__init__.py" else mod.split(".")
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def _longest(prefixes, name: str) -> str | None:
    best = None
    for p in prefixes:
        if (name == p or name.startswith(p + ".")) and (best is None or len(p) > len(best)):
            best = p
    return best


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports."""
    graph = {}
    for mod, path in modules.items():
        targets = {_longest(modules, n) for n in _imported_names(mod, path)}
        graph[mod] = {t for t in targets if t and t != mod}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module."""
    edges = {node: sorted(targets) for node, targets in graph.items()}
    return [sorted(c) for c in strongly_connected(sorted(graph), edges) if len(c) > 1]


def allowed_rooms(room: str, layers=LAYERS) -> tuple[str, ...]:
    """The rooms `room` may import: those the table lists for it ('*': every room before it)."""
    rooms = list(layers)
    return tuple(rooms[:rooms.index(room)]) if layers[room] == ("*",) else layers[room]


def forbidden_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    problems = []
    for mod, targets in sorted(graph.items()):
        room = _longest(layers, mod)
        if room is None:
            problems.append(f"{mod} is in no room of the layer table")
            continue
        allowed = allowed_rooms(room, layers)
        for target in sorted(targets):
            other = _longest(layers, target)
            if other == room or other in allowed:
                continue
            problems.append(f"{mod} ({room}) imports {target} ({other}); {room} may import "
                            f"only {', '.join(allowed) or 'nothing of ours'}")
    return problems


def group_graph(graph: dict[str, set[str]], group_of) -> dict[str, set[str]]:
    """The import graph between groups of modules (`group_of(module)` names a module's group)."""
    groups: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        group = group_of(mod)
        groups.setdefault(group, set()).update(g for g in map(group_of, targets) if g != group)
    return groups


def folder_of(modules: dict[str, Path], root: Path = ROOT):
    """module -> the folder its file is in, dotted (a package's __init__ is in its own folder)."""
    return lambda mod: ".".join(modules[mod].parent.relative_to(root).parts)


@pytest.fixture(scope="module")
def modules():
    return collect_modules(ROOT)


@pytest.fixture(scope="module")
def graph(modules):
    return import_graph(modules)


def test_no_import_cycles(graph):
    assert find_cycles(graph) == []


@pytest.mark.parametrize("level", ["package", "room", "folder"])
def test_no_import_cycles_between_packages_rooms_or_folders(graph, modules, level):
    group_of = {"package": lambda mod: mod.split(".")[0],
                "room": lambda mod: _longest(LAYERS, mod),
                "folder": folder_of(modules)}[level]
    assert find_cycles(group_graph(graph, group_of)) == []


def test_each_top_level_package_imports_only_packages_listed_before_it(graph):
    packages = group_graph(graph, lambda mod: mod.split(".")[0])
    assert {p: sorted(t for t in packages[p] if PACKAGES.index(t) > PACKAGES.index(p))
            for p in PACKAGES} == {p: [] for p in PACKAGES}


def test_each_room_may_import_only_rooms_listed_before_it():
    """No exception in the table: every allowed arrow points down."""
    rooms = list(LAYERS)
    for i, room in enumerate(rooms):
        assert "*" not in LAYERS[room] or LAYERS[room] == ("*",), room
        assert [r for r in allowed_rooms(room) if r not in rooms[:i]] == [], room


def test_the_cli_may_not_import_the_bench_that_sits_above_it():
    graph = {"deltaserve.cli": {"bench.throughput", "deltaserve.chat"}, "bench.throughput": set(),
             "deltaserve.chat": set()}
    [problem] = forbidden_imports(graph)
    assert problem.startswith("deltaserve.cli (deltaserve.cli) imports bench.throughput (bench)")


def test_every_import_is_allowed_by_the_layer_table(graph):
    assert forbidden_imports(graph) == []


def test_every_engine_common_module_lives_in_a_folder_of_the_table(modules):
    """A module dropped flat into engine_common/ would sit in the package room, which imports
    nothing: it belongs in the folder of its concern."""
    assert [m for m in modules if _longest(LAYERS, m) == "engine_common" and m != "engine_common"] \
        == []


def test_the_scheduler_side_never_reaches_worker_or_kernel_code(graph):
    for mod, targets in graph.items():
        if mod.startswith("scheduler_service"):
            assert not [t for t in targets if t.startswith(("worker_service", "kernels"))], mod


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return collect_modules(tmp_path, ("engine_common", "scheduler_service"))


def test_the_checker_reports_a_forbidden_import_even_inside_a_function(tmp_path):
    modules = _tree(tmp_path, {
        "engine_common/__init__.py": "",
        "engine_common/request/params.py": "def f():\n    from scheduler_service.core import request\n",
        "scheduler_service/__init__.py": "",
        "scheduler_service/core/__init__.py": "",
        "scheduler_service/core/request.py": "from engine_common.request import params\n",
    })
    graph = import_graph(modules)
    assert "scheduler_service.core.request" in graph["engine_common.request.params"]
    problems = forbidden_imports(graph)
    assert "engine_common.request.params (engine_common.request) imports " \
        "scheduler_service.core.request (scheduler_service.core); engine_common.request may " \
        "import only nothing of ours" in problems
    assert find_cycles(graph) == [["engine_common.request.params",
                                   "scheduler_service.core.request"]]


def test_the_checker_resolves_relative_imports(tmp_path):
    modules = _tree(tmp_path, {
        "scheduler_service/__init__.py": "",
        "scheduler_service/core/__init__.py": "",
        "scheduler_service/core/a.py": "from . import b\nfrom ..api import c\n",
        "scheduler_service/core/b.py": "",
        "scheduler_service/api/__init__.py": "",
        "scheduler_service/api/c.py": "",
    })
    graph = import_graph(modules)
    assert graph["scheduler_service.core.a"] >= {"scheduler_service.core.b",
                                                 "scheduler_service.api.c"}
    assert any("imports scheduler_service.api.c" in p for p in forbidden_imports(graph))


def test_the_checker_finds_a_cycle_between_folders_that_modules_alone_do_not_show(tmp_path):
    modules = _tree(tmp_path, {
        "engine_common/__init__.py": "",
        "engine_common/a.py": "from scheduler_service.core import b\n",
        "scheduler_service/__init__.py": "",
        "scheduler_service/core/__init__.py": "",
        "scheduler_service/core/b.py": "",
        "scheduler_service/core/c.py": "def f():\n    from engine_common import d\n",
        "engine_common/d.py": "",
    })
    graph = import_graph(modules)
    assert find_cycles(graph) == []
    assert find_cycles(group_graph(graph, lambda mod: mod.split(".")[0])) == \
        [["engine_common", "scheduler_service"]]
    assert find_cycles(group_graph(graph, folder_of(modules, tmp_path))) == \
        [["engine_common", "scheduler_service.core"]]
