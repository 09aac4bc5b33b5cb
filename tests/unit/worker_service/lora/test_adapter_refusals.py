"""LoRA adapters and flags that cannot be served are refused at start with a message naming the
adapter, the module or value, and what is allowed (docs/lora.md)."""
from __future__ import annotations

import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from deltaserve.llm import LLM
from engine_common.configuration.lora import parse_lora_modules
from engine_common.request.params import ParamError
from tests.support.lora_adapters import make_adapter
from worker_service.lora.adapter import LoRAError, read_adapter


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    return make_adapter(model, tmp_path_factory.mktemp("lora") / "a", r=8, alpha=16)


def _llm(model, mods, **kw):
    return LLM(model, dtype="float32", num_kv_blocks=32, enable_lora=True, lora_modules=mods,
               **kw)


def test_rank_above_max_lora_rank(model, adapter):
    with pytest.raises(LoRAError, match=r"adapter 'a': r=8 is invalid: .*max_lora_rank=4"):
        _llm(model, f"a={adapter}", max_lora_rank=4)


def test_missing_weights_file(adapter, tmp_path):
    d = tmp_path / "half"
    d.mkdir()
    shutil.copy(f"{adapter}/adapter_config.json", d)
    with pytest.raises(LoRAError, match=r"'half'.*adapter_model.safetensors does not exist"):
        read_adapter("half", d, 16)


def test_unsupported_target_module(model, tmp_path):
    bad = make_adapter(model, tmp_path / "head", targets=("q_proj", "lm_head"))
    with pytest.raises(LoRAError, match=r"'head': target module\(s\) \['lm_head'\] are not "
                                        r"supported"):
        read_adapter("head", bad, 16)


def test_shape_of_another_base_model(model, adapter, tmp_path):
    d = tmp_path / "wide"
    shutil.copytree(adapter, d)
    tensors = load_file(f"{d}/adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = tensors[key].repeat(1, 2)          # in = 2 x hidden_size
    save_file(tensors, f"{d}/adapter_model.safetensors")
    with pytest.raises(LoRAError, match=r"'wide': model.layers.0.self_attn.q_proj: lora_A"):
        _llm(model, f"wide={d}")


def test_lora_modules_forms():
    mods = parse_lora_modules('a=/x {"name": "b", "path": "/y", "base_model_name": "m"}'
                              .split(" ", 1)[:1] + ['{"name": "b", "path": "/y"}'])
    assert [(m.name, m.path) for m in mods] == [("a", "/x"), ("b", "/y")]
    with pytest.raises(ParamError, match=r"lora_modules=\['a'\] is invalid: must be unique"):
        parse_lora_modules("a=/x a=/y")
    with pytest.raises(ParamError, match=r"lora_modules='nopath' is invalid: must be name=path"):
        parse_lora_modules("nopath")


def test_lora_modules_need_enable_lora(model, adapter):
    with pytest.raises(ParamError, match="enable_lora=False is invalid"):
        LLM(model, dtype="float32", num_kv_blocks=32, lora_modules=f"a={adapter}")


def test_worker_refuses_an_adapter_it_does_not_hold(model, adapter):
    """A diff naming lora_id 2 on a worker with one adapter (or none) is a protocol error, not
    a silent base-model run."""
    from engine_common.request.params import SamplingParams, WorkerSamplingParams
    from engine_common.wire.diff import NewRequestData
    from worker_service.failures import StepProtocolError
    from worker_service.lora.load import check_lora_ids

    llm = _llm(model, f"a={adapter}")
    lora = llm.runner.lora
    sampling = WorkerSamplingParams(SamplingParams(), 0, 0, ())

    def new(lora_id):
        return NewRequestData(3, [5, 6], sampling, [0], 0, lora_id=lora_id)

    check_lora_ids([new(0), new(1)], lora)
    with pytest.raises(StepProtocolError,
                       match=r"lora_id=2 is invalid: this worker holds LoRA adapter ids \[1\]"):
        check_lora_ids([new(2)], lora)
    with pytest.raises(StepProtocolError,
                       match=r"lora_id=1 is invalid: this worker holds LoRA adapter ids \[\]"):
        check_lora_ids([new(1)], None)


def test_every_bad_directory_is_a_lora_error(model, tmp_path):
    """Reading refuses each bad directory with a LoRAError naming the reason, never another
    exception (at a runtime load that would be INTERNAL: a worker failure and a new epoch,
    every running request lost). The shapes against the base model are checked later."""
    from tests.support.lora_adapters import bad_adapters

    for case, (path, reason) in bad_adapters(model, tmp_path, 8).items():
        if case == "another model's shapes":
            continue
        with pytest.raises(LoRAError, match=reason):
            read_adapter("bad", path, 8)


def test_weights_larger_than_any_adapter_of_the_model_are_refused_unread(model, adapter,
                                                                         tmp_path):
    """An adapter_model.safetensors larger than rank max_lora_rank on every projection of the
    model (as float64) could only be another model's or garbage: refused from its size, never
    loaded whole into the worker's memory (a sparse 10 GB file here, no disk used)."""
    d = tmp_path / "huge"
    shutil.copytree(adapter, d)
    os.truncate(d / "adapter_model.safetensors", 10 ** 10)
    with pytest.raises(LoRAError, match=r"'huge': .*adapter_model.safetensors: a file of "
                                        r"10000000000 bytes is invalid: must be at most "
                                        r"\d+ bytes"):
        _llm(model, f"huge={d}")
