"""The LoRA stacks one worker rank may hold, counted from config.json and the LoRA flags before
anything is loaded (docs/lora.md, "Memory"), so the memory check (memory_fit.py) and the KV
cache's size (on CUDA, the profiled budget: runner_kv_cache.py) leave room for them, as vLLM
allocates its max_loras x max_lora_rank stacks before it profiles the KV cache.

    slots   lora/load.lora_slots: max_cpu_loras when set (the most adapters the workers
            keep; LoRASlots refuses more; the scheduler sets it whenever LoadLora is allowed);
            else the --lora-modules
    rank    --max-lora-rank on every projection the model's family serves (families.py), in
            every layer: attention q/k/v and o, the dense MLPs, a shared expert, and every
            routed expert (gate and up together up to 2 x the rank, lora/stack_shapes.py)
    size    this rank's tensor-parallel shard, in the model's dtype (the stacks' `has` mask one
            byte an expert)

The shapes are lora/stack_shapes.py's, the ones the allocation uses.
"""
from __future__ import annotations

from engine_common.configuration.config import WorkerConfig
from worker_service.lora.families import LORA_TARGETS
from worker_service.lora.load import lora_slots
from worker_service.lora.stack_shapes import dense_bytes, expert_bytes
from worker_service.runner import config_shape as shape


def lora_stack_bytes(hf_config: dict, num_slots: int, rank: int, element_bytes: int,
                     tp_size: int = 1) -> int:
    """One rank's bytes of every LoRA stack for `num_slots` adapters of rank `rank` on every
    projection LoRA serves on this model (0 for a model LoRA refuses: its load names why)."""
    cls = shape.model_class(hf_config)
    if not num_slots or cls is None or cls.__name__ not in LORA_TARGETS:
        return 0
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = shape.head_dim(hf_config)
    q = heads // tp_size * head_dim
    kv = (kv_heads // tp_size if kv_heads >= tp_size else 1) * head_dim  # replicated below TP
    attention = (dense_bytes(element_bytes, num_slots, 3, rank, hidden, q + 2 * kv)
                 + dense_bytes(element_bytes, num_slots, 1, rank, q, hidden))
    up_pieces = 2 if getattr(cls, "mlp_matrices", 3) == 3 else 1    # StarCoder2: c_fc alone

    def mlp(width: int) -> int:        # gate_up (or c_fc), then down (or c_proj)
        w = width // tp_size
        return (dense_bytes(element_bytes, num_slots, up_pieces, rank, hidden, up_pieces * w)
                + dense_bytes(element_bytes, num_slots, 1, rank, w, hidden))

    moe = shape.moe_args(hf_config)
    total = 0
    for layer in range(int(hf_config["num_hidden_layers"])):
        total += attention
        if moe is None or not moe.is_sparse(layer):
            total += mlp(int(hf_config.get("intermediate_size") or 4 * hidden))
            continue
        total += expert_bytes(element_bytes, num_slots, moe.num_experts, moe.hidden_size,
                              moe.moe_intermediate_size // tp_size, 2 * rank, rank)
        if moe.shared_expert_intermediate_size:
            total += mlp(moe.shared_expert_intermediate_size)
    return total


def lora_count_flag(config: WorkerConfig, num_slots: int) -> str:
    """The one flag that set the slot count (lora/load.lora_slots)."""
    if config.max_cpu_loras == num_slots:
        return "--max-cpu-loras"
    return "--lora-modules" if len(config.lora) == num_slots else "--max-loras"


def lora_flags_text(config: WorkerConfig, num_slots: int) -> str:
    """Where the slot count and rank come from, in flags: for a refusal's message."""
    flag = lora_count_flag(config, num_slots)
    slots = (f"the {num_slots} of --lora-modules" if flag == "--lora-modules"
             else f"{flag} {num_slots}")
    adapters = "adapter" if num_slots == 1 else "adapters"
    return f"{num_slots} {adapters} ({slots}) x --max-lora-rank {config.max_lora_rank}"
