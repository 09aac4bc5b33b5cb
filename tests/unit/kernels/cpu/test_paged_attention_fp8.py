"""The CPU paged attention kernel on fp8 caches (--kv-cache-dtype, kernels/cpu/csrc/
attention_fp8.h) against the torch reference backend on the same fp8 cache: both write the
same bytes (write_kv_cache) and widen them exactly, so they differ only by float32 summation
order. Decodes, full and chunked prefills, GQA, head sizes 64 and 128, float32 and bfloat16
queries, e5m2 and e4m3; on each build (conftest.py)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_paged
from kernels.attention.torch_ref import write_kv_cache
from kernels.cpu import extension
from tests.unit.kernels.cpu.test_paged_attention import check, make_case, random_lengths

pytestmark = [pytest.mark.skipif(not cpu_paged.available(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]

FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)


def fp8_case(gen, seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, kv_dtype):
    """make_case with its random cache rounded to kv_dtype (through write_kv_cache's rule)."""
    query, key, value, cache, meta = make_case(gen, seq_lens, query_lens, heads, kv_heads,
                                               head_dim, block_size, dtype, num_pad=1)
    fp8 = torch.empty(cache.shape, dtype=kv_dtype)
    slots = torch.arange(cache.shape[1] * cache.shape[2])
    flat = cache.view(2, -1, kv_heads, head_dim)
    write_kv_cache(flat[0], flat[1], fp8, slots)
    return query, key, value, fp8, meta


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_batches_match_the_reference_on_the_same_fp8_cache(kv_dtype, head_dim, heads,
                                                                   kv_heads, dtype):
    gen = torch.Generator().manual_seed(head_dim + heads * 7 + (dtype == torch.bfloat16))
    tol = 1e-5 if dtype == torch.float32 else 2e-2     # bfloat16: the output's rounding
    for trial in range(3):
        seq_lens, query_lens = random_lengths(gen, int(torch.randint(1, 6, (1,), generator=gen)),
                                              120)
        check(fp8_case(gen, seq_lens, query_lens, heads, kv_heads, head_dim, (1, 16, 8)[trial],
                       dtype, kv_dtype), tol)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("seq_len,query_len", [(1, 1), (17, 17), (300, 300), (300, 1),
                                               (300, 37)])
def test_decode_prefill_and_chunked_prefill_edges(kv_dtype, seq_len, query_len):
    gen = torch.Generator().manual_seed(seq_len * 1000 + query_len)
    check(fp8_case(gen, [seq_len], [query_len], 9, 3, 64, 16, torch.float32, kv_dtype), 1e-5)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e5m2", "e4m3"])
def test_every_byte_widens_as_torch_widens_it(kv_dtype):
    """All 256 patterns (subnormals, the largest, e5m2's inf; NaN bytes left out: a NaN key
    poisons its whole row) as one key per position with a one-hot query: each output is the
    value row the softmax weights, so widening errors show as a wrong score."""
    values = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    finite = values[torch.isfinite(values)]
    num = finite.numel()
    cache = torch.zeros(2, num, 1, 1, 16, dtype=kv_dtype)
    cache[0, :, 0, 0, :].view(torch.uint8)[:] = finite.to(kv_dtype).view(torch.uint8)[:, None]
    cache[1, :, 0, 0, :].view(torch.uint8)[:] = finite.to(kv_dtype).view(torch.uint8)[:, None]
    # each request attends its own one key: out = that key's value, widened
    table = torch.arange(num, dtype=torch.int32)[:, None]
    starts = torch.arange(num + 1, dtype=torch.int32)
    lens = torch.ones(num, dtype=torch.int32)
    query = torch.ones(num, 1, 16)
    out = torch.empty(num, 1, 16)
    extension.ops().paged_attention(query, cache, table, starts, lens, 1.0, out, 0, None)
    torch.testing.assert_close(out[:, 0, 0], finite, atol=0, rtol=0)


def test_write_saturates_at_the_largest_finite_value():
    cache = torch.zeros(2, 1, 4, 1, 1, dtype=torch.float8_e4m3fn)
    rows = torch.tensor([1e4, -1e4, 0.3, 448.0]).view(4, 1, 1)
    write_kv_cache(rows, rows, cache, torch.arange(4))
    assert cache[0, 0, :, 0, 0].float().tolist() == [448.0, -448.0, 0.3125, 448.0]
    e5m2 = torch.zeros(2, 1, 1, 1, 1, dtype=torch.float8_e5m2)
    write_kv_cache(torch.full((1, 1, 1), 1e9), torch.full((1, 1, 1), 1e9), e5m2,
                   torch.arange(1))
    assert e5m2.float().flatten().tolist() == [57344.0, 57344.0]


def test_a_cache_of_another_dtype_is_refused_by_the_kernel():
    query = torch.randn(1, 1, 64)
    cache = torch.zeros(2, 1, 16, 1, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float8_e5m2 or float8_e4m3fn"):
        extension.ops().paged_attention(query, cache, torch.zeros(1, 1, dtype=torch.int32),
                                        torch.tensor([0, 1], dtype=torch.int32),
                                        torch.ones(1, dtype=torch.int32), 1.0,
                                        torch.empty(1, 1, 64), 0, None)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("head_dim", [16, 32, 80, 96])
def test_every_other_head_size_matches_the_reference(kv_dtype, head_dim):
    """The head sizes the kernel dispatches besides 64 and 128: a row of 16 (one AVX-512
    vector, two AVX2 ones) up to 96 (not a power of two)."""
    gen = torch.Generator().manual_seed(head_dim)
    check(fp8_case(gen, [1, 40, 23], [1, 40, 7], 6, 2, head_dim, 16, torch.float32, kv_dtype),
          1e-5)
