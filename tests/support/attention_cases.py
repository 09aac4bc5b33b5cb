"""Random paged-attention batches and their check against the torch reference backend.

Triton picks its interpreter when a kernel is *decorated* (and, for tl.zeros and friends, at
`import triton`), so TRITON_INTERPRET is set here, before triton is imported, when there is no GPU.
KERNELS_HERE is False when an earlier import loaded triton in compiled mode on a CPU machine.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from kernels.attention.backend import AttentionMetadata  # noqa: E402
from kernels.attention.torch_ref import TorchAttentionBackend  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
KERNEL_MODULES = ("kernels.attention.triton_cache", "kernels.attention.triton_paged_attention",
                  "kernels.attention.triton_backend")


def _triton_usable_here() -> bool:
    """On GPU always; on CPU only if triton itself was imported in interpreter mode."""
    if ON_GPU:
        return True
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton.language.zeros, InterpretedFunction)


KERNELS_HERE = _triton_usable_here()
triton_cache, triton_attn, triton_backend = (
    [importlib.import_module(name) for name in KERNEL_MODULES] if KERNELS_HERE else [None] * 3)
needs_kernels = pytest.mark.skipif(
    not KERNELS_HERE, reason="triton was imported in compiled mode before this module set "
    "TRITON_INTERPRET; test_kernels_in_fresh_interpreter_process runs these instead")


def make_case(seed, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size,
              num_pad=0, dtype=torch.float32, device=DEVICE, cache_dtype=None):
    """A batch over a random cache: physical blocks shuffled, every cache slot random (the
    cached prefix is whatever the cache holds), q/k/v strided views of one fused qkv tensor,
    num_pad trailing padded rows (slot -1) with huge keys so a stray write would show.
    cache_dtype: the cache's (an fp8 type for --kv-cache-dtype), else `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [triton.cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3                   # spare blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    slots, used = [], 0
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        block_table[i, :blocks_per_req[i]] = perm[used:used + blocks_per_req[i]]
        used += blocks_per_req[i]
        pos = torch.arange(seq_len - query_len, seq_len)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    num_tokens = sum(query_lens)
    slots.append(torch.full((num_pad,), -1, dtype=torch.long))
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens + num_pad, width, generator=gen)
    qkv[num_tokens:] = 1e4
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    qkv, kv_cache = qkv.to(device, dtype), kv_cache.to(device, cache_dtype or dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    rows = num_tokens + num_pad
    query = qkv[:, :q_end].view(rows, num_heads, head_dim)
    key = qkv[:, q_end:k_end].view(rows, num_kv_heads, head_dim)
    value = qkv[:, k_end:].view(rows, num_kv_heads, head_dim)
    starts = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=starts.to(device), seq_lens=lens.to(device),
        block_table=block_table.to(device), slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return query, key, value, kv_cache, meta


def check_against_reference(case, backend, atol=2e-5, rtol=2e-5):
    """Run both backends on copies of the cache: outputs close, caches bit-identical after."""
    query, key, value, kv_cache, meta = case
    scale = query.shape[2] ** -0.5
    ref_cache, our_cache = kv_cache.clone(), kv_cache.clone()
    expected = TorchAttentionBackend(batched=False).forward(query, key, value, ref_cache, meta, scale)
    out = backend.forward(query, key, value, our_cache, meta, scale)
    n = meta.num_actual_tokens
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), atol=atol, rtol=rtol)
    if our_cache.element_size() == 1:      # fp8: compare the codes (NaN-free, so exact)
        our_cache, ref_cache = our_cache.view(torch.uint8), ref_cache.view(torch.uint8)
    assert torch.equal(our_cache, ref_cache), "KV cache differs from the reference writes"


# (num_heads, num_kv_heads, head_dim, block_size): GQA 1/2/4/8 and 3, dims 16/64/128 (+48).
