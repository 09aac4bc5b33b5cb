"""Sliding-window attention (query p sees keys p - W < k <= p) in the torch and Triton backends.

The per-request torch loop is the reference: first checked against plain causal attention over
only the last W keys (an independent way to the same numbers), then the batched torch path and
every Triton design (by_batch, unified, per_request; split decode) against it, on batches of
decodes, fresh prefills and chunks after cached prefixes, with windows below, across and above
the block and tile sizes. On CPU the Triton kernels run under the interpreter (tiny sizes).
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention.backend import check_sliding_window
from kernels.attention.torch_ref import TorchAttentionBackend, attend_one
from kernels.attention.triton_launch import KernelTiles, TritonLaunchConfig
from tests.support.attention_cases import ON_GPU, make_case, needs_kernels, triton_backend

# (seq_lens, query_lens): decodes far past the window, a fresh prefill, chunks after a cached
# prefix (one unaligned), a one-token prompt, and a one-token chunk
MIXED = ([70, 33, 40, 1, 29, 21], [1, 33, 9, 1, 1, 21])
DECODE = ([1, 9, 17, 64, 130], [1, 1, 1, 1, 1])


def reference(case, window: int) -> torch.Tensor:
    query, key, value, kv_cache, meta = case
    return TorchAttentionBackend(batched=False).forward(
        query, key, value, kv_cache.clone(), meta, query.shape[2] ** -0.5, sliding_window=window)


def check_window(case, backend, window: int, atol=2e-5) -> None:
    """backend with the window equals the reference loop; the window changed the output."""
    query, key, value, kv_cache, meta = case
    n, scale = meta.num_actual_tokens, query.shape[2] ** -0.5
    expected = reference(case, window)
    our_cache = kv_cache.clone()
    out = backend.forward(query, key, value, our_cache, meta, scale, sliding_window=window)
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), atol=atol, rtol=atol)
    full = reference(case, 0)
    assert not torch.allclose(full[:n], expected[:n], atol=1e-3), "the window changed nothing"


def test_reference_window_is_causal_attention_over_the_last_w_keys():
    gen = torch.Generator().manual_seed(0)
    seq_len, window = 37, 8
    query = torch.randn(5, 4, 16, generator=gen)            # the last 5 positions
    keys, values = torch.randn(2, seq_len, 2, 16, generator=gen)
    got = attend_one(query, keys, values, 0.25, window)
    for j in range(5):
        p = seq_len - 5 + j
        lo = p - window + 1
        alone = attend_one(query[j:j + 1], keys[lo:p + 1], values[lo:p + 1], 0.25)
        torch.testing.assert_close(got[j:j + 1], alone, atol=1e-6, rtol=1e-6)
    # a window of at least the sequence is no window at all
    torch.testing.assert_close(attend_one(query, keys, values, 0.25, seq_len),
                               attend_one(query, keys, values, 0.25), atol=0, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16, 23])
@pytest.mark.parametrize("batch", [MIXED, DECODE], ids=["mixed", "decode"])
def test_torch_batched_matches_the_loop(batch, window):
    case = make_case(3, *batch, 4, 2, 16, 4, num_pad=2, device="cpu")
    check_window(case, TorchAttentionBackend(), window, atol=1e-5)


def test_invalid_windows_are_refused():
    for bad in (-1, 2.5, True, None):
        with pytest.raises(ValueError, match="sliding_window"):
            check_sliding_window(bad)


def triton(**launch):
    return triton_backend.TritonAttentionBackend(launch=TritonLaunchConfig(**launch))


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["by_batch", "unified", "per_request"])
@pytest.mark.parametrize("block_size,window", [(16, 8), (4, 13)])
def test_triton_designs_match_the_reference(dispatch, block_size, window):
    """BLOCK_N 16 and 16-row tiles: windows start inside, on and across key tiles and blocks,
    and a tile's rows see different first keys."""
    tiles = KernelTiles(block_n=16, num_warps=2, num_stages=1)
    launch = dict(prefill=tiles, decode=tiles, block_q_rows=16, dispatch=dispatch)
    check_window(make_case(5, *MIXED, 4, 2, 16, block_size, num_pad=2), triton(**launch),
                 window)


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [7, 48])
def test_triton_split_decode_shares_only_the_window(splits, window):
    """Decodes up to 130 keys: the splits cover the last `window` keys, none of the rest."""
    tiles = KernelTiles(block_n=16, num_warps=2, num_stages=1)
    backend = triton(decode=tiles, decode_splits=splits)
    check_window(make_case(6, *DECODE, 8, 2, 32, 16, num_pad=1), backend, window)


@needs_kernels
def test_triton_split_heuristic_counts_only_the_window():
    """With a window the decode splits are sized for the keys a query reads."""
    backend = triton()
    meta = make_case(7, [4000], [1], 4, 2, 16, 16)[4]
    assert backend.num_splits(meta, 2, torch.device("cpu"), window=256) == 1
    assert backend.num_splits(meta, 2, torch.device("cpu")) > 1


@needs_kernels
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [1000, 4096])
def test_gpu_window_at_model_sizes(dtype, tol, window):
    """Model-sized heads (32 q / 8 kv, D 128), default launch: prefills and chunks across the
    window, then decodes past it (split decode), against the fp32 reference on the same cache."""
    prefill = make_case(9, [5000, 1, 4200, 300, 77], [700, 1, 64, 300, 1], 32, 8, 128, 16,
                        num_pad=3, dtype=dtype)
    check_window(prefill, triton_backend.TritonAttentionBackend(), window, atol=tol)
    decode = make_case(10, [6000, 1, 1000, 4500] * 8, [1] * 32, 32, 8, 128, 16, num_pad=3,
                       dtype=dtype)
    check_window(decode, triton_backend.TritonAttentionBackend(), window, atol=tol)
