"""The LoRA stacks the memory check counts (runner/lora_memory.py) are the bytes the real
allocation takes: a tiny real model of each served family loaded, S adapters of rank R on
every projection it serves held (every routed expert's gate, up and down too), and the sum of
numel x element size over its LoRA layers' stacks equals the figure computed from config.json
and the flags; at TP 2 each rank's shard (kv heads split, and replicated). The stacks have one
slot per held adapter whatever its id, and --max-cpu-loras caps the held adapters."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.attention.torch_ref import TorchAttentionBackend
from worker_service.config import RunnerConfig
from worker_service.lora.adapter import LoRAError, read_adapter
from worker_service.lora.experts import LoRAExperts
from worker_service.lora.families import LORA_TARGETS
from worker_service.lora.layers import LoRALinear, max_adapter_bytes
from worker_service.lora.slots import LoRASlots
from worker_service.models.loader import load_model
from worker_service.parallel_state import TPGroup, single_rank_group
from worker_service.runner.config_shape import model_class
from worker_service.runner.lora_memory import lora_stack_bytes
from worker_service.runner.model_runner import ModelRunner

RANK = 4


def _config(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def full_adapter(model_dir: str, out: Path, r: int = RANK) -> str:
    """A PEFT directory adapting, at rank r, every weight of the checkpoint whose module the
    model's family serves (per-expert gate / up / down of every expert included)."""
    targets = LORA_TARGETS[model_class(_config(model_dir)).__name__]
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                module, _, kind = name.rpartition(".")
                if kind != "weight" or module.rsplit(".", 1)[-1] not in targets:
                    continue
                fan_out, fan_in = f.get_slice(name).get_shape()
                prefix = f"base_model.model.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen)
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets),
        "bias": "none", "fan_in_fan_out": False}))
    return str(out)


def _load(model_dir: str, tp: TPGroup, dtype=None):
    return load_model(model_dir, tp, TorchAttentionBackend(), "cpu", dtype)


def _held(model, adapter_dir: str, ids: list[int], capacity: int | None = None) -> LoRASlots:
    targets = LORA_TARGETS[type(model).__name__]
    adapter = read_adapter("full", adapter_dir, RANK, max_adapter_bytes(model, RANK), targets)
    return LoRASlots(model, RANK, {i - 1: adapter for i in ids}, capacity)


def allocated_bytes(model) -> int:
    """numel x element size of every LoRA stack the model's layers hold, and how many of each
    kind of layer hold them."""
    total, kinds = 0, set()
    for m in model.modules():
        if isinstance(m, LoRALinear):
            stacks, kind = (m.lora_a, m.lora_b), "dense"
        elif isinstance(m, LoRAExperts):
            stacks, kind = (m.a13, m.b13, m.a2, m.b2, m.has), "experts"
        else:
            continue
        kinds.add(kind)
        total += sum(t.numel() * t.element_size() for t in stacks)
    return total, kinds


@pytest.mark.parametrize("arch, overrides", [
    ("qwen3", {}), ("gemma", {}), ("phi3", {}), ("starcoder2", {}), ("glm", {}),
    ("qwen3_moe", {"mlp_only_layers": [1]}), ("qwen2_moe", {}), ("mixtral", {})])
def test_the_figure_is_what_the_stacks_take(tiny_models, tmp_path, arch, overrides):
    """Three adapters, every projection: dense stacks and, on MoE models, expert stacks (gate
    and up at 2 R); Qwen3-MoE with a dense layer, Qwen2-MoE with its shared expert."""
    model_dir = tiny_models(arch, **overrides)
    model = _load(model_dir, single_rank_group())
    slots = _held(model, full_adapter(model_dir, tmp_path / "a"), [1, 2, 3])
    real, kinds = allocated_bytes(model)
    moe = arch.endswith("_moe") or arch == "mixtral"
    assert kinds == ({"dense", "experts"} if moe else {"dense"})
    assert real == lora_stack_bytes(_config(model_dir), 3, RANK, 4) == slots.stack_bytes()
    assert lora_stack_bytes(_config(model_dir), 1, RANK, 4) < real


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_bfloat16_stacks(tiny_models, tmp_path, arch):
    model_dir = tiny_models(arch)
    model = _load(model_dir, single_rank_group(), torch.bfloat16)
    _held(model, full_adapter(model_dir, tmp_path / "a"), [1, 2])
    assert allocated_bytes(model)[0] == lora_stack_bytes(_config(model_dir), 2, RANK, 2)


@pytest.mark.parametrize("arch, overrides", [("qwen3", {}), ("qwen3", {"num_key_value_heads": 1}),
                                             ("qwen3_moe", {}), ("phi3", {})])
def test_each_tensor_parallel_rank_holds_its_shard(tiny_models, tmp_path, arch, overrides):
    """Built as rank 0 and rank 1 of 2 (no collective runs: only the stacks are built): q,
    gate / up rows and o / down columns split, one kv head replicated on both ranks."""
    model_dir = tiny_models(arch, **overrides)
    adapter = full_adapter(model_dir, tmp_path / "a")
    figure = lora_stack_bytes(_config(model_dir), 2, RANK, 4, tp_size=2)
    for rank in (0, 1):
        model = _load(model_dir, TPGroup(rank=rank, world_size=2))
        _held(model, adapter, [1, 2])
        assert allocated_bytes(model)[0] == figure
    assert figure < lora_stack_bytes(_config(model_dir), 2, RANK, 4)


def test_one_slot_per_held_adapter_whatever_its_id(tiny_models, tmp_path):
    """Ids 7 and 900 (an LRU of --max-cpu-loras 2 among many served adapters) take two slots,
    not 900; a third adapter past capacity 2 is refused naming the setting, nothing changed;
    reloading a held id is not a new one."""
    model_dir = tiny_models("qwen3")
    model = _load(model_dir, single_rank_group())
    adapter = full_adapter(model_dir, tmp_path / "a")
    slots = _held(model, adapter, [7, 900], capacity=2)
    assert allocated_bytes(model)[0] == lora_stack_bytes(_config(model_dir), 2, RANK, 4)
    with pytest.raises(LoRAError, match=r"lora_id=3 is invalid: this rank holds 2 LoRA "
                                        r"adapter\(s\), the most --max-cpu-loras 2 allows"):
        slots.load(3, "third", adapter)
    assert sorted(slots.adapters) == [6, 899]
    slots.load(900, "again", adapter)
    slots.unload(7)
    slots.load(3, "third", adapter)
    assert sorted(slots.adapters) == [2, 899]
    assert allocated_bytes(model)[0] == lora_stack_bytes(_config(model_dir), 2, RANK, 4)


def test_the_runner_knows_what_its_stacks_may_take(tiny_models, tmp_path):
    """A ModelRunner started with one full adapter of rank --max-lora-rank: its bound (what a
    profiled CUDA KV budget leaves free, less what is held) is the figure, and the stacks it
    holds are all of it: nothing is left to reserve."""
    model_dir = tiny_models("qwen3_moe")
    adapter = full_adapter(model_dir, tmp_path / "a")
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, enable_lora=True,
                                      lora_modules=f"a={adapter}", max_lora_rank=RANK))
    figure = lora_stack_bytes(_config(model_dir), 1, RANK, 4)
    assert runner.lora_bound_bytes == figure == runner.lora.stack_bytes()
    runner.lora.unload(1)
    assert runner.lora.stack_bytes() == 0 and runner.lora_bound_bytes == figure


def test_the_cuda_profile_is_told_the_reserve_and_the_flags_behind_it(tiny_models, tmp_path,
                                                                      monkeypatch):
    """profile_runner (CUDA only to run) hands the profiler the stacks still to come and the
    flags that set their size, for its error: here a runtime-updating Init's capacity of 2
    (--max-cpu-loras), one adapter held (the profiler itself replaced: it needs a GPU)."""
    from worker_service.runner import runner_profile

    model_dir = tiny_models("qwen3_moe")
    adapter = full_adapter(model_dir, tmp_path / "a")
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, enable_lora=True,
                                      allow_runtime_lora_updating=True, max_cpu_loras=2,
                                      max_lora_rank=RANK))
    runner.lora.load(1, "a", adapter)
    seen = {}
    monkeypatch.setattr(runner_profile, "profile_kv_memory",
                        lambda *args: seen.setdefault("args", args))
    runner_profile.profile_runner(runner, 0.5)
    *_, reserve, flags = seen["args"]
    assert reserve == lora_stack_bytes(_config(model_dir), 1, RANK, 4)   # the second slot
    assert flags == f"2 adapters (--max-cpu-loras 2) x --max-lora-rank {RANK}"
