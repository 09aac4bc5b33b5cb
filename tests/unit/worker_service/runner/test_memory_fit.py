"""runner/memory_fit.py: the weight estimate is a close lower bound of the real checkpoint's
bytes, the KV estimate follows the Init's budget, and what exceeds the machine is refused naming
both estimates and the machine's memory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from engine_common.model_files.model_dir import ModelInfo
from worker_service.config import RunnerConfig
from worker_service.failures import DoesNotFit
from worker_service.runner.memory_fit import (GIB, check_memory_fits, estimate_kv_bytes,
                                              estimate_weight_bytes)


def _checkpoint_elements(model_dir: str) -> int:
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen2_moe", "starcoder2", "gemma",
                                  "smollm3"])
def test_the_weight_estimate_is_a_close_lower_bound(tiny_models, arch):
    """MoE models too: their experts are most of the weights (counting one dense MLP a layer
    passed a model that does not fit); StarCoder2's MLP has two matrices, not three."""
    model_dir = tiny_models(arch)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    real = _checkpoint_elements(model_dir)
    estimate = estimate_weight_bytes(config, 1)
    assert 0.95 * real <= estimate <= real, (estimate, real)
    assert estimate_weight_bytes(config, 2, tp_size=2) == estimate


def test_the_kv_estimate_follows_the_budget(tiny_models):
    model_dir = tiny_models("qwen3")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert estimate_kv_bytes(RunnerConfig(model_dir=model_dir), config, 4) == GIB
    assert estimate_kv_bytes(RunnerConfig(model_dir=model_dir, kv_cache_bytes=5), config, 4) == 5
    by_blocks = RunnerConfig(model_dir=model_dir, num_kv_blocks=10, block_size=16)
    per_block = (2 * config["num_hidden_layers"] * 16 * config["num_key_value_heads"]
                 * config["head_dim"] * 4)
    assert estimate_kv_bytes(by_blocks, config, 4) == 10 * per_block
    profiled = RunnerConfig(model_dir=model_dir, device="cuda", gpu_memory_utilization=0.9)
    assert estimate_kv_bytes(profiled, config, 2) is None


def test_more_than_the_machine_has_is_refused_naming_every_number(tiny_models):
    model_dir = tiny_models("qwen3")
    info = ModelInfo.from_dir(model_dir)
    config = RunnerConfig(model_dir=model_dir, kv_cache_bytes=3 * GIB)
    check_memory_fits(config, info, 1, 1, machine_bytes=4 * GIB)
    with pytest.raises(DoesNotFit, match=r"weights need about [\d.]+ MiB \([\d.]+ MiB of it "
                                         r"the CPU kernels' packed copies\) and its KV cache "
                                         r"3\.00 GiB per rank x 2 local ranks, more than this "
                                         r"machine's 4\.00 GiB of memory"):
        check_memory_fits(config, info, 2, 2, machine_bytes=4 * GIB)


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_a_gemma_without_head_dim_is_estimated_with_the_256_the_model_builds(tiny_models, arch):
    """GemmaConfig / Gemma2Config / Gemma3TextConfig default head_dim to 256, not
    hidden / heads (16 here): the estimates had counted 16-wide heads, 16 times too few KV
    bytes and attention weights."""
    import torch

    from kernels.attention.torch_ref import TorchAttentionBackend
    from worker_service.models.registry import MODEL_REGISTRY
    from worker_service.parallel_state import single_rank_group
    config = json.loads((Path(tiny_models(arch)) / "config.json").read_text())
    del config["head_dim"]
    model = MODEL_REGISTRY[config["architectures"][0]](config, single_rank_group(),
                                                       TorchAttentionBackend(), torch.float32)
    assert model.head_dim == 256
    by_blocks = RunnerConfig(model_dir="m", num_kv_blocks=10, block_size=16)
    assert estimate_kv_bytes(by_blocks, config, 4) == 10 * (
        2 * config["num_hidden_layers"] * 16 * config["num_key_value_heads"] * 256 * 4)
    real = sum(p.numel() for p in model.parameters())
    assert 0.95 * real <= estimate_weight_bytes(config, 1) <= real
