"""The memory check counts the LoRA stacks the flags allow (runner/lora_memory.py) beside the
weights and the KV cache: a config whose weights + stacks + KV cache exceed the machine is
refused at Init naming the flags and each part's bytes, the same one with room for them
passes; the slot count follows --max-cpu-loras, the --lora-modules and --max-loras; on CUDA
the profiled KV budget leaves the stacks still to come free."""
from __future__ import annotations

import pytest

from engine_common.configuration.config import WorkerConfig
from engine_common.configuration.settings import from_proto, to_proto
from engine_common.model_files.model_dir import ModelInfo
from engine_common.wire.protos import worker_pb2
from tests.support.fake_ranks import LAYOUT, FakeRanks, runner_config
from worker_service.config import RunnerConfig
from worker_service.failures import DoesNotFit
from worker_service.lora.load import lora_slots
from worker_service.runner.kv_profiler import KVCacheTooSmall, KVMemoryProfile
from worker_service.runner.memory_fit import (GIB, MIB, _machine_bytes, check_memory_fits,
                                              kv_room_bytes, lora_bytes)
from worker_service.runner.lora_memory import lora_flags_text, lora_stack_bytes
from worker_service.service.node_worker import NodeWorker

LORA = dict(enable_lora=True, allow_runtime_lora_updating=True, max_cpu_loras=4,
            max_lora_rank=16)


def _parts(model_dir: str, **fields) -> tuple[ModelInfo, int, int]:
    """(info, the weights' estimate, the LoRA stacks') of a config of model_dir."""
    info = ModelInfo.from_dir(model_dir)
    config = RunnerConfig(model_dir=model_dir, **fields)
    return info, kv_room_bytes(config, info, 1, 1, 1 << 50)[1], lora_bytes(config, info, 1)


def test_weights_lora_and_kv_beyond_the_machine_are_refused_naming_the_flags(tiny_models):
    """Qwen3-MoE: 4 adapters of rank 16 on every expert and projection. One byte less than
    weights + stacks + KV cache is refused; exactly that much passes; without LoRA the same
    machine has room to spare."""
    model_dir = tiny_models("qwen3_moe")
    info, weights, lora = _parts(model_dir, **LORA)
    element = 4                                               # the tiny model is float32
    assert lora == lora_stack_bytes(info.hf_config, 4, 16, element) > 0
    kv = 64 * MIB
    config = RunnerConfig(model_dir=model_dir, kv_cache_bytes=kv, **LORA)
    check_memory_fits(config, info, 1, 1, machine_bytes=weights + lora + kv)
    with pytest.raises(DoesNotFit, match=(
            rf"its weights need about [\d.]+ MiB \([\d.]+ MiB of it the CPU kernels' packed "
            rf"copies\), its LoRA stacks {lora / MIB:.1f} MiB \(4 adapters \(--max-cpu-loras "
            rf"4\) x --max-lora-rank 16\) and its KV cache 64\.0 MiB per rank, more than "
            rf"this machine's [\d.]+ MiB of memory \(lower kv_cache_bytes or num_kv_blocks; "
            rf"--max-cpu-loras or --max-lora-rank, or raise tp_size\)")):
        check_memory_fits(config, info, 1, 1, machine_bytes=weights + lora + kv - 1)
    plain = RunnerConfig(model_dir=model_dir, kv_cache_bytes=kv)
    check_memory_fits(plain, info, 1, 1, machine_bytes=weights + lora + kv - 1)


def test_the_slots_follow_the_flags(tiny_models):
    """--max-cpu-loras; else the --lora-modules (at least --max-loras with runtime updating);
    no LoRA, none. Twice the rank, twice the bytes; TP 2 about half."""
    model_dir = tiny_models("qwen3")
    modules = "a=/x/a b=/x/b c=/x/c"

    def slots(**fields) -> int:
        return lora_slots(RunnerConfig(model_dir=model_dir, **fields))

    assert slots() == 0
    assert slots(enable_lora=True, lora_modules=modules, max_loras=2) == 3
    assert slots(enable_lora=True, allow_runtime_lora_updating=True, max_loras=2) == 2
    assert slots(enable_lora=True, lora_modules=modules, allow_runtime_lora_updating=True,
                 max_loras=5) == 5
    assert slots(enable_lora=True, max_cpu_loras=7, max_loras=2,
                 allow_runtime_lora_updating=True) == 7
    cfg = ModelInfo.from_dir(model_dir).hf_config
    assert lora_stack_bytes(cfg, 3, 32, 4) == 2 * lora_stack_bytes(cfg, 3, 16, 4)
    assert lora_stack_bytes(cfg, 3, 16, 4) == 3 * lora_stack_bytes(cfg, 1, 16, 4)
    assert lora_stack_bytes(cfg, 0, 16, 4) == 0


def test_a_worker_init_is_refused_before_anything_changes(tiny_models):
    """NodeWorker.init on this machine: a KV cache that fits beside the weights alone but not
    beside the stacks of --max-lora-rank 512 and as many --max-cpu-loras as fill about half
    the machine is refused (DoesNotFit: FAILED_PRECONDITION), the running model, epoch and
    owner kept; the same KV cache without LoRA is accepted."""
    model_dir = tiny_models("qwen3_moe")
    have = _machine_bytes("cpu")
    per_slot = lora_stack_bytes(ModelInfo.from_dir(model_dir).hf_config, 1, 512, 4)
    num_slots = max(1, min(1024, have // 2 // per_slot))
    big = dict(LORA, max_cpu_loras=num_slots, max_lora_rank=512)
    _, weights, lora = _parts(model_dir, **big)
    assert lora == num_slots * per_slot and weights + lora < have      # the stacks fit alone
    kv = have - weights - lora // 2
    ranks = FakeRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(runner_config(model_dir), LAYOUT, epoch=5, owner="A")
    before = (w.epoch, w.fence.owner, ranks.num_model_loads)
    with pytest.raises(DoesNotFit, match=rf"its LoRA stacks [\d.]+ GiB \({num_slots} adapters "
                                         rf"\(--max-cpu-loras {num_slots}\) x --max-lora-rank "
                                         r"512\)"):
        w.init(runner_config(model_dir, kv_cache_bytes=kv, **big), LAYOUT, epoch=6, owner="B")
    assert (w.epoch, w.fence.owner, ranks.num_model_loads) == before
    w.init(runner_config(model_dir, kv_cache_bytes=kv), LAYOUT, epoch=6, owner="B")
    assert w.epoch == 6


def test_the_cuda_budget_leaves_the_stacks_to_come():
    prof = KVMemoryProfile(total_bytes=8 * GIB, gpu_memory_utilization=1.0, used_bytes=3 * GIB,
                           peak_activation_bytes=GIB, graph_reserve_bytes=0,
                           kv_block_bytes=1 << 20, lora_reserve_bytes=2 * GIB)
    assert prof.budget_bytes == 2 * GIB
    too_small = KVMemoryProfile(8 * GIB, 1.0, 3 * GIB, GIB, 0, 1 << 20, 4 * GIB,
                                "2 adapters (--max-cpu-loras 2) x --max-lora-rank 16")
    with pytest.raises(KVCacheTooSmall, match=r"CUDA-graph pool - 4\.00 GiB LoRA stacks to "
                                              r"come \(2 adapters \(--max-cpu-loras 2\) x "
                                              r"--max-lora-rank 16\) = 0\.000 GiB"):
        too_small.num_blocks


def test_the_refusal_says_where_the_slot_count_comes_from(tiny_models):
    model_dir = tiny_models("qwen3")
    cases = [(dict(max_cpu_loras=3, allow_runtime_lora_updating=True),
              "3 adapters (--max-cpu-loras 3) x --max-lora-rank 16"),
             (dict(lora_modules="a=/x/a b=/x/b", max_lora_rank=8),
              "2 adapters (the 2 of --lora-modules) x --max-lora-rank 8"),
             (dict(lora_modules="a=/x/a", allow_runtime_lora_updating=True, max_loras=4),
              "4 adapters (--max-loras 4) x --max-lora-rank 16"),
             (dict(allow_runtime_lora_updating=True),
              "1 adapter (--max-loras 1) x --max-lora-rank 16")]
    for fields, text in cases:
        config = RunnerConfig(model_dir=model_dir, enable_lora=True, **fields)
        assert lora_flags_text(config, lora_slots(config)) == text


def test_field_24_on_the_wire_and_a_scheduler_without_it(tiny_models):
    """--max-cpu-loras reaches the worker as WorkerConfig field 24 and sets its slots; an
    older scheduler's Init leaves it unset: the worker counts --max-loras and holds any number
    (its scheduler's LRU decides, as before)."""
    sent = WorkerConfig(model_dir=tiny_models("qwen3"), enable_lora=True,
                        allow_runtime_lora_updating=True, max_loras=2, max_cpu_loras=5)
    msg = worker_pb2.WorkerConfig()
    to_proto(sent, msg)
    assert msg.HasField("max_cpu_loras") and msg.max_cpu_loras == 5
    assert lora_slots(from_proto(RunnerConfig, msg, device="cpu")) == 5
    msg.ClearField("max_cpu_loras")                       # what an older scheduler sends
    old = from_proto(RunnerConfig, msg, device="cpu")
    assert old.max_cpu_loras is None and lora_slots(old) == 2


@pytest.mark.parametrize("fields, flag", [
    (dict(lora_modules="a=/x/a b=/x/b"), "--lora-modules"),
    (dict(allow_runtime_lora_updating=True, max_loras=3), "--max-loras"),
    (dict(allow_runtime_lora_updating=True, max_cpu_loras=3), "--max-cpu-loras")])
def test_the_refusal_names_only_the_flag_that_set_the_count(tiny_models, fields, flag):
    """The remedy names the one flag the slot count came from and --max-lora-rank; it used
    to name --max-cpu-loras, --max-loras and --max-lora-rank whichever applied."""
    model_dir = tiny_models("qwen3")
    config = RunnerConfig(model_dir=model_dir, enable_lora=True, kv_cache_bytes=MIB,
                          **fields)
    info = ModelInfo.from_dir(model_dir)
    with pytest.raises(DoesNotFit) as err:
        check_memory_fits(config, info, 1, 1, machine_bytes=MIB)
    remedy = str(err.value).rsplit("(lower ", 1)[1]
    assert remedy == (f"kv_cache_bytes or num_kv_blocks; {flag} or --max-lora-rank, or raise "
                      "tp_size)")
