"""LoRA under tensor parallelism (docs/lora.md): two gloo ranks, each with its slice of the base
weights and of every adapter (column-parallel B by output rows, row-parallel A by input
columns, reduced with the base partial sums; Phi-3's fused qkv_proj / gate_up_proj adapters cut
by rows first), give the single rank's logits for a step mixing
two adapters and the base model. Its own file: it spawns processes."""
from __future__ import annotations

import pytest
import torch

from tests.support.grpc_harness import free_port
from tests.support.lora_adapters import (ALL_TARGETS, lora_prefill_logits, lora_tp_worker,
                                         make_adapter)
from worker_service.models.tiny_model import make_tiny_model

PHI3 = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.mark.slow
@pytest.mark.parametrize("arch,overrides,targets", [
    ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
     (ALL_TARGETS, ("k_proj", "o_proj", "up_proj"))),
    ("qwen3", {}, (ALL_TARGETS, ("k_proj", "o_proj", "up_proj"))),
    # fused checkpoint projections: lora_B of qkv_proj / gate_up_proj cut by rows, then sharded
    ("phi3", {"num_key_value_heads": 2}, (PHI3, ("qkv_proj", "down_proj")))])
def test_lora_tp2_matches_tp1(tmp_path, arch, overrides, targets):
    import torch.multiprocessing as mp

    model = str(make_tiny_model(tmp_path / arch, arch=arch, **overrides))
    adapters = [make_adapter(model, tmp_path / "a0", r=8, alpha=32, seed=1, targets=targets[0]),
                make_adapter(model, tmp_path / "a1", r=4, alpha=8, seed=2, targets=targets[1])]
    mp.spawn(lora_tp_worker, args=(free_port(), model, adapters, str(tmp_path)), nprocs=2)
    expected = lora_prefill_logits(model, adapters)
    for rank in range(2):
        got = torch.load(tmp_path / f"lora_logits_{rank}.pt")
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [3, 1], ids=["gqa-kv-split", "kv-replicated"])
def test_phi3_fused_lora_tp3_matches_tp1(tmp_path, kv_heads):
    """Three ranks over Phi-3's fused qkv_proj: 6 q heads and 3 (one per rank) or 1 (every
    rank a copy) kv heads. lora_B is cut on the q / k / v boundaries first, then each piece
    by heads, so each rank's rows are its own heads' (a cut of the fused rows in thirds would
    give rank 0 q rows only)."""
    import torch.multiprocessing as mp

    model = str(make_tiny_model(tmp_path / "phi3", arch="phi3", hidden_size=96,
                                num_attention_heads=6, num_key_value_heads=kv_heads,
                                head_dim=16, intermediate_size=192))
    adapters = [make_adapter(model, tmp_path / "a0", r=8, alpha=32, seed=1, targets=PHI3),
                make_adapter(model, tmp_path / "a1", r=4, alpha=8, seed=2,
                             targets=("qkv_proj",))]
    mp.spawn(lora_tp_worker, args=(free_port(), model, adapters, str(tmp_path), 3), nprocs=3)
    expected = lora_prefill_logits(model, adapters)
    for rank in range(3):
        got = torch.load(tmp_path / f"lora_logits_{rank}.pt")
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
