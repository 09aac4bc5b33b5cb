"""Tiny random Hugging Face model directories for tests, benchmarks and the embedded default.

`make_tiny_model` writes a real model directory (config.json, safetensors weights via
transformers' own save_pretrained, generation_config.json) plus the tiny byte-level BPE tokenizer
(engine_common/text/tiny_tokenizer.py), all deterministic in `seed`.

Why initializer_range = 0.3: with the transformers default (0.02) a random 64-wide model has
nearly flat logits, so greedy decoding repeats one token and top-2 margins are ~1e-5, which makes
"greedy tokens equal" tests flaky under float noise. At 0.3 the logits spread over several units:
greedy continuations vary from step to step and top-2 margins are typically 1e-2 .. 1.
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

from engine_common.text.tiny_tokenizer import make_tiny_tokenizer_dir

ARCHS = ("qwen3", "llama", "qwen2", "qwen3_moe", "qwen2_moe", "mistral", "gemma3", "gemma2",
         "mixtral", "phi3", "olmo2", "granite", "smollm3", "gemma",
         "starcoder2", "gpt_oss", "glm", "glm4", "cohere", "cohere2", "deepseek_v2",
         "deepseek_v3")
INITIALIZER_RANGE = 0.3


def _base_config(vocab_size: int, eos_token_id: int) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        initializer_range=INITIALIZER_RANGE, bos_token_id=eos_token_id,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id)


def _interleaved_rope_archs() -> dict:
    """GLM, GLM-4, Cohere, Cohere2: (config class, model class, per-arch defaults)."""
    # GLM / GLM-4: their defaults (rope over half of each head, interleaved; q/k/v biases);
    # GLM-4's extra norms come with its class
    glm = {"tie_word_embeddings": False}
    # Cohere: per-head q/k LayerNorms (Command-R+), a logit scale that is not a power of 2;
    # Cohere2: 4 layers, the 4th full (no rope), the others sliding with a window of 8
    cohere = {"use_qk_norm": True, "logit_scale": 0.7, "tie_word_embeddings": True}
    cohere2 = {"num_hidden_layers": 4, "sliding_window": 8, "logit_scale": 0.7,
               "tie_word_embeddings": True}
    return {"glm": (tf.GlmConfig, tf.GlmForCausalLM, glm),
            "glm4": (tf.Glm4Config, tf.Glm4ForCausalLM, glm),
            "cohere": (tf.CohereConfig, tf.CohereForCausalLM, cohere),
            "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM, cohere2)}


def _arch_config(arch: str):
    """(config class, model class, per-arch config defaults) for one of ARCHS."""
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    # 3 layers: layer 1 is dense (mlp_only_layers), 0 and 2 route to 2 of 8 experts
    moe = {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1],
           "tie_word_embeddings": True}
    # Gemma 3: 3 layers, sliding (window 8), full, sliding; each type its own rope table
    # (full: theta 1e6 with linear scaling x8, as the 4B+ models; sliding: local base 1e4);
    # attention scale 1/sqrt(24), not 1/sqrt(head_dim)
    gemma3 = {"num_hidden_layers": 3, "sliding_window": 8, "query_pre_attn_scalar": 24,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
              "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "tie_word_embeddings": True}
    # Gemma 2: 4 layers alternating sliding (window 8) / full (Gemma2Config's rule); caps low
    # enough that the tiny model's scores and logits reach them
    gemma2 = {"num_hidden_layers": 4, "sliding_window": 8, "query_pre_attn_scalar": 24,
              "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
              "tie_word_embeddings": True}
    # Mixtral: every layer sparse, 2 of 4 experts of intermediate_size (no dense MLP), window 8
    mixtral = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
               "sliding_window": 8, "tie_word_embeddings": False}
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint, window 8 on every layer
    phi3 = {"sliding_window": 8, "tie_word_embeddings": False}
    # OLMo 2: q/k bias (attention_bias) on, tied head off
    olmo2 = {"attention_bias": True, "tie_word_embeddings": False}
    # Granite: every multiplier away from 1, attention scale 1/8 (not 1/sqrt(16))
    granite = {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
               "attention_multiplier": 0.125, "logits_scaling": 2.5, "tie_word_embeddings": True}
    # SmolLM3: 4 layers, every 2nd NoPE (layers 1 and 3), tied head (its config's default)
    smollm3 = {"num_hidden_layers": 4, "no_rope_layer_interval": 2}
    # Gemma (1): its GeGLU, (1 + w) norms and scaled embedding; q/k/v/o biases on
    gemma = {"attention_bias": True, "tie_word_embeddings": True}
    # StarCoder2: LayerNorms, a plain gelu MLP, biases everywhere (use_bias), tied head; no
    # window unless a test sets sliding_window
    starcoder2 = {"norm_epsilon": 1e-5, "tie_word_embeddings": True}
    # GPT-OSS: 3 layers (sliding window 8, full, sliding), 2 of 4 experts of width 48, a plain
    # rope (GptOssConfig's default is yarn), a SwiGLU limit low enough that the clamps bite
    gpt_oss = {"num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2,
               "intermediate_size": 48, "sliding_window": 8, "swiglu_limit": 1.5,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
               "tie_word_embeddings": False}
    # DeepSeek: 3 layers, layer 0 dense, 1 and 2 route to 2 of 8 experts in 4 groups (2 kept)
    # plus shared experts; MLA with a latent of 48 + 16 rope dims (64: the CPU kernel's size)
    deepseek = {"num_hidden_layers": 3, "num_key_value_heads": 4, "intermediate_size": 96,
                "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
                "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "kv_lora_rank": 48,
                "qk_rope_head_dim": 16, "qk_nope_head_dim": 24, "v_head_dim": 20,
                "tie_word_embeddings": False}
    # V2-Lite's shape (q_proj, no q_lora_rank), group-limited routing, 2 shared experts
    deepseek_v2 = {**deepseek, "q_lora_rank": None, "topk_method": "group_limited_greedy",
                   "n_shared_experts": 2, "routed_scaling_factor": 1.5}
    # V3: q through the q LoRA, sigmoid routing with the correction bias, yarn with DeepSeek's
    # mscale / mscale_all_dim (the attention factor and the softmax scale both away from 1)
    deepseek_v3 = {**deepseek, "q_lora_rank": 24, "n_shared_experts": 1,
                   "routed_scaling_factor": 2.5,
                   "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                       "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                                       "original_max_position_embeddings": 512,
                                       "beta_fast": 32, "beta_slow": 1}}
    table = {
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, deepseek_v2),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, deepseek_v3),
        **_interleaved_rope_archs(),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, gpt_oss),
        "starcoder2": (tf.Starcoder2Config, tf.Starcoder2ForCausalLM, starcoder2),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, gemma),
        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM, smollm3),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, olmo2),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, granite),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, phi3),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, mixtral),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, gemma2),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, gemma3),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, moe),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                      {**moe, "norm_topk_prob": False, "shared_expert_intermediate_size": 48}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"tie_word_embeddings": True}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        # sliding_window: transformers' default 4096 (set it small to test the window)
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"tie_word_embeddings": False}),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM,
                  {"tie_word_embeddings": False, "rope_scaling": llama3_rope}),
    }
    return table[arch]


def _perturb_biases_and_norms(model) -> None:
    """transformers initialises biases to 0 and norm weights to 1, which would leave those
    code paths untested; give them random values (from the already seeded generator)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_bias")):
                param.normal_(0.0, INITIALIZER_RANGE)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):    # DeepSeek-V3's router (zeros)
                buffer.normal_(0.0, INITIALIZER_RANGE)


def make_tiny_model(out_dir: str | Path, arch: str = "qwen3", seed: int = 0,
                    shard_size: int | str | None = None, **config_overrides) -> Path:
    """Write a tiny random `arch` model with its tokenizer into out_dir and return the path.

    shard_size (bytes or e.g. "100KB") makes save_pretrained split the weights and write
    model.safetensors.index.json. config_overrides replace any config field (e.g.
    num_key_value_heads=1, num_hidden_layers=3).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is invalid: must be one of {ARCHS}")
    out = Path(out_dir)
    tok = make_tiny_tokenizer_dir(out)
    config_class, model_class, arch_defaults = _arch_config(arch)
    fields = {**_base_config(tok["vocab_size"], tok["eos_token_id"]), **arch_defaults,
              **config_overrides}
    config = config_class(**fields)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    _perturb_biases_and_norms(model)
    save_kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(out, **save_kwargs)
    tf.GenerationConfig(eos_token_id=tok["eos_token_id"], bos_token_id=tok["eos_token_id"],
                     pad_token_id=tok["eos_token_id"], do_sample=False).save_pretrained(out)
    return out
