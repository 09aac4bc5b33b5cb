"""A new epoch's Init that keeps the loaded model (a restarted scheduler, same settings) also
resets its LoRA adapters to the Init's: the scheduler before may have loaded others at run
time, which the new one never serves, and with --max-cpu-loras they would fill the slots the
rank may hold (docs/lora.md, "Workers restarted")."""
from __future__ import annotations

from worker_service.config import NodeLayout, RunnerConfig
from worker_service.ranks.runner_keeper import RunnerKeeper
from tests.support.lora_adapters import make_adapter


def _config(model: str, **kw) -> RunnerConfig:
    return RunnerConfig(model_dir=model, dtype="float32", num_kv_blocks=64, enable_lora=True,
                        allow_runtime_lora_updating=True, max_lora_rank=8, **kw)


def test_a_kept_model_drops_the_last_schedulers_runtime_adapters(tiny_models, tmp_path):
    model = tiny_models("llama")
    a, b = (make_adapter(model, tmp_path / n, r=4, seed=i) for i, n in enumerate("ab"))
    config = _config(model, max_cpu_loras=1)
    keeper = RunnerKeeper("cpu")
    keeper.load(config, NodeLayout())
    keeper.load_lora(2, "b", b)                # the first scheduler's load
    keeper.load(config, NodeLayout())          # a restarted scheduler's Init
    assert keeper.num_model_loads == 1         # the model was kept ...
    assert keeper.runner.lora.adapters == {}   # ... but not the other scheduler's adapter
    assert keeper.runner.lora.stack_bytes() == 0
    keeper.load_lora(1, "a", a)                # its replay: room for it at --max-cpu-loras 1
    assert sorted(keeper.runner.lora.adapters) == [0]
    assert keeper.runner.lora.adapters[0].name == "a"


def test_a_kept_model_keeps_the_inits_own_adapters(tiny_models, tmp_path):
    model = tiny_models("llama")
    a, b = (make_adapter(model, tmp_path / n, r=4, seed=i) for i, n in enumerate("ab"))
    config = _config(model, lora_modules=f"a={a}")
    keeper = RunnerKeeper("cpu")
    keeper.load(config, NodeLayout())
    keeper.load_lora(2, "b", b)
    keeper.load(config, NodeLayout())
    assert keeper.num_model_loads == 1
    assert {i + 1: ad.name for i, ad in keeper.runner.lora.adapters.items()} == {1: "a"}
