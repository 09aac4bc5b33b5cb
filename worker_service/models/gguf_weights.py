"""A GGUF file's tensors under their Hugging Face names, dequantized to float32 (numpy only).

    GGUF name                      Hugging Face name
    token_embd.weight              model.embed_tokens.weight
    output_norm.weight             model.norm.weight
    output.weight                  lm_head.weight        (absent: tied to the embedding)
    blk.N.attn_norm.weight         model.layers.N.input_layernorm.weight
    blk.N.ffn_norm.weight          model.layers.N.post_attention_layernorm.weight
    blk.N.attn_{q,k,v}.{weight,bias}   model.layers.N.self_attn.{q,k,v}_proj.*
    blk.N.attn_output.weight       model.layers.N.self_attn.o_proj.weight
    blk.N.attn_{q,k}_norm.weight   model.layers.N.self_attn.{q,k}_norm.weight   (Qwen3)
    blk.N.ffn_{gate,up,down}.weight    model.layers.N.mlp.{gate,up,down}_proj.weight
  and per family (_FAMILY_LAYER, gguf-py's tensor map for that architecture):
    gemma2, gemma3: blk.N.post_attention_norm -> post_attention_layernorm,
                    blk.N.ffn_norm -> pre_feedforward_layernorm,
                    blk.N.post_ffw_norm -> post_feedforward_layernorm
    phi3:           blk.N.attn_qkv -> self_attn.qkv_proj, blk.N.ffn_up -> mlp.gate_up_proj
                    (both fused: models/phi3.py cuts them as it cuts the checkpoint's)
    starcoder2:     blk.N.ffn_up -> mlp.c_fc, blk.N.ffn_down -> mlp.c_proj (norms with .bias)

llama.cpp's converter permutes the q and k rows of `llama` files from the Hugging Face "rotate
half" rope layout to interleaved pairs; `unpermute_rows` undoes it (as transformers'
LlamaTensorProcessor does). Other families are not permuted. Gemma files hold every RMSNorm
weight with Gemma's (1 + w) folded in (w + 1); 1 is subtracted back (transformers'
Gemma2TensorProcessor does so for gemma2/gemma3; gemma files were converted the same way).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from engine_common.model_files.gguf_config import gguf_architecture
from engine_common.model_files.gguf_file import GGUFError, GGUFFile
from worker_service.models.gguf_dequant import check_supported, dequantize_tensor

_TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight",
              "output_norm.bias": "model.norm.bias",          # StarCoder2's LayerNorm
              "output.weight": "lm_head.weight"}
_PER_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_FAMILY_LAYER = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "starcoder2": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
}
_FAMILY_LAYER["gemma3"] = _FAMILY_LAYER["gemma2"]
# GGUF architectures whose q/k rows llama.cpp permuted
_PERMUTED_ARCHS = ("llama",)
# GGUF architectures whose norm weights llama.cpp stored as w + 1
_NORM_PLUS_ONE_ARCHS = ("gemma", "gemma2", "gemma3")
# tensors the config reads instead (Llama 3.1 rope factors: engine_common/model_files/gguf_config.py)
CONFIG_TENSORS = ("rope_freqs.weight",)


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor of architecture `arch`, or None when it has
    none."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    per_layer = {**_PER_LAYER, **_FAMILY_LAYER.get(arch, {})}
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in per_layer:
        return f"model.layers.{parts[1]}.{per_layer[parts[2]]}.{parts[3]}"
    return None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: within each head, rows (0, 2, 4, .., 1, 3, 5, ..) of
    the file go back to rows 0 .. head_dim-1. Works on weights [rows, in] and biases [rows]."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_tensor_names(gguf: GGUFFile) -> set[str]:
    """The Hugging Face names the file provides (GGUFError naming a tensor with none)."""
    names = set()
    arch = gguf.get("general.architecture")
    for name in gguf.tensors:
        if name in CONFIG_TENSORS:
            continue
        mapped = hf_name(name, arch)
        if mapped is None:
            raise GGUFError(f"{gguf.path}: tensor {name!r} has no Hugging Face counterpart "
                            f"(architecture {gguf.get('general.architecture')!r})")
        names.add(mapped)
    return names


def iter_gguf_weights(gguf: GGUFFile, hf_config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array) for every tensor, one at a time, in file order."""
    arch = gguf_architecture(gguf)
    gguf_tensor_names(gguf)
    check_supported(gguf)
    heads = {"q_proj": int(hf_config["num_attention_heads"]),
             "k_proj": int(hf_config["num_key_value_heads"])}
    for info in gguf.tensors.values():
        if info.name in CONFIG_TENSORS:
            continue
        name = hf_name(info.name, arch)
        w = dequantize_tensor(gguf, info)
        proj = name.split(".")[-2]
        if arch in _PERMUTED_ARCHS and proj in heads:
            w = unpermute_rows(w, heads[proj])
        if arch in _NORM_PLUS_ONE_ARCHS and info.name.endswith("norm.weight"):
            w = w - np.float32(1)
        yield name, w
