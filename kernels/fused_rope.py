"""Fused rotary embedding in Triton: q and k of one token rotated in one launch, in place.

Same contract as worker_service/layers/rotary.py RotaryEmbedding, rounding step for rounding
step ("rotate half" layout, x = [x1, x2] split at D/2; c, s = cos, sin cast from float32 to the
activations' dtype first, as the torch module does):

    out1 = x1 * c - x2 * s          each product rounded to the dtype, then the difference
    out2 = x2 * c + x1 * s          (torch: x * cos + rotate_half(x) * sin, three kernels)

Products of two fp16/bf16 values are exact in float32, so "compute in float32, round once" is
exactly torch's rounding of each op; float32 launches disable mul+add -> fma contraction so
float32 agrees bit for bit too (the CPU interpreter rounds float32 -> bfloat16 by truncation,
see tests/unit/kernels/test_fused_rope.py for the tolerance that costs).

Layouts:
    positions  [T] any integer dtype, each in [0, max_position) (not checked: no device sync)
    query      [T, Hq, D], key [T, Hk, D]: any token/head strides, last dim contiguous
    cos_cache, sin_cache  [max_position, R] float32, rows [f, f] (both halves equal, as
               RotaryEmbedding builds them): only the first R/2 columns are read. R is the
               rotary dim: D, or less with a partial_rotary_factor (Phi-4-mini: 0.75 D); the
               first R dims of each head rotate (x1, x2 split at R/2), dims R .. D-1 pass
               through (read only to normalise them or to store keys in the cache)

Grid: (T, head blocks); head block b < cdiv(Hq, BLOCK_H) rotates query heads, the rest key heads.
D may be any even size up to MAX_HEAD_DIM (R/2 and D - R are padded to powers of two and masked).

With q_weight / k_weight (Qwen3's per-head q_norm / k_norm, applied before rope) each head is
first RMS-normalised as kernels/fused_norm.py does (statistics in float32, the normalised row
rounded to the dtype, then times the weight, rounded again): one launch instead of three, 56
fewer a decode step for Qwen3-0.6B.

With value / kv_cache / slot_mapping the programs that rotate key heads also store the rotated
key rows, and copy the value rows, into the paged cache (kv_cache[2, num_blocks, block_size,
Hk, D], row t at slot_mapping[t], as kernels/attention/triton_cache.py does): the Triton
attention backend then skips its own write launch, 28 fewer a decode step for Qwen3-0.6B.
Rows t >= len(slot_mapping) (CUDA-graph padding) and slots of -1 store nothing. An fp8 cache
(--kv-cache-dtype) gets the rounded codes triton_cache.py writes (kernels/attention/triton_fp8.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.triton_fp8 import cache_operand, store_cache

MAX_HEAD_DIM = 256
TILE_ELEMS = 2048            # heads x (D/2) per program: keeps two halves in registers
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _mul(x, y):
    """x * y rounded once to x's dtype (exact float32 product for fp16/bf16 inputs)."""
    return (x.to(tl.float32) * y.to(tl.float32)).to(x.dtype)


@triton.jit
def _normed(x, rstd, w_ptr, cols, width):
    """x * rstd rounded to x's dtype, times the weight w_ptr[cols] (cols < width), rounded."""
    w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)[None, :]
    return (w * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def _rms_normed(x1, x2, x3, w_ptr, eps, half, tail, cols, tcols, HAS_TAIL: tl.constexpr):
    """The rotated halves (x1, x2) and the pass-through tail (x3, HAS_TAIL) of each row of heads
    RMS-normalised over the whole head, times the weight: fused_norm's rounding (float32
    statistics, normalised row rounded, weight product rounded)."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    sum_sq = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
    if HAS_TAIL:
        c = x3.to(tl.float32)
        sum_sq += tl.sum(c * c, axis=1)
    rstd = (1.0 / tl.sqrt(sum_sq / (2 * half + tail) + eps))[:, None]
    n1 = _normed(x1, rstd, w_ptr, cols, half)
    n2 = _normed(x2, rstd, w_ptr + half, cols, half)
    if HAS_TAIL:
        x3 = _normed(x3, rstd, w_ptr + 2 * half, tcols, tail)
    return n1, n2, x3


@triton.jit
def _rotate_heads(base_ptr, stride_h, num_heads, head0, half, tail, cos, sin, w_ptr, eps,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                  NORM: tl.constexpr, LOAD_TAIL: tl.constexpr):
    """Rotate heads head0 .. head0 + BLOCK_H - 1 (those < num_heads) of one token in place,
    RMS-normalising each first when NORM. Returns the rotated halves and, when LOAD_TAIL, the
    tail (dims 2 * half .. 2 * half + tail - 1: never rotated, normalised in place when NORM;
    LOAD_TAIL must be set when there is a tail and NORM)."""
    heads = head0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (cols < half)[None, :]
    ptr1 = base_ptr + heads[:, None].to(tl.int64) * stride_h + cols[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + half, mask=mask, other=0.0)
    tcols = tl.arange(0, BLOCK_TAIL)
    tmask = (heads < num_heads)[:, None] & (tcols < tail)[None, :]
    ptr3 = base_ptr + heads[:, None].to(tl.int64) * stride_h + 2 * half + tcols[None, :]
    x3 = tl.zeros((BLOCK_H, BLOCK_TAIL), dtype=x1.dtype)
    if LOAD_TAIL:
        x3 = tl.load(ptr3, mask=tmask, other=0.0)
    if NORM:
        x1, x2, x3 = _rms_normed(x1, x2, x3, w_ptr, eps, half, tail, cols, tcols, LOAD_TAIL)
        if LOAD_TAIL:
            tl.store(ptr3, x3, mask=tmask)
    c = cos.to(x1.dtype)[None, :]          # cast first, as torch's cos_cache[...].to(dtype)
    s = sin.to(x1.dtype)[None, :]
    out1 = (_mul(x1, c).to(tl.float32) - _mul(x2, s).to(tl.float32)).to(x1.dtype)
    out2 = (_mul(x2, c).to(tl.float32) + _mul(x1, s).to(tl.float32)).to(x1.dtype)
    tl.store(ptr1, out1, mask=mask)
    tl.store(ptr1 + half, out2, mask=mask)
    return out1, out2, x3


@triton.jit
def _store_kv(out1, out2, out3, token, head0, num_heads, half, tail, v_ptr, stride_vt,
              stride_vh, cache_ptr, slot_ptr, num_slots, stride_c_kv, stride_c_blk,
              stride_c_row, stride_c_head, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
              BLOCK_TAIL: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              FP8: tl.constexpr):
    """The rotated key heads (out1, out2, and the unrotated tail out3 when HAS_TAIL) and the
    same heads of the value row into the cache at slot_mapping[token]: nothing for
    token >= num_slots (>= 1) or a slot of -1. FP8: an fp8 cache's codes (triton_fp8.py)."""
    slot = tl.load(slot_ptr + tl.minimum(token, num_slots - 1)).to(tl.int64)
    slot = tl.where(token < num_slots, slot, -1)
    heads = head0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    # A scalar bool in a mask trips the interpreter: the slot test folds into the head bound.
    limit = tl.where(slot >= 0, num_heads, 0)
    mask = (heads < limit)[:, None] & (cols < half)[None, :]
    safe_slot = tl.maximum(slot, 0)       # keeps masked rows' addresses in range
    dst_row = cache_ptr + (safe_slot // BLOCK_SIZE) * stride_c_blk \
        + (safe_slot % BLOCK_SIZE) * stride_c_row + heads[:, None].to(tl.int64) * stride_c_head
    src_row = v_ptr + token * stride_vt + heads[:, None].to(tl.int64) * stride_vh
    dst = dst_row + cols[None, :]
    src = src_row + cols[None, :]
    store_cache(dst, out1, mask, FP8)
    store_cache(dst + half, out2, mask, FP8)
    store_cache(dst + stride_c_kv, tl.load(src, mask=mask), mask, FP8)
    store_cache(dst + stride_c_kv + half, tl.load(src + half, mask=mask), mask, FP8)
    if HAS_TAIL:
        tcols = tl.arange(0, BLOCK_TAIL)
        tmask = (heads < limit)[:, None] & (tcols < tail)[None, :]
        tdst = dst_row + 2 * half + tcols[None, :]
        tsrc = src_row + 2 * half + tcols[None, :]
        store_cache(tdst, out3, tmask, FP8)
        store_cache(tdst + stride_c_kv, tl.load(tsrc, mask=tmask), tmask, FP8)


# num_slots is len(slot_mapping) (or T without a write): it varies with the batch, and a
# specialised int (== 1, a multiple of 16) would compile the kernel again mid-run.
@triton.jit(do_not_specialize=["num_slots"])
def _rope_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
                 num_q_heads, num_k_heads, half, tail,
                 v_ptr, cache_ptr, slot_ptr, num_slots, stride_vt, stride_vh,
                 stride_c_kv, stride_c_blk, stride_c_row, stride_c_head,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                 NORM: tl.constexpr, WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 Q_TAIL: tl.constexpr, K_TAIL: tl.constexpr, FP8: tl.constexpr):
    # Q_TAIL / K_TAIL: whether query / key heads touch their unrotated tail (partial rotary with
    # a norm, or a cache write for keys); without, the tail is never read.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * stride_cache + cols, mask=cols < half, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cache + cols, mask=cols < half, other=0.0)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if block < num_q_blocks:
        _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, block * BLOCK_H, half,
                      tail, cos, sin, qw_ptr, eps, BLOCK_H, BLOCK_HALF, BLOCK_TAIL, NORM, Q_TAIL)
    else:
        head0 = (block - num_q_blocks) * BLOCK_H
        out1, out2, out3 = _rotate_heads(
            k_ptr + token * stride_kt, stride_kh, num_k_heads, head0, half, tail, cos, sin,
            kw_ptr, eps, BLOCK_H, BLOCK_HALF, BLOCK_TAIL, NORM, K_TAIL)
        if WRITE_KV:
            _store_kv(out1, out2, out3, token, head0, num_k_heads, half, tail, v_ptr, stride_vt,
                      stride_vh, cache_ptr, slot_ptr, num_slots, stride_c_kv, stride_c_blk,
                      stride_c_row, stride_c_head, BLOCK_H, BLOCK_HALF, BLOCK_TAIL, K_TAIL,
                      BLOCK_SIZE, FP8)


def fused_rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
               cos_cache: torch.Tensor, sin_cache: torch.Tensor,
               q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
               eps: float = 0.0, value: torch.Tensor | None = None,
               kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, Hq, D] and key [T, Hk, D] at `positions` [T] IN PLACE, one launch;
    returns (query, key), the same tensors. cos_cache / sin_cache: RotaryEmbedding's float32
    [max_position, rotary_dim] buffers (rotary_dim <= D: the first rotary_dim dims of each head
    rotate, the rest pass through). q_weight and k_weight ([D], the activations' dtype; both or
    neither): RMS-normalise each head with them and `eps` first. value [T, Hk, D] (last dim
    contiguous), kv_cache [2, num_blocks, block_size, Hk, D] and slot_mapping [<= T] (all three
    or none): also store rows t < len(slot_mapping) of the rotated key and of value at
    slot_mapping[t] (-1: nothing). See the module docstring."""
    _check(positions, query, key, cos_cache, sin_cache)
    write_kv = _check_kv_write(key, value, kv_cache, slot_mapping)
    norm = q_weight is not None
    if norm != (k_weight is not None):
        raise ValueError("q_weight and k_weight: give both (per-head q/k norm) or neither")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if norm and (w.shape != (query.shape[2],) or w.dtype != query.dtype
                     or w.device != query.device or w.stride(0) != 1):
            raise ValueError(f"{name} {tuple(w.shape)} {w.dtype} on {w.device}: must be a "
                             f"contiguous [{query.shape[2]}] {query.dtype} on {query.device}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    if num_tokens == 0:
        return query, key
    rotary_dim = cos_cache.shape[1]           # the first rotary_dim dims of each head rotate
    tail = head_dim - rotary_dim
    block_half = triton.next_power_of_2(rotary_dim // 2)
    load_tail = tail > 0 and (norm or write_kv)
    block_tail = triton.next_power_of_2(max(tail, 1))
    widest = max(block_half, block_tail) if load_tail else block_half   # a tile's row
    block_h = max(1, min(triton.next_power_of_2(min(num_q_heads, num_k_heads)),
                         TILE_ELEMS // widest))
    num_blocks = triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h)
    # Without a write the cache arguments are dead code: any tensors of the right kind do.
    v, cache, slots = (value, kv_cache, slot_mapping) if write_kv else (key, key, positions)
    cache, fp8 = cache_operand(cache)         # an fp8 cache: its uint8 view and type code
    _rope_kernel[(num_tokens, num_blocks)](
        positions, query, key, cos_cache, sin_cache,
        q_weight if norm else query, k_weight if norm else key, float(eps),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_cache.stride(0),
        num_q_heads, num_k_heads, rotary_dim // 2, tail,
        v, cache, slots, slots.shape[0], v.stride(0), v.stride(1),
        *(kv_cache.stride()[:4] if write_kv else (0, 0, 0, 0)),
        BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_TAIL=block_tail,
        NORM=norm, WRITE_KV=write_kv, BLOCK_SIZE=kv_cache.shape[2] if write_kv else 1,
        Q_TAIL=tail > 0 and norm, K_TAIL=load_tail, FP8=fp8,
        num_warps=max(1, min(4, block_h * widest // 256)), enable_fp_fusion=False)
    return query, key


def _check_kv_write(key: torch.Tensor, value: torch.Tensor | None,
                    kv_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None) -> bool:
    """Whether the launch writes the cache (an empty slot_mapping writes nothing); ValueError
    naming the offender when the three arguments do not fit key or each other."""
    given = [t is not None for t in (value, kv_cache, slot_mapping)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError("value, kv_cache and slot_mapping: give all three (write the KV "
                         "cache) or none")
    if value.shape != key.shape or value.stride(-1) != 1:
        raise ValueError(f"value {tuple(value.shape)} stride {value.stride()}: must be "
                         f"{tuple(key.shape)} like key with a contiguous last dim")
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]
            or kv_cache.stride(4) != 1):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} stride {kv_cache.stride()}: must be "
                         f"[2, num_blocks, block_size, {key.shape[1]}, {key.shape[2]}] with a "
                         f"contiguous last dim")
    if (slot_mapping.dim() != 1 or slot_mapping.shape[0] > key.shape[0]
            or slot_mapping.dtype.is_floating_point):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype}: must "
                         f"be [<= {key.shape[0]}] integers")
    devices = {t.device for t in (key, value, kv_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"key, value, kv_cache and slot_mapping are on devices "
                         f"{sorted(map(str, devices))}: must share one device")
    return slot_mapping.shape[0] > 0


def _check(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
           cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
    """Shape/dtype rules the kernel relies on; ValueError naming the offender."""
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(f"query {tuple(query.shape)} / key {tuple(key.shape)}: must be "
                         f"[T, heads, head_dim]")
    num_tokens, _, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key {tuple(key.shape)}: must be [{num_tokens}, Hk, {head_dim}] "
                         f"like query {tuple(query.shape)}")
    if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is invalid: must be even, in [2, {MAX_HEAD_DIM}]")
    if query.dtype not in DTYPES or key.dtype != query.dtype:
        raise ValueError(f"query/key dtype {query.dtype}/{key.dtype}: must be one of {DTYPES} "
                         f"and equal")
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError(f"query stride {query.stride()} / key stride {key.stride()}: the "
                         f"last dim must be contiguous")
    if positions.shape != (num_tokens,) or positions.dtype.is_floating_point:
        raise ValueError(f"positions {tuple(positions.shape)} {positions.dtype}: must be "
                         f"[{num_tokens}] integers")
    devices = {t.device for t in (positions, query, key, cos_cache, sin_cache)}
    if len(devices) != 1:
        raise ValueError(f"positions, query, key, cos_cache and sin_cache are on devices "
                         f"{sorted(map(str, devices))}: must share one device")
    rotary_dim = cos_cache.shape[-1] if cos_cache.dim() else 0
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if (cache.dim() != 2 or cache.shape[1] != rotary_dim or rotary_dim % 2
                or not 2 <= rotary_dim <= head_dim or cache.dtype != torch.float32
                or cache.stride(-1) != 1 or cache.stride() != cos_cache.stride()):
            raise ValueError(f"{name} {tuple(cache.shape)} {cache.dtype}: must be "
                             f"[max_position, rotary_dim] float32, rotary_dim even in "
                             f"[2, head_dim={head_dim}] and equal for both caches, with a "
                             f"contiguous last dim (strides equal to cos_cache's)")


def triton_runs_on(device: str | torch.device) -> bool:
    """Whether the fused kernels can run on `device`: CUDA, or the CPU when they were built for
    Triton's interpreter (TRITON_INTERPRET=1 before triton was imported)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return True
    from triton.runtime.interpreter import InterpretedFunction
    return kind == "cpu" and isinstance(_rope_kernel, InterpretedFunction)
