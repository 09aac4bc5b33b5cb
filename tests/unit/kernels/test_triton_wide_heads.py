"""The Triton kernels at DeepSeek's MLA latent (head 576: kv_lora_rank 512 + rope 64, padded to
1024) over the stride-0 cache whose value half is its key half (loader.new_kv_cache), with 16
and 128 query heads on the one latent head, fp32 and bf16, against the torch backend: varlen
(fresh and chunked prefills after a cached prefix, decodes mixed in) and split decode. These
launches take the wide-head tiles (triton_launch.WIDE_HEAD_DIM: 16-row tiles, the group cut
into tiles of 16 heads, K read once as V); the launch choices themselves are checked without
kernels, ordinary heads keeping theirs. Under the interpreter without CUDA (attention_cases).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.attention_cases import KERNELS_HERE, make_case, needs_kernels, triton_backend
from kernels.attention.torch_ref import TorchAttentionBackend
from kernels.attention.triton_launch import (KernelTiles, TritonLaunchConfig, decode_tile_shape,
                                             prefill_tile_shape, wide_prefill_tiles)
from tests.support.paths import REPO

LATENT = 576
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def shared_latent_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """kv_cache's key half as both halves: one memory seen twice (stride 0), as MLA's cache."""
    return kv_cache[:1].clone().expand(kv_cache.shape)


def check_latent_case(case, backend, dtype) -> None:
    """Both backends on their own stride-0 caches (clone() would make two memories): outputs
    close on all 576 columns, caches equal after the writes."""
    query, key, _, kv_cache, meta = case
    scale = 192 ** -0.5
    ref_cache, our_cache = shared_latent_cache(kv_cache), shared_latent_cache(kv_cache)
    assert our_cache.stride(0) == 0
    expected = TorchAttentionBackend(batched=False).forward(query, key, key, ref_cache, meta,
                                                            scale)
    out = backend.forward(query, key, key, our_cache, meta, scale)
    n, tol = meta.num_actual_tokens, TOLERANCE[dtype]
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), atol=tol, rtol=tol)
    assert torch.equal(our_cache, ref_cache)


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [16, 128])
def test_latent_prefill_matches_torch(heads, dtype):
    """A fresh prefill, a chunk after an unaligned cached prefix, a decode and a one-token
    prompt in one varlen launch; 128 heads run as 8 tiles of 16 a token."""
    case = make_case(11, [19, 37, 30, 1], [19, 9, 1, 1], heads, 1, LATENT, 16, num_pad=2,
                     dtype=dtype)
    check_latent_case(case, triton_backend.TritonAttentionBackend(), dtype)


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [16, 128])
def test_latent_decode_matches_torch(heads, dtype, splits):
    """Pure decode, one split and three (the reduce kernel merges per head)."""
    case = make_case(12, [1, 17, 70], [1, 1, 1], heads, 1, LATENT, 16, num_pad=1, dtype=dtype)
    check_latent_case(case, triton_backend.TritonAttentionBackend(splits), dtype)


@pytest.mark.slow
@needs_kernels
def test_latent_at_the_untimed_wide_tiles():
    """docs/gpu.md's alternatives (32-row tiles: 128 heads as 4 tiles of 32; 32 keys a step)."""
    launch = TritonLaunchConfig(wide_tile_rows=32, wide_block_n=32)
    prefill = make_case(13, [40, 23, 1], [12, 1, 1], 128, 1, LATENT, 16, dtype=torch.float32)
    check_latent_case(prefill, triton_backend.TritonAttentionBackend(launch=launch),
                      torch.float32)
    decode = make_case(14, [45, 3], [1, 1], 128, 1, LATENT, 16, dtype=torch.float32)
    check_latent_case(decode, triton_backend.TritonAttentionBackend(2, launch), torch.float32)


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 8, 16, 128])
def test_ordinary_heads_keep_their_launch(group, head_dim, elem_bytes):
    """Head dims up to 256: today's tiles exactly (one tile of the whole group, 64 rows,
    launch.prefill; decode launch.decode at >= 16 rows, keys capped by bytes)."""
    launch = TritonLaunchConfig()
    block_g = 1 << (group - 1).bit_length()
    prefill = prefill_tile_shape(launch, group, head_dim, elem_bytes)
    assert (prefill.block_g, prefill.g_tiles, prefill.tiles) == (block_g, 1, launch.prefill)
    assert prefill.block_q == max(1, 64 // block_g)
    decode = decode_tile_shape(launch, group, head_dim, elem_bytes)
    assert (decode.block_g, decode.g_tiles) == (max(16, block_g), 1)
    assert decode.tiles.num_stages == launch.decode.num_stages
    assert decode.tiles.block_n == (128 if head_dim * elem_bytes <= 256 else
                                    32 * 1024 // (prefill.block_d * elem_bytes))


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("group,g_tiles,block_q", [(1, 1, 16), (4, 1, 4), (16, 1, 1),
                                                   (24, 2, 1), (128, 8, 1)])
def test_wide_head_tiles(group, g_tiles, block_q, elem_bytes):
    """Head 576: 16-row tiles, groups above 16 heads cut into tiles of 16, 16 keys a step."""
    launch = TritonLaunchConfig()
    prefill = prefill_tile_shape(launch, group, LATENT, elem_bytes)
    assert prefill.tiles == wide_prefill_tiles(launch) == KernelTiles(16, 4, 2)
    assert (prefill.block_g * prefill.block_q, prefill.g_tiles, prefill.block_q,
            prefill.block_d) == (16, g_tiles, block_q, 1024)
    decode = decode_tile_shape(launch, group, LATENT, elem_bytes)
    assert (decode.block_g, decode.g_tiles, decode.tiles.block_n) == (16, g_tiles, 16)


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


@pytest.mark.parametrize("field,value", [("wide_tile_rows", 8), ("wide_tile_rows", 24),
                                         ("wide_block_n", 0), ("wide_num_warps", 32)])
def test_bad_wide_launch_choices_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field}={value} is invalid: must be a power of two"):
        TritonLaunchConfig(**{field: value})
