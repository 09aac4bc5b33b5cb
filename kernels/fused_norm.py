"""Fused RMSNorm (+ residual add) in Triton: one program per row, statistics in float32.

Same contract as worker_service/layers/norm.py RMSNorm, rounding step for rounding step:

    rms_norm(x, w, eps)            -> w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)
    rms_norm(x, w, eps, residual)  -> (rms_norm(s, w, eps), s)  where s = (x + residual) in
                                      x.dtype (the next residual add starts from s)

The torch version takes ~5 kernels (add, pow, mean, rsqrt-mul, cast, weight-mul) and reads the
row several times; this reads x (and residual) once and writes once. The model uses it when
loaded with fused_ops=True (RunnerConfig.fused_ops; off by default until GPU timings, `python -m
bench.fused_ops`, show a gain). Launched without mul+add -> fma contraction, like torch's ops.

On CPU the kernel runs only under the Triton interpreter (TRITON_INTERPRET=1 before triton is
imported, as tests/conftest.py arranges).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_FUSED_HIDDEN = 65536      # one row per program must fit in registers / shared memory


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, inner,
                     stride_x0, stride_x1, stride_res0, stride_res1,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # row r of the input sits at (r // inner) * stride_0 + (r % inner) * stride_1; outputs are
    # contiguous [rows, n_cols]
    row = tl.program_id(0).to(tl.int64)
    outer, in_row = row // inner, row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + outer * stride_x0 + in_row * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + outer * stride_res0 + in_row * stride_res1 + cols, mask=mask,
                      other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * (1.0 / tl.sqrt(mean_sq + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x [..., H] (contiguous last dim), weight [H] in x's dtype. Returns the normed tensor, or
    (normed, x + residual) when residual (same shape and dtype as x) is given; outputs are
    contiguous. A 3-D x (the model's per-head q/k [T, heads, D], a strided view of the qkv
    projection) is read through its strides, never copied."""
    hidden = x.shape[-1]
    _check(x, weight, residual, hidden)
    inner = x.shape[1] if x.dim() == 3 else 1
    x_rows, sx0, sx1 = _row_layout(x, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // hidden
    if residual is not None:
        res_rows, sr0, sr1 = _row_layout(residual, hidden)
        res_out = torch.empty_like(out)
    else:
        res_rows, sr0, sr1, res_out = x_rows, 0, 0, out      # unused (HAS_RESIDUAL=False)
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x_rows, res_rows, weight, out, res_out, hidden, eps, inner, sx0, sx1, sr0, sr1,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)), enable_fp_fusion=False)
    if residual is None:
        return out
    return out, res_out


def _row_layout(t: torch.Tensor, hidden: int) -> tuple[torch.Tensor, int, int]:
    """(tensor, outer stride, inner stride) as the kernel indexes rows: a 3-D tensor as it is,
    anything else as a [-1, hidden] view (a copy only when no view exists)."""
    if t.dim() == 3:
        return t, t.stride(0), t.stride(1)
    t2 = t.reshape(-1, hidden)
    return t2, t2.stride(0), 0


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
           hidden: int) -> None:
    """Shape/dtype rules the kernel relies on; ValueError naming the offender."""
    if not 1 <= hidden <= MAX_FUSED_HIDDEN:
        raise ValueError(f"hidden size {hidden} is invalid: must be in [1, {MAX_FUSED_HIDDEN}]")
    if x.stride(-1) != 1:
        raise ValueError(f"x stride {x.stride()}: the last dim must be contiguous")
    if tuple(weight.shape) != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype}: must be ({hidden},) "
                         f"{x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype}: must match x "
                         f"{tuple(x.shape)} {x.dtype} with a contiguous last dim")
