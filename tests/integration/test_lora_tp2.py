"""LoRA under tensor parallelism (docs/lora.md): two gloo ranks, each with its slice of the base
weights and of every adapter (column-parallel B by output rows, row-parallel A by input
columns, reduced with the base partial sums), give the single rank's logits for a step mixing
two adapters and the base model. Its own file: it spawns processes."""
from __future__ import annotations

import pytest
import torch

from tests.support.grpc_harness import free_port
from tests.support.lora_adapters import lora_prefill_logits, lora_tp_worker, make_adapter
from worker_service.models.tiny_model import make_tiny_model


@pytest.mark.slow
@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}),
    ("qwen3", {})])
def test_lora_tp2_matches_tp1(tmp_path, arch, overrides):
    import torch.multiprocessing as mp

    model = str(make_tiny_model(tmp_path / arch, arch=arch, **overrides))
    adapters = [make_adapter(model, tmp_path / "a0", r=8, alpha=32, seed=1),
                make_adapter(model, tmp_path / "a1", r=4, alpha=8, seed=2,
                             targets=("k_proj", "o_proj", "up_proj"))]
    mp.spawn(lora_tp_worker, args=(free_port(), model, adapters, str(tmp_path)), nprocs=2)
    expected = lora_prefill_logits(model, adapters)
    for rank in range(2):
        got = torch.load(tmp_path / f"lora_logits_{rank}.pt")
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
