"""bfloat16 prefill tiles on AVX512-BF16 dot products (kernels/cpu/csrc/attention_bf16dot.h):
which builds take them, and that they stay as close to float32 attention over the same bf16
inputs as the widening body does, over long prompts (P rounded to bf16 in the P V product)
and with a window."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_paged
from kernels.attention.torch_ref import TorchAttentionBackend
from kernels.cpu import extension
from tests.unit.kernels.cpu.test_paged_attention import make_case

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="deltaserve_cpu not built")


def test_the_dot_products_are_compiled_where_the_cpu_has_them(cpu_isa):
    flags = set(extension.cpu_flags().split())
    expected = cpu_isa == "native" and {"avx512f", "avx512_bf16"} <= flags
    assert extension.ops(cpu_isa).bf16_dot() is expected


def _relative_error(heads, kv_heads, head_dim, seq_lens, query_lens, window):
    gen = torch.Generator().manual_seed(head_dim + len(seq_lens) + window)
    query, key, value, cache, meta = make_case(gen, seq_lens, query_lens, heads, kv_heads,
                                               head_dim, 16, torch.bfloat16)
    scale = head_dim ** -0.5
    got = cpu_paged.CpuPagedAttentionBackend().forward(query, key, value, cache.clone(), meta,
                                                       scale, sliding_window=window)
    f32 = [t.float() for t in (query, key, value, cache)]      # the same bf16 values, widened
    want = TorchAttentionBackend(batched=False).forward(*f32[:3], f32[3], meta, scale,
                                                        sliding_window=window)
    n = meta.num_actual_tokens
    return ((got[:n].float() - want[:n]).norm() / want[:n].norm()).item()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 16)])
@pytest.mark.parametrize("window", [0, 100])
def test_long_bf16_prefills_stay_within_bf16_rounding(cpu_isa, heads, kv_heads, head_dim,
                                                      window):
    # a 1,200-token prompt, a 300-token chunk after 700 cached, a decode: the output's own bf16
    # rounding is ~1.5e-3 of its norm; a wrong pair, a stale probability or a lost rescale is
    # far more
    err = _relative_error(heads, kv_heads, head_dim, [1200, 1000, 400], [1200, 300, 1], window)
    assert err < 3e-3, err
