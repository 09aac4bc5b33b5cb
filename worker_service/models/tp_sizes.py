"""Which tensor-parallel sizes a model's shapes allow, so a bad size is refused before any rank
loads anything, with the sizes that would work.

A size t works when the layers can split evenly (worker_service/layers/linear.py):
  - t divides num_attention_heads (query heads are split),
  - t divides num_key_value_heads, or is a multiple of it (kv heads are then replicated),
  - t divides intermediate_size (gate/up rows, down columns).
The vocabulary is padded to a multiple of t, so it never constrains t.
"""
from __future__ import annotations


def _shape(hf_config: dict) -> tuple[int, int, int]:
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    return heads, kv_heads, int(hf_config["intermediate_size"])


def tp_size_problem(hf_config: dict, tp_size: int) -> str | None:
    """Why `tp_size` cannot split this model, or None when it can."""
    heads, kv_heads, inter = _shape(hf_config)
    if heads % tp_size:
        return f"it does not divide num_attention_heads={heads}"
    if kv_heads % tp_size and tp_size % kv_heads:
        return f"it neither divides num_key_value_heads={kv_heads} nor is a multiple of it"
    if inter % tp_size:
        return f"it does not divide intermediate_size={inter}"
    return None


def valid_tp_sizes(hf_config: dict) -> list[int]:
    heads = _shape(hf_config)[0]
    return [t for t in range(1, heads + 1) if tp_size_problem(hf_config, t) is None]


def check_tp_size(hf_config: dict, tp_size: int) -> None:
    """ValueError naming the size, why it fails and the sizes that would work."""
    problem = tp_size_problem(hf_config, tp_size)
    if problem is None:
        return
    heads = _shape(hf_config)[0]
    dividing = [t for t in range(1, heads + 1) if heads % t == 0]
    valid = valid_tp_sizes(hf_config)
    notes = [f"{t} divides the {heads} attention heads too, but {tp_size_problem(hf_config, t)}"
             for t in dividing if t not in valid and t != tp_size]
    note = f" ({'; '.join(notes)})" if notes else ""
    raise ValueError(f"tensor-parallel size {tp_size} does not fit this model: {problem}; "
                     f"sizes that would: {', '.join(map(str, valid))}{note}")
