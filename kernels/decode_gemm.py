"""A split-K Triton GEMM for decode-sized inputs, y = x @ W^T, and a chooser that times a few
tile shapes per (rows bucket, N, K) on first use.

Why: at a decode step's batch (M <= 256) a projection is a few microseconds of work that
cuBLAS spreads over too few output tiles to fill an H100 (the four projections of Qwen3-0.6B
ran at ~0.35 of the copy bandwidth for their weight bytes, 0.84 ms a step). Splitting K gives
the N = hidden projections (o_proj, down_proj) more programs. Not an engine default: the
benchmarks' `--decode-gemm triton` swaps it in (bench/decode_gemm_override.py) and
`python -m bench.decode_gemm` times it per shape against F.linear.

Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K): each program multiplies one output tile
over a 1/SPLIT_K share of K. SPLIT_K = 1 writes the output in x's dtype; otherwise each split
writes float32 partials [SPLIT_K, M, N] that a sum reduces (deterministic: no atomics), so a
projection whose N alone makes few tiles (N = hidden size) can still spread over every SM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): small-M tiles, split-K for the
# projections whose N alone leaves most SMs idle (o_proj, down_proj: N = hidden).
CONFIGS = [(64, 64, 128, 1, 4, 4), (64, 128, 64, 1, 4, 4), (128, 64, 64, 1, 4, 4),
           (64, 64, 128, 2, 4, 4), (64, 64, 128, 4, 4, 4), (64, 128, 128, 2, 8, 3),
           (128, 128, 64, 1, 8, 3), (32, 64, 128, 1, 4, 4), (32, 64, 128, 4, 4, 4)]
MAX_ROWS = 256             # inputs with more rows stay with F.linear


# M (the step's rows) varies with the batch: specialised (== 1, a multiple of 16) it compiled
# the kernel again mid-run; it only bounds masks.
@triton.jit(do_not_specialize=["M"])
def _split_k_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_os, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * per_split
    k_end = tl.minimum(k_start + per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=(rn < N)[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, b)
    dst = out_ptr + pid_k.to(tl.int64) * stride_os + rm[:, None].to(tl.int64) * stride_om \
        + rn[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int,
                   block_k: int, split_k: int, num_warps: int = 4,
                   num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype (both with a unit last stride)."""
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: need [M, K] "
                         "and [N, K] with unit stride along K")
    m, k = x.shape
    n = weight.shape[0]
    out = (torch.empty(m, n, dtype=x.dtype, device=x.device) if split_k == 1 else
           torch.empty(split_k, m, n, dtype=torch.float32, device=x.device))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _split_k_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0),
                          out.stride(0) if split_k > 1 else 0, out.stride(-2),
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                          num_warps=num_warps, num_stages=num_stages)
    return out if split_k == 1 else out.sum(0).to(x.dtype)


class DecodeGemm:
    """x @ weight^T (+ bias) through split_k_linear, with the best of `configs` for each
    (rows bucket, N, K), timed on first use outside graph capture (during capture, or when
    nothing was timed yet, the first config that fits). `timer(fn) -> seconds` is injectable."""

    def __init__(self, configs=None, timer=None) -> None:
        self.configs = list(configs or CONFIGS)
        self.timer = timer or _cuda_time
        self.chosen: dict[tuple[int, int, int], tuple] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        key = (max(16, triton.next_power_of_2(x.shape[0])), weight.shape[0], weight.shape[1])
        cfg = self.chosen.get(key)
        if cfg is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                cfg = self.configs[0]
            else:
                cfg = self.chosen[key] = min(
                    self.configs, key=lambda c: self.timer(lambda: split_k_linear(x, weight, *c)))
        y = split_k_linear(x, weight, *cfg)
        return y if bias is None else y + bias


def _cuda_time(fn, reps: int = 10) -> float:
    """Mean seconds per call over `reps` calls after two untimed ones (a device sync)."""
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps
