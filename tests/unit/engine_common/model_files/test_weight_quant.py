"""model_files/weight_quant.py and quant_config.py: the quantization_config blocks of released
checkpoints (as their config.json files ship them) are served as what they are; everything we
do not serve is refused naming the field, its value and what is allowed, torch-free."""
from __future__ import annotations

import json

import pytest

from engine_common.model_files.quant_config import quantization_problem
from engine_common.model_files.quant_files import with_quant_file
from engine_common.model_files.weight_quant import WeightQuant, weight_quant

QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
             "weight_block_size": [128, 128]}
CT_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
              "strategy": "channel", "group_size": None, "block_structure": None,
              "actorder": None, "observer": "minmax", "observer_kwargs": {}}
CT_TOKEN = {**CT_CHANNEL, "dynamic": True, "strategy": "token", "observer": None}
RED_HAT_FP8_DYNAMIC = {
    "config_groups": {"group_0": {"input_activations": CT_TOKEN, "output_activations": None,
                                  "targets": ["Linear"], "weights": CT_CHANNEL}},
    "format": "float-quantized", "global_compression_ratio": 1.24, "ignore": ["lm_head"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed"}
THEBLOKE_GPTQ = {"bits": 4, "group_size": 128, "damp_percent": 0.1, "desc_act": True,
                 "sym": True, "true_sequential": True, "model_name_or_path": None,
                 "model_file_base_name": "model", "quant_method": "gptq"}
GPTQMODEL_V2 = {"bits": 8, "group_size": -1, "desc_act": False, "sym": True, "lm_head": False,
                "quant_method": "gptq", "checkpoint_format": "gptq_v2", "pack_dtype": "int32",
                "meta": {"quantizer": ["gptqmodel:2.0.0"], "damp_percent": 0.01}}
# what transformers 5's FineGrainedFP8Config, GPTQConfig and AwqConfig save (to_dict)
TRANSFORMERS5_FP8 = {"activation_scheme": "dynamic", "dequantize": False, "expert_dtype": "fp8",
                     "modules_to_convert": None, "modules_to_not_convert": None,
                     "quant_method": "fp8", "scale_fmt": "float", "weight_block_size": [128, 128]}
_GPTQ5 = {"act_group_aware": True, "backend": None, "batch_size": 1, "bits": 4,
          "block_name_to_quantize": None, "cache_block_outputs": True, "damp_percent": 0.1,
          "dataset": None, "desc_act": False, "group_size": 128, "max_input_length": None,
          "meta": None, "model_seqlen": None, "module_name_preceding_first_block": None,
          "modules_in_block_to_quantize": None, "pad_token_id": None, "sym": True,
          "tokenizer": None, "true_sequential": True}
TRANSFORMERS5_GPTQ = {**_GPTQ5, "quant_method": "gptq", "format": "gptq_v2",
                      "checkpoint_format": None}
TRANSFORMERS5_AWQ = {**_GPTQ5, "quant_method": "awq", "format": "gemm", "zero_point": True,
                     "modules_to_not_convert": None, "backend": "auto"}
AUTOAWQ = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq",
           "version": "gemm", "zero_point": True}


def cfg(quant, arch="Qwen3ForCausalLM") -> dict:
    return {"architectures": [arch], "quantization_config": quant}


@pytest.mark.parametrize("quant,want", [
    (QWEN3_FP8, WeightQuant("fp8", block=(128, 128))),
    ({**QWEN3_FP8, "weight_block_size": None}, WeightQuant("fp8")),
    ({**QWEN3_FP8, "scale_fmt": "ue8m0"}, WeightQuant("fp8", block=(128, 128))),
    (TRANSFORMERS5_FP8, WeightQuant("fp8", block=(128, 128))),
    (TRANSFORMERS5_GPTQ, WeightQuant("gptq", bits=4, group_size=128, zero_offset=0)),
    (TRANSFORMERS5_AWQ, WeightQuant("awq", bits=4, group_size=128)),
    (RED_HAT_FP8_DYNAMIC, WeightQuant("compressed-tensors")),
    ({**RED_HAT_FP8_DYNAMIC, "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {**CT_CHANNEL, "strategy": "tensor"},
        "input_activations": None}}}, WeightQuant("compressed-tensors")),
    (THEBLOKE_GPTQ, WeightQuant("gptq", bits=4, group_size=128, desc_act=True, zero_offset=1)),
    (GPTQMODEL_V2, WeightQuant("gptq", bits=8, group_size=-1, zero_offset=0)),
    (AUTOAWQ, WeightQuant("awq", bits=4, group_size=128)),
])
def test_released_configs_are_served(quant, want):
    for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM", "MixtralForCausalLM"):
        assert quantization_problem(cfg(quant, arch)) is None
    assert weight_quant(cfg(quant)) == want


CT_GROUP = RED_HAT_FP8_DYNAMIC["config_groups"]["group_0"]


@pytest.mark.parametrize("quant,problem", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "quantization_config.quant_method='bitsandbytes' is not supported for Qwen3ForCausalLM: "
     "only 'fp8', 'compressed-tensors', 'gptq', 'awq' ('mxfp4' on GptOssForCausalLM only)"),
    ({"quant_method": "mxfp4"},
     "quantization_config.quant_method='mxfp4' is not supported for Qwen3ForCausalLM"),
    ({**QWEN3_FP8, "activation_scheme": "static"},
     "quantization_config.activation_scheme='static' is not supported: only 'dynamic' "
     "(activations are served unquantized: static input scales would be ignored)"),
    ({**QWEN3_FP8, "fmt": "e5m2"}, "quantization_config.fmt='e5m2' is not supported: only 'e4m3'"),
    ({**QWEN3_FP8, "scale_fmt": "e4m3"},
     "quantization_config.scale_fmt='e4m3' is not supported: only 'float', 'ue8m0'"),
    ({**QWEN3_FP8, "weight_block_size": [128]},
     "quantization_config.weight_block_size=[128] is not supported: must be [rows, cols]"),
    ({**QWEN3_FP8, "kv_cache_scheme": "fp8"},
     "quantization_config.kv_cache_scheme='fp8' is not supported: a 'fp8' config may only hold"),
    ({**THEBLOKE_GPTQ, "bits": 3},
     "quantization_config.bits=3 is not supported: must be one of [4, 8]"),
    ({**THEBLOKE_GPTQ, "bits": 2}, "quantization_config.bits=2 is not supported"),
    ({**THEBLOKE_GPTQ, "group_size": 0}, "quantization_config.group_size=0 is not supported"),
    ({**THEBLOKE_GPTQ, "desc_act": "yes"},
     "quantization_config.desc_act='yes' is not supported: must be true or false"),
    ({**THEBLOKE_GPTQ, "checkpoint_format": "marlin"},
     "quantization_config.checkpoint_format='marlin' is not supported: must be one of "
     "['gptq', 'gptq_v2']"),
    ({**THEBLOKE_GPTQ, "dynamic": {"-:.*lm_head": {}}},
     "quantization_config.dynamic={'-:.*lm_head': {}} is not supported: per-module overrides"),
    ({**THEBLOKE_GPTQ, "pack_dtype": "int64"},
     "quantization_config.pack_dtype='int64' is not supported: only 'int32'"),
    ({**AUTOAWQ, "version": "gemv"}, "quantization_config.version='gemv' is not supported: "
                                     "only 'gemm'"),
    ({**TRANSFORMERS5_AWQ, "format": "gemv_fast"},
     "quantization_config.format='gemv_fast' is not supported: only 'gemm'"),
    ({**TRANSFORMERS5_GPTQ, "format": "marlin"},
     "quantization_config.format='marlin' is not supported: must be one of "
     "['gptq', 'gptq_v2']"),
    ({**TRANSFORMERS5_FP8, "expert_dtype": "fp4"},
     "quantization_config.expert_dtype='fp4' is not supported: only 'fp8'"),
    ({**AUTOAWQ, "zero_point": False}, "quantization_config.zero_point=False is not supported"),
    ({**AUTOAWQ, "bits": 8}, "quantization_config.bits=8 is not supported: must be one of [4]"),
    ({**RED_HAT_FP8_DYNAMIC, "format": "pack-quantized"},
     "quantization_config.format='pack-quantized' is not supported: only 'float-quantized'"),
    ({**RED_HAT_FP8_DYNAMIC, "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
     "quantization_config.kv_cache_scheme={'num_bits': 8, 'type': 'float'} is not supported: "
     "only null (KV-cache scales are not served"),
    ({**RED_HAT_FP8_DYNAMIC, "config_groups": {"group_0": {
        **CT_GROUP, "input_activations": {**CT_TOKEN, "dynamic": False,
                                          "strategy": "tensor"}}}},
     "quantization_config.config_groups.group_0.input_activations.dynamic=False is not "
     "supported: only true (activations are served unquantized"),
    ({**RED_HAT_FP8_DYNAMIC, "config_groups": {"group_0": {
        **CT_GROUP, "weights": {**CT_CHANNEL, "type": "int", "num_bits": 4}}}},
     "quantization_config.config_groups.group_0.weights.type='int' is not supported: "
     "only 'float'"),
    ({**RED_HAT_FP8_DYNAMIC, "config_groups": {"group_0": {
        **CT_GROUP, "weights": {**CT_CHANNEL, "strategy": "block"}}}},
     "quantization_config.config_groups.group_0.weights.strategy='block' is not supported"),
    ({**RED_HAT_FP8_DYNAMIC, "ignore": "lm_head"},
     "quantization_config.ignore='lm_head' is not supported: must be a list of module names"),
])
def test_what_is_not_served_is_refused_by_name(quant, problem):
    got = quantization_problem(cfg(quant))
    assert got is not None and got.startswith(problem), got


def test_weight_formats_are_refused_on_gpt_oss():
    """GPT-OSS ships MXFP4 experts; its stacked experts are not linear [out, in] weights."""
    assert quantization_problem(cfg(QWEN3_FP8, "GptOssForCausalLM")) == (
        "quantization_config.quant_method='fp8' is not supported for GptOssForCausalLM: only "
        "'mxfp4' on GptOssForCausalLM")


def test_no_config_and_mxfp4_are_not_weight_formats():
    assert weight_quant({"architectures": ["Qwen3ForCausalLM"]}) is None
    assert weight_quant(cfg({"quant_method": "mxfp4"}, "GptOssForCausalLM")) is None


def test_the_configs_transformers_itself_saves_are_served():
    """GPTQConfig / AwqConfig / FineGrainedFP8Config as transformers writes them into
    config.json (to_dict), with every key its version adds."""
    qc = pytest.importorskip("transformers.utils.quantization_config")
    saved = {
        "gptq": qc.GPTQConfig(bits=4, group_size=64, desc_act=True, format="gptq").to_dict(),
        "gptq_v2": qc.GPTQConfig(bits=8, format="gptq_v2").to_dict(),
        "awq": qc.AwqConfig(bits=4, group_size=128).to_dict(),
        "fp8": qc.FineGrainedFP8Config(weight_block_size=(128, 128)).to_dict(),
    }
    saved = json.loads(json.dumps(saved))          # as config.json holds them
    assert weight_quant(cfg(saved["gptq"])) == WeightQuant("gptq", bits=4, group_size=64,
                                                           desc_act=True, zero_offset=1)
    assert weight_quant(cfg(saved["gptq_v2"])) == WeightQuant("gptq", bits=8, group_size=128)
    assert weight_quant(cfg(saved["awq"])) == WeightQuant("awq", bits=4, group_size=128)
    assert weight_quant(cfg(saved["fp8"])) == WeightQuant("fp8", block=(128, 128))


# keys newer GPTQModel releases save into quantize_config.json that we do not know, each at
# its off value (null, false, empty), beside the ones that would change the weights when set
GPTQMODEL_OFF_KEYS = {"rotation": None, "gptaq": None, "foem": None, "mock_quantization": False,
                      "adapter_options": {}, "hyb_act_layers": [],
                      # the quantization run's own settings, at GPTQModel's defaults
                      "offload_to_disk": True, "offload_to_disk_path": None, "pack_impl": "cpu",
                      "v2_memory_device": "auto",
                      "failsafe": {"strategy": "rtn", "threshold": "0.5%"}}


def test_unknown_gptqmodel_keys_at_their_off_value_are_served(tmp_path):
    """An unknown key set to null, false or empty asks for nothing that changes the packing
    (GPTQModel writes every field of its QuantizeConfig, most of them off), nor do the
    quantization run's settings, so a quantize_config.json holding them reads as the same
    WeightQuant as without them."""
    saved = {k: v for k, v in GPTQMODEL_V2.items() if k != "quant_method"}
    (tmp_path / "quantize_config.json").write_text(json.dumps({**saved, **GPTQMODEL_OFF_KEYS}))
    config = with_quant_file({"architectures": ["Qwen3ForCausalLM"]}, tmp_path)
    assert quantization_problem(config) is None
    assert weight_quant(config) == weight_quant(cfg(GPTQMODEL_V2)) == WeightQuant(
        "gptq", bits=8, group_size=-1)


@pytest.mark.parametrize("key, value", [("rotation", "hadamard"), ("gptaq", {"alpha": 0.25}),
                                        ("mock_quantization", True), ("foem", 0.1)])
def test_unknown_gptqmodel_keys_set_are_refused_by_name(key, value):
    problem = quantization_problem(cfg({**GPTQMODEL_V2, **GPTQMODEL_OFF_KEYS, key: value}))
    assert problem is not None and problem.startswith(
        f"quantization_config.{key}={value!r} is not supported: an unknown 'gptq' key may "
        "only be null, false or empty"), problem
