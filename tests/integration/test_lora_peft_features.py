"""PEFT features beyond plain LoRA (docs/lora.md): an adapter saved by peft with DoRA,
modules_to_save, trained biases, a lora_B bias, replicated layers or trained embedding rows
changes what its weights mean, so it is refused naming the adapter_config.json key and its
value (vLLM's PEFTHelper refuses DoRA and modules_to_save), never served as a plain LoRA that
would give other tokens than peft."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from tests.support.lora_adapters import make_adapter
from worker_service.lora.adapter import LoRAError, read_adapter
from worker_service.lora.families import LLAMA


@pytest.mark.parametrize("arch,options,message", [
    ("llama", {"use_dora": True}, r"use_dora=True is not supported \(DoRA"),
    ("llama", {"modules_to_save": ["lm_head"]},
     r"modules_to_save=\['lm_head'\] is not supported \(whole modules saved"),
    ("llama", {"lora_bias": True}, r"lora_bias=True is not supported \(a bias on lora_B\)"),
    ("llama", {"layer_replication": [[0, 2], [1, 2]]},
     r"layer_replication=\[\[0, 2\], \[1, 2\]\] is not supported \(decoder layers"),
    ("llama", {"trainable_token_indices": [3, 4]},
     r"trainable_token_indices=\[3, 4\] is not supported \(trained embedding rows\)"),
    # StarCoder2's projections have biases: peft saves them trained, next to lora_A / lora_B
    ("starcoder2", {"bias": "all"}, r"bias='all' is not supported \(biases trained"),
    ("starcoder2", {"bias": "lora_only"}, r"bias='lora_only' is not supported"),
])
def test_a_peft_feature_beyond_lora_is_refused_naming_the_key(tiny_models, tmp_path, arch,
                                                              options, message):
    model = tiny_models(arch)
    path = make_adapter(model, tmp_path / "ad", r=4, targets=("q_proj", "v_proj"), **options)
    with pytest.raises(LoRAError, match=rf"LoRA adapter 'ad': {message}"):
        read_adapter("ad", path, 8, None, LLAMA + ("c_fc", "c_proj"))


def test_the_refusal_reaches_the_engine_start(tiny_models, tmp_path):
    model = tiny_models("llama")
    path = make_adapter(model, tmp_path / "dora", r=4, targets=("q_proj",), use_dora=True)
    with pytest.raises(LoRAError, match=r"LoRA adapter 'dora': use_dora=True is not supported"):
        LLM(model, dtype="float32", num_kv_blocks=32, enable_lora=True,
            lora_modules=f"dora={path}")


def test_plain_defaults_written_by_peft_are_served(tiny_models, tmp_path):
    """peft writes every key with its default (use_dora false, bias "none", modules_to_save
    null, ...): such an adapter, with layers_to_transform limiting it to layer 0, is read, and
    holds only layer 0's modules."""
    model = tiny_models("llama")
    path = make_adapter(model, tmp_path / "plain", r=4, targets=("q_proj",),
                        layers_to_transform=[0])
    adapter = read_adapter("plain", path, 8, None, LLAMA)
    assert sorted(adapter.weights) == ["model.layers.0.self_attn.q_proj"]
