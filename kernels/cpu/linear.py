"""F.linear's CPU stand-in: y = x W^T + b through the deltaserve_cpu library's GEMMs.

Every prepared weight gets two layouts, chosen per call by the number of rows M:

    panels    M <= panel_max_rows() (decode steps): W repacked in panels of 32 output columns
              that stream from memory once per call (csrc/panel_gemm.cpp); a bfloat16 W stays
              bfloat16 and is widened in registers, so it streams half the bytes. 1.2-2x MKL's
              packed GEMM at 4-48 rows, and several times F.linear's bf16 path. With two or
              more threads the panels split evenly between them while MKL's own threading
              splits few rows poorly (1.4x from a second thread at 64 rows, the panels 1.9x),
              so float32 goes to the panels up to 128 rows there. On an AVX2 core the panels
              keep up with the blocked GEMMs to a few hundred rows (PANEL_MAX_ROWS).
    oneDNN    more rows (prefill) on the native build of an AVX-512 or AVX2 CPU, or the
              emulated avx2 build with oneDNN capped at AVX2 (kernels/cpu/onednn_gemm.py,
              float32 only on AVX2 bodies): W reordered once into oneDNN's blocked layout;
              ~12% over MKL's packed sgemm in float32 (AVX2: 5-25%) and ~2.3x its bf16 GEMM
              where the CPU has bf16 dot products (AVX512-BF16, AMX). Its lead over the panels
              starts at fewer rows, so the panels' limit is lower with it (PANEL_MAX_ROWS;
              bench/cpu_gemm_layouts.py).
    MKL       more rows elsewhere: float32 W packed once into MKL's blocked layout
              (cblas_sgemm_pack, then cblas_sgemm_compute); bfloat16 through
              cblas_gemm_bf16bf16f32 (float32 accumulation, one rounding), several times the
              speed of F.linear's oneDNN path on CPUs without native bf16 dot products.
    wide      a float32 weight of TILED_FROM_N rows or more (an LM head) is MKL-packed as column
              tiles of TILE_N outputs, each written while it fits in L2; `greedy(x)` runs the
              same tiles into a streaming argmax + log-sum-exp, so a greedy step never
              materialises its logits (about 1.3x the GEMM alone plus the sampler's pass).
              TILE_N 512: a K=256 tile's packed weight and its [256, 512] output are 512 KiB
              each, both in L2 together; 3-13% faster than 2048 at 64-256 rows for K 256
              and 576 (one thread, this VM; docs/cpu_performance.md).
    screened  on the AVX2 build, a greedy step that wants no logprobs takes the wide weight's
              16-bit copy instead (csrc/screened_greedy.cpp): every logit estimated with integer
              multiply-adds under a proven error bound, the few columns the bound cannot rule
              out computed in float32; the argmax of the float32 logits, the same on any batch.
              1.1-1.5x the float32 paths at 1-256 rows (emulated AVX2; on AVX-512 the float32
              FMAs keep pace with 16-bit ones, so that build keeps MKL). Costs a half-size copy
              of the weight, and keeps the weight (its float32 pass over the columns the bound keeps reads it): only
              a layer asked for greedy() (prepare's `greedy`: the one-rank LM head) takes it.

A 3-D input runs as its rows flattened; another dtype is cast to the weight's and the result
back (F.linear would refuse the mix), so no call needs the dense weight unless `weight` (below)
says so. The packed copies are made from the weight at prepare time (re-prepare after changing
it) and must not be moved (MKL's packed data depends on its address; oneDNN's is an opaque
tensor), so they are plain attributes, never parameters or buffers. Panels plus one pack are
two copies of the weight; once prepared, layers/cpu_kernels.py lets the module's parameter go
(a NaN stand-in) unless `weight` is set here (the bf16 MKL path, the screened head: it IS the
parameter's tensor, no extra copy) or another module shares the parameter (a tied head).
"""
from __future__ import annotations

import os

import torch
from kernels.cpu import extension, onednn_gemm

F32, BF16 = torch.float32, torch.bfloat16
# The most rows that take the panels, by (vector body, the GEMM taking the rows above, two or
# more threads): crossovers measured with bench/cpu_gemm_layouts.py (30 layers of SmolLM2-135M's
# shapes streaming from memory). "wide": AVX-512 (Zen 4, Sapphire Rapids). "avx2": Zen 4 with
# AVX-512 hidden, where the panels' 6-row half-panel blocks run at ~75 of the core's 89 GFLOP/s:
# ahead of MKL's packed sgemm up to ~512 rows (and of its bf16 GEMM at every row count), of
# oneDNN up to ~96 rows (oneDNN 0-7% ahead from 128 rows; docs/cpu_performance.md).
PANEL_MAX_ROWS = {
    ("wide", "mkl", False): {F32: 48, BF16: 128},
    ("wide", "mkl", True): {F32: 128, BF16: 128},
    ("wide", "onednn", False): {F32: 15, BF16: 7},
    ("wide", "onednn", True): {F32: 48, BF16: 11},
    ("avx2", "mkl", False): {F32: 256, BF16: 256},
    ("avx2", "mkl", True): {F32: 256, BF16: 256},
    # bf16 oneDNN runs on an AVX2 core only with AVX-NE-CONVERT (not measured: the wide limits)
    ("avx2", "onednn", False): {F32: 96, BF16: 7},
    ("avx2", "onednn", True): {F32: 96, BF16: 11},
}
GREEDY_PANEL_MAX_ROWS = (48, 64)            # LM head + sampler: (one thread, two or more)
TILE_N = 512
TILED_FROM_N = 8192


class CpuLinear:
    """One weight prepared for the CPU GEMMs; call it as F.linear(x, weight, bias)."""

    def __init__(self, weight: torch.Tensor, greedy: bool = True) -> None:
        ops = extension.ops()
        self.dtype = weight.dtype
        self.out_features = weight.shape[0]
        w = weight.detach().contiguous()
        self.panels = ops.panel_pack(w)
        self.packed = None
        self.tiles: list[torch.Tensor] | None = None
        self.screen: tuple[torch.Tensor, ...] | None = None
        self.onednn: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None     # the dense weight, where a path reads it
        self.in_features = weight.shape[1]
        if weight.dtype == torch.float32 and self.out_features >= TILED_FROM_N:
            self.tiles = [ops.mkl_pack(w[i:i + TILE_N].contiguous())
                          for i in range(0, self.out_features, TILE_N)]
            if greedy and ops.screen_available():
                self.weight, self.screen = w, _screen_pack(ops, w)
        elif onednn_gemm.wanted(weight.dtype):
            self.onednn = onednn_gemm.pack(w)
        elif weight.dtype == torch.float32:
            self.packed = ops.mkl_pack(w)
        else:                       # bfloat16 through cblas_gemm_bf16bf16f32 reads W itself
            self.weight = w
        self.calls = 0              # calls that took a kernel (tests check they ran)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + bias for x [..., K] of any float dtype (the result in x's dtype); `weight`
        is ignored (the module's parameter may be a stand-in once prepared)."""
        if x.dim() != 2:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"x's last dim {x.shape[-1]} must be the weight's "
                                 f"in_features {self.in_features}")
            return self(x.reshape(-1, self.in_features), None, bias).reshape(
                *x.shape[:-1], self.out_features)
        if x.dtype != self.dtype:
            b = None if bias is None else bias.to(self.dtype)
            return self(x.to(self.dtype), None, b).to(x.dtype)
        self.calls += 1
        ops, x, n = extension.ops(), x.contiguous(), self.out_features
        if x.shape[0] <= panel_max_rows(self.dtype, self.onednn is not None):
            return ops.panel_linear(x, self.panels, n, bias)
        if self.onednn is not None:
            return onednn_gemm.linear(x, self.onednn, bias)
        if self.tiles is not None:
            return ops.mkl_tiled_linear(x, self.tiles, TILE_N, n, bias)
        if self.packed is not None:
            return ops.mkl_packed_linear(x, self.packed, n, bias)
        return ops.mkl_bf16_linear(x, self.weight, bias)

    @property
    def fuses_greedy(self) -> bool:
        return self.tiles is not None

    def greedy(self, x: torch.Tensor, logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax of x W^T per row (first on ties), its log-softmax); x: float32 [M, K]. Only
        when fuses_greedy. Few rows build their (small) logits with the panels instead.
        logprobs False: the argmax alone (no exponentials) and an empty logprob tensor."""
        self.calls += 1
        ops, x = extension.ops(), x.contiguous()
        if not logprobs and self.screen is not None:
            return self._screened(x), x.new_empty(0)
        if x.shape[0] <= GREEDY_PANEL_MAX_ROWS[torch.get_num_threads() > 1]:
            logits = ops.panel_linear(x, self.panels, self.out_features, None)
            return ops.greedy_sample(logits, logprobs)
        return ops.mkl_tiled_greedy(x, self.tiles, TILE_N, self.out_features, logprobs)

    def _screened(self, x: torch.Tensor) -> torch.Tensor:
        """The screened argmax; rows it hands back (-1: non-finite, all zero, or too many
        near-ties) take the float32 tiles."""
        ops = extension.ops()
        ids = ops.screen_greedy(x, self.weight, *self.screen)
        back = (ids < 0).nonzero().flatten()
        if back.numel():
            ids[back] = ops.mkl_tiled_greedy(x[back].contiguous(), self.tiles, TILE_N,
                                             self.out_features, False)[0]
        return ids


def _screen_pack(ops, w: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The 16-bit copy, or None (greedy keeps the float32 tiles) for a weight screen_pack
    refuses: a non-finite value, or K too long for int32 sums of 16-bit products."""
    try:
        return ops.screen_pack(w)
    except RuntimeError:
        return None


def screens_heads() -> bool:
    """Whether a wide float32 head prepared in this process keeps a screen: its build's vector
    body is AVX2 (the avx2 build, or the native one on a CPU without AVX-512), told from the
    CPU's flags without loading the library (the memory check runs before the load)."""
    if os.environ.get(extension.ENV_SWITCH, "") == "0":
        return False
    return extension.avx2_body()


def panel_max_rows(dtype: torch.dtype, onednn: bool = False) -> int:
    """The most rows that take the panels for this build's vector body, the GEMM taking the
    rows above (oneDNN or MKL) and the current thread count (PANEL_MAX_ROWS)."""
    key = ("avx2" if extension.avx2_body() else "wide", "onednn" if onednn else "mkl",
           torch.get_num_threads() > 1)
    return PANEL_MAX_ROWS[key][dtype]


def prepare(weight: torch.Tensor, greedy: bool = True) -> CpuLinear | None:
    """A CpuLinear for a CPU weight this module can run faster than F.linear, else None.
    greedy False: `greedy()` is never asked (any layer but a one-rank LM head), so a wide
    weight takes no screen (its 16-bit copy, and the kept dense weight it reads)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not extension.load():
        return None
    ops = extension.ops()
    if weight.dtype == torch.float32 and ops.mkl_sgemm_packed_available():
        return CpuLinear(weight, greedy)
    if weight.dtype == torch.bfloat16 and ops.mkl_bf16_available():
        return CpuLinear(weight, greedy)
    return None
