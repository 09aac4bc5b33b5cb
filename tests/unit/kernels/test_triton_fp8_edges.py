"""fp8 KV caches in the Triton kernels at their edges (review of kernels/attention/triton_fp8.py).

The codes: every float16 and bfloat16 bit pattern (NaN, infinities, -0.0, subnormals of the
input and of both fp8 types, the saturation points) encodes to torch's `clamp(-max, max).to(fp8)`
byte for byte, as the cache write gets them from a float16 or bfloat16 model; every code widens
exactly to float16 and bfloat16 (the dtypes the dots read it in). The kernels: float16 queries,
GQA ratios 1, 3 and 8, heads 80 and 256, blocks of 1 and 32, attention sinks and sliding windows
over an fp8 cache (prefill and split decodes) equal the torch backend on the same cache.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.attention_cases import (DEVICE, check_against_reference, make_case,
                                           needs_kernels, triton, triton_backend)
from tests.support.lanes import split_grid
from kernels.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from kernels.attention.triton_fp8 import FP8_CODES, decode, encode  # noqa: E402

tl = triton.language
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
WIDE = [torch.float16, torch.bfloat16]


@triton.jit
def _encode_kernel(x_ptr, out_ptr, FP8: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, encode(tl.load(x_ptr + i), FP8))


@triton.jit
def _widen_kernel(codes_ptr, out_ptr, FP8: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, decode(tl.load(codes_ptr + i), FP8).to(out_ptr.dtype.element_ty))


@needs_kernels
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("wide", WIDE, ids=str)
def test_every_16_bit_input_encodes_as_torch(fp8, wide):
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(wide).to(DEVICE)
    got = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    _encode_kernel[((1 << 16) // 4096,)](x, got, FP8=FP8_CODES[fp8], BLOCK=4096)
    limit = torch.finfo(fp8).max
    want = x.float().clamp(-limit, limit).to(fp8)
    nan = want.isnan()
    assert torch.equal(got.view(fp8).isnan(), nan)
    bad = ((got != want.view(torch.uint8)) & ~nan).nonzero().flatten()[:5].tolist()
    assert not bad, [(float(x[i]), int(got[i]), int(want.view(torch.uint8)[i])) for i in bad]


@needs_kernels
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("wide", WIDE, ids=str)
def test_every_code_widens_exactly_to_half_and_bfloat16(fp8, wide):
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    got = torch.empty(256, dtype=wide, device=DEVICE)
    _widen_kernel[(1,)](codes, got, FP8=FP8_CODES[fp8])
    want = codes.view(fp8).to(wide)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0).view(torch.int16), want.nan_to_num(0.0).view(torch.int16))


SHAPES = [(8, 8, 64, 16), (6, 2, 80, 32), (8, 1, 256, 1)]     # (heads, kv heads, head, block)


@needs_kernels
@pytest.mark.parametrize("fp8,query_dtype,shape", split_grid(
    [FP8, [torch.float16, torch.float32], SHAPES],
    fast={(FP8[0], torch.float16, SHAPES[0]), (FP8[1], torch.float32, SHAPES[1]),
          (FP8[0], torch.float32, SHAPES[2])}))
def test_shapes_and_half_queries_match_the_torch_backend(fp8, query_dtype, shape):
    """A mixed batch (prefill, chunk after a prefix, decodes) and split decodes."""
    heads, kv_heads, head_dim, block = shape
    tol = 2e-5 if query_dtype == torch.float32 else 2e-3
    mixed = make_case(31, [21, 39, 1, 9], [21, 7, 1, 1], heads, kv_heads, head_dim, block,
                      num_pad=2, dtype=query_dtype, cache_dtype=fp8)
    check_against_reference(mixed, triton_backend.TritonAttentionBackend(), tol, tol)
    decodes = make_case(32, [5, 70, 133], [1, 1, 1], heads, kv_heads, head_dim, block,
                        dtype=query_dtype, cache_dtype=fp8)
    check_against_reference(decodes, triton_backend.TritonAttentionBackend(4), tol, tol)


@needs_kernels
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("splits", [1, 4, 16])      # 16: empty splits in the reduce
def test_sinks_and_windows_over_fp8_match_the_torch_backend(fp8, splits):
    """What the Triton backend alone runs with fp8 (kv_dtype.fp8_problem): a window of 7 and
    per-head sinks, over prefills, a chunk after a cached prefix and decodes (split or not)."""
    query, key, value, cache, meta = make_case(33, [30, 41, 1, 66], [30, 9, 1, 1], 4, 2, 64,
                                               16, num_pad=1, cache_dtype=fp8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    ref_cache, our_cache = cache.clone(), cache.clone()
    want = TorchAttentionBackend(batched=False).forward(query, key, value, ref_cache, meta,
                                                        0.125, sliding_window=7, sinks=sinks)
    got = triton_backend.TritonAttentionBackend(splits).forward(
        query, key, value, our_cache, meta, 0.125, sliding_window=7, sinks=sinks)
    n = meta.num_actual_tokens
    torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    assert torch.equal(our_cache.view(torch.uint8), ref_cache.view(torch.uint8))
