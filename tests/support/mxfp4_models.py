"""A tiny GPT-OSS whose experts are stored as MXFP4 (the layout openai/gpt-oss ships:
<proj>_blocks uint8 [E, R, G, 16], <proj>_scales uint8 [E, R, G], quantization_config
quant_method "mxfp4"), and its reference twin with the same experts dequantized by
transformers' own convert_moe_packed_tensors, as a plain float32 checkpoint transformers loads."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
# what openai/gpt-oss-20b's config.json lists
MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                         "model.embed_tokens", "lm_head"]


def random_packed(shape_out_in: tuple[int, int, int], gen: torch.Generator):
    """Random MXFP4 blocks and scales for a weight W [E, R, C] (C a multiple of 32); the
    scales 2^-5 .. 2^-3 keep the tiny model's activations in range."""
    experts, rows, cols = shape_out_in
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen,
                           dtype=torch.uint8)
    scales = torch.randint(122, 125, (experts, rows, cols // 32), generator=gen,
                           dtype=torch.uint8)
    return blocks, scales


def make_mxfp4_pair(src: str | Path, quantized: str | Path, reference: str | Path,
                    seed: int = 0) -> tuple[Path, Path]:
    """Copy the tiny GPT-OSS at `src` twice: `quantized` with every expert weight replaced by
    random MXFP4 blocks/scales, `reference` with those weights dequantized (float32)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    src, quantized, reference = Path(src), Path(quantized), Path(reference)
    for dst in (quantized, reference):
        shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    packed, dense = {}, {}
    for name, tensor in weights.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in EXPERT_WEIGHTS:
            packed[name] = dense[name] = tensor
            continue
        experts, cols, rows = tensor.shape             # transformers' [E, in, out]
        blocks, scales = random_packed((experts, rows, cols), gen)
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, reference / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": MODULES_NOT_CONVERTED}
    (quantized / "config.json").write_text(json.dumps(cfg, indent=2))
    return quantized, reference
