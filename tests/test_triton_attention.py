"""Triton KV writes and paged attention against the torch reference backend.

With CUDA the kernels run compiled on the GPU. Without it they run under the Triton interpreter,
which @triton.jit picks when a function is *decorated*: at import of the kernel modules and, for
tl.zeros / tl.sum / tl.max and friends, at `import triton` itself. So TRITON_INTERPRET is set
here before triton is imported. If an earlier test module already imported triton in compiled
mode, the kernel tests skip in this process and `test_kernels_in_fresh_interpreter_process`
reruns this file in a subprocess instead.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from kernels.attention.backend import AttentionMetadata  # noqa: E402
from kernels.attention.torch_ref import TorchAttentionBackend, write_kv_cache  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
REPO_ROOT = Path(__file__).resolve().parent.parent
KERNEL_MODULES = ("kernels.attention.triton_cache", "kernels.attention.triton_paged_attention",
                  "kernels.attention.triton_backend")


def _triton_usable_here() -> bool:
    """On GPU always; on CPU only if triton itself was imported in interpreter mode."""
    if ON_GPU:
        return True
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton.language.zeros, InterpretedFunction)


KERNELS_HERE = _triton_usable_here()
triton_cache, triton_attn, triton_backend = (
    [importlib.import_module(name) for name in KERNEL_MODULES] if KERNELS_HERE else [None] * 3)
needs_kernels = pytest.mark.skipif(
    not KERNELS_HERE, reason="triton was imported in compiled mode before this module set "
    "TRITON_INTERPRET; test_kernels_in_fresh_interpreter_process runs these instead")


def make_case(seed, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size,
              num_pad=0, dtype=torch.float32, device=DEVICE):
    """A batch over a random cache: physical blocks shuffled, every cache slot random (the
    cached prefix is whatever the cache holds), q/k/v strided views of one fused qkv tensor,
    num_pad trailing padded rows (slot -1) with huge keys so a stray write would show."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [triton.cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3                   # spare blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    slots, used = [], 0
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        block_table[i, :blocks_per_req[i]] = perm[used:used + blocks_per_req[i]]
        used += blocks_per_req[i]
        pos = torch.arange(seq_len - query_len, seq_len)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    num_tokens = sum(query_lens)
    slots.append(torch.full((num_pad,), -1, dtype=torch.long))
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens + num_pad, width, generator=gen)
    qkv[num_tokens:] = 1e4
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    qkv, kv_cache = qkv.to(device, dtype), kv_cache.to(device, dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    rows = num_tokens + num_pad
    query = qkv[:, :q_end].view(rows, num_heads, head_dim)
    key = qkv[:, q_end:k_end].view(rows, num_kv_heads, head_dim)
    value = qkv[:, k_end:].view(rows, num_kv_heads, head_dim)
    starts = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=starts.to(device), seq_lens=lens.to(device),
        block_table=block_table.to(device), slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return query, key, value, kv_cache, meta


def check_against_reference(case, backend, atol=2e-5, rtol=2e-5):
    """Run both backends on copies of the cache: outputs close, caches bit-identical after."""
    query, key, value, kv_cache, meta = case
    scale = query.shape[2] ** -0.5
    ref_cache, our_cache = kv_cache.clone(), kv_cache.clone()
    expected = TorchAttentionBackend(batched=False).forward(query, key, value, ref_cache, meta, scale)
    out = backend.forward(query, key, value, our_cache, meta, scale)
    n = meta.num_actual_tokens
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), atol=atol, rtol=rtol)
    assert torch.equal(our_cache, ref_cache), "KV cache differs from the reference writes"


# (num_heads, num_kv_heads, head_dim, block_size): GQA 1/2/4/8 and 3, dims 16/64/128 (+48).
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
from kernels.attention import triton_cache as tc, triton_paged_attention as pa

def build(fn, ptr_types, constexprs, **options):
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
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

for dt in ("fp16", "bf16"):
    ptrs = dict(q_ptr=dt, out_ptr=dt, cache_ptr=dt, key_ptr=dt, value_ptr=dt, slot_ptr="i64",
                bt_ptr="i32", qsl_ptr="i32", seq_lens_ptr="i32", m_ptr="fp32", l_ptr="fp32",
                acc_ptr="fp32")
    dot = dict(PRECISION="tf32", UPCAST=False)
    for skip, warps in ((False, 4), (True, 8)):      # SKIP_DECODES: per-request dispatch
        build(pa._prefill_kernel, ptrs, dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_Q=16,
              BLOCK_G=4, BLOCK_D=128, BLOCK_N=64, SKIP_DECODES=skip, **dot), num_warps=warps,
              num_stages=2)
    build(pa._decode_kernel, ptrs, dict(NUM_HEADS=32, GROUP=8, HEAD_DIM=128, BLOCK_SIZE=256,
          NUM_SPLITS=8, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, **dot), num_warps=4, num_stages=2)
    build(pa._reduce_kernel, ptrs, dict(NUM_HEADS=32, HEAD_DIM=128, NUM_SPLITS=8, BLOCK_S=8,
          BLOCK_D=128), num_warps=1)
    build(tc._write_kv_kernel, ptrs, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16,
          BLOCK_H=8, BLOCK_D=128), num_warps=4)
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
