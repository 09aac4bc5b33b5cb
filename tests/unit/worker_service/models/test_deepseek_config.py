"""models/deepseek_config.py and what is read from a DeepSeek config.json before anything is built:
the architectures are served (unknown before), refusals name the field, the value and what is
allowed, sparse layers follow first_k_dense_replace and moe_layer_freq, the memory estimate and
the cache layout count one latent head per token, and the MTP layer's tensors are skipped."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.cpu import extension
from tests.support.paged_prefill import load
from worker_service.config import RunnerConfig
from worker_service.models.deepseek_config import (read_mla, read_routing, read_sparse_layers,
                                                   with_defaults)
from worker_service.models.registry import get_model_class
from worker_service.runner.memory_fit import (estimate_cpu_packed_bytes, estimate_kv_bytes,
                                              estimate_weight_bytes, kv_cache_dims)
from worker_service.runner.model_runner import cache_layout

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3, less quantization_config)
V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "scoring_func": "sigmoid", "first_k_dense_replace": 3, "topk_group": 4,
    "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# DeepSeek-V2-Lite's (q_proj: q_lora_rank null; greedy softmax routing)
V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
    "kv_lora_rank": 512, "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "first_k_dense_replace": 1, "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128,
    "vocab_size": 102400, "hidden_act": "silu", "max_position_embeddings": 163840,
}


def test_both_architectures_are_served():
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert get_model_class(arch).__name__ == arch


def test_real_configs_read_as_transformers_reads_them():
    v3 = with_defaults(V3_CONFIG, v3=True)
    mla = read_mla(v3, v3=True)
    assert (mla.q_lora_rank, mla.latent_dim, mla.rope_interleave) == (1536, 576, True)
    # yarn factor 40, mscale_all_dim 1: (0.1 ln 40 + 1)^2 / sqrt(192)
    assert mla.scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192))
    routing = read_routing(v3, v3=True)
    assert (routing.sigmoid, routing.grouped, routing.n_group, routing.topk_group,
            routing.top_k, routing.routed_scaling_factor) == (True, True, 8, 4, 8, 2.5)
    sparse = read_sparse_layers(v3)
    assert [sparse.is_sparse(i) for i in range(5)] == [False, False, False, True, True]
    lite = with_defaults(V2_LITE_CONFIG, v3=False)
    assert read_mla(lite, v3=False).q_lora_rank == 0          # null: q_proj
    assert read_routing(lite, v3=False).grouped is False


def test_null_first_k_dense_replace_is_refused_by_name():
    with pytest.raises(ValueError, match="first_k_dense_replace=None is invalid: must be an "
                                         "integer >= 0"):
        read_sparse_layers(with_defaults({**V3_CONFIG, "first_k_dense_replace": None}, True))


def test_moe_layer_freq_and_absent_keys_take_the_config_class_defaults():
    sparse = read_sparse_layers(with_defaults({"num_hidden_layers": 8, "moe_layer_freq": 2,
                                               "first_k_dense_replace": 1}, v3=True))
    assert [i for i in range(8) if sparse.is_sparse(i)] == [2, 4, 6]
    # V3Config: first_k_dense_replace 3; V2Config: 0
    assert read_sparse_layers(with_defaults({"num_hidden_layers": 4}, v3=True)) \
        .first_k_dense_replace == 3
    assert read_sparse_layers(with_defaults({"num_hidden_layers": 4}, v3=False)) \
        .first_k_dense_replace == 0


@pytest.mark.parametrize("v3, change, message", [
    (False, {"norm_topk_prob": True}, "norm_topk_prob=True is not supported"),
    (False, {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported"),
    (True, {"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    (True, {"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    (True, {"n_group": 3}, "n_group=3 is invalid: must be >= 1 and divide n_routed_experts=256"),
    (True, {"topk_group": 9}, "topk_group=9 is invalid: must be in [1, n_group=8]"),
    (True, {"num_experts_per_tok": 300}, "num_experts_per_tok=300 is invalid"),
    (True, {"n_group": 1, "topk_group": 1, "n_routed_experts": 1, "num_experts_per_tok": 1},
     "each group is scored by its two best experts"),
    (True, {"routed_scaling_factor": 0}, "routed_scaling_factor=0 is invalid"),
])
def test_routing_refusals_name_the_field(v3, change, message):
    base = V3_CONFIG if v3 else V2_LITE_CONFIG
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_routing(with_defaults({**base, **change}, v3=v3), v3=v3)


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim=63 is invalid: must be even"),
    ({"kv_lora_rank": 0}, "kv_lora_rank=0 is invalid: must be an integer >= 1"),
    ({"q_lora_rank": 0}, r"q_lora_rank=0 is invalid: must be null \(q_proj\) or an integer"),
    ({"rope_scaling": {"type": "yarn", "factor": None, "mscale_all_dim": 0.707,
                       "original_max_position_embeddings": 4096}},
     "rope_scaling.factor is absent with rope_type='yarn' and mscale_all_dim=0.707: must be "
     "set"),
    ({"rope_scaling": {"type": "yarn", "mscale_all_dim": 0.707,
                       "original_max_position_embeddings": 4096}},
     "yarn rope scaling has no 'factor' key: must be set"),
    ({"head_dim": 128}, "head_dim=128 is invalid for DeepseekV2ForCausalLM: must be absent or "
                        "qk_rope_head_dim=64"),
])
def test_attention_refusals_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        read_mla(with_defaults({**V2_LITE_CONFIG, **change}, v3=False), v3=False)


def test_the_kv_estimate_and_the_cache_layout_count_one_latent_head():
    """V3: 2 (K and V) x 61 layers x 576 x 2 bytes a token, whatever the TP size (the latent
    is replicated), about 43x less than 128 heads of 192 + 128 decompressed."""
    assert kv_cache_dims(V3_CONFIG) == (1, 576)
    config = RunnerConfig(model_dir="unused", device="cpu", dtype="bfloat16", num_kv_blocks=10,
                          block_size=16)
    per_block = 61 * 16 * 576 * 2       # the latent once: the values are the keys
    assert estimate_kv_bytes(config, V3_CONFIG, 2) == 10 * per_block
    assert estimate_kv_bytes(config, V3_CONFIG, 2, tp_size=8) == 10 * per_block
    assert cache_layout(V3_CONFIG, config).head_dim == 576
    assert kv_cache_dims(V2_LITE_CONFIG) == (1, 576)


def test_the_weight_estimate_is_deepseek_v3s_parameter_count():
    """671B without the MTP layer's 14B (DeepSeek's own figure: 671B main model)."""
    params = estimate_weight_bytes(V3_CONFIG, 1)
    assert 670e9 < params < 672e9, params


def test_the_mtp_layer_is_skipped_on_load(tiny_models, tmp_path, keep_dense_weights):
    """A checkpoint with model.layers.{num_hidden_layers}.* (V3's MTP module) loads as without."""
    import shutil
    src = tiny_models("deepseek_v3")
    path = tmp_path / "with_mtp"
    shutil.copytree(src, path)
    weights = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    extra = {k.replace("model.layers.2.", f"model.layers.{cfg['num_hidden_layers']}."): v.clone()
             for k, v in weights.items() if k.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**weights, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    with_mtp, plain = load(path), load(src)
    for (name, a), (_, b) in zip(with_mtp.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_the_estimates_are_what_the_built_model_holds(tiny_models, arch):
    """The KV estimate is the cache the model asks for (one latent head); the weight estimate
    is within 1% of its parameters (it counts a shared-expert gate DeepSeek lacks)."""
    from pathlib import Path
    from worker_service.models.loader import kv_cache_shape
    path = tiny_models(arch)
    config = json.loads((Path(path) / "config.json").read_text())
    model = load(path)
    by_blocks = RunnerConfig(model_dir="m", num_kv_blocks=10, block_size=16)
    shape = kv_cache_shape(model, 10, 16)
    assert shape == (2, 10, 16, 1, 64)
    # the [2, ...] shape's halves are one memory (loader.kv_cache_halves)
    assert estimate_kv_bytes(by_blocks, config, 4) == model.num_layers * math.prod(shape) * 4 // 2
    real = sum(p.numel() for p in model.parameters())
    assert abs(estimate_weight_bytes(config, 1) - real) <= 0.01 * real
    # the routed experts' CPU-packed panels (2 sparse layers) replace their parameters: the
    # estimate is what the panels, as the packing allocated them, hold beyond those (0 here:
    # whole panels)
    packed = [m for m in model.modules() if getattr(m, "cpu_experts", None) is not None]
    if extension.load():
        assert len(packed) == 2 and all(m.weights_released for m in packed)
        beyond = sum(m.cpu_experts.nbytes - 4 * (m.w13_weight.numel() + m.w2_weight.numel())
                     for m in packed)
        assert estimate_cpu_packed_bytes(config, torch.float32) == beyond


def test_tp_sizes_that_do_not_split_the_heads_or_experts_are_refused_by_name():
    """V3: 128 heads, experts 2048 wide, dense 18432: TP=3 refused before any rank loads
    anything, naming the heads; 2, 4, 8 accepted (the latent is replicated, not split)."""
    from engine_common.request.params import ParamError
    from worker_service.models.tp_sizes import check_tp_size
    for tp in (2, 4, 8):
        check_tp_size(V3_CONFIG, tp)
    with pytest.raises(ParamError, match=r"tp_size=3 .*3 does not divide "
                                         r"num_attention_heads=128"):
        check_tp_size(V3_CONFIG, 3)
    with pytest.raises(ParamError, match="does not divide moe_intermediate_size=1400"):
        check_tp_size({**V2_LITE_CONFIG, "moe_intermediate_size": 1400}, 16)
