"""What an Init's settings must pass before a worker lets go of the model it holds.

`check_runner_config` runs every check a ModelRunner would make before loading weights, without
loading or allocating anything: the model directory and its config (architecture, vocabulary,
max_model_len within max_position_embeddings), the dtype, the attention backend on this device
type, fused ops, and the host memory the persistent batch would take. A failure raises
ValueError (a refused setting: INVALID_ARGUMENT) or NotImplementedError (a choice this device
cannot run: UNIMPLEMENTED), naming the field and the value. The weights themselves are read only
once the old model is released; a checkpoint that fails to load then leaves the worker without a
model (reported like any failed Init).
"""
from __future__ import annotations

import os

import torch

from engine_common.model_files.model_dir import ModelInfo
from kernels.attention.selector import get_attention_backend
from worker_service.config import RunnerConfig
from worker_service.models.loader import check_fused_ops_device
from worker_service.models.registry import get_model_class
from worker_service.runner.model_runner import cache_layout

# The persistent batch may take at most this share of the machine's memory.
_MAX_BATCH_MEMORY_SHARE = 0.5
# Host bytes of one (request, position) cell across the batch's per-token arrays (int64 ids).
_BYTES_PER_TOKEN_CELL = 8


def check_runner_config(config: RunnerConfig, tp_size: int = 1) -> ModelInfo:
    """Raise unless a ModelRunner (one rank of tp_size) could be built from `config`; returns
    the model's info (its max_model_len resolved)."""
    info = ModelInfo.from_dir(config.model_dir, config.max_model_len)
    get_model_class(info.architecture, info.hf_config.get("auto_map"))
    layout = cache_layout(info.hf_config, config, tp_size)
    device_type = torch.device(config.device).type
    try:
        get_attention_backend(config.attention_backend, device_type, layout)
    except ImportError as e:
        raise NotImplementedError(f"attention_backend={config.attention_backend!r} cannot run "
                                  f"here: {e}") from None
    if config.fused_ops:
        check_fused_ops_device(config.device)
    check_batch_memory(config.max_num_seqs, info.max_model_len)
    return info


def check_batch_memory(max_num_seqs: int, max_model_len: int,
                       total_bytes: int | None = None) -> None:
    """ValueError when the persistent batch (max_num_seqs rows of max_model_len token ids)
    would take more than half of the machine's memory."""
    total = total_bytes if total_bytes is not None else _physical_memory_bytes()
    need = max_num_seqs * max_model_len * _BYTES_PER_TOKEN_CELL
    if total and need > _MAX_BATCH_MEMORY_SHARE * total:
        raise ValueError(f"max_num_seqs={max_num_seqs} is invalid with max_model_len="
                         f"{max_model_len}: the batch's token table would take "
                         f"{need / 2**30:.1f} GiB, more than half of this machine's "
                         f"{total / 2**30:.1f} GiB")


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
