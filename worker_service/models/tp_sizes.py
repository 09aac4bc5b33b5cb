"""Which tensor-parallel sizes a model's shapes allow, so a bad size is refused before any rank
loads anything, naming the sizes that would work.

A size t works when the layers can split evenly (worker_service/layers/linear.py):
  - t divides num_attention_heads (query heads are split),
  - t divides num_key_value_heads, or is a multiple of it (kv heads are then replicated),
  - t divides intermediate_size (gate/up rows, down columns),
  - in a mixture-of-experts model, t also divides moe_intermediate_size (each rank keeps a slice
    of every expert) and shared_expert_intermediate_size when there is a shared expert.
The vocabulary is padded to a multiple of t, so it never constrains t.
"""
from __future__ import annotations

from engine_common.request.params import ParamError


def _shape(hf_config: dict) -> tuple[int, int, int]:
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    return heads, kv_heads, int(hf_config["intermediate_size"])


def tp_size_problem(hf_config: dict, tp_size: int) -> str | None:
    """Why `tp_size` cannot split this model ("does not divide ..."), or None when it can."""
    heads, kv_heads, inter = _shape(hf_config)
    if tp_size < 1:
        return "is not a positive size"
    if heads % tp_size:
        return f"does not divide num_attention_heads={heads}"
    if kv_heads % tp_size and tp_size % kv_heads:
        return f"neither divides num_key_value_heads={kv_heads} nor is a multiple of it"
    if inter % tp_size:
        return f"does not divide intermediate_size={inter}"
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        size = int(hf_config.get(field) or 0)
        if size % tp_size:
            return f"does not divide {field}={size}"
    return None


def valid_tp_sizes(hf_config: dict) -> list[int]:
    heads = _shape(hf_config)[0]
    return [t for t in range(1, heads + 1) if tp_size_problem(hf_config, t) is None]


def check_tp_size(hf_config: dict, tp_size: int, field: str = "tp_size") -> None:
    """ParamError on `field` naming the sizes that would work and why `tp_size` does not."""
    problem = tp_size_problem(hf_config, tp_size)
    if problem is None:
        return
    heads = _shape(hf_config)[0]
    valid = valid_tp_sizes(hf_config)
    # sizes a user would guess from the head count alone, and why they fail too
    why = [f"{tp_size} {problem}"] + [
        f"{t} divides the {heads} attention heads but {tp_size_problem(hf_config, t)}"
        for t in range(1, heads + 1) if heads % t == 0 and t not in valid and t != tp_size]
    raise ParamError(field, tp_size, f"a tensor-parallel size this model can be split over: "
                                     f"{', '.join(map(str, valid))} ({'; '.join(why)})")
