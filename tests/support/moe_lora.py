"""LoRA adapters on routed MoE experts and their references (docs/lora.md, "MoE experts").

Two forms: peft's own adapter over transformers 5 (target_parameters on the fused expert
parameters: make_adapter with MLP targets converts them, or target_parameters given outright),
and the per-expert modules (`experts.<e>.gate_proj`, Mixtral's `experts.<e>.w1`) written here
with random tensors, only on the experts asked for. The reference is transformers with each
adapter merged into the weights, W + scale * B @ A: peft's merge_and_unload for its own form,
the sum written out here for the per-expert form.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.support.lora_adapters import model_greedy

# per-expert module names: (gate, up, down) and where each sits in the fused parameters
PROJS = {"mixtral": ("w1", "w3", "w2")}
QWEN_PROJS = ("gate_proj", "up_proj", "down_proj")


def per_expert_adapter(model_dir: str, out_dir: Path, *, experts: dict[int, list[int]],
                       r: int = 4, alpha: int = 16, seed: int = 0,
                       projs: tuple[int, ...] = (0, 1, 2), attention: bool = True) -> str:
    """A PEFT directory (peft over transformers 4's layout) adapting, for layer L, the experts
    experts[L] (projections `projs`: 0 gate, 1 up, 2 down), plus q_proj / v_proj of every
    layer when `attention`."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = cfg["model_type"]
    names = PROJS.get(arch, QWEN_PROJS)
    hidden, inter = cfg["hidden_size"], cfg.get("moe_intermediate_size",
                                                 cfg["intermediate_size"])
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    gen = torch.Generator().manual_seed(seed)
    tensors = {}

    def add(module: str, fan_in: int, fan_out: int) -> None:
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) * 0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * 0.5

    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    for layer in range(cfg["num_hidden_layers"]):
        if attention:
            add(f"model.layers.{layer}.self_attn.q_proj", hidden, heads * head_dim)
            add(f"model.layers.{layer}.self_attn.v_proj", hidden, kv * head_dim)
        for e in experts.get(layer, ()):
            for p in projs:
                fan_in, fan_out = (inter, hidden) if p == 2 else (hidden, inter)
                add(f"model.layers.{layer}.{block}.experts.{e}.{names[p]}", fan_in, fan_out)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    targets = (["q_proj", "v_proj"] if attention else []) + [names[p] for p in projs]
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": model_dir}))
    return str(out_dir)


def _merge_per_expert(model, adapter_dir: str) -> None:
    """W += scale * B @ A for every module of a per-expert adapter, in transformers 5's model
    (fused gate_up_proj [E, 2I, H]: gate rows then up rows; down_proj [E, H, I])."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
    tensors = load_file(f"{adapter_dir}/adapter_model.safetensors")
    params = dict(model.named_parameters())
    for key in [k for k in tensors if ".lora_A." in k]:
        module = key[len("base_model.model."):-len(".lora_A.weight")]
        delta = scale * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
        if ".experts." not in module:
            params[f"{module}.weight"].data += delta
            continue
        prefix, e, proj = module.replace(".block_sparse_moe.", ".mlp.").rsplit(".", 2)
        if proj in ("down_proj", "w2"):
            params[f"{prefix}.down_proj"].data[int(e)] += delta
        else:                                    # gate rows first, then up rows
            rows = delta.shape[0]
            start = 0 if proj in ("gate_proj", "w1") else rows
            params[f"{prefix}.gate_up_proj"].data[int(e), start:start + rows] += delta


@lru_cache(maxsize=8)
def merged_model(model_dir: str, adapter_dir: str | None):
    """transformers' fp32 model of model_dir with the adapter merged into its weights (None:
    the base), eval mode, no eos; cached."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
        if cfg.get("target_parameters"):
            from peft import PeftModel
            model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
        else:
            _merge_per_expert(model, adapter_dir)
    model.generation_config.eos_token_id = None
    return model.eval()


def reference(model_dir: str, adapter_dir: str | None, prompt: tuple[int, ...], max_new: int):
    """(HFGreedy of the merged model's generate(), the logprob of each prompt token after the
    first under its forward)."""
    model = merged_model(model_dir, adapter_dir)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    prompt_lp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return model_greedy(model, prompt, max_new), prompt_lp
