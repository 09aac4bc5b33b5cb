"""The CPU paged attention kernel (kernels/cpu/csrc/paged_attention.cpp) against the torch
reference backend on random paged batches: decodes, full and chunked prefills on a cached
prefix, idle requests, padding rows; float32 and bfloat16; head sizes 16, 64 and 128; GQA
groups from 1 to 8; block sizes 1 to 16; on each build (conftest.py)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_paged
from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import TorchAttentionBackend

pytestmark = [pytest.mark.skipif(not cpu_paged.available(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]


def make_case(gen, seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype,
              num_pad=0):
    """Random cache (every slot random), shuffled blocks, q/k/v strided views of one qkv."""
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks) + 2, dtype=torch.int32)
    slots, used = [], 0
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        table[i, :blocks[i]] = perm[used:used + blocks[i]]
        used += blocks[i]
        pos = torch.arange(s - q, s)
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    tokens = sum(query_lens)
    slots.append(torch.full((num_pad,), -1, dtype=torch.long))
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens + num_pad, width, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    rows = tokens + num_pad
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    query = qkv[:, :q_end].view(rows, heads, head_dim)
    key = qkv[:, q_end:k_end].view(rows, kv_heads, head_dim)
    value = qkv[:, k_end:].view(rows, kv_heads, head_dim)
    starts = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=starts, seq_lens=lens, block_table=table,
        slot_mapping=torch.cat(slots), query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return query, key, value, cache, meta


def check(case, tol):
    """The kernel's output and cache writes on `case` against the torch reference's."""
    query, key, value, cache, meta = case
    ref_cache = cache.clone()
    scale = query.shape[-1] ** -0.5
    backend = cpu_paged.CpuPagedAttentionBackend()
    got = backend.forward(query, key, value, cache, meta, scale)
    want = TorchAttentionBackend(batched=False).forward(query, key, value, ref_cache, meta, scale)
    assert backend.calls == 1 and got.dtype == query.dtype
    # The same writes, bit for bit (an fp8 cache too: test_paged_attention_fp8.py)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    n = meta.num_actual_tokens
    torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=tol, rtol=tol)


def random_lengths(gen, num_reqs, max_len):
    seq_lens, query_lens = [], []
    for _ in range(num_reqs):
        s = int(torch.randint(1, max_len, (1,), generator=gen))
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        q = [1, s, int(torch.randint(1, s + 1, (1,), generator=gen)), 0][kind]
        seq_lens.append(s)
        query_lens.append(q)
    query_lens[0] = max(query_lens[0], 1)
    return seq_lens, query_lens


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_batches_match_the_reference(head_dim, heads, kv_heads, dtype):
    gen = torch.Generator().manual_seed(head_dim + heads * 7 + (dtype == torch.bfloat16))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for trial in range(4):
        seq_lens, query_lens = random_lengths(gen, int(torch.randint(1, 7, (1,), generator=gen)),
                                              120)
        block_size = (1, 4, 16, 8)[trial]
        check(make_case(gen, seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype,
                        num_pad=trial % 2), tol)


@pytest.mark.parametrize("seq_len,query_len", [(1, 1), (16, 16), (17, 17), (300, 300),
                                               (300, 1), (300, 37), (64, 48)])
def test_tile_and_chunk_edges(seq_len, query_len):
    """Prefill tiles of 16 tokens (48 rows) and 16-key chunks: lengths at and around them."""
    gen = torch.Generator().manual_seed(seq_len * 1000 + query_len)
    check(make_case(gen, [seq_len], [query_len], 9, 3, 64, 16, torch.float32), 1e-5)


def test_a_whole_decode_batch_of_many_requests():
    gen = torch.Generator().manual_seed(11)
    seq_lens = [int(x) for x in torch.randint(1, 200, (40,), generator=gen)]
    check(make_case(gen, seq_lens, [1] * 40, 9, 3, 64, 16, torch.float32), 1e-5)


def test_the_kernel_reads_only_each_requests_own_positions():
    """NaN in every cache slot no request owns (stale blocks, past seq_len) never reaches out."""
    gen = torch.Generator().manual_seed(5)
    query, key, value, cache, meta = make_case(gen, [5, 40, 2], [5, 1, 1], 4, 2, 64, 16,
                                               torch.float32)
    live = torch.zeros(cache.shape[1] * cache.shape[2], dtype=torch.bool)
    for i, s in enumerate(meta.seq_lens_cpu.tolist()):
        pos = torch.arange(s)
        live[meta.block_table[i, pos // 16].long() * 16 + pos % 16] = True
    cache.view(2, -1, 2 * 64)[:, ~live] = float("nan")
    check((query, key, value, cache, meta), 1e-5)


def test_supports_names_the_layouts_it_takes():
    assert cpu_paged.supports(64, torch.float32) and cpu_paged.supports(128, torch.bfloat16)
    assert cpu_paged.supports(576, torch.float32)                # the MLA latent
    assert not cpu_paged.supports(72, torch.float32)
    assert not cpu_paged.supports(64, torch.float16)


def test_selector_picks_it_on_cpu_when_the_layout_fits():
    from kernels.attention.selector import CacheLayout, resolve_backend_name
    assert resolve_backend_name("auto", "cpu", CacheLayout(16, 64, torch.float32)) == "cpu"
    assert resolve_backend_name("auto", "cpu", CacheLayout(16, 72, torch.float32)) == "torch"
    assert resolve_backend_name("auto", "cpu", CacheLayout(16, 64, torch.float16)) == "torch"
    assert resolve_backend_name("torch", "cpu", CacheLayout(16, 64, torch.float32)) == "torch"


def test_cpu_named_for_a_layout_it_cannot_take_is_refused_by_name():
    """`auto` falls back to torch; `cpu` named explicitly is refused, naming the head size or the
    heads per kv head, never run as another backend (the reported backend is what runs)."""
    from kernels.attention.selector import (CacheLayout, get_attention_backend,
                                            resolve_backend_name)
    with pytest.raises(ValueError, match=r"attention_backend='cpu' is invalid .* head size 72"):
        get_attention_backend("cpu", "cpu", CacheLayout(16, 72, torch.float32))
    with pytest.raises(ValueError, match="129 query heads per kv head on a rank"):
        get_attention_backend("cpu", "cpu", CacheLayout(16, 64, torch.float32, group=129))
    assert resolve_backend_name("auto", "cpu", CacheLayout(16, 64, torch.float32,
                                                           group=129)) == "torch"
    # DeepSeek's latent: 576 with up to 128 heads on its one kv head fits; 512 does not
    assert resolve_backend_name("auto", "cpu", CacheLayout(16, 576, torch.bfloat16,
                                                           group=128, value_dim=512)) == "cpu"
    assert resolve_backend_name("auto", "cpu", CacheLayout(16, 512, torch.float32,
                                                           group=16)) == "torch"


@pytest.mark.parametrize("value_dim,sinks,why", [
    (0, False, "its cached head size 576 with a value of 576 dims; .* at most its first 512"),
    (544, False, "its cached head size 576 with a value of 544 dims; .* at most its first 512"),
    (512, True, "attention sinks with its cached head size 576"),
])
def test_the_latent_head_only_with_a_value_in_its_prefix(value_dim, sinks, why):
    """576 is attended as MLA's latent (values the row's first 512, no sinks): a whole-head
    value, a wider latent value (kv_lora_rank 544 + rope 32) or sinks at 576 are left to torch
    by `auto` and refused by name for `cpu` (the kernel would fail at the first step)."""
    from kernels.attention.selector import (CacheLayout, get_attention_backend,
                                            resolve_backend_name)
    layout = CacheLayout(16, 576, torch.float32, sinks=sinks, group=16, value_dim=value_dim)
    assert resolve_backend_name("auto", "cpu", layout) == "torch"
    with pytest.raises(ValueError, match=r"attention_backend='cpu' is invalid for this model: "
                                         + why):
        get_attention_backend("cpu", "cpu", layout)
    assert resolve_backend_name("auto", "cpu", CacheLayout(16, 576, torch.float32, group=16,
                                                           value_dim=448)) == "cpu"
