"""The CPU paged attention kernel on DeepSeek's MLA latent (kernels/cpu/csrc/attention_latent.h):
keys of 576 dims (kv_lora_rank 512 + rope 64), values the first 512 dims of the same cached row
(the [2, ...] cache is one tensor seen twice, stride 0), 16 / 32 / 128 query heads on the one
latent head (past 48 the kernel cuts them into head tiles), against the torch reference
backend: decodes, chunked prefills on a cached prefix, a mixed batch, several blocks per
request, float32 and bfloat16 (on an AVX512-BF16 build bfloat16's scores take the pair
products), with MLA's yarn-scaled softmax scale; on each build (conftest.py)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_paged
from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import TorchAttentionBackend

pytestmark = [pytest.mark.skipif(not cpu_paged.available(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]

LATENT, VALUE = 576, 512
SCALE = 192 ** -0.5 * 1.37 ** 2          # qk_head_dim ** -0.5 times a yarn mscale squared


def latent_cache(base: torch.Tensor) -> torch.Tensor:
    """[2, blocks, block_size, 1, 576] over one [blocks, block_size, 1, 576] (stride 0)."""
    return base.unsqueeze(0).expand(2, *base.shape)


def make_case(gen, seq_lens, query_lens, heads, block_size, dtype, num_pad=0):
    """Random latent cache, shuffled blocks; the key and value of a row are one tensor."""
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    slots, used = [], 0
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        table[i, :blocks[i]] = perm[used:used + blocks[i]]
        used += blocks[i]
        pos = torch.arange(s - q, s)
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    tokens = sum(query_lens)
    slots.append(torch.full((num_pad,), -1, dtype=torch.long))
    rows = tokens + num_pad
    query = torch.randn(rows, heads, LATENT, generator=gen).to(dtype)
    latent = torch.randn(rows, 1, LATENT, generator=gen).to(dtype)
    base = torch.randn(num_blocks, block_size, 1, LATENT, generator=gen).to(dtype)
    starts = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=starts, seq_lens=lens, block_table=table,
        slot_mapping=torch.cat(slots), query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return query, latent, base, meta


def check(case, tol):
    query, latent, base, meta = case
    ref_base = base.clone()
    backend = cpu_paged.CpuPagedAttentionBackend()
    got = backend.forward(query, latent, latent, latent_cache(base), meta, SCALE,
                          v_head_dim=VALUE)
    want = TorchAttentionBackend(batched=False).forward(query, latent, latent,
                                                        latent_cache(ref_base), meta, SCALE)
    assert backend.calls == 1 and got.dtype == query.dtype
    assert got.shape == (query.shape[0], query.shape[1], VALUE)
    torch.testing.assert_close(base, ref_base, atol=0, rtol=0, equal_nan=True)   # same writes
    n = meta.num_actual_tokens
    torch.testing.assert_close(got[:n].float(), want[:n, :, :VALUE].float(), atol=tol, rtol=tol)


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("heads", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_match_the_reference(heads, dtype):
    """One token per request, 1 to 5 blocks of 16 each, a request at a block's edge."""
    gen = torch.Generator().manual_seed(heads + (dtype == torch.bfloat16))
    seq_lens = [1, 16, 17, 40, 77]
    check(make_case(gen, seq_lens, [1] * 5, heads, 16, dtype), TOL[dtype])


@pytest.mark.parametrize("heads", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefills_and_decodes_in_one_batch(heads, dtype):
    """A whole prefill, a chunk on a cached prefix, decodes, an idle request, a padding row."""
    gen = torch.Generator().manual_seed(7 * heads + (dtype == torch.bfloat16))
    check(make_case(gen, [21, 50, 9, 33, 12], [21, 13, 1, 1, 0], heads, 8, dtype, num_pad=1),
          TOL[dtype])


@pytest.mark.parametrize("heads", [1, 8, 49])
def test_head_counts_off_the_vector_width(heads):
    """Tiles of 1 and 8 rows (part of a vector) and 49 heads (a tile of 48 and one of 1)."""
    gen = torch.Generator().manual_seed(heads)
    check(make_case(gen, [5, 30], [5, 1], heads, 4, torch.float32), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_reads_only_each_requests_own_rows(dtype):
    """NaN in every latent row no request owns never reaches the output (bfloat16 on an
    AVX512-BF16 build: the keys read in place by the pair products)."""
    gen = torch.Generator().manual_seed(3)
    query, latent, base, meta = make_case(gen, [5, 40], [5, 1], 16, 16, dtype)
    live = torch.zeros(base.shape[0] * base.shape[1], dtype=torch.bool)
    for i, s in enumerate(meta.seq_lens_cpu.tolist()):
        pos = torch.arange(s)
        live[meta.block_table[i, pos // 16].long() * 16 + pos % 16] = True
    live[meta.slot_mapping[meta.slot_mapping >= 0]] = True
    base.view(-1, LATENT)[~live] = float("nan")
    check((query, latent, base, meta), TOL[dtype])


def test_a_window_or_sinks_with_the_latent_are_refused_by_name():
    gen = torch.Generator().manual_seed(1)
    query, latent, base, meta = make_case(gen, [4], [1], 16, 16, torch.float32)
    backend = cpu_paged.CpuPagedAttentionBackend()
    with pytest.raises(ValueError, match="v_head_dim=512 with head_dim=576.*sliding window"):
        backend.forward(query, latent, latent, latent_cache(base), meta, SCALE,
                        sliding_window=8, v_head_dim=VALUE)
    with pytest.raises(ValueError, match="v_head_dim=512 with head_dim=576.*sinks"):
        backend.forward(query, latent, latent, latent_cache(base), meta, SCALE,
                        sinks=torch.zeros(16), v_head_dim=VALUE)
    with pytest.raises(ValueError, match="v_head_dim=576 with head_dim=576: .* first 512"):
        backend.forward(query, latent, latent, latent_cache(base), meta, SCALE)
    with pytest.raises(ValueError, match=r"v_head_dim=600 is invalid: must be an int in 0\.\.576"):
        backend.forward(query, latent, latent, latent_cache(base), meta, SCALE, v_head_dim=600)


def test_the_op_refuses_a_value_dim_it_has_no_body_for(ops):
    """The op itself: out's last dim is the value dim, 512 for 576 and the head dim else."""
    gen = torch.Generator().manual_seed(2)
    query, _, base, meta = make_case(gen, [4], [1], 16, 16, torch.float32)
    out = torch.empty(1, 16, 500)
    with pytest.raises(RuntimeError, match="value head dim 500 with head_dim 576"):
        ops.paged_attention(query, latent_cache(base), meta.block_table,
                                        meta.query_start_loc_cpu, meta.seq_lens_cpu, SCALE, out)
    with pytest.raises(RuntimeError, match="query heads per kv head: 129, at most 128"):
        ops.paged_attention(torch.randn(1, 129, 576), latent_cache(base),
                                        meta.block_table, meta.query_start_loc_cpu,
                                        meta.seq_lens_cpu, SCALE, torch.empty(1, 129, 512))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_with_its_own_value_half(dtype):
    """[2, ...] contiguous, values not the keys: the kernel reads the value row's first 512."""
    gen = torch.Generator().manual_seed(9)
    query, latent, base, meta = make_case(gen, [30, 7], [1, 7], 16, 16, dtype)
    cache = torch.stack((base, torch.randn(base.shape, generator=gen).to(dtype)))
    value = torch.randn(latent.shape, generator=gen).to(dtype)
    ref_cache = cache.clone()
    got = cpu_paged.CpuPagedAttentionBackend().forward(query, latent, value, cache, meta, SCALE,
                                                       v_head_dim=VALUE)
    want = TorchAttentionBackend(batched=False).forward(query, latent, value, ref_cache, meta,
                                                        SCALE)
    n = meta.num_actual_tokens
    torch.testing.assert_close(got[:n].float(), want[:n, :, :VALUE].float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


def test_the_attention_layer_returns_the_value_width_on_either_backend():
    """layers/attention.py with v_head_dim=512: the cpu backend attends the prefix, the torch
    backend the whole head (sliced by the layer); both give [T, H * 512], the same values."""
    from worker_service.layers.attention import Attention
    gen = torch.Generator().manual_seed(4)
    query, latent, base, meta = make_case(gen, [12, 30], [12, 1], 16, 16, torch.float32)
    n = meta.num_actual_tokens
    outs = []
    for backend in (cpu_paged.CpuPagedAttentionBackend(), TorchAttentionBackend()):
        layer = Attention(16, 1, LATENT, SCALE, backend, v_head_dim=VALUE)
        outs.append(layer(query.flatten(1), latent.flatten(1), latent.flatten(1),
                          latent_cache(base.clone()), meta))
    assert outs[0].shape == outs[1].shape == (query.shape[0], 16 * VALUE)
    torch.testing.assert_close(outs[0][:n], outs[1][:n], atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match=r"v_head_dim=577 is invalid: must be an int in "
                                         r"0\.\.head_dim=576"):
        Attention(16, 1, LATENT, SCALE, TorchAttentionBackend(), v_head_dim=577)
