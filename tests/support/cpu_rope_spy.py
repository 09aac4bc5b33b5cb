"""A counter of the C++ CPU rope's calls on one RotaryEmbedding, for tests that assert the
model's rope ran in kernels/cpu (not torch's fallback) whenever that library is built."""
from __future__ import annotations

from kernels.cpu import extension
from worker_service.layers.rotary import RotaryEmbedding


class CountingOps:
    """Passes rope calls on to the real kernels/cpu ops, counting them."""

    def __init__(self, ops) -> None:
        self.ops, self.calls = ops, 0

    def rope(self, *args) -> None:
        self.calls += 1
        self.ops.rope(*args)


def count_cpu_ropes(rope: RotaryEmbedding) -> CountingOps | None:
    """A counter of the C++ rope's calls on this module, or None when the library is not built
    (the torch rope then runs, and a comparison with transformers still holds)."""
    if not extension.load():
        assert rope.kernel == "torch"
        return None
    assert rope.kernel == "cpu", "a model on the CPU takes the C++ rope"
    rope._cpu = CountingOps(rope._cpu)
    return rope._cpu
