"""The fused Triton rope against the model's torch RotaryEmbedding (interpreter on CPU, compiled
on GPU), plus a compile of both fused kernels for sm_90 in a fresh process (no GPU needed)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from worker_service.layers.rotary import RopeSettings, RotaryEmbedding  # noqa: E402
from tests.support.lanes import split_grid  # noqa: E402
from tests.support.paths import REPO

DEVICE = "cuda" if ON_GPU else "cpu"
REPO_ROOT = REPO


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton.language.zeros, InterpretedFunction)


needs_kernels = pytest.mark.skipif(
    not ON_GPU and not _interpreted(),
    reason="triton was imported in compiled mode without a GPU (TRITON_INTERPRET unset)")

SETTINGS = {
    "default": RopeSettings("default", 10000.0),
    "linear": RopeSettings("linear", 10000.0, {"factor": 4.0}),
    "llama3": RopeSettings("llama3", 500000.0, {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
}
MAX_POSITION = 40960
# Agreement with torch, elementwise: |got - want| <= ulps * eps(dtype) * max|input|. On GPU both
# round to nearest even (1 ulp leaves room for a compiler's choices); the CPU interpreter
# truncates float32 -> bfloat16 in each of its 5 casts (bf16 is also checked bit for bit against
# a truncating emulation below). float32 and float16 agree bit for bit on CPU.
ULPS = {torch.float32: 1, torch.float16: 1, torch.bfloat16: 1 if ON_GPU else 4}


@pytest.fixture(scope="module")
def ropes():
    """rope type -> RotaryEmbedding, by head_dim (built once: the caches are 40960 rows)."""
    cache = {}

    def get(rope_type: str, head_dim: int) -> RotaryEmbedding:
        key = (rope_type, head_dim)
        if key not in cache:
            cache[key] = RotaryEmbedding(head_dim, MAX_POSITION, SETTINGS[rope_type]).to(DEVICE)
        return cache[key]

    return get


def make_qk(num_tokens, num_q_heads, num_k_heads, head_dim, dtype, seed):
    """q, k as strided views of one fused qkv row (the model's layout), and positions that
    include 0, the largest cached one and random large ones."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_k_heads) * head_dim
    qkv = (2 * torch.randn(num_tokens, width, generator=gen)).to(dtype).to(DEVICE)
    q_size, kv_size = num_q_heads * head_dim, num_k_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_k_heads, head_dim)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
    positions[:2] = torch.tensor([0, MAX_POSITION - 1])
    return qkv, q, k, positions.to(DEVICE)


def assert_agrees(got, want, x, dtype):
    eps = torch.finfo(dtype).eps
    bound = ULPS[dtype] * eps * float(x.float().abs().max())
    if dtype != torch.bfloat16 and not ON_GPU:
        assert torch.equal(got, want), float((got.float() - want.float()).abs().max())
        return
    err = float((got.float() - want.float()).abs().max())
    assert err <= bound, f"{dtype}: max error {err} > {bound}"


@needs_kernels
@pytest.mark.parametrize("rope_type,head_dim,dtype", split_grid(
    [["default", "linear", "llama3"], [64, 128], [torch.float32, torch.float16, torch.bfloat16]],
    fast={("default", 64, torch.float32), ("linear", 128, torch.float16),
          ("llama3", 64, torch.bfloat16)}))
def test_matches_torch_rotary_embedding(ropes, rope_type, head_dim, dtype):
    from kernels.fused_rope import fused_rope

    rope = ropes(rope_type, head_dim)
    qkv, q, k, positions = make_qk(5, 4, 2, head_dim, dtype, seed=head_dim)
    want_q, want_k = rope(positions, q, k)
    v_before = qkv[:, -2 * head_dim:].clone()
    got_q, got_k = fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache)
    assert got_q is q and got_k is k, "rotated in place"
    assert_agrees(got_q, want_q, want_q, dtype)
    assert_agrees(got_k, want_k, want_k, dtype)
    assert torch.equal(qkv[:, -2 * head_dim:], v_before), "v (beside q and k) untouched"


def _trunc_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 by dropping the low 16 bits, as Triton's CPU interpreter casts."""
    bits = x.float().contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)


@needs_kernels
@pytest.mark.skipif(ON_GPU, reason="emulates the CPU interpreter's truncating cast")
def test_bf16_rounds_like_torch_step_for_step_under_the_interpreter(ropes):
    """With the interpreter's truncation substituted for round-to-nearest, every rounding step
    of the kernel is torch's: cast cos/sin, round each product, round the sum."""
    from kernels.fused_rope import fused_rope

    rope = ropes("llama3", 64)
    _, q, k, positions = make_qk(6, 3, 3, 64, torch.bfloat16, seed=7)
    x1, x2 = q.float().chunk(2, dim=-1)
    cos = _trunc_bf16(rope.cos_cache[positions, :32]).float()[:, None, :]
    sin = _trunc_bf16(rope.sin_cache[positions, :32]).float()[:, None, :]

    def t(x):
        return _trunc_bf16(x).float()

    want = torch.cat((t(t(x1 * cos) - t(x2 * sin)), t(t(x2 * cos) + t(x1 * sin))), dim=-1)
    got_q, _ = fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache)
    assert torch.equal(got_q.float(), want)


@needs_kernels
@pytest.mark.parametrize("num_q_heads,num_k_heads,head_dim", [
    (6, 4, 64),       # GQA, head blocks padded past the last query head
    (3, 1, 96),       # D/2 = 48 padded to 64
    (1, 1, 256),      # the largest head_dim
    (8, 8, 2),        # the smallest
])
def test_head_counts_and_padded_head_dims(num_q_heads, num_k_heads, head_dim):
    from kernels.fused_rope import fused_rope

    rope = RotaryEmbedding(head_dim, MAX_POSITION, SETTINGS["default"]).to(DEVICE)
    _, q, k, positions = make_qk(3, num_q_heads, num_k_heads, head_dim, torch.float32, seed=1)
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = fused_rope(positions.to(torch.int32), q.contiguous(), k,
                              rope.cos_cache, rope.sin_cache)
    assert_agrees(got_q, want_q, want_q, torch.float32)
    assert_agrees(got_k, want_k, want_k, torch.float32)


@needs_kernels
def test_the_fused_module_path_and_empty_input():
    """RotaryEmbedding(fused=True) calls the kernel (in place); zero tokens is a no-op."""
    fused = RotaryEmbedding(32, 64, SETTINGS["default"], fused=True).to(DEVICE)
    plain = RotaryEmbedding(32, 64, SETTINGS["default"]).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 32, generator=gen).to(DEVICE)
    k = torch.randn(4, 1, 32, generator=gen).to(DEVICE)
    positions = torch.tensor([5, 0, 63, 17], device=DEVICE)
    want = plain(positions, q, k)
    got = fused(positions, q, k)
    assert got[0] is q and got[1] is k
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    empty = q[:0]
    assert fused(positions[:0], empty, k[:0])[0].shape == (0, 2, 32)


def test_cache_rows_hold_equal_halves():
    """The kernel reads only the first D/2 columns of each cache row: the halves must match."""
    rope = RotaryEmbedding(64, 128, SETTINGS["llama3"])
    for cache in (rope.cos_cache, rope.sin_cache):
        assert torch.equal(cache[:, :32], cache[:, 32:])


def test_bad_inputs_are_named():
    from kernels.fused_rope import fused_rope

    rope = RotaryEmbedding(16, 8, SETTINGS["default"])
    q, k, pos = torch.zeros(2, 2, 16), torch.zeros(2, 1, 16), torch.zeros(2, dtype=torch.long)
    cases = [
        ((pos, q, torch.zeros(2, 1, 8), rope.cos_cache, rope.sin_cache), "key"),
        ((pos, torch.zeros(2, 2, 15), torch.zeros(2, 1, 15), rope.cos_cache[:, :15],
          rope.sin_cache[:, :15]), "head_dim 15"),
        ((pos, q, k.half(), rope.cos_cache, rope.sin_cache), "dtype"),
        ((pos, torch.zeros(2, 16, 2).transpose(1, 2), k, rope.cos_cache, rope.sin_cache),
         "contiguous"),
        ((pos.float(), q, k, rope.cos_cache, rope.sin_cache), "positions"),
        ((pos.to("meta"), q, k, rope.cos_cache, rope.sin_cache), "devices"),
        ((pos, q, k, rope.cos_cache.half(), rope.sin_cache), "cos_cache"),
        ((pos, q, k, rope.cos_cache, rope.sin_cache[:, :8]), "sin_cache"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            fused_rope(*args)


# Run in a fresh process without TRITON_INTERPRET: builds each fused kernel for sm_90.
COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import fused_norm, fused_rope, fused_silu_mul

def build(fn, ptrs, constexprs, **options):
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

# tail: partial rotary (96 of 128 dims rotate, 32 pass through), in bf16 only; fp8: a cache
# of fp8 codes (--kv-cache-dtype; 1 e4m3, 2 e5m2), written in bf16 only
for dt, norm, kv, tail, fp8 in [(dt, norm, kv, tail, fp8) for dt in ("fp32", "fp16", "bf16")
                               for norm in (False, True) for kv in (False, True)
                               for tail in (False, True) for fp8 in (0, 1, 2)
                               if (dt == "bf16" or not tail) and (fp8 == 0 or
                                                                  (kv and dt == "bf16"))]:
    rope = build(fused_rope._rope_kernel, dict(pos_ptr="*i64", q_ptr="*" + dt, k_ptr="*" + dt,
                 cos_ptr="*fp32", sin_ptr="*fp32", qw_ptr="*" + dt, kw_ptr="*" + dt,
                 eps="fp32", v_ptr="*" + dt, cache_ptr="*u8" if fp8 else "*" + dt,
                 slot_ptr="*i64", stride_c_blk="i64"),
                 dict(BLOCK_H=8, BLOCK_HALF=64, NORM=norm, WRITE_KV=kv,
                      BLOCK_SIZE=16, BLOCK_TAIL=32 if tail else 1, Q_TAIL=tail and norm,
                      K_TAIL=tail and (norm or kv), FP8=fp8),
                 num_warps=2, enable_fp_fusion=False)
    assert "fma" not in rope.asm["ptx"], "rope must not contract mul+add into fma"
for dt in ("fp32", "fp16", "bf16"):
    silu = build(fused_silu_mul._silu_and_mul_kernel, dict(x_ptr="*" + dt, out_ptr="*" + dt),
                 dict(BLOCK=1024, LIBDEVICE=True), num_warps=4, enable_fp_fusion=False)
    assert "div.rn.f32" in silu.asm["ptx"], "silu must divide as IEEE (torch's rounding)"
    ptrs = {n: "*" + dt for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
    build(fused_norm._rms_norm_kernel, dict(ptrs, eps="fp32"),
          dict(HAS_RESIDUAL=True, BLOCK=1024), num_warps=4, enable_fp_fusion=False)
"""


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="pip triton without a bundled ptxas cannot compile for sm_90")
@pytest.mark.slow
def test_fused_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts things the compiler rejects: compile the fused kernels for
    sm_90 in a fresh process (no TRITON_INTERPRET), every dtype, rope with and without the KV
    cache write, and with a partial-rotary tail."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@needs_kernels
@pytest.mark.parametrize("head_dim,dtype", split_grid(
    [[64, 128], [torch.float32, torch.bfloat16]],
    fast={(64, torch.float32), (128, torch.bfloat16)}))
def test_per_head_norm_then_rope_matches_the_unfused_modules(ropes, head_dim, dtype):
    """Qwen3's q_norm / k_norm before rope, in the rope's launch: as the torch RMSNorm then the
    torch rope (the norm's float32 sum runs in another order, so up to a rounding step)."""
    from kernels.fused_rope import fused_rope
    from worker_service.layers.norm import RMSNorm

    rope = ropes("default", head_dim)
    qkv, q, k, positions = make_qk(6, 4, 2, head_dim, dtype, seed=head_dim + 1)
    gen = torch.Generator().manual_seed(head_dim)
    norms = [RMSNorm(head_dim, 1e-6, dtype) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + 0.5 * torch.randn(head_dim, generator=gen))
    q_norm, k_norm = (n.to(DEVICE) for n in norms)
    with torch.no_grad():
        want_q, want_k = rope(positions, q_norm(q), k_norm(k))
        v_before = qkv[:, -2 * head_dim:].clone()
        got_q, got_k = fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache,
                                  q_norm.weight, k_norm.weight, 1e-6)
    assert got_q is q and got_k is k, "normalised and rotated in place"
    for got, want in ((got_q, want_q), (got_k, want_k)):
        err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        assert err <= (2 * ULPS[dtype] + 2) * torch.finfo(dtype).eps   # ~2 eps seen on CPU
    assert torch.equal(qkv[:, -2 * head_dim:], v_before), "v (beside q and k) untouched"


@needs_kernels
def test_the_fused_module_normalises_in_the_same_launch():
    from worker_service.layers.norm import RMSNorm

    fused = RotaryEmbedding(32, 64, SETTINGS["default"], fused=True).to(DEVICE)
    plain = RotaryEmbedding(32, 64, SETTINGS["default"]).to(DEVICE)
    q_norm, k_norm = RMSNorm(32, 1e-6).to(DEVICE), RMSNorm(32, 1e-6).to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():   # new_param is torch.empty: on a GPU it held NaNs (2026-11-27)
        for norm in (q_norm, k_norm):
            norm.weight.copy_(1 + 0.5 * torch.randn(32, generator=gen))
    q = torch.randn(4, 2, 32, generator=gen).to(DEVICE)
    k = torch.randn(4, 1, 32, generator=gen).to(DEVICE)
    positions = torch.tensor([5, 0, 63, 17], device=DEVICE)
    with torch.no_grad():
        want = plain(positions, q, k, q_norm, k_norm)
        got = fused(positions, q, k, q_norm, k_norm)
    assert got[0] is q and got[1] is k
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_norm_weights_come_in_pairs_of_the_right_shape():
    from kernels.fused_rope import fused_rope

    rope = RotaryEmbedding(16, 8, SETTINGS["default"])
    q, k = torch.zeros(2, 2, 16), torch.zeros(2, 1, 16)
    positions = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="both"):
        fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache, torch.ones(16), None)
    with pytest.raises(ValueError, match="k_weight"):
        fused_rope(positions, q, k, rope.cos_cache, rope.sin_cache, torch.ones(16),
                   torch.ones(8))
