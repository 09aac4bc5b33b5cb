"""engine_common/model_files/gguf_families.py: what each family's GGUF metadata becomes in
config.json, on minimal files: llama.cpp's Gemma attention-scale rule (27B by layer count),
Gemma 3's fixed pattern and a file without a window, Gemma 2's softcap defaults, Phi-3's partial
rotary and null window, StarCoder2's biases, a llama file with a window served as Mistral, the
linear rope scaling; and what stays refused."""
from __future__ import annotations

import gguf
import pytest

from engine_common.model_files.gguf_config import hf_config_from_gguf
from engine_common.model_files.gguf_file import GGUFError
from tests.unit.engine_common.model_files.test_gguf_config import _minimal

U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING


def _config(tmp_path, arch, tensors=("token_embd.weight",), **keys):
    """A minimal file (2 heads, hidden 32) with `arch`.<key> metadata added."""
    extra = {f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()}
    tmp_path.mkdir(exist_ok=True)
    return hf_config_from_gguf(_minimal(tmp_path, arch=arch, extra=extra, tensors=tensors))


@pytest.mark.parametrize("arch,layers,scalar", [("gemma2", 1, 8), ("gemma2", 46, 16),
                                                ("gemma3", 1, 8), ("gemma3", 62, 16)])
def test_gemma_attention_scale_is_llama_cpps_rule(tmp_path, arch, layers, scalar):
    """key_length 8 (head_dim) except for the 27B layer counts: hidden / heads = 16."""
    cfg = _config(tmp_path, arch, block_count=(layers, U32), attention__key_length=(8, U32),
                  attention__sliding_window=(4, U32))
    assert cfg["head_dim"] == 8 and cfg["query_pre_attn_scalar"] == scalar


def test_gemma2_reads_its_softcaps_and_window_and_defaults_them_as_llama_cpp(tmp_path):
    cfg = _config(tmp_path, "gemma2", attention__sliding_window=(4, U32),
                  attn_logit_softcapping=(20.0, F32))
    assert cfg["architectures"] == ["Gemma2ForCausalLM"] and cfg["sliding_window"] == 4
    assert cfg["attn_logit_softcapping"] == 20.0 and cfg["final_logit_softcapping"] == 30.0
    assert cfg["hidden_activation"] == "gelu_pytorch_tanh"


def test_gemma3_pattern_rope_and_a_file_without_a_window(tmp_path):
    cfg = _config(tmp_path / "a", "gemma3", block_count=(7, U32), rope__freq_base=(1e6, F32),
                  attention__sliding_window=(512, U32), rope__scaling__type=("linear", STR),
                  rope__scaling__factor=(8.0, F32))
    assert cfg["model_type"] == "gemma3_text" and cfg["sliding_window"] == 512
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention",
                                                              "sliding_attention"]
    assert (cfg["rope_theta"], cfg["rope_local_base_freq"]) == (1e6, 10000.0)
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert "rope_parameters" not in cfg
    bare = _config(tmp_path / "b", "gemma3", block_count=(7, U32))
    assert bare["layer_types"] == ["full_attention"] * 7 and bare["sliding_window"] is None


def test_phi3_partial_rotary_and_window(tmp_path):
    cfg = _config(tmp_path / "a", "phi3", rope__dimension_count=(12, U32),
                  attention__sliding_window=(0, U32))
    assert cfg["head_dim"] == 16 and cfg["sliding_window"] is None
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.75
    full = _config(tmp_path / "b", "phi3", rope__dimension_count=(16, U32),
                   attention__sliding_window=(2047, U32))
    assert full["sliding_window"] == 2047 and "partial_rotary_factor" not in full[
        "rope_parameters"]


def test_starcoder2_reads_layer_norm_eps_and_bias_presence(tmp_path):
    cfg = _config(tmp_path, "starcoder2", attention__layer_norm_epsilon=(1e-5, F32))
    assert cfg["architectures"] == ["Starcoder2ForCausalLM"] and cfg["use_bias"] is False
    assert cfg["norm_epsilon"] == pytest.approx(1e-5) and cfg["hidden_act"] == \
        "gelu_pytorch_tanh"


def test_a_llama_file_with_a_window_is_mistral_and_one_without_stays_llama(tmp_path):
    cfg = _config(tmp_path / "a", "llama", attention__sliding_window=(4096, U32))
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["sliding_window"] == 4096
    plain = _config(tmp_path / "b", "llama")
    assert plain["architectures"] == ["LlamaForCausalLM"] and "sliding_window" not in plain


def test_linear_rope_scaling_is_read_and_other_kinds_still_refused(tmp_path):
    cfg = _config(tmp_path / "a", "llama", rope__scaling__type=("linear", STR),
                  rope__scaling__factor=(4.0, F32))
    assert cfg["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0,
                                      "factor": 4.0}
    with pytest.raises(GGUFError, match=r"phi3.rope.scaling.type='yarn' is not supported: "
                                        r"must be absent, 'none' or 'linear'"):
        _config(tmp_path / "b", "phi3", rope__scaling__type=("yarn", STR))


def test_a_bad_window_and_a_missing_gemma2_window_are_named(tmp_path):
    with pytest.raises(GGUFError, match="metadata key 'gemma2.attention.sliding_window' is "
                                        "missing"):
        _config(tmp_path / "a", "gemma2")
    with pytest.raises(GGUFError, match=r"phi3.attention.sliding_window=-1 is invalid: must "
                                        r"be an integer >= 0"):
        _config(tmp_path / "b", "phi3", attention__sliding_window=(-1, gguf.GGUFValueType.INT32))


def test_phi3_longrope_factors_are_refused_with_the_way_out(tmp_path):
    import numpy as np
    tensors = {"token_embd.weight": np.zeros((2, 32), np.float32),
               "rope_factors_long.weight": np.ones(8, np.float32)}
    with pytest.raises(GGUFError, match=r"rope_factors_long.weight \(Phi-3 LongRoPE\) is not "
                                        r"read from GGUF files: serve the Hugging Face checkpoint"):
        _config(tmp_path, "phi3", tensors=tensors)
