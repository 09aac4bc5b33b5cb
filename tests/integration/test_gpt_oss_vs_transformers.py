"""GPT-OSS (GptOssForCausalLM) against transformers on the same tiny random weights, float32 on
the CPU (worker_service/models/tiny_model.py: 3 layers sliding (window 8) / full / sliding,
attention sinks, biased q/k/v/o, 2 of 4 clamped-SwiGLU experts with biases, SwiGLU limit 1.5
so the clamps bite):

  - prefill logits through the paged cache equal transformers' forward on the torch, CPU (the
    C++ kernel, sinks included) and Triton (interpreter, slow lane) backends, and each of the
    sinks, the window and the clamp matters on these weights,
  - chunked prefill then decodes far past the window, step by step, on every backend,
  - the in-process engine's greedy tokens equal generate(), with chunks and prefix-cache hits,
  - MXFP4 experts (the layout openai/gpt-oss ships) load dequantized, bit for bit as
    transformers dequantizes them, and give transformers' tokens on the dequantized twin,
  - two gloo ranks (half of the heads and their sinks, half of every expert) give one rank's
    logits, plain and MXFP4,
  - configs this engine cannot serve as transformers would are refused naming the field.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.model_files.model_dir import ModelDirError, ModelInfo
from engine_common.model_files.quant_config import quantization_problem
from kernels.attention import cpu_paged
from kernels.attention.selector import get_attention_backend
from tests.integration.test_model_vs_transformers import hf_logits
from tests.support.engine_checks import _check, _prompts, check_chunked_greedy
from tests.support.hf_reference import hf_model
from tests.support.mxfp4_models import make_mxfp4_pair
from tests.support.paged_prefill import assert_tp2_matches_tp1, prefill_logits
from tests.support.window_schedule import (BACKENDS, assert_chunks_and_decodes_match,
                                           assert_engine_greedy_with_prefix_hits)
from worker_service.models.gpt_oss import GptOssForCausalLM, with_config_defaults
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group

ATOL = 1e-4
WINDOWS = [8, 0, 8]

# some tests compare the weights the loader writes, read back from the parameters
pytestmark = pytest.mark.usefixtures("keep_dense_weights")


def ours(path, backend: str = "torch"):
    if backend == "cpu" and not cpu_paged.available():
        pytest.skip("deltaserve_cpu not built")
    return load_model(path, single_rank_group(), get_attention_backend(backend, "cpu"), "cpu")


@pytest.fixture(scope="module")
def mxfp4_pair(tiny_models, tmp_path_factory):
    """(quantized, reference) dirs; experts 64 wide so both dims are whole MXFP4 groups."""
    root = tmp_path_factory.mktemp("mxfp4")
    return make_mxfp4_pair(tiny_models("gpt_oss", intermediate_size=64), root / "mxfp4",
                           root / "dequantized")


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_logits_match_transformers(tiny_models, backend):
    path = tiny_models("gpt_oss")
    model = ours(path, backend)
    assert isinstance(model, GptOssForCausalLM)
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.attn.sliding_window for a in attns] == WINDOWS
    ids = torch.arange(41) * 37 % 500 + 3
    expected = hf_logits(hf_model(path), ids)
    torch.testing.assert_close(prefill_logits(model, ids), expected, atol=ATOL, rtol=0)
    if backend == "cpu":
        assert model.model.layers[0].self_attn.attn.backend.calls > 0     # the kernel ran
    # each of the sinks, the window and the SwiGLU clamp matters on these weights
    sinks = [a.sinks.data.clone() for a in attns]
    for a in attns:
        a.sinks.data.fill_(-1e4)                       # e^sink = 0: no sink at all
    assert (prefill_logits(model, ids) - expected).abs().max() > 1e-2
    for a, s in zip(attns, sinks):
        a.sinks.data.copy_(s)
        a.attn.sliding_window = 0
    assert (prefill_logits(model, ids) - expected).abs().max() > 1e-2
    for a, window in zip(attns, WINDOWS):
        a.attn.sliding_window = window
    for layer in model.model.layers:
        layer.mlp.experts.limit = 1e9
    assert (prefill_logits(model, ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_then_decodes_far_past_the_window(tiny_models, backend):
    path = tiny_models("gpt_oss")
    assert_chunks_and_decodes_match(ours(path, backend), hf_model(path), ATOL)


@pytest.mark.parametrize("backend,block_size", [("torch", 4), ("cpu", 16)])
def test_engine_greedy_with_chunks_and_prefix_hits(tiny_models, backend, block_size):
    if backend == "cpu" and not cpu_paged.available():
        pytest.skip("deltaserve_cpu not built")
    assert_engine_greedy_with_prefix_hits(tiny_models("gpt_oss"), backend, block_size,
                                          "gpt_oss")


def test_chunked_greedy_matches_transformers(tiny_models):
    check_chunked_greedy(tiny_models("gpt_oss"), "gpt_oss")


def test_mxfp4_experts_load_as_transformers_dequantizes_them(mxfp4_pair):
    quantized, reference = mxfp4_pair
    ModelInfo.from_dir(quantized)                         # the scheduler side accepts it
    got, want = ours(quantized), ours(reference)
    assert got.model.layers[0].mlp.experts.w13_weight.shard_ids == ("blocks", "scales")
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        assert torch.equal(a, b), name
    ids = torch.arange(41) * 37 % 500 + 3
    torch.testing.assert_close(prefill_logits(got, ids), hf_logits(hf_model(reference), ids),
                               atol=ATOL, rtol=0)


def test_mxfp4_greedy_matches_transformers_dequantized(mxfp4_pair):
    quantized, reference = mxfp4_pair
    llm = LLM(str(quantized), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, str(reference), _prompts(llm.model_info.vocab_size)[:6], "gpt_oss/mxfp4")


def test_mxfp4_checkpoint_with_some_experts_dequantized(mxfp4_pair, tmp_path):
    """Layer 1's experts stored plain (dequantized) beside MXFP4 ones under the same mxfp4
    config: transformers loads it; so do we, to the same weights (was: "missing
    gate_up_proj_blocks")."""
    from safetensors.torch import load_file, save_file
    quantized, reference = mxfp4_pair
    path = shutil.copytree(quantized, tmp_path / "mixed")
    weights = load_file(path / "model.safetensors")
    plain = load_file(reference / "model.safetensors")
    layer1 = "model.layers.1.mlp.experts."
    weights = {n: t for n, t in weights.items() if not n.startswith(layer1)}
    weights.update({n: t for n, t in plain.items() if n.startswith(layer1)})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    got, want = ours(path), ours(reference)
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        assert torch.equal(a, b), name


def test_mxfp4_without_its_scales_is_refused(mxfp4_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    from worker_service.models.loader import WeightLoadError
    path = shutil.copytree(mxfp4_pair[0], tmp_path / "no-scales")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    missing = r"missing from the checkpoint: \['model\.layers\.1\.mlp\.experts\.down_proj_scales'"
    with pytest.raises(WeightLoadError, match=missing):
        ours(path)


def test_mxfp4_pieces_without_the_mxfp4_config_are_refused(mxfp4_pair, tmp_path):
    """A quantized checkpoint whose config.json lost its quantization_config: named as such
    (was: its expert weights, loaded, reported missing by internal names)."""
    from worker_service.models.loader import WeightLoadError
    path = shutil.copytree(mxfp4_pair[0], tmp_path / "no-quant-config")
    cfg = json.load(open(path / "config.json"))
    del cfg["quantization_config"]
    json.dump(cfg, open(path / "config.json", "w"))
    with pytest.raises(WeightLoadError, match=r"experts\.(gate_up|down)_proj_(blocks|scales)': "
                                              r"(gate_up|down)_proj_(blocks|scales) is an MXFP4 "
                                              r"piece, but config\.json has no "
                                              r"quantization_config"):
        ours(path)


def test_mxfp4_blocks_of_the_wrong_shape_are_refused(mxfp4_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    from worker_service.models.loader import WeightLoadError
    path = shutil.copytree(mxfp4_pair[0], tmp_path / "short-blocks")
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    weights[name] = weights[name][:, :, :1].contiguous()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"experts\.gate_up_proj_blocks: checkpoint shape "
                                              r"\(4, 128, 1, 16\) does not match the config's "
                                              r"\(4, 128, 2, 16\)"):
        ours(path)


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tiny_models, mxfp4_pair, tmp_path):
    assert_tp2_matches_tp1([tiny_models("gpt_oss"), mxfp4_pair[0]], tmp_path)


@pytest.mark.parametrize("quant,problem", [
    ({"quant_method": "awq"}, "quantization_config.quant_method='awq' is not supported for "
                              "GptOssForCausalLM: only 'mxfp4' on GptOssForCausalLM"),
    ({"quant_method": "mxfp4", "group_size": 64},
     "quantization_config.group_size=64 is not supported: an mxfp4 config may only hold "
     "quant_method, modules_to_not_convert, dequantize"),
    ({"quant_method": "mxfp4", "dequantize": "yes"},
     "quantization_config.dequantize='yes' is invalid: must be true or false"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"},
     "quantization_config.modules_to_not_convert='lm_head' is invalid: must be a list of "
     "module names"),
    ("mxfp4", "quantization_config='mxfp4' is invalid: must be an object"),
])
def test_unservable_quantization_configs_are_refused(tiny_models, tmp_path, quant, problem):
    cfg = {"architectures": ["GptOssForCausalLM"], "quantization_config": quant}
    assert quantization_problem(cfg) == problem
    path = shutil.copytree(tiny_models("gpt_oss"), tmp_path / "quant")
    full = {**json.load(open(path / "config.json")), "quantization_config": quant}
    json.dump(full, open(path / "config.json", "w"))
    with pytest.raises(ModelDirError, match="quantization_config"):
        ModelInfo.from_dir(path)
    with pytest.raises(ValueError, match="quantization_config"):
        ours(path)
    mxfp4_elsewhere = {"architectures": ["LlamaForCausalLM"],
                       "quantization_config": {"quant_method": "mxfp4"}}
    assert "not supported for LlamaForCausalLM" in quantization_problem(mxfp4_elsewhere)


@pytest.mark.parametrize("dequantize", [True, False])
def test_mxfp4_dequantize_flag_is_served(mxfp4_pair, tmp_path, dequantize):
    """transformers' Mxfp4Config(dequantize=...) saved in config.json: transformers loads it
    (dequantizing on the CPU either way); so do we, to the same weights (was refused)."""
    quantized, reference = mxfp4_pair
    path = shutil.copytree(quantized, tmp_path / "flag")
    cfg = json.load(open(path / "config.json"))
    cfg["quantization_config"]["dequantize"] = dequantize
    json.dump(cfg, open(path / "config.json", "w"))
    ModelInfo.from_dir(path)
    got, want = ours(path), ours(reference)
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        assert torch.equal(a, b), name


def test_config_defaults_are_gpt_oss_configs():
    """An absent key reads as GptOssConfig's default: biases on, layers alternating (sliding
    first) with window 128, the yarn rope at theta 150000 (never a plain rope)."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.GptOssConfig(num_hidden_layers=4)
    cfg = with_config_defaults({"num_hidden_layers": 4})
    assert cfg["attention_bias"] is ref.attention_bias is True
    assert GptOssForCausalLM.layer_windows(cfg, 4) == tuple(
        ref.sliding_window if t == "sliding_attention" else 0 for t in ref.layer_types)
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert cfg["rope_parameters"]["rope_type"] == ref.rope_parameters["rope_type"] == "yarn"
    kept = with_config_defaults({"rope_parameters": {"rope_type": "default",
                                                     "rope_theta": 1e4}})
    assert kept["rope_parameters"]["rope_theta"] == 1e4 and "rope_theta" not in kept


# the released checkpoints' rope (yarn, truncate false) scaled down to the tiny model
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0}


@pytest.mark.parametrize("rope", ["yarn", "absent"])
def test_yarn_rope_matches_transformers(tiny_models, tmp_path, rope):
    """The checkpoints' yarn rope, and a config.json without any rope key (GptOssConfig's
    default: yarn, factor 32 over 4096 positions, theta 150000): logits past the original
    length equal transformers'."""
    path = shutil.copytree(tiny_models("gpt_oss", rope_parameters=YARN), tmp_path / rope)
    if rope == "absent":
        cfg = json.load(open(path / "config.json"))
        del cfg["rope_parameters"]
        json.dump(cfg, open(path / "config.json", "w"))
        hf_cfg = pytest.importorskip("transformers").AutoConfig.from_pretrained(path)
        assert hf_cfg.rope_parameters["rope_type"] == "yarn"
    ids = torch.arange(60) * 37 % 500 + 3
    torch.testing.assert_close(prefill_logits(ours(path), ids),
                               hf_logits(hf_model(str(path)), ids), atol=ATOL, rtol=0)


def test_bad_layer_types_are_refused():
    with pytest.raises(ValueError, match=r"layer_types=\['sliding_attention'\] is invalid: "
                                         r"must list num_hidden_layers=2 entries"):
        GptOssForCausalLM.layer_windows({"layer_types": ["sliding_attention"]}, 2)
    with pytest.raises(ValueError, match="layer_types"):
        GptOssForCausalLM.layer_windows({"layer_types": ["local", "global"]}, 2)
