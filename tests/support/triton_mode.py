"""Import first in a test module of Triton kernels: compiled on a GPU, else the interpreter.

Triton picks the interpreter when a kernel is *decorated* (and, for tl.zeros and friends, at
`import triton`), so TRITON_INTERPRET is set here, before triton is imported, when there is no
GPU. If an earlier module already imported triton in compiled mode, `needs_kernels` skips.
"""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

DEVICE = "cuda" if ON_GPU else "cpu"


def interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton.language.zeros, InterpretedFunction)


needs_kernels = pytest.mark.skipif(
    not ON_GPU and not interpreted(),
    reason="triton was imported in compiled mode without a GPU (TRITON_INTERPRET unset)")
