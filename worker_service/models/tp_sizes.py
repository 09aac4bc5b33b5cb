"""Which tensor-parallel sizes a model's shapes allow, so a bad size is refused before any rank
loads anything, naming the sizes that would work.

A size t works when the layers can split evenly (worker_service/layers/linear.py):
  - t divides num_attention_heads (query heads are split),
  - t divides num_key_value_heads, or is a multiple of it (kv heads are then replicated),
  - t divides intermediate_size (gate/up rows, down columns) when the model has a dense MLP
    (a DeepSeek model whose layers are all sparse has none: first_k_dense_replace 0 and
    moe_layer_freq 1),
  - in a mixture-of-experts model, t also divides moe_intermediate_size (each rank keeps a slice
    of every expert; DeepSeek's shared experts are n_shared_experts times as wide, so they
    split too) and shared_expert_intermediate_size when there is a shared expert.
The vocabulary is padded to a multiple of t, so it never constrains t. Read without torch.
"""
from __future__ import annotations

from types import MappingProxyType

from engine_common.request.params import ParamError

# first_k_dense_replace when config.json has none: DeepseekV2Config's and DeepseekV3Config's
# (models/deepseek_config.py's V2_DEFAULTS / V3_DEFAULTS, which import torch; a test keeps
# them equal)
DEEPSEEK_DENSE_DEFAULTS = MappingProxyType({"DeepseekV2ForCausalLM": 0,
                                            "DeepseekV3ForCausalLM": 3})


def _heads(hf_config: dict) -> tuple[int, int]:
    heads = int(hf_config["num_attention_heads"])
    return heads, int(hf_config.get("num_key_value_heads") or heads)


def _has_dense_mlp(hf_config: dict) -> bool:
    """Whether some layer builds a dense MLP (intermediate_size wide). DeepSeek: a layer is
    sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0 (deepseek_config)."""
    arch = (hf_config.get("architectures") or [None])[0]
    if arch not in DEEPSEEK_DENSE_DEFAULTS:
        return True
    first = hf_config.get("first_k_dense_replace", DEEPSEEK_DENSE_DEFAULTS[arch])
    freq = hf_config.get("moe_layer_freq") or 1
    num_layers = hf_config.get("num_hidden_layers") or 0
    if not all(isinstance(v, int) for v in (first, freq, num_layers)):
        return True         # deepseek_config refuses such a field by name when building
    return any(i < first or i % freq for i in range(num_layers))


def _width_problem(hf_config: dict, tp_size: int) -> str | None:
    """The first MLP width (dense, experts, shared expert) `tp_size` does not divide."""
    fields = ("moe_intermediate_size", "shared_expert_intermediate_size")
    if _has_dense_mlp(hf_config):
        fields = ("intermediate_size",) + fields
    for field in fields:
        size = int(hf_config[field] if field == "intermediate_size" else
                   hf_config.get(field) or 0)
        if size % tp_size:
            return f"does not divide {field}={size}"
    return None


def tp_size_problem(hf_config: dict, tp_size: int) -> str | None:
    """Why `tp_size` cannot split this model ("does not divide ..."), or None when it can."""
    heads, kv_heads = _heads(hf_config)
    if tp_size < 1:
        return "is not a positive size"
    if heads % tp_size:
        return f"does not divide num_attention_heads={heads}"
    if kv_heads % tp_size and tp_size % kv_heads:
        return f"neither divides num_key_value_heads={kv_heads} nor is a multiple of it"
    return _width_problem(hf_config, tp_size)


def valid_tp_sizes(hf_config: dict) -> list[int]:
    """Every size from 1 to the head count that splits this model."""
    heads = _heads(hf_config)[0]
    return [t for t in range(1, heads + 1) if tp_size_problem(hf_config, t) is None]


def check_tp_size(hf_config: dict, tp_size: int, field: str = "tp_size") -> None:
    """ParamError on `field` naming the sizes that would work and why `tp_size` does not."""
    problem = tp_size_problem(hf_config, tp_size)
    if problem is None:
        return
    heads = _heads(hf_config)[0]
    valid = valid_tp_sizes(hf_config)
    # sizes a user would guess from the head count alone, and why they fail too
    why = [f"{tp_size} {problem}"] + [
        f"{t} divides the {heads} attention heads but {tp_size_problem(hf_config, t)}"
        for t in range(1, heads + 1) if heads % t == 0 and t not in valid and t != tp_size]
    raise ParamError(field, tp_size, f"a tensor-parallel size this model can be split over: "
                                     f"{', '.join(map(str, valid))} ({'; '.join(why)})")
