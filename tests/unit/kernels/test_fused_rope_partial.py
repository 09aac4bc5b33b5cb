"""The fused Triton rope with partial rotary (cos/sin caches [max_position, rotary_dim],
rotary_dim < head_dim: Phi-4-mini) against the torch RotaryEmbedding: the first rotary_dim dims
of each head rotate, the rest pass through; with a per-head q/k norm first (the whole head
normalised) and with the KV cache write (the whole key row stored). Interpreter on CPU,
compiled on GPU."""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from worker_service.layers.norm import RMSNorm  # noqa: E402
from worker_service.layers.rotary import RopeSettings, RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
HEAD_DIM, MAX_POSITION = 64, 512
ROTARY_DIMS = [HEAD_DIM // 4, HEAD_DIM // 2, 3 * HEAD_DIM // 4]
NUM_BLOCKS, BLOCK_SIZE = 4, 4


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton.language.zeros, InterpretedFunction)


pytestmark = pytest.mark.skipif(
    not ON_GPU and not _interpreted(),
    reason="triton was imported in compiled mode without a GPU (TRITON_INTERPRET unset)")


def _rope(rotary_dim: int, fused: bool = False) -> RotaryEmbedding:
    settings = RopeSettings("default", 10000.0, partial_rotary_factor=rotary_dim / HEAD_DIM)
    rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION, settings, fused=fused).to(DEVICE)
    assert rope.cos_cache.shape == (MAX_POSITION, rotary_dim)
    return rope


def _qkv(num_tokens, dtype, seed):
    """q [T, 3, D], k and v [T, 2, D] as views of one qkv row; positions incl. the last one."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(num_tokens, 7 * HEAD_DIM, generator=gen)).to(dtype).to(DEVICE)
    q, k, v = (t.view(num_tokens, -1, HEAD_DIM)
               for t in qkv.split([3 * HEAD_DIM, 2 * HEAD_DIM, 2 * HEAD_DIM], dim=-1))
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
    positions[0] = MAX_POSITION - 1
    return qkv, q, k, v, positions.to(DEVICE)


def _assert_agrees(got, want, dtype):
    """Bit for bit in float32 (CPU), else within the rope's ulps (test_fused_rope.py)."""
    if dtype == torch.float32 and not ON_GPU:
        assert torch.equal(got, want), float((got - want).abs().max())
        return
    ulps = 1 if ON_GPU else 4
    bound = ulps * torch.finfo(dtype).eps * float(want.float().abs().max())
    assert float((got.float() - want.float()).abs().max()) <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", ROTARY_DIMS)
def test_partial_rotation_matches_torch_and_passes_the_tail(rotary_dim, dtype):
    from kernels.fused_rope import fused_rope

    rope = _rope(rotary_dim)
    qkv, q, k, _, positions = _qkv(5, dtype, seed=rotary_dim)
    want_q, want_k = rope(positions, q, k)
    before = qkv.clone()
    got_q, got_k = fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache)
    assert got_q is q and got_k is k
    _assert_agrees(got_q, want_q, dtype)
    _assert_agrees(got_k, want_k, dtype)
    was = before[:, :5 * HEAD_DIM].view(5, 5, HEAD_DIM)
    assert torch.equal(qkv[:, :5 * HEAD_DIM].view(5, 5, HEAD_DIM)[..., rotary_dim:],
                       was[..., rotary_dim:]), "dims past rotary_dim untouched"
    assert torch.equal(qkv[:, 5 * HEAD_DIM:], before[:, 5 * HEAD_DIM:]), "v untouched"


@pytest.mark.parametrize("rotary_dim,dtype", [(48, torch.float32), (48, torch.bfloat16),
                                              (16, torch.float32)])
def test_norm_covers_the_whole_head_and_the_cache_gets_the_tail(rotary_dim, dtype):
    """q/k norm over all 64 dims, then rotary_dim rotate (16: a tail of 48, padded to 64 and
    masked); the cache holds what the backend's own write of the rotated keys (tail
    included) and of the values would."""
    from kernels.attention.triton_cache import triton_write_kv_cache
    from kernels.fused_rope import fused_rope

    rope = _rope(rotary_dim)
    gen = torch.Generator().manual_seed(4)
    norms = [RMSNorm(HEAD_DIM, 1e-6, dtype).to(DEVICE) for _ in range(2)]
    for norm in norms:
        norm.weight.data = (1 + 0.5 * torch.randn(HEAD_DIM, generator=gen)).to(dtype).to(DEVICE)
    _, q, k, v, positions = _qkv(7, dtype, seed=9)
    want_q, want_k = rope(positions, norms[0](q), norms[1](k))
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM, generator=gen).to(dtype)
    cache = cache.to(DEVICE)
    slots = torch.tensor([9, 0, -1, 13, 2], device=DEVICE)     # rows 5, 6: past the slice
    weights = [n.weight for n in norms]
    got_q, got_k = fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache, *weights, 1e-6,
                              value=v, kv_cache=cache, slot_mapping=slots)
    # float32 statistics summed in another order than torch's: a float32 ulp or so
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=0.02)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    want_cache = torch.zeros_like(cache)
    triton_write_kv_cache(got_k, v, want_cache, slots)
    flat = cache.view(2, NUM_BLOCKS * BLOCK_SIZE, 2, HEAD_DIM)
    want_flat = want_cache.view_as(flat)
    for slot in (9, 0, 13, 2):
        assert torch.equal(flat[:, slot], want_flat[:, slot]), f"slot {slot}"
    assert torch.equal(flat[0, 13], got_k[3]) and torch.equal(flat[1, 2], v[4])


def test_the_fused_module_path_with_partial_rotary():
    """RotaryEmbedding(fused=True) with partial rotary keeps the Triton rope (in place)."""
    fused, plain = _rope(32, fused=True), _rope(32)
    assert fused.kernel == "triton" and plain.kernel == "torch"
    _, q, k, _, positions = _qkv(3, torch.float32, seed=1)
    want = plain(positions, q, k)
    got = fused(positions, q, k)
    assert got[0] is q and got[1] is k
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_cache_widths_the_kernel_cannot_take_are_named():
    from kernels.fused_rope import fused_rope

    rope = _rope(32)
    _, q, k, _, positions = _qkv(2, torch.float32, seed=2)
    wide = torch.zeros(8, HEAD_DIM + 2, device=DEVICE)
    for cos, sin in ((rope.cos_cache[:, :31], rope.sin_cache[:, :31]), (wide, wide),
                     (rope.cos_cache, rope.sin_cache[:, :16])):
        with pytest.raises(ValueError, match=r"rotary_dim even in \[2, head_dim=64\]"):
            fused_rope(positions, q, k, cos, sin)
