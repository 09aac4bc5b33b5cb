"""The fused rope's KV cache write (kernels/fused_rope.py with value / kv_cache / slot_mapping)
against the attention backend's own write (kernels/attention/triton_cache.py) after the rope:
the same cache bytes, padding slots and rows past len(slot_mapping) untouched. Interpreter on
CPU, compiled on GPU; the sm_90 compile of both variants is in test_fused_rope.py."""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.lanes import split_grid

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from worker_service.layers.rotary import RopeSettings, RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
NUM_BLOCKS, BLOCK_SIZE = 6, 4
MAX_POSITION = 64


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton.language.zeros, InterpretedFunction)


pytestmark = pytest.mark.skipif(
    not ON_GPU and not _interpreted(),
    reason="triton was imported in compiled mode without a GPU (TRITON_INTERPRET unset)")


def _inputs(num_tokens, num_q_heads, num_k_heads, head_dim, dtype, seed):
    """positions; q, k, v as strided views of one qkv tensor (the model's layout); a cache
    filled with noise, so any stray store shows."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_q_heads * head_dim, num_k_heads * head_dim
    qkv = (2 * torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)).to(dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim)
               for t in qkv.to(DEVICE).split([q_size, kv_size, kv_size], dim=-1))
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen).to(DEVICE)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_k_heads, head_dim, generator=gen)
    return positions, q, k, v, cache.to(dtype).to(DEVICE)


def _norm_weights(head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE)
            for _ in range(2)]


# (q heads, k heads, head_dim, q/k norm): plain; Qwen3's q/k norm in the same launch; a key
# head block padded past the last head, D/2 48 padded to 64
SHAPES = [(4, 2, 64, False), (4, 2, 64, True), (6, 3, 96, True)]


@pytest.mark.parametrize("shape,dtype", split_grid(
    [SHAPES, [torch.float32, torch.bfloat16]],
    fast={(SHAPES[0], torch.bfloat16), (SHAPES[1], torch.float32), (SHAPES[2], torch.bfloat16)}))
def test_cache_holds_what_the_backend_write_would(shape, dtype):
    num_q_heads, num_k_heads, head_dim, norm = shape
    from kernels.attention.triton_cache import triton_write_kv_cache
    from kernels.fused_rope import fused_rope

    rope = RotaryEmbedding(head_dim, MAX_POSITION, RopeSettings()).to(DEVICE)
    weights = _norm_weights(head_dim, dtype, seed=head_dim) if norm else [None, None]
    positions, q, k, v, cache = _inputs(7, num_q_heads, num_k_heads, head_dim, dtype, seed=3)
    # rows 0..4 are real (row 2 a padded slot), rows 5 and 6 graph padding past the slice
    slot_mapping = torch.tensor([9, 0, -1, 23, 14, 5, 6], device=DEVICE)
    slots = slot_mapping[:5]
    want_q, want_k = q.clone(), k.clone()
    fused_rope(positions, want_q, want_k, rope.cos_cache, rope.sin_cache, *weights, 1e-6)
    want_cache = cache.clone()
    triton_write_kv_cache(want_k, v, want_cache, slots)
    v_before, noise = v.clone(), cache.clone()

    got_q, got_k = fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache, *weights, 1e-6,
                              value=v, kv_cache=cache, slot_mapping=slots)
    assert got_q is q and got_k is k, "still rotated in place"
    assert torch.equal(q, want_q) and torch.equal(k, want_k), "same rotation as without a write"
    assert torch.equal(cache, want_cache), "the backend's write, byte for byte"
    assert torch.equal(v, v_before)
    flat = cache.view(2, NUM_BLOCKS * BLOCK_SIZE, num_k_heads, head_dim)
    assert torch.equal(flat[0, 23], k[3]) and torch.equal(flat[1, 14], v[4])
    untouched = [s for s in range(NUM_BLOCKS * BLOCK_SIZE) if s not in (9, 0, 23, 14)]
    noise = noise.view_as(flat)
    assert torch.equal(flat[:, untouched], noise[:, untouched]), "padding and rows 5, 6: no store"
    assert not torch.equal(flat[0, 5], k[5]), "row 5 (past the slice) stored nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_keys_in_the_cache_agree_with_the_torch_rope(dtype):
    """Against the torch module + the backend write: the rope's own tolerance (see
    test_fused_rope.py: exact in float32 on CPU, a few bf16 ulps under the interpreter)."""
    from kernels.attention.triton_cache import triton_write_kv_cache
    from kernels.fused_rope import fused_rope

    rope = RotaryEmbedding(64, MAX_POSITION, RopeSettings()).to(DEVICE)
    positions, q, k, v, cache = _inputs(4, 2, 2, 64, dtype, seed=8)
    slots = torch.tensor([3, 17, -1, 8], device=DEVICE)
    _, torch_k = rope(positions, q, k)
    want = cache.clone()
    triton_write_kv_cache(torch_k, v, want, slots)
    fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache, value=v, kv_cache=cache,
               slot_mapping=slots)
    if dtype == torch.float32 and not ON_GPU:
        assert torch.equal(cache, want)
    else:
        ulps = 1 if ON_GPU else 4
        bound = ulps * torch.finfo(dtype).eps * float(torch_k.float().abs().max())
        assert float((cache.float() - want.float()).abs().max()) <= bound
    assert torch.equal(cache[1], want[1]), "values are copied, not rounded"


def test_empty_slot_mapping_and_the_module_path():
    """An empty slot_mapping stores nothing (still rotates); RotaryEmbedding(fused=True) passes
    kv_write through, and the torch module refuses it."""
    fused = RotaryEmbedding(32, MAX_POSITION, RopeSettings(), fused=True).to(DEVICE)
    plain = RotaryEmbedding(32, MAX_POSITION, RopeSettings()).to(DEVICE)
    positions, q, k, v, cache = _inputs(3, 2, 1, 32, torch.float32, seed=5)
    want_q, want_k = plain(positions, q, k)
    before = cache.clone()
    got = fused(positions, q, k, kv_write=(v, cache, torch.zeros(0, dtype=torch.long,
                                                                  device=DEVICE)))
    assert got[0] is q and torch.equal(cache, before)
    torch.testing.assert_close(got, (want_q, want_k), atol=1e-6, rtol=0)
    fused(positions, q, k, kv_write=(v, cache, torch.tensor([2, 1, 0], device=DEVICE)))
    assert torch.equal(cache[1, 0, :3].flip(0), v)
    with pytest.raises(ValueError, match="fused"):
        plain(positions, q, k, kv_write=(v, cache, torch.tensor([2, 1, 0], device=DEVICE)))


def test_bad_write_arguments_are_named():
    from kernels.fused_rope import fused_rope

    rope = RotaryEmbedding(16, 8, RopeSettings())
    q, k, v = torch.zeros(2, 2, 16), torch.zeros(2, 1, 16), torch.zeros(2, 1, 16)
    cache, pos = torch.zeros(2, 3, 4, 1, 16), torch.zeros(2, dtype=torch.long)
    slots = torch.zeros(2, dtype=torch.long)
    cases = [
        (dict(value=v, kv_cache=cache), "all three"),
        (dict(value=torch.zeros(2, 2, 16), kv_cache=cache, slot_mapping=slots), "value"),
        (dict(value=v, kv_cache=torch.zeros(2, 3, 4, 2, 16), slot_mapping=slots), "kv_cache"),
        (dict(value=v, kv_cache=cache, slot_mapping=torch.zeros(3, dtype=torch.long)),
         "slot_mapping"),
        (dict(value=v, kv_cache=cache, slot_mapping=slots.float()), "slot_mapping"),
        (dict(value=v, kv_cache=cache.to("meta"), slot_mapping=slots), "devices"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=name):
            fused_rope(pos, q, k, rope.cos_cache, rope.sin_cache, **kwargs)
