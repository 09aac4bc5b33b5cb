"""MXFP4 expert weights (GPT-OSS checkpoints: quantization_config quant_method "mxfp4"),
dequantized at load to the model's dtype exactly as transformers' integrations/mxfp4.py
(`convert_moe_packed_tensors`) does, so a served model holds the very weights transformers runs.

Layout of one quantized weight W [E, R, C] (R output rows, C = G * 32 input columns):

    <name>_blocks  uint8 [E, R, G, 16]   two FP4 (e2m1) codes a byte: low nibble = even column
    <name>_scales  uint8 [E, R, G]       one power-of-two exponent per 32 columns, biased by 127

    W[e, r, 32 g + 2 b]     = FP4_VALUES[blocks[e, r, g, b] & 0xF] * 2 ** (scales[e, r, g] - 127)
    W[e, r, 32 g + 2 b + 1] = FP4_VALUES[blocks[e, r, g, b] >> 4]  * 2 ** (scales[e, r, g] - 127)

and the result is transposed to [E, C, R], the layout of transformers' GptOssExperts parameters
(gate_up_proj [E, H, 2I], down_proj [E, I, H]). The lookup and the ldexp run in the target dtype,
as transformers' do, so bfloat16 results round the same way.
"""
from __future__ import annotations

import math

import torch

# the e2m1 code points, by code (bit 3 is the sign), as transformers' FP4_VALUES
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BYTES_PER_GROUP = 16        # 32 FP4 values


def check_packed(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """ValueError naming `name` unless blocks [..., G, 16] and scales [..., G] are uint8 and
    agree in shape."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} "
                         f"and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BYTES_PER_GROUP \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit: must be [E, R, G, 16] and [E, R, G]")


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                       name: str = "experts") -> torch.Tensor:
    """blocks uint8 [E, R, G, 16], scales uint8 [E, R, G] -> W^T [E, G * 32, R] in dtype (the
    module docstring's formula)."""
    check_packed(blocks, scales, name)
    num_experts, rows, groups, width = blocks.shape
    flat = blocks.reshape(-1, width)
    exponents = scales.to(torch.int32).reshape(-1, 1) - SCALE_BIAS
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(flat.shape[0], width * 2, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(flat & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(flat >> 4).to(torch.int)]
    torch.ldexp(out, exponents, out=out)
    check_finite(out.view(num_experts, rows, groups, width * 2), scales, dtype, name)
    out = out.view(num_experts, rows, groups * width * 2)
    return out.transpose(1, 2).contiguous()


def check_finite(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 name: str) -> None:
    """ValueError naming the first group [E, R, G, 32] whose scale overflows `dtype` (255, the
    E8M0 NaN code, always does): transformers would load inf/NaN weights silently and every
    token routed to that expert would come out NaN."""
    largest_safe = SCALE_BIAS + math.floor(math.log2(torch.finfo(dtype).max / 6.0))
    if scales.numel() == 0 or int(scales.max()) <= largest_safe:
        return              # no group can overflow: skip the pass over the weights
    bad = ~torch.isfinite(values).all(dim=-1)
    if not bad.any():
        return
    expert, row, group = (int(i) for i in bad.nonzero()[0])
    scale = int(scales[expert, row, group])
    raise ValueError(f"{name}: MXFP4 scale {scale} (expert {expert}, row {row}, group {group}) "
                     f"gives non-finite {dtype} weights: each code x 2^(scale - {SCALE_BIAS}) "
                     f"must be within +-{torch.finfo(dtype).max:.4g} (255 is the NaN code)")
