"""Triton KV writes and paged attention against the torch reference backend.

With CUDA the kernels run compiled on the GPU. Without it they run under the Triton interpreter,
which @triton.jit picks when a function is *decorated*: at import of the kernel modules and, for
tl.zeros / tl.sum / tl.max and friends, at `import triton` itself. So TRITON_INTERPRET is set
here before triton is imported. If an earlier test module already imported triton in compiled
mode, the kernel tests skip in this process and `test_kernels_in_fresh_interpreter_process`
reruns this file in a subprocess instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.attention_cases import (  # noqa: E402
    DEVICE, KERNELS_HERE, ON_GPU, check_against_reference, make_case, needs_kernels, triton,
    triton_attn, triton_backend, triton_cache)
from kernels.attention.torch_ref import TorchAttentionBackend, write_kv_cache  # noqa: E402
from tests.support.paths import REPO as REPO_ROOT  # noqa: E402

# The Triton interpreter runs every kernel in Python: seconds per case on CPU.
pytestmark = pytest.mark.slow


PREFILL_SHAPES = [(2, 2, 16, 16), (4, 2, 64, 16), (8, 2, 128, 16), (8, 1, 16, 16),
                  (8, 1, 64, 64), (4, 4, 128, 128), (6, 2, 48, 32)]


@needs_kernels
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", PREFILL_SHAPES)
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, head_dim, block_size):
    """Fresh prefill, decodes, chunked prefills after an aligned and an unaligned cached
    prefix, a one-token prompt, and padded rows: all in one varlen launch."""
    aligned = 2 * block_size
    seq_lens = [21, 40, aligned + 7, 29, 1]
    query_lens = [21, 1, 7, 10, 1]
    case = make_case(1, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size,
                     num_pad=3)
    check_against_reference(case, triton_backend.TritonAttentionBackend())


@needs_kernels
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (4, 2, 64),
                                                             (8, 2, 128), (8, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_decode_batch_matches_reference(num_heads, num_kv_heads, head_dim, block_size, splits):
    """Pure decode (max_query_len 1) through flash-decoding: fixed and auto split counts,
    contexts from 1 token (most splits empty) to several splits' worth, padded rows."""
    seq_lens = [1, 17, 64, 130, 300]
    case = make_case(2, seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim,
                     block_size, num_pad=2)
    check_against_reference(case, triton_backend.TritonAttentionBackend(decode_splits=splits))


@needs_kernels
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("decode_order,order", [
    ("head_fastest", None),
    ("longest_first", "by length"),        # what DecodeBuffers stages
    ("longest_first", [2, 0, 4, 1, 3]),    # any permutation must give the same attention
    ("longest_first", None)])              # nothing staged: runs head_fastest
def test_decode_program_orders_match_reference(splits, decode_order, order):
    """decode_order head_fastest (grid (Hkv, num_reqs, splits)) and longest_first (the
    requests taken through meta.decode_order): the same attention as the reference."""
    from kernels.attention.triton_launch import TritonLaunchConfig
    from worker_service.step.decode_buffers import longest_first

    seq_lens = [1, 40, 300, 130, 7]
    query, key, value, kv_cache, meta = make_case(9, seq_lens, [1] * 5, 8, 2, 64, 16,
                                                  num_pad=2)
    if order == "by length":
        order = longest_first(meta.seq_lens_cpu.numpy()).tolist()
        assert order == [2, 3, 1, 4, 0]        # lengths all differ
    if order is not None:
        meta.decode_order = torch.tensor(order, dtype=torch.int64, device=DEVICE)
    launch = TritonLaunchConfig(decode_order=decode_order)
    check_against_reference((query, key, value, kv_cache, meta),
                            triton_backend.TritonAttentionBackend(splits, launch))


@needs_kernels
def test_longest_first_takes_its_requests_from_the_order():
    """The kernel reads meta.decode_order: an order naming request 2 five times computes only
    request 2's row (the others keep whatever `out` held)."""
    from kernels.attention.triton_launch import TritonLaunchConfig

    query, key, value, kv_cache, meta = make_case(10, [1, 40, 300, 130, 7], [1] * 5, 8, 2,
                                                  64, 16)
    meta.decode_order = torch.full((5,), 2, dtype=torch.int64, device=DEVICE)
    backend = triton_backend.TritonAttentionBackend(1, TritonLaunchConfig(
        decode_order="longest_first"))
    expected = TorchAttentionBackend(batched=False).forward(
        query, key, value, kv_cache.clone(), meta, 64 ** -0.5)
    out = backend.forward(query, key, value, kv_cache.clone(), meta, 64 ** -0.5)
    torch.testing.assert_close(out[2], expected[2], atol=2e-5, rtol=2e-5)
    for row in (0, 1, 3, 4):
        assert not torch.allclose(out[row], expected[row], atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_matches_reference(dtype, tol):
    """fp16/bf16 cache and activations, fp32 accumulation: prefill and split decode."""
    prefill = make_case(3, [40, 9, 1], [16, 9, 1], 8, 2, 64, 16, num_pad=1, dtype=dtype)
    check_against_reference(prefill, triton_backend.TritonAttentionBackend(), tol, tol)
    decode = make_case(4, [70, 5], [1, 1], 8, 2, 64, 16, dtype=dtype)
    check_against_reference(decode, triton_backend.TritonAttentionBackend(3), tol, tol)


@needs_kernels
def test_prefill_kernel_serves_decode_rows_and_small_tiles():
    """The varlen kernel alone on a decode batch, with tiles of 16 rows and 16 keys."""
    query, key, value, kv_cache, meta = make_case(5, [33, 7, 50], [1, 1, 1], 4, 2, 16, 16)
    scale = 0.25
    expected = TorchAttentionBackend(batched=False).forward(query, key, value, kv_cache, meta, scale)
    out = torch.zeros_like(query)
    triton_attn.paged_prefill_attention(
        query, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
        meta.num_reqs, meta.num_actual_tokens, scale, block_q_rows=16, block_n=16)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 16, 16), (3, 64, 32),
                                                              (8, 128, 256)])
def test_write_kv_cache_matches_reference(num_kv_heads, head_dim, block_size):
    """The write kernel alone: strided key/value views, shuffled slots, -1 rows untouched."""
    gen = torch.Generator().manual_seed(num_kv_heads)
    num_blocks, num_tokens = 3, 9
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    fused = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 5, generator=gen)
    key = fused[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim:-5].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 4, 8]] = -1
    expected = kv_cache.clone()
    write_kv_cache(key, value, expected, slots)
    ours = kv_cache.to(DEVICE)
    triton_cache.triton_write_kv_cache(key.to(DEVICE), value.to(DEVICE), ours, slots.to(DEVICE))
    assert torch.equal(ours.cpu(), expected)
    untouched = kv_cache.to(DEVICE)
    triton_cache.triton_write_kv_cache(key.to(DEVICE), value.to(DEVICE), untouched,
                                       torch.full((num_tokens,), -1, device=DEVICE))
    assert torch.equal(untouched.cpu(), kv_cache)


@needs_kernels
def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="decode_splits"):
        triton_backend.TritonAttentionBackend(decode_splits=0)
    query, key, value, kv_cache, meta = make_case(6, [5], [5], 3, 2, 16, 16)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        triton_attn.paged_prefill_attention(query, kv_cache, torch.empty_like(query),
                                            meta.query_start_loc, meta.seq_lens,
                                            meta.block_table, 1, 5, 1.0)


@needs_kernels
def test_selector_builds_triton_backend():
    from kernels.attention.selector import get_attention_backend
    backend = get_attention_backend("triton", DEVICE)
    assert backend.name == "triton"
    assert isinstance(backend, triton_backend.TritonAttentionBackend)


@needs_kernels
def test_num_splits_heuristic():
    choose = triton_attn.choose_num_splits
    assert choose(1, 8, 100, 132) == 1                      # too short to split
    assert choose(1, 8, 8192, 132) == 32                    # one request: use the whole GPU
    assert choose(256, 8, 1024, 132) == 1                   # batch already fills the GPU
    assert choose(4, 8, 4096, 132) == 9


# Run in a fresh process without TRITON_INTERPRET: builds each kernel for sm_90 (no GPU needed).
COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.attention import triton_cache as tc
from kernels.attention.triton_decode_kernels import _decode_kernel, _reduce_kernel
from kernels.attention.triton_prefill_kernel import _prefill_kernel

def build(fn, ptr_types, constexprs, aligned=False, **options):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + ptr_types[name]
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:                                   # cache strides can pass 2**31 elements
            sig[name] = "i64" if name.startswith("stride_c") else "i32"
    # aligned: pointers and cache strides divisible by 16, as at run time (Triton specialises
    # on it, and its 16-byte loads stage more in shared memory)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if aligned and (name.endswith("_ptr") or name.startswith("stride_c"))}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

for dt in ("fp16", "bf16"):
    ptrs = dict(q_ptr=dt, out_ptr=dt, cache_ptr=dt, key_ptr=dt, value_ptr=dt, slot_ptr="i64",
                bt_ptr="i32", qsl_ptr="i32", seq_lens_ptr="i32", m_ptr="fp32", l_ptr="fp32",
                acc_ptr="fp32", sinks_ptr="fp32")
    dot = dict(PRECISION="tf32", UPCAST=False)
    # SKIP_DECODES: per-request dispatch; SLIDING: a sliding window; SINKS: attention sinks
    for skip, warps, sliding, sinks in ((False, 4, False, False), (True, 8, False, False),
                                        (False, 4, True, False), (False, 4, True, True)):
        build(_prefill_kernel, ptrs, dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_Q=16,
              BLOCK_G=4, BLOCK_D=128, BLOCK_N=64, SKIP_DECODES=skip, SLIDING=sliding,
              SINKS=sinks, G_TILES=1, KV_SHARED=False, FP8=0, **dot), num_warps=warps,
              num_stages=2)
    for head_fastest, ordered, sliding, splits, sinks in (
            (False, False, False, 8, False), (True, False, False, 8, False),
            (True, True, False, 8, False), (False, False, True, 8, False),
            (False, False, True, 1, True)):
        build(_decode_kernel, dict(ptrs, order_ptr="i64"), dict(NUM_HEADS=32, GROUP=8,
              HEAD_DIM=128, BLOCK_SIZE=256, PARTIALS=splits > 1, BLOCK_G=16, BLOCK_D=128,
              BLOCK_N=64, HEAD_FASTEST=head_fastest, ORDERED=ordered, SLIDING=sliding,
              SINKS=sinks, G_TILES=1, KV_SHARED=False, FP8=0, **dot), num_warps=4,
              num_stages=2)
    for sinks in (False, True):
        build(_reduce_kernel, ptrs, dict(NUM_HEADS=32, HEAD_DIM=128, BLOCK_D=128, SINKS=sinks),
              num_warps=1)
    build(tc._write_kv_kernel, ptrs, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16,
          BLOCK_H=8, BLOCK_D=128, FP8=0), num_warps=4)
    # an fp8 cache (--kv-cache-dtype): its uint8 view, FP8 1 (e4m3) or 2 (e5m2)
    for fp8 in (1, 2):
        codes = dict(ptrs, cache_ptr="u8")
        build(_prefill_kernel, codes, dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_Q=16,
              BLOCK_G=4, BLOCK_D=128, BLOCK_N=64, SKIP_DECODES=False, SLIDING=True,
              SINKS=True, G_TILES=1, KV_SHARED=False, FP8=fp8, **dot), num_warps=4,
              num_stages=2)
        build(_decode_kernel, dict(codes, order_ptr="i64"), dict(NUM_HEADS=32, GROUP=8,
              HEAD_DIM=128, BLOCK_SIZE=16, PARTIALS=True, BLOCK_G=16, BLOCK_D=128,
              BLOCK_N=128, HEAD_FASTEST=False, ORDERED=False, SLIDING=False,
              SINKS=False, G_TILES=1, KV_SHARED=False, FP8=fp8, **dot), num_warps=4,
              num_stages=2)
        build(tc._write_kv_kernel, codes, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16,
              BLOCK_H=8, BLOCK_D=128, FP8=fp8), num_warps=4)

# The decode kernel at its default launch fits the 99 KB of shared memory of sm_86/sm_89 GPUs
# for every cache dtype and head_dim up to 256 (128 fp32 keys of 128 dims a step needed 147 KB).
from kernels.attention.triton_launch import TritonLaunchConfig, decode_keys_per_step
tiles = TritonLaunchConfig().decode
for dt, size, head_dim in (("bf16", 2, 128), ("fp32", 4, 128), ("bf16", 2, 256), ("fp32", 4, 256)):
    ptrs = dict(q_ptr=dt, out_ptr=dt, cache_ptr=dt, bt_ptr="i32", qsl_ptr="i32",
                seq_lens_ptr="i32", order_ptr="i64", m_ptr="fp32", l_ptr="fp32", acc_ptr="fp32",
                sinks_ptr="fp32")
    keys = decode_keys_per_step(tiles.block_n, head_dim, size)
    k = build(_decode_kernel, ptrs, dict(NUM_HEADS=16, GROUP=2, HEAD_DIM=head_dim,
              BLOCK_SIZE=16, PARTIALS=False, BLOCK_G=16, BLOCK_D=head_dim, BLOCK_N=keys,
              PRECISION="ieee" if dt == "fp32" else "tf32", UPCAST=False,
              HEAD_FASTEST=False, ORDERED=False, SLIDING=False, SINKS=False, G_TILES=1,
              KV_SHARED=False, FP8=0), aligned=True,
              num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    assert k.metadata.shared <= 99 * 1024, (dt, head_dim, keys, k.metadata.shared)
"""


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="pip triton without a bundled ptxas cannot compile for sm_90")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts things the compiler rejects: compile each kernel for sm_90 in a
    fresh process (no TRITON_INTERPRET), fp16 and bf16."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@needs_kernels
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_half_precision_at_model_sizes(dtype, tol, block_size):
    """Model-sized heads (32 q / 8 kv, D 128) on CUDA; tolerance atol = rtol = tol against the
    fp32 reference on the same fp16/bf16 cache."""
    seq_lens = [517, 1, 2048, 300, 77]
    prefill = make_case(7, seq_lens, [200, 1, 64, 300, 1], 32, 8, 128, block_size,
                        num_pad=5, dtype=dtype)
    check_against_reference(prefill, triton_backend.TritonAttentionBackend(), tol, tol)
    decode = make_case(8, [4096, 1, 1000, 2500] * 8, [1] * 32, 32, 8, 128, block_size,
                       num_pad=3, dtype=dtype)
    check_against_reference(decode, triton_backend.TritonAttentionBackend(), tol, tol)


@pytest.mark.skipif(KERNELS_HERE, reason="the kernel tests ran in this process")
def test_kernels_in_fresh_interpreter_process():
    """Triton was imported compiled-mode before this module: rerun the file with the env set."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "not fresh_interpreter_process and not compile_for_sm90"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
