"""Shared fixtures: tiny real Hugging Face model directories, built once per test session."""
from __future__ import annotations

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is imported and when kernels are decorated, so it must be
# set before anything imports triton: without a GPU, every Triton kernel runs in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


