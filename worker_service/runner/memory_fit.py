"""Whether a model's weights and its KV cache fit this machine: estimated from config.json and
the Init's settings before anything is loaded or allocated (issue 23: a config.json with
hidden_size 10^7 passed every other check and the worker was OOM-killed at 11 GB; kv_cache_bytes
2^62 failed with "Cannot allocate memory" after the epoch and owner had changed).

    weights   per rank: the embedding (and an untied LM head), then per layer the attention
              projections q, k, v, o (DeepSeek's latent attention: the class counts its own),
              the MLP's matrices (three gated, StarCoder2's two) and
              two norms, in the weights' dtype, divided by tp_size (a lower bound: layers not
              split, buffers and the loader's transient copies come on top); on the CPU also
              what the routed experts' panels (kernels/cpu/moe_experts.py) hold beyond the
              dense experts counted above, which they replace: their padding to whole panels
              and a bfloat16 GPT-OSS layer's float32 biases; the dense linears' panels and
              packs (cpu_linear_memory.py: one copy more of each, two of a tied head); a
              GPTQ / AWQ checkpoint's dense linears
              kept packed on the CPU (--cpu-quantized-weights native) at their packed size
              (quant_memory.py)
    LoRA      per rank: the stacks the LoRA flags allow, every slot at --max-lora-rank on
              every served projection and routed expert (lora_memory.py: the allocation's
              own shapes); docs/lora.md, "Memory"
    KV cache  per rank: num_kv_blocks x the block's bytes (in --kv-cache-dtype's element:
              fp8 one byte; kv_cache_dims: DeepSeek caches one
              latent head per token, on every rank) when set, else kv_cache_bytes (1 GiB
              unset); on CUDA with gpu_memory_utilization it is sized from what is free after
              loading less the LoRA stacks to come, so only the weights and stacks are checked
    machine   CPU: the host's physical memory, shared by the node's local ranks; CUDA: each
              rank's device memory

More than the machine has is refused (DoesNotFit: FAILED_PRECONDITION), naming each estimate
(and the LoRA flags) and the machine's memory. What fits the estimate may still fail to load (the estimate is a lower
bound); that failure comes after the old model is released, as any failed load does.
"""
from __future__ import annotations

import os

import torch

from engine_common.model_files.model_dir import ModelInfo
from kernels.cpu import linear as cpu_linear, onednn_gemm
from kernels.cpu.moe_experts import bytes_beyond_weights
from worker_service.config import RunnerConfig, rank_device
from worker_service.failures import DoesNotFit
from worker_service.models.loader import kv_cache_halves, resolve_dtype
from worker_service.runner.kv_dtype import kv_cache_dtype
from worker_service.lora.load import lora_slots
from worker_service.runner.lora_memory import (lora_count_flag, lora_flags_text,
                                               lora_stack_bytes)
from worker_service.layers import quant_linear
from worker_service.runner import config_shape as shape
from worker_service.runner.cpu_linear_memory import extra_copy_bytes, screen_bytes
from worker_service.runner.quant_memory import native_bytes_per_param, native_saving

GIB = 1 << 30
MIB = 1 << 20


def estimate_weight_bytes(hf_config: dict, element_bytes: int, tp_size: int = 1,
                          native_quant: bool = False) -> int:
    """A lower bound on one rank's weight bytes for a Llama/Qwen-shaped config (the
    architecture's class says how many matrices its dense MLP has and whether an absent
    tie_word_embeddings ties the head). native_quant: a GPTQ / AWQ checkpoint's dense linears
    counted at their packed size (quant_memory.py)."""
    model_class = shape.model_class(hf_config)
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = shape.head_dim(hf_config)
    inter = int(hf_config.get("intermediate_size") or 4 * hidden)
    vocab = int(hf_config["vocab_size"])
    layers = int(hf_config["num_hidden_layers"])
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    own_attention = getattr(model_class, "attention_elements", None)   # MLA (DeepSeek)
    if own_attention is not None:
        attention = own_attention(hf_config)
    dense_mlp = getattr(model_class, "mlp_matrices", 3) * hidden * inter
    mlps = sum(_moe_mlp_elements(hf_config, i) or dense_mlp for i in range(layers))
    tied = hf_config.get("tie_word_embeddings", getattr(model_class, "tie_by_default", False))
    heads_out = 1 if tied else 2
    elements = layers * (attention + 2 * hidden) + mlps + heads_out * vocab * hidden + hidden
    saving = 0
    if native_quant:
        dense_linear = layers * (attention if own_attention is None else 0) + sum(
            0 if _moe_mlp_elements(hf_config, i) else dense_mlp for i in range(layers))
        saving = native_saving(hf_config, element_bytes, dense_linear, tp_size)
    return elements * element_bytes // tp_size - saving


def kv_cache_dims(hf_config: dict) -> tuple[int, int]:
    """(kv heads, head size) of the KV cache, all ranks together: the architecture's own
    (DeepSeek's one latent head) or the config's."""
    own = getattr(shape.model_class(hf_config), "kv_cache_dims", None)
    if own is not None:
        return own(hf_config)
    heads = int(hf_config["num_attention_heads"])
    return int(hf_config.get("num_key_value_heads") or heads), shape.head_dim(hf_config)


def kv_value_dim(hf_config: dict) -> int:
    """The dims of each cached value row the attention reads: the architecture's own (DeepSeek:
    its latent's first kv_lora_rank) or 0 (the whole head)."""
    own = getattr(shape.model_class(hf_config), "kv_value_dim", None)
    return own(hf_config) if own is not None else 0


def _moe_mlp_elements(hf_config: dict, layer: int) -> int | None:
    """A sparse layer's MLP elements (every expert, the router, a shared expert and its gate),
    or None for a dense one: an MoE model's experts are most of its weights."""
    moe = shape.moe_args(hf_config)
    if moe is None or not moe.is_sparse(layer):
        return None
    hidden = moe.hidden_size
    return (moe.num_experts * 3 * hidden * moe.moe_intermediate_size + moe.num_experts * hidden
            + 3 * hidden * moe.shared_expert_intermediate_size
            + (hidden if moe.shared_expert_intermediate_size else 0))


def estimate_cpu_packed_bytes(hf_config: dict, dtype: torch.dtype, tp_size: int = 1) -> int:
    """One rank's bytes of CPU-packed experts beyond their dense weights (the panels replace
    the parameters): kernels/cpu/moe_experts.bytes_beyond_weights for every sparse layer (0
    for a dense model or a dtype the kernel does not take). Counted also where the experts
    stay unpacked (no C++ extension built, fused_moe forced): over, never under."""
    moe = shape.moe_args(hf_config)
    if moe is None:
        return 0
    sparse = sum(moe.is_sparse(i) for i in range(int(hf_config["num_hidden_layers"])))
    biases = getattr(shape.model_class(hf_config), "expert_biases", False)
    return sparse * bytes_beyond_weights(moe.num_experts, moe.hidden_size,
                                         moe.moe_intermediate_size // tp_size, dtype, biases)


def estimate_kv_bytes(config: RunnerConfig, hf_config: dict, element_bytes: int,
                      tp_size: int = 1) -> int | None:
    """One rank's KV-cache bytes; None when it is profiled from free memory (CUDA with
    gpu_memory_utilization)."""
    if config.num_kv_blocks is not None:
        kv_heads, head_dim = kv_cache_dims(hf_config)
        halves = kv_cache_halves(shape.model_class(hf_config))
        block = (halves * int(hf_config["num_hidden_layers"]) * config.block_size
                 * max(1, kv_heads // tp_size) * head_dim * element_bytes)
        return config.num_kv_blocks * block
    if config.gpu_memory_utilization is not None:
        return None
    return config.kv_budget_bytes


def estimate_cpu_linear_bytes(hf_config: dict, dtype: torch.dtype, tp_size: int = 1,
                              native_quant: bool = False) -> int:
    """One rank's bytes beyond estimate_weight_bytes that the CPU GEMMs' panels and packs
    of its dense linears hold (cpu_linear_memory.py): the attention projections (a latent
    attention's but kv_b) and dense MLPs unless kept natively quantized, shared experts, the
    head."""
    model_class = shape.model_class(hf_config)
    hidden = int(hf_config["hidden_size"])
    layers = int(hf_config["num_hidden_layers"])
    inter = int(hf_config.get("intermediate_size") or 4 * hidden)
    dense_mlp = getattr(model_class, "mlp_matrices", 3) * hidden * inter
    moe = shape.moe_args(hf_config)
    sparse = [moe is not None and moe.is_sparse(i) for i in range(layers)]
    elements = 0
    if not (native_quant and native_bytes_per_param(
            hf_config, torch.empty((), dtype=dtype).element_size()) is not None):
        elements += layers * _attention_linear_elements(hf_config, model_class, tp_size)
        elements += dense_mlp * sparse.count(False)
    if moe is not None:
        elements += sum(sparse) * 3 * moe.hidden_size * moe.shared_expert_intermediate_size
    # a pooling-only model's head is never prepared (cpu_kernels.use_cpu_kernels)
    head = 0 if getattr(model_class, "pooling_only", False) else int(
        hf_config["vocab_size"]) * hidden
    tied = hf_config.get("tie_word_embeddings", getattr(model_class, "tie_by_default", False))
    screened = (dtype == torch.float32 and tp_size == 1 and head
                and int(hf_config["vocab_size"]) >= cpu_linear.TILED_FROM_N
                and cpu_linear.screens_heads())
    return (extra_copy_bytes(elements + (0 if tied else head), head if tied else 0, dtype,
                             onednn_gemm.wanted(dtype))
            + (screen_bytes(head, tied) if screened else 0)) // tp_size


def _attention_linear_elements(hf_config: dict, model_class, tp_size: int) -> int:
    """One layer's attention weights run as CPU linears, all ranks together, what each rank
    holds whole counted once per rank: k / v when there are fewer kv heads than ranks (each
    keeps one), a latent attention's q_a / kv_a (its kv_b is no linear)."""
    own = getattr(model_class, "attention_linear_elements", None)   # MLA
    if own is not None:
        return own(hf_config) + (tp_size - 1) * model_class.replicated_attention_elements(
            hf_config)
    hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    return 2 * hidden * (heads + max(kv_heads, tp_size)) * shape.head_dim(hf_config)


def kv_room_bytes(config: RunnerConfig, info: ModelInfo, tp_size: int, num_local_ranks: int,
                  machine_bytes: int | None = None) -> tuple[int, int, int] | None:
    """(the most KV-cache bytes per rank the machine leaves beside the weights and the LoRA
    stacks, the weights' estimate, the CPU kernels' packed copies' part of it: experts and
    linears); None when the machine's memory is unknown."""
    device = torch.device(config.device).type
    dtype = resolve_dtype(info.hf_config, config.dtype, info.path)
    element = torch.empty((), dtype=dtype).element_size()
    native = device == "cpu" and config.cpu_quantized_weights == "native" \
        and dtype in quant_linear.NATIVE_DTYPES
    packed = (estimate_cpu_packed_bytes(info.hf_config, dtype, tp_size)
              + estimate_cpu_linear_bytes(info.hf_config, dtype, tp_size, native)
              if device == "cpu" else 0)
    weights = estimate_weight_bytes(info.hf_config, element, tp_size, native) + packed
    have = machine_bytes if machine_bytes is not None else _machine_bytes(config.device)
    if not have:
        return None
    sharing = num_local_ranks if device == "cpu" else 1
    return have // sharing - weights - lora_bytes(config, info, tp_size), weights, packed


def lora_bytes(config: RunnerConfig, info: ModelInfo, tp_size: int) -> int:
    """One rank's LoRA stacks at the most the flags allow (lora_memory.py), in the model's
    dtype."""
    element = torch.empty((), dtype=resolve_dtype(info.hf_config, config.dtype,
                                                  info.path)).element_size()
    return lora_stack_bytes(info.hf_config, lora_slots(config), config.max_lora_rank, element,
                            tp_size)


def check_memory_fits(config: RunnerConfig, info: ModelInfo, tp_size: int,
                      num_local_ranks: int, machine_bytes: int | None = None) -> None:
    """DoesNotFit when the node's ranks would need more than the machine has."""
    device = torch.device(config.device).type
    have = machine_bytes if machine_bytes is not None else _machine_bytes(config.device)
    room = kv_room_bytes(config, info, tp_size, num_local_ranks, have)
    if room is None:
        return
    room_bytes, weights, packed = room
    dtype = kv_cache_dtype(config.kv_cache_dtype,
                           resolve_dtype(info.hf_config, config.dtype, info.path), device)
    element = torch.empty((), dtype=dtype).element_size()      # fp8 caches: 1 byte a value
    kv = estimate_kv_bytes(config, info.hf_config, element, tp_size)
    if (kv or 0) <= room_bytes:
        return
    sharing = num_local_ranks if device == "cpu" else 1
    kv_text = "sized from free memory" if kv is None else _size(kv)
    packed_text = f" ({_size(packed)} of it the CPU kernels' packed copies)" if packed else ""
    lora, num_slots = lora_bytes(config, info, tp_size), lora_slots(config)
    lora_text = (f", its LoRA stacks {_size(lora)} ({lora_flags_text(config, num_slots)})"
                 if lora else "")
    # only the flag that set the slot count, and the rank's
    lora_flags = (f"; {lora_count_flag(config, num_slots)} or --max-lora-rank" if lora else "")
    where = (f"this machine's {_size(have)} of memory" if device == "cpu"
             else f"{config.device}'s {_size(have)}")
    ranks = f" x {sharing} local ranks" if sharing > 1 else ""
    raise DoesNotFit(f"model_dir={config.model_dir!r} does not fit: its weights need about "
                     f"{_size(weights)}{packed_text}{lora_text} and its KV cache {kv_text} per "
                     f"rank{ranks}, more than {where} (lower kv_cache_bytes or num_kv_blocks"
                     f"{lora_flags}, or raise tp_size)")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB // 10 else f"{num_bytes / MIB:.1f} MiB"


def _machine_bytes(device: str) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(rank_device(device, 0)).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
