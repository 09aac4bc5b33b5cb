"""A tiny model saved in each weight-quantized form users download (same tensor names, dtypes
and quantization_config as the real files), and its reference twin: the same model with those
weights dequantized by a reference independent of ours, saved as a plain float32 checkpoint
transformers loads.

    fp8          Qwen3-*-FP8 / DeepSeek-V3: weight F8_E4M3 + weight_scale_inv F32 per block
    fp8-ct       compressed-tensors FP8-dynamic: weight F8_E4M3 + weight_scale BF16 [R, 1]
    gptq         AutoGPTQ v1, 4 bits, desc_act (a shuffled g_idx), asymmetric zeros
    gptq8        GPTQModel gptq_v2, 8 bits, symmetric, no act order (no g_idx)
    awq          AutoAWQ GEMM, 4 bits, zero_point

FP8's reference is transformers' own _dequantize_fp8_weight; GPTQ's and AWQ's are the integer
codes, zeros and scales the builder drew, packed here bit by bit from the formats' published
layouts (so a wrong order or offset on our side fails)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("fp8", "fp8-ct", "gptq", "gptq8", "awq")
FP8_MAX = 448.0
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The decoder's linear weights (not norms, embeddings, the head or an MoE router), as the
    released checkpoints quantize them."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and not name.endswith((".gate.weight", "shared_expert_gate.weight"))
            and "norm" not in name)


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]):
    """(weight float8_e4m3fn, weight_scale_inv float32 per block) of w [R, C]."""
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = tile.abs().max().clamp(min=1e-8) / FP8_MAX
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def dequant_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int]) -> torch.Tensor:
    """float32 weight [R, C] of FP8 `weight` and its per-block scale_inv: transformers'
    _dequantize_fp8_weight where it has one (5.24 does; 5.17, the GPU image's, does not: the
    same product then, equal to it bit for bit: tests/unit/bench/test_gpu_image_compat.py)."""
    try:
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    except ImportError:
        rows, cols = weight.shape
        full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)
        return weight.to(torch.float32) * full[:, :cols].to(torch.float32)
    return _dequantize_fp8_weight(weight, scale, list(block), torch.float32)


def pack_words(codes: list[int], bits: int) -> int:
    """Codes (first at the lowest bits) in one int32 word, as a signed Python int."""
    word = 0
    for k, code in enumerate(codes):
        word |= (int(code) & ((1 << bits) - 1)) << (k * bits)
    return word - (1 << 32) if word >= 1 << 31 else word


def gptq_pack(q: torch.Tensor, z: torch.Tensor, bits: int = 4, zero_offset: int = 1):
    """(qweight [C/p, R], qzeros [G, R/p]) of codes q [C, R] and true zeros z [G, R]; the v1
    format (zero_offset 1) stores each zero minus one, gptq_v2 (0) the zero itself."""
    p = 32 // bits
    cols, rows = q.shape
    qweight = torch.tensor([[pack_words([q[i * p + k, r] for k in range(p)], bits)
                             for r in range(rows)] for i in range(cols // p)], dtype=torch.int32)
    qzeros = torch.tensor([[pack_words([z[g, j * p + k] - zero_offset for k in range(p)], bits)
                            for j in range(rows // p)] for g in range(z.shape[0])],
                          dtype=torch.int32)
    return qweight, qzeros


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM words [N, R/8] of codes [N, R]: nibble k of word j holds row j*8 + AWQ_ORDER[k]."""
    n, rows = codes.shape
    return torch.tensor([[pack_words([codes[i, j * 8 + AWQ_ORDER[k]] for k in range(8)], 4)
                          for j in range(rows // 8)] for i in range(n)], dtype=torch.int32)


def _draw_ints(w: torch.Tensor, group_size: int, gen: torch.Generator, fmt: str,
               act_order: bool = True):
    """Random codes, zeros, scales (float16) and each column's group for a weight w [R, C]
    (its magnitude kept): returns q [C, R], z [G, R], scales [G, R], groups [C]. GPTQ v1's
    zeros run 1 .. 16 (stored minus one), AWQ's 0 .. 15, both ends drawn; gptq8 is symmetric
    8-bit (every zero 128). group_size -1: one group of all columns."""
    group_size = group_size if group_size > 0 else w.shape[1]
    if fmt == "gptq8":
        return _draw_sym8(w, group_size, gen)
    rows, cols = w.shape
    num_groups = -(-cols // group_size)        # a partial last group (DeepSeek q_lora_rank 24)
    groups = torch.arange(cols) // group_size
    if fmt == "gptq" and act_order:     # act order: columns visit the groups out of order
        groups = groups[torch.randperm(cols, generator=gen)]
    q = torch.randint(0, 16, (cols, rows), generator=gen, dtype=torch.int32)
    low = 1 if fmt == "gptq" else 0
    z = torch.randint(low, low + 16, (num_groups, rows), generator=gen, dtype=torch.int32)
    z[0, :2] = torch.tensor([low, low + 15])
    scales = (w.abs().mean() / 4 * (0.5 + torch.rand(num_groups, rows, generator=gen)))
    return q, z, scales.to(torch.float16), groups


def _draw_sym8(w: torch.Tensor, group_size: int, gen: torch.Generator):
    rows, cols = w.shape
    num_groups = -(-cols // group_size)        # a partial last group (DeepSeek q_lora_rank 24)
    q = torch.randint(0, 256, (cols, rows), generator=gen, dtype=torch.int32)
    z = torch.full((num_groups, rows), 128, dtype=torch.int32)
    scales = w.abs().mean() / 64 * (0.5 + torch.rand(num_groups, rows, generator=gen))
    return q, z, scales.to(torch.float16), torch.arange(cols) // group_size


def _dequant_ints(q, z, scales, groups) -> torch.Tensor:
    """W [R, C] = scales[g, r] * (q[c, r] - z[g, r]), float32, from the drawn integers."""
    return ((q - z[groups]).to(torch.float32) * scales.to(torch.float32)[groups]).t().contiguous()


def quantize(name: str, w: torch.Tensor, fmt: str, gen: torch.Generator,
             group_size: int, block: tuple[int, int], act_order: bool = True
             ) -> tuple[dict, torch.Tensor]:
    """(the packed tensors of module `name`'s weight, the reference dequantized weight)."""
    prefix = name.removesuffix(".weight")
    if fmt == "fp8":
        weight, scale = quantize_fp8_blocks(w, block)
        ref = dequant_fp8_blocks(weight, scale, block)
        return {name: weight, f"{prefix}.weight_scale_inv": scale}, ref
    if fmt == "fp8-ct":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(torch.bfloat16)
        weight = (w / scale.float()).to(torch.float8_e4m3fn)
        return {name: weight, f"{prefix}.weight_scale": scale}, weight.float() * scale.float()
    q, z, scales, groups = _draw_ints(w, group_size, gen, fmt, act_order)
    ref = _dequant_ints(q, z, scales, groups)
    if fmt == "gptq8":                  # gptq_v2, no act order: no g_idx saved
        qweight, qzeros = gptq_pack(q, z, bits=8, zero_offset=0)
        return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros,
                f"{prefix}.scales": scales}, ref
    if fmt == "gptq":
        qweight, qzeros = gptq_pack(q, z)
        return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros,
                f"{prefix}.scales": scales, f"{prefix}.g_idx": groups.to(torch.int32)}, ref
    return {f"{prefix}.qweight": awq_pack(q), f"{prefix}.qzeros": awq_pack(z),
            f"{prefix}.scales": scales}, ref


def quant_config(fmt: str, group_size: int, block: tuple[int, int],
                 act_order: bool = True) -> dict:
    """The quantization_config the released checkpoints of `fmt` carry."""
    if fmt == "fp8":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(block)}
    if fmt == "fp8-ct":
        scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                  "strategy": "channel", "group_size": None, "block_structure": None,
                  "actorder": None, "observer": "minmax", "observer_kwargs": {}}
        acts = {**scheme, "dynamic": True, "strategy": "token", "observer": None}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                              "input_activations": acts,
                                              "output_activations": None}},
                "ignore": ["lm_head"], "kv_cache_scheme": None,
                "quantization_status": "compressed", "global_compression_ratio": 1.5}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
                "sym": False, "damp_percent": 0.01, "static_groups": False,
                "true_sequential": True, "checkpoint_format": "gptq",
                "model_name_or_path": None, "model_file_base_name": "model"}
    if fmt == "gptq8":
        return {"quant_method": "gptq", "bits": 8, "group_size": group_size, "desc_act": False,
                "sym": True, "lm_head": False, "checkpoint_format": "gptq_v2",
                "pack_dtype": "int32", "meta": {"quantizer": ["gptqmodel:2.2.0"]}}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
            "zero_point": True, "modules_to_not_convert": None}


def make_quantized_pair(src: str | Path, out: str | Path, fmt: str, seed: int = 0,
                        group_size: int = 16, block: tuple[int, int] = (16, 16),
                        act_order: bool = True) -> tuple[Path, Path]:
    """Copy the tiny model at `src` as (`out`/fmt quantized, `out`/fmt-ref its float32 twin);
    act_order False: gptq's g_idx in column order (desc_act false)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} is invalid: must be one of {FORMATS}")
    src, out = Path(src), Path(out)
    quantized, reference = out / fmt, out / f"{fmt}-ref"
    for dst in (quantized, reference):
        shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    packed, dense = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if not is_quantized(name, tensor):
            packed[name] = dense[name] = tensor
            continue
        pieces, dense[name] = quantize(name, tensor, fmt, gen, group_size, block, act_order)
        packed.update(pieces)
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, reference / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant_config(fmt, group_size, block, act_order)
    cfg["torch_dtype"] = cfg.get("torch_dtype") or "float32"
    (quantized / "config.json").write_text(json.dumps(cfg, indent=2))
    return quantized, reference
