"""Decode throughput with and without a LoRA adapter (docs/lora.md), in-process, CPU fp32.

    python -m bench.lora_decode [--model DIR] [--rounds 3] [--batch 8] [--tokens 64]

Writes a random rank-16 PEFT adapter on q/k/v/o/gate/up/down of the model (no peft needed), then
alternates rounds: the batch with no adapter, the batch with the adapter, on one LLM started
with --enable-lora. --no-lora instead times the base path of an LLM started without LoRA (run it
against another checkout's PYTHONPATH to compare the LoRA-off path with it). Output tokens per
second of the whole generate() call (a short prompt's prefill included)."""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from deltaserve.default_model import default_model_dir
from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: Path, out: Path, r: int = 16) -> Path:
    """A random PEFT LoRA directory (B != 0) over model_dir's Llama-family config."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    dims = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d),
            "o_proj": (heads * d, h), "gate_proj": (h, inter), "up_proj": (h, inter),
            "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in TARGETS:
            part = "self_attn" if t in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            fan_in, fan_out = dims[t]
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(TARGETS)}))
    return out


def timed(llm: LLM, prompts, tokens: int, lora) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(), StoppingParams(max_tokens=tokens,
                                                                 ignore_eos=True),
                        **({} if lora is False else {"lora_request": lora}))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lora_decode")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--no-lora", action="store_true")
    a = p.parse_args()
    model = a.model or default_model_dir()
    prompts = [[(17 * i + j) % 1000 + 10 for j in range(16)] for i in range(a.batch)]
    print(f"{model.name} fp32 on {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; batch {a.batch}, {a.tokens} tokens each")
    if a.no_lora:
        llm = LLM(str(model), dtype="float32", num_kv_blocks=256)
        timed(llm, prompts, 4, False)                               # warm-up
        for i in range(a.rounds):
            print(f"round {i}: lora off {timed(llm, prompts, a.tokens, False):7.1f} tok/s")
        return
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_adapter(model, Path(tmp) / "r16")
        llm = LLM(str(model), dtype="float32", num_kv_blocks=256, enable_lora=True,
                  lora_modules=f"r16={adapter}", max_lora_rank=16)
        timed(llm, prompts, 4, "r16")                               # warm-up
        for i in range(a.rounds):
            base = timed(llm, prompts, a.tokens, None)
            lora = timed(llm, prompts, a.tokens, "r16")
            print(f"round {i}: no adapter {base:7.1f} tok/s | rank-16 adapter {lora:7.1f} "
                  f"tok/s ({lora / base:.2f}x)")


if __name__ == "__main__":
    main()
