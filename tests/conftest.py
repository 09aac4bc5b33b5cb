"""Shared fixtures: tiny real Hugging Face model directories, built once per test session."""
from __future__ import annotations

import os

import pytest
import torch

from kernels.cpu import extension

# Triton reads TRITON_INTERPRET when it is imported and when kernels are decorated, so it must be
# set before anything imports triton: without a GPU, every Triton kernel runs in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# On a GPU machine the interpreter's exit after the last test has hung once (a CUDA or NCCL
# teardown; the H100 run of 2026-11-24): with CUDA present, end the process once pytest has
# reported, with pytest's exit status.
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


def pytest_unconfigure(config):
    if torch.cuda.is_available() and _EXIT_STATUS:
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


# Tests that give a child process its own XDG_CACHE_HOME (an empty model cache) must not make it
# rebuild the CPU kernels there (a minute or two on 2 cores): every process uses this build.
os.environ.setdefault(extension.DIR_VAR, str(extension.build_root()))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Lazily built model dirs by architecture name ("qwen3", "llama", "qwen2")."""
    from worker_service.models.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    cache: dict[str, str] = {}

    def get(arch: str, **overrides) -> str:
        key = arch + repr(sorted(overrides.items()))
        if key not in cache:
            cache[key] = str(make_tiny_model(root / f"{arch}-{len(cache)}", arch=arch,
                                             **overrides))
        return cache[key]

    return get




@pytest.fixture(scope="session")
def tiny_cache_home(tiny_models):
    """seed(home) -> home: an XDG_CACHE_HOME for a child's `--model tiny` that already holds the
    tiny model, so the child does not write it again (about 2 s each). The same model
    deltaserve.embedded.tiny_model_dir() writes (make_tiny_model, qwen3, seed 0), copied under
    its name. A test of the first run's writing gives its child an empty home instead."""
    import shutil
    from pathlib import Path

    from deltaserve.embedded import TINY_MODEL_NAME

    def seed(home) -> str:
        shutil.copytree(tiny_models("qwen3"), Path(home) / "deltaserve" / TINY_MODEL_NAME)
        return str(home)

    return seed


@pytest.fixture(scope="session")
def bench_presets(tmp_path_factory):
    """A bench --cache-dir with the "tiny" preset built once (about 5 s a build): for the tests
    of what a bench runs and prints. The tests of building and reusing a preset
    (tests/integration/bench/test_throughput.py) use their own empty directories."""
    from bench.presets import preset_dir

    root = tmp_path_factory.mktemp("presets")
    preset_dir("tiny", root)
    return root


@pytest.fixture(scope="session")
def tiny_ggufs(tiny_models, tmp_path_factory):
    """Lazily written GGUF files of the tiny models: get(arch, qtype="F32", **write_gguf kwargs).
    "llama" is the tiny llama with the default rope; "llama3" keeps its Llama 3.1 rope scaling,
    which the file carries as rope_freqs.weight."""
    from tests.support.gguf_files import write_gguf

    root = tmp_path_factory.mktemp("gguf")
    cache: dict[str, str] = {}

    def get(arch: str, qtype: str = "F32", **kwargs) -> str:
        key = arch + qtype + repr(sorted(kwargs.items()))
        if key not in cache:
            model = (tiny_models("llama", rope_scaling=None) if arch == "llama"
                     else tiny_models("llama") if arch == "llama3" else tiny_models(arch))
            out = root / f"{arch}-{qtype}-{len(cache)}"
            out.mkdir()
            cache[key] = str(write_gguf(out / f"tiny-{arch}.{qtype}.gguf", model, qtype,
                                        **kwargs))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def default_model():
    """The real default model directory (SmolLM2-135M-Instruct, float32), converted once into
    the user's cache (`make install` prepares it; otherwise it is fetched here)."""
    from deltaserve.default_model import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture
def keep_dense_weights(monkeypatch):
    """A CPU load keeps every linear's parameter and every packed MoE experts module's
    stacked weights (layers/cpu_kernels.release_dense_weights / release_expert_weights let
    them go once packed): for tests that check where the loader writes weights."""
    from worker_service.layers import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "release_dense_weights", lambda model, holders=None: 0)
    monkeypatch.setattr(cpu_kernels, "release_expert_weights", lambda model: 0)
