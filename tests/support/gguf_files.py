"""GGUF files for tests, written with gguf-py's GGUFWriter (the reference writer) the way
llama.cpp's convert_hf_to_gguf.py writes them: from a tiny Hugging Face model directory, with the
llama q/k permutation, 2-D weights in the asked type and 1-D tensors (norms) in F32.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ARCH_OF = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
           "Qwen3ForCausalLM": "qwen3",
           # mixture-of-experts: written as llama.cpp does (no reader here supports them yet)
           "Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe"}
_HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               # a MoE block: the router, the shared expert and its gate
               "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp"}
# one expert's projection -> the name of the [E, ...] tensor llama.cpp stacks every expert's into
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf.startswith("blk."):     # already named (stacked experts)
        return hf
    if hf in _TOP:
        return _TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it for Llama 3.1 rope scaling."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _tokenizer_metadata(writer: gguf.GGUFWriter, model_dir: Path, pre: str | None,
                        user_defined: tuple[str, ...]) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    specials = {t["id"] for t in tok["added_tokens"] if t["special"]}
    user = {vocab[t] for t in user_defined}
    types = [3 if i in specials else 4 if i in user else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)


def write_gguf(path: Path, model_dir: str | Path, qtype: str = "F32", pre: str | None = None,
               chat_template: str | None = None, user_defined: tuple[str, ...] = (),
               bos_token_id: int | None = None, eot_token_id: int | None = None) -> Path:
    """Write the tiny model in `model_dir` (made by make_tiny_model) as a GGUF file."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = ARCH_OF[cfg["architectures"][0]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta")
    writer.add_rope_freq_base(theta)
    writer.add_key_length(cfg["head_dim"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if cfg.get("num_experts"):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _tokenizer_metadata(writer, model_dir, pre, user_defined)
    writer.add_eos_token_id(cfg["eos_token_id"])
    if bos_token_id is not None:
        writer.add_bos_token_id(bos_token_id)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    writer.add_add_bos_token(bos_token_id is not None)
    if chat_template:
        writer.add_chat_template(chat_template)
    _add_tensors(writer, model_dir, cfg, arch, gguf.GGMLQuantizationType[qtype])
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, cfg["head_dim"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _stack_experts(weights: dict) -> dict:
    """Per-expert projections -> one [E, out, in] tensor per layer and projection, under its
    GGUF name (blk.N.ffn_{gate,up,down}_exps.weight); other tensors unchanged."""
    out, experts = {}, {}
    for name, w in weights.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = w
        else:
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = w
    for (layer, proj), by_expert in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack(
            [by_expert[e] for e in sorted(by_expert)])
    return out


def _add_tensors(writer: gguf.GGUFWriter, model_dir: Path, cfg: dict, arch: str,
                 qtype: gguf.GGMLQuantizationType) -> None:
    weights = _stack_experts(load_file(str(model_dir / "model.safetensors")))
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for name in sorted(weights):
        w = weights[name].astype(np.float32)
        proj = name.split(".")[-2]
        if arch == "llama" and proj in heads:
            w = llama_cpp_permute(w, heads[proj])
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), w)


def write_spm_tokenizer_gguf(path: Path, corpus: list[str], vocab_size: int = 600,
                             arch: str = "llama",
                             extra_tokens: tuple[tuple[str, int], ...] = ()) -> Path:
    """A GGUF holding only a SentencePiece-style ("llama") tokenizer, as llama.cpp writes Llama 2
    files: <unk>, <s>, </s>, the 256 <0xXX> byte tokens, then pieces with "▁" for spaces; scores
    give the merge priority (no tokenizer.ggml.merges key). `arch` names the architecture
    (general.architecture and its keys); a Gemma one also gets whitespace-only pieces spelled
    with real spaces, as Gemma files hold them. `extra_tokens`: (token, token_type) appended
    (Gemma's <mask>, marked user-defined by converters older than llama.cpp's
    does_token_look_special)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(list(corpus) * 3, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False))
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    if arch.startswith("gemma"):
        tokens += ["  ", "   ", "\t\t"]
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x")
             else 1 for t in tokens]
    tokens += [t for t, _ in extra_tokens]
    types += [kind for _, kind in extra_tokens]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 32,
                       "feed_forward_length": 64, "attention.head_count": 2}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0 if kind != 1 else -float(i) for i, kind in enumerate(types)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
