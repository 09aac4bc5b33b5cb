"""Many-row linears straight from torch's packed int4 weight (csrc/int4_gemm.cpp): each panel of
32 output columns expanded a chunk of k at a time into a small scratch and reused by every row,
so the expansion is paid once per call instead of once per 4 rows as in torch's
_weight_int4pack_mm_for_cpu (which stays the faster kernel for a few rows: it streams the
codes once with no scratch). layers/quant_linear.py picks between them by row count.

torch's packed layout is not a public format: it depends on the ATen CPU capability that packed
it (64-row interleaved blocks on AVX-512, 32 on AVX2, pairs on the portable build). layout()
packs probes once per process (a full block, each tail, two k tiles) and keeps the reading of
them that reproduces the codes; when none does (a torch that changed its format), layout() is
None and torch's kernel runs every row count.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from kernels.cpu import extension

# rows from which the panel kernel beats torch's (Zen 4, one [12288, 2048] linear, CPU time:
# 3.0 against 2.5 ms at 4 rows, 22 against 28 ms wall at 8 with 2 threads; torch's kernel
# costs ~0.6 ms a row past a few, the panel kernel ~2.2 ms a call plus its dot products;
# docs/cpu_performance.md)
MIN_ROWS = 8
_CANDIDATES = ((64, True), (32, True), (32, False), (64, False))
# a full 64-row block and each tail torch can leave (16, 32, 48 rows; on AVX2 a 32-row block
# and a 16-row tail), over two k tiles of 256: a pack that differs only past a shape checked
# would be misread, every layer of that shape
_PROBE_NS, _PROBE_K, _PROBE_GROUP = (80, 96, 112), 512, 32


class Int4Layout(NamedTuple):
    """torch's int4 pack as csrc/int4_gemm.cpp reads it."""
    block: int
    interleaved: bool


def pack(codes: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4 pack of codes [N, K] in 0 .. 15."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)


def reference(codes: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """W [N, K] float32 = (q - 8) * scale + zero, torch's kernel's formula."""
    g = torch.arange(codes.shape[1]) // group
    s, z = sz[..., 0].float()[g].t(), sz[..., 1].float()[g].t()
    return (codes.float() - 8) * s + z


@functools.cache
def _probe(namespace: str) -> Int4Layout | None:
    ops = getattr(torch.ops, namespace)
    gen = torch.Generator().manual_seed(7)
    probes = []
    for n in _PROBE_NS:
        codes = torch.randint(0, 16, (n, _PROBE_K), generator=gen, dtype=torch.int32)
        sz = (torch.rand(_PROBE_K // _PROBE_GROUP, n, 2, generator=gen) + 0.5).bfloat16()
        probes.append((pack(codes), sz, n, reference(codes, sz, _PROBE_GROUP)))
    for block, interleaved in _CANDIDATES:
        if all(torch.equal(ops.int4pack_dequantize(packed, sz, _PROBE_GROUP, n, block,
                                                   interleaved), want)
               for packed, sz, n, want in probes):
            return Int4Layout(block, interleaved)
    return None


def layout(which: str | None = None) -> Int4Layout | None:
    """How this torch packs int4 weights, as the `which` build reads it (None: unknown, or the
    library did not load)."""
    if not extension.load(which):
        return None
    return _probe(extension.namespace(which))


def wanted(rows: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a call of `rows` rows of `dtype` takes the panel kernel in this process:
    bfloat16, enough rows, and a build with AVX512-BF16 dot products (elsewhere its portable
    body is slower than torch's kernel; the tests still run it)."""
    if dtype != torch.bfloat16 or rows < MIN_ROWS or layout() is None:
        return False
    return _bf16_dot(extension.namespace())


@functools.cache
def _bf16_dot(namespace: str) -> bool:
    return bool(getattr(torch.ops, namespace).bf16_dot())


def linear(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group: int,
           n: int, which: str | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 (contiguous) @ W^T from torch's packed int4 W (call when layout())."""
    lay = layout(which)
    return extension.ops(which).int4pack_linear(x, packed, sz, group, n, lay.block,
                                                lay.interleaved)
