"""The torch attention backend: both paths (per-request reference, batched default) against dense
causal SDPA, the batched path against the reference on random batches, and the memory bound."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention.backend import AttentionMetadata
from kernels.attention import torch_ref
from kernels.attention.torch_batched import attend_decodes, attend_group, padded_bytes
from kernels.attention.torch_ref import (DEFAULT_MAX_PADDED_BYTES, TorchAttentionBackend,
                                         write_kv_cache)

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


def build_case(gen, seq_lens, query_lens, num_heads, num_kv_heads, num_pad,
               num_blocks=NUM_BLOCKS, extra_cols=0):
    """Random sequences, a random block table (extra_cols unused columns past the widest
    request), prefixes written into the cache beforehand."""
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max((s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens) + extra_cols
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
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


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("num_pad", [0, 3])
def test_reference_matches_dense_causal(num_heads, num_kv_heads, num_pad, batched):
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads + num_pad)
    seq_lens = [7, 1, 13, 9, 5]
    query_lens = [7, 1, 4, 1, 2]   # full prefill, tiny prefill, chunked prefill, decodes
    seqs, (query, key, value), kv_cache, meta = build_case(
        gen, seq_lens, query_lens, num_heads, num_kv_heads, num_pad)
    scale = HEAD_DIM ** -0.5
    used = {int(b) for i, s in enumerate(seq_lens)
            for b in meta.block_table[i, :(s + BLOCK_SIZE - 1) // BLOCK_SIZE]}
    untouched_before = kv_cache[:, [b for b in range(NUM_BLOCKS) if b not in used]].clone()

    out = TorchAttentionBackend(batched=batched).forward(query, key, value, kv_cache, meta, scale)

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


@pytest.mark.parametrize("batched", [False, True])
def test_bf16_cache_returns_query_dtype(batched):
    gen = torch.Generator().manual_seed(0)
    seqs, (query, key, value), kv_cache, meta = build_case(gen, [6], [6], 4, 2, 0)
    backend = TorchAttentionBackend(batched=batched)
    out = backend.forward(query.bfloat16(), key.bfloat16(), value.bfloat16(),
                          kv_cache.bfloat16(), meta, HEAD_DIM ** -0.5)
    assert out.dtype == torch.bfloat16
    expected = dense_reference(*seqs[0], HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


# -- batched path against the per-request reference ---------------------------------------------

def random_batch(gen, num_reqs, decode_only):
    """seq_lens and query_lens: decodes, full prefills, chunked prefills on a cached prefix and
    idle requests (query_len 0), or decodes only."""
    seq_lens, query_lens = [], []
    for _ in range(num_reqs):
        seq_len = int(torch.randint(1, 20, (1,), generator=gen))
        kind = 0 if decode_only else int(torch.randint(0, 4, (1,), generator=gen))
        query_len = [1, seq_len, int(torch.randint(1, seq_len + 1, (1,), generator=gen)), 0][kind]
        seq_lens.append(seq_len)
        query_lens.append(query_len)
    if sum(query_lens) == 0:
        query_lens[0] = 1
    return seq_lens, query_lens


def run_both(case, dtype=torch.float32, **batched_kwargs):
    """Forward through the batched backend and the reference on copies of the same cache."""
    _, (query, key, value), kv_cache, meta = case
    q, k, v, cache = (t.to(dtype) for t in (query, key, value, kv_cache))
    ref_cache = cache.clone()
    got = TorchAttentionBackend(**batched_kwargs).forward(q, k, v, cache, meta, HEAD_DIM ** -0.5)
    want = TorchAttentionBackend(batched=False).forward(q, k, v, ref_cache, meta,
                                                        HEAD_DIM ** -0.5)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0, equal_nan=True)
    n = meta.num_actual_tokens
    return got[:n], want[:n]


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("decode_only", [False, True])
def test_batched_matches_reference_on_random_batches(group, decode_only):
    gen = torch.Generator().manual_seed(group * 2 + decode_only)
    for trial in range(8):
        num_reqs = int(torch.randint(1, 9, (1,), generator=gen))
        seq_lens, query_lens = random_batch(gen, num_reqs, decode_only)
        num_pad = trial % 3
        case = build_case(gen, seq_lens, query_lens, 2 * group, 2, num_pad, num_blocks=64,
                          extra_cols=trial % 2)
        got, want = run_both(case)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{seq_lens} {query_lens}: {m}")


def test_batched_matches_reference_in_bf16():
    gen = torch.Generator().manual_seed(7)
    case = build_case(gen, [9, 3, 17, 5], [9, 1, 6, 1], 8, 2, 2, num_blocks=64)
    got, want = run_both(case, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 5, 1]])
def test_batched_ignores_stale_nan_slots(query_lens):
    """Padding re-reads real rows, so NaN anywhere outside the requests' positions is unseen."""
    gen = torch.Generator().manual_seed(3)
    seqs, tensors, kv_cache, meta = build_case(gen, [5, 10, 2], query_lens, 4, 2, 0)
    live = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        pos = torch.arange(seq_len)
        live[meta.block_table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE] = True
    kv_cache.view(2, NUM_BLOCKS * BLOCK_SIZE, -1)[:, ~live] = float("nan")
    got, want = run_both((seqs, tensors, kv_cache, meta))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- the memory bound ------------------------------------------------------------------------------

def test_padded_bytes_counts_kv_queries_and_mask():
    # R=3, Q=2, L=10, Hq=4, Hkv=2, D=8: 4 * (2*3*10*2*8 + 2*3*2*4*8) + 3*2*10
    assert padded_bytes(3, 2, 10, 4, 2, 8) == 4 * (960 + 384) + 60
    assert DEFAULT_MAX_PADDED_BYTES == 256 * 1024 * 1024
    # e.g. 256 decodes of 4096 tokens, 8 kv heads of 128: 2 GiB of keys/values, over the bound
    assert padded_bytes(256, 1, 4096, 32, 8, 128) > DEFAULT_MAX_PADDED_BYTES


def test_groups_over_the_bound_write_nothing():
    gen = torch.Generator().manual_seed(5)
    _, (query, key, value), kv_cache, meta = build_case(gen, [7, 9, 4], [1, 1, 1], 4, 2, 0)
    write_kv_cache(key, value, kv_cache, meta.slot_mapping)
    lens, scale = meta.seq_lens_cpu, HEAD_DIM ** -0.5
    need = padded_bytes(3, 1, 9, 4, 2, HEAD_DIM)
    out = torch.zeros_like(query)
    assert not attend_decodes(query, kv_cache, meta.block_table, lens, scale, out, need - 1)
    assert not out.any()
    assert attend_decodes(query, kv_cache, meta.block_table, lens, scale, out, need)
    assert out.abs().sum() > 0

    starts = meta.query_start_loc_cpu.long()
    req_ids = torch.tensor([0, 2])
    need = padded_bytes(2, 1, 7, 4, 2, HEAD_DIM)
    out = torch.zeros_like(query)
    args = (query, kv_cache, meta.block_table, req_ids, starts, starts[1:] - starts[:-1], lens,
            scale, out)
    assert not attend_group(*args, need - 1)
    assert not out.any()
    assert attend_group(*args, need)
    assert out[0].any() and out[2].any() and not out[1].any()


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [4, 1, 3]])
def test_backend_over_the_bound_falls_back_to_the_loop(query_lens, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    case = build_case(gen, [7, 9, 4], query_lens, 4, 2, 1)
    looped: list[list[int]] = []
    loop = torch_ref.attend_requests

    def counting_loop(query, kv_cache, meta, req_ids, scale, out, window=0, softcap=0.0,
                      sinks=None):
        looped.append(list(req_ids))
        return loop(query, kv_cache, meta, req_ids, scale, out, window, softcap, sinks)

    monkeypatch.setattr(torch_ref, "attend_requests", counting_loop)
    got, want = run_both(case, max_padded_bytes=100)   # below any group: every group loops
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # The batched backend looped over all three requests (the reference loops once more).
    assert sorted(r for call in looped[:-1] for r in call) == [0, 1, 2], looped


def test_negative_bound_is_rejected():
    with pytest.raises(ValueError, match="max_padded_bytes=-1"):
        TorchAttentionBackend(max_padded_bytes=-1)


def _count_index_copies(fn) -> int:
    """How many index_copy_ calls fn() makes (a dispatch mode sees every aten op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.index_copy_:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


@pytest.mark.parametrize("slots", [[5, 0, 9], [5, -1, 0]], ids=["full", "padded"])
def test_a_cache_whose_values_are_its_keys_is_written_once(slots):
    """MLA's latent cache (loader.new_kv_cache: one tensor seen twice, stride 0) takes the key
    as the value: one index_copy_, also past padding rows (which index key and value apart);
    the rows land in both halves, the others stay zero."""
    key = torch.randn(3, 1, 8)
    base = torch.zeros(3, 4, 1, 8)
    kv_cache = base.unsqueeze(0).expand(2, *base.shape)
    slot_mapping = torch.tensor(slots)
    assert _count_index_copies(lambda: write_kv_cache(key, key, kv_cache, slot_mapping)) == 1
    flat = base.view(-1, 1, 8)
    for row, slot in enumerate(slots):
        if slot >= 0:
            torch.testing.assert_close(flat[slot], key[row], atol=0, rtol=0)
    assert int((flat.abs().sum((1, 2)) != 0).sum()) == sum(s >= 0 for s in slots)
    assert _count_index_copies(lambda: write_kv_cache(key, key, torch.zeros(2, 3, 4, 1, 8),
                                                      slot_mapping)) == 2


def test_another_value_into_a_cache_whose_values_are_its_keys_is_refused():
    """A value that is not the key tensor would overwrite the keys of a stride-0 cache."""
    key = torch.randn(3, 1, 8)
    base = torch.zeros(3, 4, 1, 8)
    kv_cache = base.unsqueeze(0).expand(2, *base.shape)
    with pytest.raises(ValueError, match="value is not the key tensor.*stride 0"):
        write_kv_cache(key, key.clone(), kv_cache, torch.tensor([0, 1, 2]))
    assert not base.any()
