"""The torch reference attention backend against dense causal SDPA, request by request."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import TorchAttentionBackend, write_kv_cache

BLOCK_SIZE = 4
NUM_BLOCKS = 32
HEAD_DIM = 8


def dense_reference(q_full, k_full, v_full, scale):
    """Causal attention over a whole sequence: [S, H, D] -> [S, Hq, D]."""
    group = q_full.shape[1] // k_full.shape[1]
    q = q_full.transpose(0, 1)
    k = k_full.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v_full.repeat_interleave(group, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
    return out[0].transpose(0, 1)


def build_case(gen, seq_lens, query_lens, num_heads, num_kv_heads, num_pad):
    """Random sequences, a random block table, prefixes written into the cache beforehand."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    max_blocks = max((s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    seqs, qs, ks, vs, slots = [], [], [], [], []
    next_block = 0
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        n_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        block_table[i, :n_blocks] = perm[next_block:next_block + n_blocks].to(torch.int32)
        next_block += n_blocks
        q = torch.randn(seq_len, num_heads, HEAD_DIM, generator=gen)
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        pos = torch.arange(seq_len)
        seq_slots = block_table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        prefix = seq_len - query_len
        write_kv_cache(k[:prefix], v[:prefix], kv_cache, seq_slots[:prefix])  # cached prefix
        seqs.append((q, k, v))
        qs.append(q[prefix:])
        ks.append(k[prefix:])
        vs.append(v[prefix:])
        slots.append(seq_slots[prefix:])
    pad_q = torch.randn(num_pad, num_heads, HEAD_DIM, generator=gen)
    pad_kv = torch.randn(num_pad, num_kv_heads, HEAD_DIM, generator=gen)
    query = torch.cat(qs + [pad_q])
    key = torch.cat(ks + [pad_kv])
    value = torch.cat(vs + [pad_kv])
    slot_mapping = torch.cat(slots + [torch.full((num_pad,), -1, dtype=torch.long)])
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc=starts, seq_lens=lens, block_table=block_table,
        slot_mapping=slot_mapping, query_start_loc_cpu=starts.clone(), seq_lens_cpu=lens.clone())
    return seqs, (query, key, value), kv_cache, meta


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("num_pad", [0, 3])
def test_reference_matches_dense_causal(num_heads, num_kv_heads, num_pad):
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads + num_pad)
    seq_lens = [7, 1, 13, 9, 5]
    query_lens = [7, 1, 4, 1, 2]   # full prefill, tiny prefill, chunked prefill, decodes
    seqs, (query, key, value), kv_cache, meta = build_case(
        gen, seq_lens, query_lens, num_heads, num_kv_heads, num_pad)
    scale = HEAD_DIM ** -0.5
    used = {int(b) for i, s in enumerate(seq_lens)
            for b in meta.block_table[i, :(s + BLOCK_SIZE - 1) // BLOCK_SIZE]}
    untouched_before = kv_cache[:, [b for b in range(NUM_BLOCKS) if b not in used]].clone()

    out = TorchAttentionBackend().forward(query, key, value, kv_cache, meta, scale)

    assert out.shape == query.shape and out.dtype == query.dtype
    starts = meta.query_start_loc_cpu.tolist()
    for i, (q, k, v) in enumerate(seqs):
        expected = dense_reference(q, k, v, scale)[seq_lens[i] - query_lens[i]:]
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], expected, atol=1e-5, rtol=1e-5)
    # Padded rows (slot -1) wrote nothing: blocks outside every block table are unchanged.
    untouched_after = kv_cache[:, [b for b in range(NUM_BLOCKS) if b not in used]]
    torch.testing.assert_close(untouched_after, untouched_before, atol=0, rtol=0)


def test_write_kv_cache_places_rows_and_skips_padding():
    kv_cache = torch.zeros(2, 3, 2, 1, 2)
    key = torch.arange(6, dtype=torch.float32).view(3, 1, 2) + 1
    value = -key
    write_kv_cache(key, value, kv_cache, torch.tensor([5, -1, 0]))
    assert kv_cache[0, 2, 1, 0].tolist() == [1.0, 2.0]      # slot 5 = block 2, row 1
    assert kv_cache[1, 0, 0, 0].tolist() == [-5.0, -6.0]    # slot 0 = block 0, row 0
    assert int((kv_cache != 0).sum()) == 8                   # row 1 (slot -1) went nowhere


def test_bf16_cache_returns_query_dtype():
    gen = torch.Generator().manual_seed(0)
    seqs, (query, key, value), kv_cache, meta = build_case(gen, [6], [6], 4, 2, 0)
    out = TorchAttentionBackend().forward(query.bfloat16(), key.bfloat16(), value.bfloat16(),
                                          kv_cache.bfloat16(), meta, HEAD_DIM ** -0.5)
    assert out.dtype == torch.bfloat16
    expected = dense_reference(*seqs[0], HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
