"""The wide-head tiles (triton_launch.WIDE_HEAD_DIM) where the GQA group is cut into G_TILES
tiles that do not divide it: DeepSeek V2/V3's 128 latent heads at the tensor-parallel splits
that leave 20 or 40 heads a rank, one head, an ordinary (not stride-0) cache with two kv heads
and K != V at head 576 (KV_SHARED off: V must come from the value half, each kv head's tiles
its own), and windows, softcaps and sinks at the wide tiles, all against the torch backend,
varlen and split decode in one per_request launch pair. Under the interpreter (attention_cases).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.attention_cases import KERNELS_HERE, make_case, needs_kernels, triton_backend
from kernels.attention.torch_ref import TorchAttentionBackend
from kernels.attention.triton_launch import TritonLaunchConfig, decode_tile_shape
from tests.support.paths import REPO
from tests.unit.kernels.test_triton_wide_heads import LATENT, check_latent_case

PER_REQUEST = TritonLaunchConfig(dispatch="per_request")


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("heads", [1, 20, 40])
def test_latent_groups_not_a_multiple_of_16(heads):
    """A prefill after a cached prefix, a fresh one and two decodes (split 3 ways) at heads
    that leave the last G tile part empty: every head's rows written once, right."""
    case = make_case(21, [21, 18, 40, 1], [5, 18, 1, 1], heads, 1, LATENT, 16, num_pad=1)
    check_latent_case(case, triton_backend.TritonAttentionBackend(3, PER_REQUEST),
                      torch.float32)


@pytest.mark.slow
@needs_kernels
def test_latent_unified_dispatch():
    """dispatch="unified": the varlen kernel serves a pure-decode batch too, at the wide tiles
    (its 16-row decode tile is the wide tile already), 40 heads as three G tiles."""
    launch = TritonLaunchConfig(dispatch="unified")
    decode = make_case(26, [33, 1, 17], [1, 1, 1], 40, 1, LATENT, 16, num_pad=1)
    check_latent_case(decode, triton_backend.TritonAttentionBackend(launch=launch),
                      torch.float32)


@pytest.mark.slow
@needs_kernels
def test_wide_head_ordinary_cache_two_kv_heads():
    """Head 576 over a cache with distinct K and V halves and 2 kv heads of 20 query heads:
    KV_SHARED is off, and kv head 1's tiles read its own keys and values."""
    query, key, value, kv_cache, meta = make_case(22, [19, 33, 1], [7, 1, 1], 40, 2, LATENT,
                                                  16, num_pad=1)
    assert kv_cache.stride(0) != 0 and not torch.equal(kv_cache[0], kv_cache[1])
    expected = TorchAttentionBackend(batched=False).forward(query, key, value, kv_cache.clone(),
                                                            meta, 0.05)
    out = triton_backend.TritonAttentionBackend(2, PER_REQUEST).forward(
        query, key, value, kv_cache, meta, 0.05)
    n = meta.num_actual_tokens
    torch.testing.assert_close(out[:n], expected[:n], atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@needs_kernels
def test_wide_head_window_softcap_sinks():
    """Sliding window 9, softcap 5 and per-head sinks at head 576, 20 heads (two G tiles)."""
    query, key, value, kv_cache, meta = make_case(23, [30, 26, 1], [12, 1, 1], 20, 1, LATENT,
                                                  16)
    sinks = torch.randn(20, generator=torch.Generator().manual_seed(5))
    extra = dict(sliding_window=9, softcap=5.0, sinks=sinks)
    expected = TorchAttentionBackend(batched=False).forward(
        query, key, value, kv_cache.clone(), meta, 0.05, **extra)
    out = triton_backend.TritonAttentionBackend(2, PER_REQUEST).forward(
        query, key, value, kv_cache, meta, 0.05, **extra)
    n = meta.num_actual_tokens
    torch.testing.assert_close(out[:n], expected[:n], atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.skipif(KERNELS_HERE, reason="the kernel tests ran in this process")
def test_kernels_in_fresh_interpreter_process():
    """Triton was imported compiled-mode before this module: rerun the file with the env set."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "not fresh_interpreter_process"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@needs_kernels
def test_split_heuristic_counts_the_g_tiles():
    """MLA's 128 heads on one latent head run 8 decode programs a request and split: the
    heuristic sizes splits for 8 (one split fills the interpreter's 4 stand-in SMs twice),
    not for 1 kv head (8 splits, 64 programs, each writing fp32 partials of 576 columns)."""
    query, _, _, kv_cache, meta = make_case(24, [4096], [1], 128, 1, LATENT, 256)
    backend = triton_backend.TritonAttentionBackend()
    assert backend.decode_head_programs(query, kv_cache) == 8
    assert backend.num_splits(meta, backend.decode_head_programs(query, kv_cache),
                              query.device) == 1
    assert decode_tile_shape(backend.launch, 20, LATENT, 4).g_tiles == 2
    ordinary, _, _, cache, _ = make_case(25, [16], [1], 32, 8, 128, 16)
    assert backend.decode_head_programs(ordinary, cache) == 8      # kv heads, as before


# Today's launch choices of the ordinary heads (before the wide tiles: 6d24b90^), written out
# rather than recomputed. group -> (prefill block_g, block_q; block_q at the unified decode's
# 16 rows; decode block_g)
ORDINARY_TILES = {1: (1, 64, 16, 16), 2: (2, 32, 8, 16), 4: (4, 16, 4, 16), 6: (8, 8, 2, 16),
                  8: (8, 8, 2, 16), 16: (16, 4, 1, 16), 32: (32, 2, 1, 32)}
# (head_dim, cache element bytes) -> decode keys a step (128 capped at 32 KiB of keys)
ORDINARY_DECODE_KEYS = {(64, 2): 128, (64, 4): 128, (80, 2): 128, (80, 4): 64, (128, 2): 128,
                        (128, 4): 64, (256, 2): 64, (256, 4): 32}


@pytest.mark.parametrize("head_dim,elem_bytes", sorted(ORDINARY_DECODE_KEYS))
@pytest.mark.parametrize("group", sorted(ORDINARY_TILES))
def test_ordinary_heads_pinned_to_the_old_table(group, head_dim, elem_bytes):
    from kernels.attention.triton_launch import KernelTiles, prefill_tile_shape
    block_g, block_q, unified_q, decode_g = ORDINARY_TILES[group]
    launch = TritonLaunchConfig()
    prefill = prefill_tile_shape(launch, group, head_dim, elem_bytes)
    assert (prefill.block_g, prefill.block_q, prefill.g_tiles, prefill.tiles) == \
        (block_g, block_q, 1, KernelTiles(64, 4, 2))
    assert prefill.block_d == (128 if head_dim == 80 else head_dim)
    unified = prefill_tile_shape(launch, group, head_dim, elem_bytes, launch.decode_q_rows)
    assert (unified.block_g, unified.block_q, unified.g_tiles) == (block_g, unified_q, 1)
    decode = decode_tile_shape(launch, group, head_dim, elem_bytes)
    assert (decode.block_g, decode.g_tiles, decode.block_q, decode.tiles) == \
        (decode_g, 1, 1, KernelTiles(ORDINARY_DECODE_KEYS[head_dim, elem_bytes], 4, 2))
