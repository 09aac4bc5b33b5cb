"""kernels/cpu's rope with partial rotary (partial_rotary_factor < 1, Phi-4-mini): the first
rotary_dim dims of each head rotate as the torch RotaryEmbedding rotates them, the rest are not
touched; every ISA build the machine runs (the cpu_isa fixture)."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension
from worker_service.layers.rotary import get_rope

pytestmark = [pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]
HEAD_DIM = 64
MAX_POSITION = 4096


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)


def partial_rope(rotary_dim: int, longrope: bool = False):
    cfg = {"rope_theta": 10000.0, "max_position_embeddings": MAX_POSITION,
           "partial_rotary_factor": rotary_dim / HEAD_DIM}
    if longrope:
        half = rotary_dim // 2
        cfg.update(original_max_position_embeddings=256, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0 + i / 16 for i in range(half)],
            "long_factor": [2.0 + i / 4 for i in range(half)]})
    rope = get_rope(HEAD_DIM, cfg)
    assert rope.rotary_dim == rotary_dim and rope.cos_cache.shape[1] == rotary_dim
    return rope


def strided_qk(num_tokens: int, dtype: torch.dtype, seed: int):
    """q [T, 4, 64] and k [T, 2, 64] as views of one qkv row (the model's layout)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(num_tokens, 8 * HEAD_DIM, generator=gen)).to(dtype)
    q = qkv[:, :4 * HEAD_DIM].view(num_tokens, 4, HEAD_DIM)
    k = qkv[:, 4 * HEAD_DIM:6 * HEAD_DIM].view(num_tokens, 2, HEAD_DIM)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
    positions[0] = MAX_POSITION - 1
    return qkv, q, k, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM // 4, HEAD_DIM // 2, 3 * HEAD_DIM // 4])
@pytest.mark.parametrize("num_tokens", [1, 23])
def test_partial_rope_matches_torch_and_leaves_the_tail(dtype, rotary_dim, num_tokens):
    rope = partial_rope(rotary_dim)
    qkv, q, k, positions = strided_qk(num_tokens, dtype, seed=rotary_dim + num_tokens)
    want_q, want_k = rope(positions, q, k)
    before = qkv.clone()
    assert rope.use_cpu_kernels() and rope.kernel == "cpu"
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **tol(dtype))
    torch.testing.assert_close(got_k, want_k, **tol(dtype))
    for x, was in ((q, before[:, :4 * HEAD_DIM]), (k, before[:, 4 * HEAD_DIM:6 * HEAD_DIM])):
        tail = was.view(num_tokens, -1, HEAD_DIM)[..., rotary_dim:]
        assert torch.equal(x[..., rotary_dim:], tail), "dims past rotary_dim untouched"
    assert torch.equal(qkv[:, 6 * HEAD_DIM:], before[:, 6 * HEAD_DIM:]), "v untouched"
    assert not torch.equal(q[1:, :, :rotary_dim], before[1:, :4 * HEAD_DIM].view(
        num_tokens - 1, 4, HEAD_DIM)[..., :rotary_dim]) or num_tokens == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_longrope_matches_torch(dtype):
    """LongRoPE's factors cover rotary_dim / 2 frequencies; past the original length too."""
    rope = partial_rope(48, longrope=True)
    _, q, k, positions = strided_qk(9, dtype, seed=5)
    want_q, want_k = rope(positions, q, k)
    assert rope.use_cpu_kernels()
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q, **tol(dtype))
    torch.testing.assert_close(got_k, want_k, **tol(dtype))


def test_cache_widths_the_kernel_cannot_take_are_named(ops):
    rope = partial_rope(32)
    q, k = torch.zeros(2, 2, HEAD_DIM), torch.zeros(2, 1, HEAD_DIM)
    pos = torch.zeros(2, dtype=torch.long)
    wide = torch.zeros(8, HEAD_DIM + 2)
    for cos, sin, match in ((rope.cos_cache[:, :31].contiguous(),
                             rope.sin_cache[:, :31].contiguous(), "rotary_dim"),
                            (wide, wide, "rotary_dim"),
                            (rope.cos_cache, rope.sin_cache[:, :16].contiguous(), "equal shapes")):
        with pytest.raises(RuntimeError, match=match):
            ops.rope(pos, q, k, cos, sin)
    with pytest.raises(RuntimeError, match="key head_dim 32 must equal query's 64"):
        ops.rope(pos, q, torch.zeros(2, 1, 32), rope.cos_cache, rope.sin_cache)


@pytest.mark.parametrize("bad", [-1, MAX_POSITION, MAX_POSITION + 7, 2 ** 40, -2 ** 62])
def test_positions_outside_the_caches_are_refused_before_anything_rotates(ops, bad):
    """The torch path's cos_cache[positions] raises IndexError (and wraps -1 to the last
    row); the kernel read the tables unchecked (a segfault, or silent garbage). Now:
    RuntimeError naming the index, the value and the range, and q, k untouched."""
    rope = partial_rope(32)
    qkv, q, k, positions = strided_qk(5, torch.float32, seed=3)
    positions[3] = bad
    before = qkv.clone()
    with pytest.raises(RuntimeError, match=rf"positions\[3\] = {bad} is outside the cos/sin "
                                           rf"caches' \[0, {MAX_POSITION}\)"):
        ops.rope(positions, q, k, rope.cos_cache, rope.sin_cache)
    assert torch.equal(qkv, before), "nothing rotated"
    assert rope.use_cpu_kernels()       # the module's CPU path (RotaryEmbedding.forward)
    with pytest.raises(RuntimeError, match=rf"positions\[3\] = {bad}"):
        rope(positions, q, k)
    positions[3] = MAX_POSITION - 1     # the last row is inside
    ops.rope(positions, q, k, rope.cos_cache, rope.sin_cache)


def test_positions_must_match_the_tokens(ops):
    """One position per token of q and k: more positions than rows read past q's end."""
    rope = partial_rope(32)
    _, q, k, positions = strided_qk(4, torch.float32, seed=4)
    for pos, match in ((positions[:3], r"T = query's and key's tokens \(4, 4\), got \[3\]"),
                       (torch.zeros(5, dtype=torch.long), r"got \[5\]")):
        with pytest.raises(RuntimeError, match=match):
            ops.rope(pos.contiguous(), q, k, rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match=r"\(4, 3\)"):
        ops.rope(positions, q, k[:3], rope.cos_cache, rope.sin_cache)
    ops.rope(positions[:0].contiguous(), q[:0], k[:0], rope.cos_cache, rope.sin_cache)
