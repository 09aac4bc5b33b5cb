"""The Triton backend's dispatch designs and launch choices against the torch reference.

unified (the varlen kernel serves every batch) and per_request (one-token requests to the
split-KV kernel, the rest to the varlen kernel, two launches) on decode, mixed and pure-prefill
batches; non-default num_warps / BLOCK_N / num_stages / tile heights; the launch config's
validation and split heuristic. Batches and the comparison come from test_triton_attention.py;
on CPU the kernels run under the Triton interpreter, so sizes stay tiny.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.attention_cases import (ON_GPU, check_against_reference, make_case,
                                           needs_kernels, triton_attn, triton_backend)
from kernels.attention.torch_ref import TorchAttentionBackend
from kernels.attention.triton_launch import (KernelTiles, TritonLaunchConfig, choose_num_splits,
                                             decode_keys_per_step)

# The Triton interpreter runs every kernel in Python: seconds per case on CPU.
pytestmark = pytest.mark.slow

# One-token prompt (seq 1), a one-token chunk after a cached prefix (seq 29), decodes, a fresh
# prefill, and a chunk after an unaligned prefix: each request kind the dispatch must route.
MIXED = ([21, 40, 1, 29, 39, 70], [21, 1, 1, 1, 7, 1])
DECODE = ([1, 17, 64, 130], [1, 1, 1, 1])
PREFILL_ONLY = ([12, 40], [12, 9])


def backend(**launch) -> object:
    return triton_backend.TritonAttentionBackend(launch=TritonLaunchConfig(**launch))


@needs_kernels
@pytest.mark.parametrize("dispatch", ["unified", "per_request"])
@pytest.mark.parametrize("batch", [MIXED, DECODE, PREFILL_ONLY], ids=["mixed", "decode",
                                                                       "prefill"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (8, 1, 64)])
def test_dispatch_matches_reference(dispatch, batch, num_heads, num_kv_heads, head_dim):
    """Every design agrees with the reference on every batch kind, padded rows included."""
    case = make_case(11, *batch, num_heads, num_kv_heads, head_dim, 16, num_pad=2)
    check_against_reference(case, backend(dispatch=dispatch))


@needs_kernels
@pytest.mark.parametrize("splits", [1, 3])
def test_per_request_with_fixed_splits(splits):
    case = make_case(12, *MIXED, 4, 2, 16, 16, num_pad=1)
    check_against_reference(case, backend(dispatch="per_request", decode_splits=splits))


@needs_kernels
@pytest.mark.parametrize("tiles", [KernelTiles(16, 2, 1), KernelTiles(64, 8, 3),
                                   KernelTiles(32, 4, 2), KernelTiles(128, 2, 2)],
                         ids=lambda t: f"n{t.block_n}-w{t.num_warps}-s{t.num_stages}")
def test_non_default_launch_choices_match(tiles):
    """Other BLOCK_N / num_warps / num_stages and tile heights, through all three designs."""
    for dispatch, batch in (("by_batch", MIXED), ("by_batch", DECODE), ("unified", DECODE)):
        launch = TritonLaunchConfig(prefill=tiles, decode=tiles, block_q_rows=16,
                                    decode_q_rows=32, decode_splits=2, dispatch=dispatch)
        case = make_case(13, *batch, 4, 2, 16, 16, num_pad=1)
        check_against_reference(case, triton_backend.TritonAttentionBackend(launch=launch))


@needs_kernels
@pytest.mark.parametrize("splits", [1, 2])
def test_each_kernel_leaves_the_others_rows_alone(splits):
    """The per-request contract: the decode kernel (direct store or reduce) writes only
    one-token requests' rows, the varlen kernel with skip_decodes only the others'."""
    query, key, value, kv_cache, meta = make_case(14, *MIXED, 4, 2, 16, 16)
    scale = 0.25
    expected = TorchAttentionBackend(batched=False).forward(query, key, value, kv_cache, meta,
                                                            scale)
    lens = (meta.query_start_loc_cpu[1:] - meta.query_start_loc_cpu[:-1]).tolist()
    one = torch.cat([torch.full((n,), n == 1) for n in lens])
    args = (meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_reqs)
    out = torch.full_like(query, 7.0)
    triton_attn.paged_decode_attention(query, kv_cache, out, *args, splits, scale)
    assert bool((out[~one] == 7.0).all())
    torch.testing.assert_close(out[one], expected[one], atol=2e-5, rtol=2e-5)
    out = torch.full_like(query, 7.0)
    triton_attn.paged_prefill_attention(query, kv_cache, out, *args, meta.num_actual_tokens,
                                        scale, skip_decodes=True)
    assert bool((out[one] == 7.0).all())
    torch.testing.assert_close(out[~one], expected[~one], atol=2e-5, rtol=2e-5)


def test_decode_keys_per_step_caps_the_tile_bytes():
    """128 bf16 keys of head_dim 128 a step (32 KB); fp32 or head_dim 256 halve it, never
    below tl.dot's 16 keys."""
    assert decode_keys_per_step(128, 128, 2) == 128
    assert decode_keys_per_step(128, 128, 4) == decode_keys_per_step(128, 256, 2) == 64
    assert decode_keys_per_step(128, 256, 4) == 32 and decode_keys_per_step(64, 64, 2) == 64
    assert decode_keys_per_step(256, 128, 2) == 128 and decode_keys_per_step(32, 4096, 4) == 16


def test_defaults_are_todays_values():
    d = TritonLaunchConfig()
    assert (d.prefill, d.decode) == (KernelTiles(64, 4, 2), KernelTiles(128, 4, 2))
    assert (d.block_q_rows, d.decode_splits, d.dispatch) == (64, None, "by_batch")
    assert (d.min_split_tokens, d.max_splits) == (256, 32)


@pytest.mark.parametrize("make,field", [
    (lambda: KernelTiles(block_n=8), "block_n"),
    (lambda: KernelTiles(block_n=48), "block_n"),
    (lambda: KernelTiles(num_warps=3), "num_warps"),
    (lambda: KernelTiles(num_warps=32), "num_warps"),
    (lambda: KernelTiles(num_stages=0), "num_stages"),
    (lambda: TritonLaunchConfig(block_q_rows=8), "block_q_rows"),
    (lambda: TritonLaunchConfig(decode_q_rows=24), "decode_q_rows"),
    (lambda: TritonLaunchConfig(decode_splits=0), "decode_splits"),
    (lambda: TritonLaunchConfig(max_splits=0), "max_splits"),
    (lambda: TritonLaunchConfig(split_waves=0), "split_waves"),
    (lambda: TritonLaunchConfig(dispatch="both"), "dispatch"),
])
def test_invalid_launch_choices_raise(make, field):
    with pytest.raises(ValueError, match=f"^{field}=.* is invalid: must be"):
        make()


def test_split_heuristic_follows_the_config():
    assert choose_num_splits(4, 8, 4096, 132) == 9              # ~2 waves of 132 SMs
    assert choose_num_splits(4, 8, 4096, 132, min_split_tokens=1024) == 4
    assert choose_num_splits(1, 8, 8192, 132, max_splits=8) == 8
    assert TritonLaunchConfig(max_splits=5).splits_for(4, 8, 4096, 132) == 5
    assert TritonLaunchConfig(decode_splits=3).splits_for(256, 8, 10, 132) == 3
    # more waves: a mid-size batch (86 x 8 programs, 1.7 waves of ~400) is split in two
    assert choose_num_splits(86, 8, 4096, 132) == 1
    assert TritonLaunchConfig(split_waves=6).splits_for(86, 8, 4096, 132) == 2


@needs_kernels
def test_decode_splits_argument_overrides_launch():
    b = triton_backend.TritonAttentionBackend(4, TritonLaunchConfig(decode_splits=2,
                                                                    dispatch="unified"))
    assert b.decode_splits == 4 and b.launch.dispatch == "unified"


@needs_kernels
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dispatch", ["unified", "per_request"])
def test_gpu_dispatch_at_model_sizes(dispatch):
    """bf16, 32 query / 8 KV heads, D 128: a mixed batch and a decode batch, plus the sweep's
    extreme launch choices on the decode batch (the compiler, not the interpreter, decides)."""
    mixed = make_case(15, [517, 1, 2048, 300, 77], [200, 1, 1, 300, 1], 32, 8, 128, 16,
                      num_pad=3, dtype=torch.bfloat16)
    check_against_reference(mixed, backend(dispatch=dispatch), 2e-2, 2e-2)
    decode = make_case(16, [4096, 1, 1000, 2500] * 4, [1] * 16, 32, 8, 128, 16,
                       dtype=torch.bfloat16)
    for tiles in (KernelTiles(16, 2, 1), KernelTiles(128, 8, 3)):
        launch = TritonLaunchConfig(prefill=tiles, decode=tiles, decode_q_rows=64,
                                    dispatch=dispatch)
        check_against_reference(decode, triton_backend.TritonAttentionBackend(launch=launch),
                                2e-2, 2e-2)
