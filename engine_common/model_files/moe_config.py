"""The mixture-of-experts fields of a config.json that no model could be built from, found when
the model directory is first read (ModelInfo.from_dir), so `deltaserve serve` and the scheduler
refuse them before any worker starts rather than at the worker's Init.

With experts (num_experts, or transformers 5's num_local_experts, above 0) a token is routed to
num_experts_per_tok of them, each of width moe_intermediate_size:

    num_experts / num_local_experts   >= 0 (0: no sparse layer, every MLP dense; see below)
    num_experts_per_tok               in [1, the expert count]
    moe_intermediate_size             >= 1

Zero experts, per class served (worker_service/models/registry.py): transformers'
Qwen2MoeDecoderLayer and Qwen3MoeDecoderLayer build the sparse block only when num_experts > 0
(5.x, modeling_qwen{2,3}_moe.py), else the dense MLP of width intermediate_size (Qwen2-MoE
without its shared expert), and so does models/qwen_moe.MoeArgs.is_sparse: such a config is
the dense model, served as transformers runs it (tests/integration/test_moe_config_variants.py).
An MoE class whose transformers model cannot run without experts must refuse 0 here: Mixtral
and GPT-OSS (every layer sparse; their experts are intermediate_size wide, they have no
moe_intermediate_size).
"""
from __future__ import annotations

EXPERT_FIELDS = ("num_experts", "num_local_experts")


def moe_config_problem(config: dict) -> str | None:
    """Why these MoE fields cannot be served ("<field>=<value> is invalid: must be ..."), or None
    (also for a config without experts)."""
    for name in (*EXPERT_FIELDS, "num_experts_per_tok", "moe_intermediate_size"):
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{name}={value!r} is invalid: must be an integer"
    field = next((f for f in EXPERT_FIELDS if f in config), None)
    if field is None:
        return None
    experts = config[field] or 0
    least = 1 if experts_are_the_mlp(config) else 0
    if experts < least:
        return f"{field}={experts} is invalid: must be >= {least}"
    if experts == 0:
        return None
    top_k = config.get("num_experts_per_tok")
    if top_k is None or not 1 <= top_k <= experts:
        return (f"num_experts_per_tok={top_k} is invalid: must be in [1, {field}={experts}]")
    width = expert_width_field(config)
    inter = config.get(width)
    if inter is not None and (isinstance(inter, bool) or not isinstance(inter, int)):
        return f"{width}={inter!r} is invalid: must be an integer"
    if inter is None or inter < 1:
        return f"{width}={inter} is invalid: must be >= 1"
    return None


def is_mixtral(config: dict) -> bool:
    return "MixtralForCausalLM" in (config.get("architectures") or ())


# architectures whose every MLP is sparse, with experts intermediate_size wide
WHOLE_MLP_EXPERTS = ("MixtralForCausalLM", "GptOssForCausalLM")


def experts_are_the_mlp(config: dict) -> bool:
    archs = config.get("architectures") or ()
    return any(arch in archs for arch in WHOLE_MLP_EXPERTS)


def expert_width_field(config: dict) -> str:
    """The config key of an expert's width: Mixtral's and GPT-OSS's experts are their MLPs
    (intermediate_size)."""
    return "intermediate_size" if experts_are_the_mlp(config) else "moe_intermediate_size"
