"""fp8 KV caches (--kv-cache-dtype) in the Triton kernels (kernels/attention/triton_fp8.py).

The codes: every fp8 value, every midpoint between two (ties to even) and its float32
neighbours, random magnitudes from 1e-12 to 1e6 (subnormals, saturation), infinities and NaN
round to torch's `clamp(-max, max).to(fp8)` byte for byte; every code widens to torch's float.
The kernels: the cache write, and attention over a mixed batch (prefill, chunked prefill after
an aligned and an unaligned cached prefix, decodes, a one-token prompt, padding) and over
split decodes, equal the torch backend on the same fp8 cache: the same bytes written, outputs
within float32 tolerance (bfloat16 queries: bfloat16's). Interpreter on CPU, compiled on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.attention_cases import (DEVICE, check_against_reference, make_case,
                                           needs_kernels, triton, triton_backend, triton_cache)
from tests.support.lanes import split_grid
from kernels.attention.torch_ref import write_kv_cache  # noqa: E402
from kernels.attention.triton_fp8 import FP8_CODES, decode, encode  # noqa: E402

tl = triton.language
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, FP8: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, encode(tl.load(x_ptr + i, mask=i < n), FP8), mask=i < n)


@triton.jit
def _decode_kernel(codes_ptr, out_ptr, FP8: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, decode(tl.load(codes_ptr + i), FP8))


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes.view(dtype).float()
    finite = finite[torch.isfinite(finite)].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(20000, generator=gen) * torch.logspace(-12, 6, 20000)
    limit = torch.finfo(dtype).max
    edges = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan"), 1e30,
                          limit * 1.03, -limit * 1.07, 0.0, -0.0, 1e-45])
    return torch.cat([finite, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                      spread, edges]).to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_codes_round_to_nearest_even_and_saturate_as_torch(dtype):
    x = _hard_values(dtype)
    got = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), FP8=FP8_CODES[dtype],
                                                    BLOCK=1024)
    limit = torch.finfo(dtype).max
    want = x.clamp(-limit, limit).to(dtype).view(torch.uint8)
    bad = (got != want).nonzero().flatten()[:5].tolist()
    assert not bad, [(float(x[i]), int(got[i]), int(want[i])) for i in bad]


@needs_kernels
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_every_code_widens_exactly(dtype):
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    got = torch.empty(256, device=DEVICE)
    _decode_kernel[(1,)](codes, got, FP8=FP8_CODES[dtype])
    want = codes.view(dtype).float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


@needs_kernels
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_cache_write_is_the_reference_write_byte_for_byte(dtype):
    """Keys and values past e4m3's 448 saturate; slot -1 and unlisted slots keep their bytes."""
    gen = torch.Generator().manual_seed(4)
    key, value = [(300 * torch.randn(6, 2, 48, generator=gen)).to(DEVICE) for _ in "kv"]
    cache = torch.randn(2, 4, 4, 2, 48, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([3, 9, -1, 15, 0], device=DEVICE)      # row 5: past slot_mapping
    want = cache.clone()
    write_kv_cache(key, value, want, slots)
    got = cache.clone()
    triton_cache.triton_write_kv_cache(key, value, got, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(want.view(torch.uint8), cache.view(torch.uint8))


MIXED = ([21, 40, 39, 29, 1], [21, 1, 7, 10, 1])      # 39: an aligned 32-key prefix + 7


@needs_kernels
@pytest.mark.parametrize("dtype,query_dtype,head_dim,block_size", split_grid(
    [FP8, [torch.float32, torch.bfloat16], [64, 48], [16, 4]],
    fast={(FP8[0], torch.float32, 64, 16), (FP8[1], torch.bfloat16, 48, 4)}))
def test_mixed_batch_matches_the_torch_backend(dtype, query_dtype, head_dim, block_size):
    seq_lens, query_lens = MIXED
    case = make_case(11, seq_lens, query_lens, 8, 2, head_dim, block_size, num_pad=3,
                     dtype=query_dtype, cache_dtype=dtype)
    tol = 2e-5 if query_dtype == torch.float32 else 2e-2
    check_against_reference(case, triton_backend.TritonAttentionBackend(), tol, tol)


@needs_kernels
@pytest.mark.parametrize("dtype,query_dtype,splits", split_grid(
    [FP8, [torch.float32, torch.bfloat16], [None, 1, 4]],
    fast={(FP8[0], torch.float32, 4), (FP8[1], torch.bfloat16, 1),
          (FP8[1], torch.float32, None)}))
def test_split_decode_matches_the_torch_backend(dtype, query_dtype, splits):
    seq_lens = [1, 17, 64, 130, 300]
    case = make_case(12, seq_lens, [1] * len(seq_lens), 8, 2, 64, 16, num_pad=2,
                     dtype=query_dtype, cache_dtype=dtype)
    tol = 2e-5 if query_dtype == torch.float32 else 2e-2
    check_against_reference(case, triton_backend.TritonAttentionBackend(splits), tol, tol)


@needs_kernels
def test_fp8_reads_the_rounded_values_not_the_model_dtype_cache():
    """The same batch over the float32 cache rounded to e4m3 (stored as float32) gives the fp8
    cache's output; over the unrounded float32 cache it does not (the codes are really read)."""
    seq_lens = [40, 9]
    query, key, value, cache, meta = make_case(13, seq_lens, [16, 9], 4, 2, 64, 16,
                                               cache_dtype=torch.float8_e4m3fn)
    backend = triton_backend.TritonAttentionBackend()
    scale = 0.125
    fp8_out = backend.forward(query, key, value, cache.clone(), meta, scale)
    rounded = cache.float()
    limit = torch.finfo(torch.float8_e4m3fn).max
    wide = backend.forward(query, key.clamp(-limit, limit).to(torch.float8_e4m3fn).float(),
                           value.clamp(-limit, limit).to(torch.float8_e4m3fn).float(),
                           rounded, meta, scale)
    torch.testing.assert_close(fp8_out, wide, atol=2e-6, rtol=2e-6)
    plain = backend.forward(query, key, value, rounded.clone(), meta, scale)
    assert (plain - fp8_out).abs().max() > 1e-3


@needs_kernels
@pytest.mark.parametrize("dtype,act", [(FP8[0], torch.bfloat16), (FP8[1], torch.float32)],
                         ids=str)
def test_fused_rope_write_is_the_reference_write_byte_for_byte(dtype, act):
    """The fused rope's cache write (CUDA's default path) stores the codes write_kv_cache
    stores for the keys it rotated: the same rounding whichever kernel writes."""
    from kernels.fused_rope import fused_rope
    from worker_service.layers.rotary import RopeSettings, RotaryEmbedding

    gen = torch.Generator().manual_seed(6)
    rope = RotaryEmbedding(64, 32, RopeSettings()).to(DEVICE)
    qkv = (40 * torch.randn(5, 4 * 64, generator=gen)).to(DEVICE, act)
    q, k, v = (t.view(5, -1, 64) for t in qkv.split([2 * 64, 64, 64], dim=-1))
    positions = torch.tensor([0, 3, 9, 17, 31], device=DEVICE)
    cache = torch.randn(2, 4, 4, 1, 64, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([2, 7, -1, 12, 15], device=DEVICE)
    want = cache.clone()
    rotated_q, rotated_k = q.clone(), k.clone()
    fused_rope(positions, rotated_q, rotated_k, rope.cos_cache, rope.sin_cache)
    write_kv_cache(rotated_k, v, want, slots)
    fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache, value=v, kv_cache=cache,
               slot_mapping=slots)
    assert torch.equal(k, rotated_k)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
