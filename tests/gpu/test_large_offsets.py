"""Triton KV write and paged attention at real-size cache offsets (issue 5's desk check).

A 40 GiB KV cache holds more than 2^31 elements, so every pointer offset into it must be
computed in int64: block id x block stride, and the K -> V step. These tests build KV-cache
views whose used blocks sit past element 2^31 without allocating them: one flat fp16 buffer of
a little over 2^31 elements (4 GiB of address space; on CPU only the pages the test touches are
ever backed) seen through torch.as_strided as kv_cache[2, num_blocks, block_size, Hkv, D]:

    case "blocks past 2^31":  used blocks 2^22 - 4 .. 2^22 + 3 (x 512 elements per block: the
                              K offsets cross 2^31), the V half 2^20 elements after K (2048
                              blocks: no used block's K and V overlap)
    case "V half past 2^31":  used blocks 0 .. 7, the V half 2^31 + 4096 elements after K (a
                              stride Triton must pass as int64)

The same writes and attention run on a compact copy (the used blocks renumbered from 0) through
the torch reference; the used blocks and the outputs must agree. Without a GPU the kernels run
in the Triton interpreter, which wraps int32 arithmetic like the GPU does, so an int32 offset
shows up here as wrong values (or a crash) instead of on the first GPU run.
"""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kernels.attention.backend import AttentionMetadata  # noqa: E402
from kernels.attention.torch_ref import TorchAttentionBackend  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.float16
BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 16, 2, 4, 16
BLOCK_ELEMS = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM          # 512
NUM_USED = 8
# name -> (first used block, elements from the K half to the V half)
CASES = {"blocks past 2^31": (2**22 - 4, 2**20), "V half past 2^31": (0, 2**31 + 4096)}


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton.language.zeros, InterpretedFunction)


pytestmark = pytest.mark.skipif(
    not ON_GPU and not _interpreted(),
    reason="triton was imported in compiled mode without a GPU (TRITON_INTERPRET unset)")


def huge_cache(first: int, kv_step: int) -> torch.Tensor:
    """kv_cache[2, first + NUM_USED, ...] over one uninitialised buffer. With a V half less
    than the K half long, V blocks alias K blocks kv_step / BLOCK_ELEMS further on, which the
    cases keep clear of the used ones; only the used blocks are ever touched."""
    num_blocks = first + NUM_USED
    base = torch.empty((num_blocks * BLOCK_ELEMS + kv_step,), dtype=DTYPE, device=DEVICE)
    return torch.as_strided(base, (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                            (kv_step, BLOCK_ELEMS, NUM_KV_HEADS * HEAD_DIM, HEAD_DIM, 1))


def fill_used(cache: torch.Tensor, first: int, seed: int) -> torch.Tensor:
    """Random values into the used blocks; returns them as a compact cache [2, NUM_USED, ...]."""
    gen = torch.Generator().manual_seed(seed)
    compact = torch.randn((2, NUM_USED, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), generator=gen)
    compact = compact.to(DEVICE, DTYPE)
    cache[:, first:first + NUM_USED].copy_(compact)
    return compact


def batch(seq_lens: list[int], query_lens: list[int], first: int, seed: int):
    """q, k, v and two metadata objects for the same requests: block ids as in the huge cache
    (first + i) and as in the compact copy (i). Request r owns consecutive used blocks."""
    gen = torch.Generator().manual_seed(seed)
    width = max(triton.cdiv(s, BLOCK_SIZE) for s in seq_lens)
    table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    slots, owned = [], 0
    for r, (s, q) in enumerate(zip(seq_lens, query_lens)):
        n = triton.cdiv(s, BLOCK_SIZE)
        table[r, :n] = torch.arange(owned, owned + n, dtype=torch.int32)
        owned += n
        pos = torch.arange(s - q, s)
        slots.append(table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    assert owned <= NUM_USED
    num_tokens = sum(query_lens)
    q = torch.randn((num_tokens, NUM_HEADS, HEAD_DIM), generator=gen).to(DEVICE, DTYPE)
    k, v = (torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), generator=gen).to(DEVICE, DTYPE)
            for _ in range(2))
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    slots = torch.cat(slots)

    def meta(offset: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=len(seq_lens), num_actual_tokens=num_tokens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_start_loc=starts.to(DEVICE), seq_lens=lens.to(DEVICE),
            block_table=(table + offset).to(DEVICE),
            slot_mapping=(slots + offset * BLOCK_SIZE).to(DEVICE),
            query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return q, k, v, meta(first), meta(0)


@pytest.mark.parametrize("case", list(CASES))
def test_write_kv_cache_past_2_31_elements(case):
    from kernels.attention.triton_cache import triton_write_kv_cache
    from kernels.attention.torch_ref import write_kv_cache

    first, kv_step = CASES[case]
    cache = huge_cache(first, kv_step)
    compact = fill_used(cache, first, seed=1)
    _, k, v, meta, compact_meta = batch([40, 57], [40, 57], first, seed=2)
    padded = torch.cat([meta.slot_mapping, torch.full((2,), -1, device=DEVICE)])
    k_pad = torch.cat([k, torch.full_like(k[:2], 1e4)])
    v_pad = torch.cat([v, torch.full_like(v[:2], 1e4)])
    triton_write_kv_cache(k_pad, v_pad, cache, padded)
    write_kv_cache(k, v, compact, compact_meta.slot_mapping)
    assert torch.equal(cache[:, first:first + NUM_USED], compact)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_attention_past_2_31_elements(case, kind):
    """Varlen (a prefill chunk after a cached prefix, a decode) and split-KV decode (two
    decodes, three splits) read the cache where its offsets pass 2^31."""
    from kernels.attention.triton_backend import TritonAttentionBackend

    first, kv_step = CASES[case]
    cache = huge_cache(first, kv_step)
    compact = fill_used(cache, first, seed=3)
    query_lens = [9, 1] if kind == "mixed" else [1, 1]
    q, k, v, meta, compact_meta = batch([40, 57], query_lens, first, seed=4)
    scale = HEAD_DIM ** -0.5
    ours = TritonAttentionBackend(decode_splits=3).forward(q, k, v, cache, meta, scale)
    ref = TorchAttentionBackend(batched=False).forward(q, k, v, compact, compact_meta, scale)
    torch.testing.assert_close(ours.float(), ref.float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(cache[:, first:first + NUM_USED], compact)
