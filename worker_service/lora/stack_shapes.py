"""The shapes of the LoRA stacks one module holds, for S slots at rank R: what layers.py and
expert_weights.py allocate, and what the memory check counts before the KV cache is sized
(runner/lora_memory.py), from one definition so the two cannot drift (docs/lora.md, "Memory").

    a projection of P pieces (q, k, v: 3; gate, up: 2; else 1), this rank's in / out sizes:
        a [S, P R, in_rank], b [S, out_rank, P R]
    routed experts (E of them, hidden H, this rank's expert width I_r), ranks R13 (gate and up
    together: up to 2 R) and R2 (down):
        a13 [S, E, R13, H], b13 [S, E, 2 I_r, R13], a2 [S, E, R2, I_r], b2 [S, E, H, R2],
        has [S, E] (bool)
"""
from __future__ import annotations

from math import prod

Shape = tuple[int, ...]


def dense_shapes(num_slots: int, pieces: int, rank: int, in_rank: int, out_rank: int
                 ) -> tuple[Shape, Shape]:
    return (num_slots, pieces * rank, in_rank), (num_slots, out_rank, pieces * rank)


def expert_shapes(num_slots: int, num_experts: int, hidden: int, inter_rank: int, r13: int,
                  r2: int) -> tuple[Shape, Shape, Shape, Shape, Shape]:
    """(a13, b13, a2, b2, has)."""
    s, e = num_slots, num_experts
    return ((s, e, r13, hidden), (s, e, 2 * inter_rank, r13), (s, e, r2, inter_rank),
            (s, e, hidden, r2), (s, e))


def dense_bytes(element_bytes: int, *args) -> int:
    """dense_shapes(*args)'s bytes in the model's element size."""
    return sum(prod(s) for s in dense_shapes(*args)) * element_bytes


def expert_bytes(element_bytes: int, *args) -> int:
    """expert_shapes(*args)'s bytes: the stacks in the model's element size, `has` one byte."""
    *stacks, has = expert_shapes(*args)
    return sum(prod(s) for s in stacks) * element_bytes + prod(has)
