"""The weight bytes a GPTQ / AWQ checkpoint keeps on the CPU with native quantized weights
(layers/quant_linear.py), for the memory estimate (memory_fit.kv_room_bytes): each dense
linear parameter (attention projections, a dense MLP's matrices) costs bits / 8 bytes plus its
group's scale and zero in the model dtype, instead of the dtype's size. MoE experts, embeddings,
the LM head, norms and a DeepSeek latent attention stay dequantized, and are counted so.
"""
from __future__ import annotations

from engine_common.model_files.weight_quant import weight_quant
from worker_service.layers.quant_linear import KERNEL_GROUPS


def native_bytes_per_param(hf_config: dict, element_bytes: int) -> float | None:
    """Bytes a natively kept linear parameter costs, or None when the checkpoint's linears are
    dequantized (not GPTQ / AWQ, act order, or no kernel for its bits and groups)."""
    quant = weight_quant(hf_config)
    if quant is None or quant.method not in ("gptq", "awq") or quant.desc_act:
        return None
    if quant.bits == 8:
        return 1.0 if quant.group_size == -1 else None
    if quant.group_size == -1:
        return 0.5 + 2 * element_bytes / KERNEL_GROUPS[0]
    group = next((g for g in KERNEL_GROUPS if quant.group_size % g == 0), None)
    return None if group is None else 0.5 + 2 * element_bytes / group


def native_saving(hf_config: dict, element_bytes: int, dense_linear_elements: int,
                  tp_size: int) -> int:
    """Bytes per rank the packed linears save against the dequantized estimate (0 when
    none are kept packed)."""
    per_param = native_bytes_per_param(hf_config, element_bytes)
    if per_param is None or per_param >= element_bytes:
        return 0
    return int(dense_linear_elements * (element_bytes - per_param)) // tp_size
