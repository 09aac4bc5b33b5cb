"""FP8 (e4m3) linear weights dequantized at load: quant_method "fp8" (Qwen3-*-FP8, DeepSeek-V3)
and compressed-tensors "float-quantized" (RedHatAI / neuralmagic *-FP8-dynamic).

A weight W [R, C] is stored as `weight` float8_e4m3fn [R, C] and one float scale per

    block     [bn, bk] (weight_block_size): scale [ceil(R / bn), ceil(C / bk)]; the last block
              row / column may be partial (R or C not a multiple of the block)
    channel   row: scale [R, 1] (or [R])
    tensor    the whole weight: scale [] (or [1])

    W[r, c] = float32(weight[r, c]) * scale[r // bn, c // bk]       (block; the others alike)

computed in float32 and rounded once to the model dtype, as transformers' Fp8Dequantize does
(`weight_scale_inv` is, despite its name, the multiplier: the checkpoint stores 1 / the
quantizer's scale). A region [r0, r1) x [c0, c1) is dequantized from its own blocks only.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn


def check_fp8(weight: torch.Tensor, name: str) -> None:
    """ValueError naming `name` unless the weight is float8_e4m3fn (the e4m3 format)."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: FP8 weight dtype {weight.dtype} is not supported: only "
                         f"{FP8_DTYPE} (fmt e4m3)")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   name: str) -> torch.Tensor:
    """weight float8_e4m3fn [R, C] x its scales (module docstring) -> float32 [R, C]; a
    non-finite result (a NaN code, an inf scale) is refused naming `name`."""
    check_fp8(weight, name)
    if not scale.dtype.is_floating_point:
        raise ValueError(f"{name}: FP8 scale dtype {scale.dtype} is not supported: only floating "
                         "scales (float32, bfloat16, float16, float8_e8m0fnu)")
    rows, cols = weight.shape
    values = weight.to(torch.float32)
    if block is not None:
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != want:
            raise ValueError(f"{name}: FP8 block scale shape {tuple(scale.shape)} does not fit "
                             f"weight {(rows, cols)} in blocks {list(block)}: must be {want}")
        times_block_scale(values, scale.to(torch.float32), block)
    else:
        values.mul_(_channel_or_tensor(scale, rows, name))
    check_finite(values, f"{name}: FP8 weight dequantizes to non-finite values (a NaN code or "
                         "an infinite scale)")
    return values


def times_block_scale(values: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int]) -> None:
    """values [R, C] *= scale [ceil(R / bn), ceil(C / bk)] per block, in place: the whole
    blocks through one broadcast view (no [R, C] scale nor a second [R, C] product: an 8B
    model's gate_proj is 200 MB in float32), a partial last block column / row apart."""
    (rows, cols), (bn, bk) = values.shape, block
    full_r, full_c = rows // bn, cols // bk
    if full_r and full_c:
        whole = values[:full_r * bn, :full_c * bk].unflatten(1, (full_c, bk))
        whole.unflatten(0, (full_r, bn)).mul_(scale[:full_r, None, :full_c, None])
    if cols > full_c * bk:             # the last block column, every row
        values[:, full_c * bk:].mul_(scale[:, -1].repeat_interleave(bn)[:rows, None])
    if rows > full_r * bn and full_c:  # the last block row, its whole block columns
        values[full_r * bn:, :full_c * bk].mul_(scale[-1, :full_c].repeat_interleave(bk))


def check_finite(values: torch.Tensor, message: str) -> None:
    """ValueError(message) unless every value is finite: min and max propagate NaN and show
    an inf, for a fraction of torch.isfinite's cost."""
    if values.numel():
        lo, hi = values.aminmax()
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            raise ValueError(message)


def _channel_or_tensor(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A per-row [R, 1] / [R] or per-tensor [] / [1] scale, shaped to broadcast over [R, C]."""
    if scale.numel() == 1 and scale.dim() <= 1:
        return scale.to(torch.float32).reshape(1, 1)
    if tuple(scale.shape) in ((rows, 1), (rows,)):
        return scale.to(torch.float32).reshape(rows, 1)
    raise ValueError(f"{name}: FP8 scale shape {tuple(scale.shape)} does not fit {rows} rows: "
                     f"must be [{rows}, 1] (per channel) or [] / [1] (per tensor)")
