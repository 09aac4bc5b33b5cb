"""GGUF files of the families beyond Llama and Qwen (Gemma 1/2/3, Phi-3, StarCoder2, a Mistral
with a window), written from a tiny Hugging Face model directory as llama.cpp's
convert_hf_to_gguf.py writes them: tensor names from gguf-py's own map for the architecture,
Gemma's RMSNorm weights stored as w + 1, the llama q/k permutation, and the metadata each
family's converter adds (softcaps, windows, key length, rope dimension count, linear rope
scaling). Tokenizer metadata as tests/support/gguf_files.py writes it.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.support.gguf_files import _tokenizer_metadata, llama_cpp_permute

GGUF_ARCH = {"GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
             "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
             "Starcoder2ForCausalLM": "starcoder2", "MistralForCausalLM": "llama"}
_GEMMA = ("gemma", "gemma2", "gemma3")


def _rope(cfg: dict) -> dict:
    """The rope dict the converter reads (Gemma 3: the full layers'), rope_theta included."""
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope = rope.get("full_attention", rope)
    return {"rope_theta": cfg.get("rope_theta"), **rope}


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = _rope(cfg)
    w.add_rope_freq_base(rope["rope_theta"])
    if arch == "starcoder2":
        w.add_layer_norm_eps(cfg["norm_epsilon"])
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch in _GEMMA:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3" and cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        rot = rope.get("partial_rotary_factor") or 1.0
        w.add_rope_dimension_count(int(rot * cfg["hidden_size"]) // cfg["num_attention_heads"])
    if arch in ("gemma2", "gemma3", "phi3") or cfg.get("sliding_window"):
        w.add_sliding_window(cfg.get("sliding_window") or 0)


def _tensors(w: gguf.GGUFWriter, arch: str, cfg: dict, model_dir: Path,
             qtype: gguf.GGMLQuantizationType) -> None:
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg["num_hidden_layers"])
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for hf, tensor in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if arch == "gemma2" and hf == "lm_head.weight":
            continue              # llama.cpp's Gemma 2 always ties the head
        x = tensor.astype(np.float32)
        if arch == "llama" and hf.split(".")[-2] in heads:
            x = llama_cpp_permute(x, heads[hf.split(".")[-2]])
        if arch in _GEMMA and hf.endswith("norm.weight"):
            x = x + np.float32(1)
        stem, suffix = hf.rsplit(".", 1)
        name = f"{names.get_name(stem)}.{suffix}"
        if x.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)


def write_family_gguf(path: Path, model_dir: str | Path, qtype: str = "F32") -> Path:
    """The tiny model in `model_dir` (make_tiny_model) as llama.cpp would convert it."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, cfg)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer_metadata(w, model_dir, None, ())
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])       # Phi3Config's default 32000 is off the vocab
    _tensors(w, arch, cfg, model_dir, gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
