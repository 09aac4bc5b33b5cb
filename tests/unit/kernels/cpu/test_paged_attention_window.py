"""The CPU paged attention kernel's sliding window (query p sees keys p - W < k <= p) against
the torch reference loop, on each build (conftest.py): decodes far past the window (the narrow
vector bodies), wide prefill tiles whose rows' windows start in different chunks, chunks after
cached prefixes, windows of 1, under a chunk, across chunks and blocks, and over the sequence;
float32 and bfloat16; block sizes 4 (chunks cross blocks) and 16; head sizes 16 to 128."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_paged
from kernels.attention.torch_ref import TorchAttentionBackend
from tests.unit.kernels.cpu.test_paged_attention import make_case

pytestmark = [pytest.mark.skipif(not cpu_paged.available(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]

# decodes (70, 130 keys), a fresh 60-token prefill, chunks of 9 and 40 after cached prefixes,
# a one-token prompt, an idle request
SEQ_LENS = [70, 60, 45, 1, 130, 88, 12]
QUERY_LENS = [1, 60, 9, 1, 1, 40, 0]


def run_both(case, window):
    query, key, value, cache, meta = case
    scale = query.shape[-1] ** -0.5
    backend = cpu_paged.CpuPagedAttentionBackend()
    got = backend.forward(query, key, value, cache.clone(), meta, scale, sliding_window=window)
    want = TorchAttentionBackend(batched=False).forward(query, key, value, cache.clone(), meta,
                                                        scale, sliding_window=window)
    assert backend.calls == 1
    n = meta.num_actual_tokens
    return got[:n].float(), want[:n].float()


@pytest.mark.parametrize("window", [1, 7, 16, 33, 200])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (16, 2, 64), (9, 3, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_window_matches_the_reference(window, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(window + heads + block_size)
    case = make_case(gen, SEQ_LENS, QUERY_LENS, heads, kv_heads, head_dim, block_size,
                     torch.float32, num_pad=2)
    got, want = run_both(case, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if window < 200:        # the window changed the answer (200 covers every sequence)
        full = TorchAttentionBackend(batched=False).forward(
            *case[:3], case[3].clone(), case[4], head_dim ** -0.5)[:got.shape[0]]
        assert not torch.allclose(full.float(), want, atol=1e-3)


def test_window_in_bfloat16():
    gen = torch.Generator().manual_seed(5)
    case = make_case(gen, SEQ_LENS, QUERY_LENS, 8, 2, 64, 16, torch.bfloat16)
    got, want = run_both(case, 24)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_negative_window_is_refused(ops):
    case = make_case(torch.Generator().manual_seed(0), [5], [5], 4, 4, 16, 4, torch.float32)
    query, _, _, cache, meta = case
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops.paged_attention(query, cache, meta.block_table, meta.query_start_loc_cpu,
                            meta.seq_lens_cpu, 0.25, torch.empty_like(query), -1)


@pytest.mark.parametrize("window", [1, 17, 131])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 80), (12, 4, 96)])
def test_window_at_head_dims_80_and_96(window, heads, kv_heads, head_dim):
    """The head sizes the vector bodies handle in pieces (80, 96: not a multiple of a chunk)."""
    gen = torch.Generator().manual_seed(window + head_dim)
    case = make_case(gen, SEQ_LENS + [140], QUERY_LENS + [3], heads, kv_heads, head_dim, 16,
                     torch.float32, num_pad=2)
    got, want = run_both(case, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
