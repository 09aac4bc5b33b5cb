"""The CPU paged attention kernel's attention sinks (GPT-OSS: each query head's sink logit joins
its softmax denominator) against the torch reference loop, on each build (conftest.py): decodes
(the narrow vector bodies), wide prefill tiles, chunks after cached prefixes, with and without
a sliding window, GQA groups of 1 to 8, float32 and bfloat16, sinks far above and below the
scores. Without sinks the kernel's answer is unchanged; bad sinks are refused."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_paged
from kernels.attention.torch_ref import TorchAttentionBackend
from tests.unit.kernels.cpu.test_paged_attention import make_case

pytestmark = [pytest.mark.skipif(not cpu_paged.available(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]

SEQ_LENS = [70, 60, 45, 1, 130, 88, 12]
QUERY_LENS = [1, 60, 9, 1, 1, 40, 0]


def sinks_for(num_heads: int, seed: int) -> torch.Tensor:
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 30.0, -30.0       # one dominates its row's keys, one vanishes
    return sinks


def run_both(case, sinks, window=0):
    query, key, value, cache, meta = case
    scale = query.shape[-1] ** -0.5
    backend = cpu_paged.CpuPagedAttentionBackend()
    got = backend.forward(query, key, value, cache.clone(), meta, scale,
                          sliding_window=window, sinks=sinks)
    want = TorchAttentionBackend(batched=False).forward(query, key, value, cache.clone(), meta,
                                                        scale, sliding_window=window,
                                                        sinks=sinks)
    assert backend.calls == 1 and backend.capped_calls == 0      # the kernel ran
    n = meta.num_actual_tokens
    return got[:n].float(), want[:n].float()


@pytest.mark.parametrize("window", [0, 7, 33])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (16, 2, 64), (9, 3, 128),
                                                     (8, 8, 80)])
def test_sinks_match_the_reference(window, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(window + heads)
    case = make_case(gen, SEQ_LENS, QUERY_LENS, heads, kv_heads, head_dim, 16, torch.float32,
                     num_pad=2)
    sinks = sinks_for(heads, heads)
    got, want = run_both(case, sinks, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    without, _ = run_both(case, None, window)
    assert not torch.allclose(without, want, atol=1e-3)          # the sinks changed the answer


def test_sinks_in_bfloat16():
    gen = torch.Generator().manual_seed(5)
    case = make_case(gen, SEQ_LENS, QUERY_LENS, 8, 2, 64, 16, torch.bfloat16)
    got, want = run_both(case, sinks_for(8, 5), 24)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_without_sinks_the_kernel_is_unchanged(ops):
    """sinks=None and the op's old call (no sinks argument) give the same bits."""
    gen = torch.Generator().manual_seed(9)
    query, _, _, cache, meta = make_case(gen, SEQ_LENS, QUERY_LENS, 8, 2, 64, 16, torch.float32)
    args = (query, cache, meta.block_table, meta.query_start_loc_cpu, meta.seq_lens_cpu, 0.125)
    old, new = torch.empty_like(query), torch.empty_like(query)
    ops.paged_attention(*args, old, 0)
    ops.paged_attention(*args, new, 0, None)
    n = meta.num_actual_tokens
    assert torch.equal(old[:n], new[:n])


def test_bad_sinks_are_refused(ops):
    case = make_case(torch.Generator().manual_seed(0), [5], [5], 4, 4, 16, 4, torch.float32)
    query, _, _, cache, meta = case
    args = (query, cache, meta.block_table, meta.query_start_loc_cpu, meta.seq_lens_cpu, 0.25,
            torch.empty_like(query), 0)
    for bad in (torch.zeros(3), torch.zeros(4, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match=r"sinks must be a contiguous float32 \[Hq\]"):
            ops.paged_attention(*args, bad)
