"""Greedy sampling in one pass over the logits, in Triton: each row's argmax and its logprob.

    greedy_sample(logits) -> (ids int64 [N], logprobs float32 [N])
      ids[r]      = argmax(logits[r])        (the first index of the maximum, as torch.argmax)
      logprobs[r] = log_softmax(logits[r])[ids[r]] = -log(sum(exp(logits[r] - max)))

The sampler's plain greedy step on a GPU used to be argmax plus logsumexp and a gather: about
five passes over the [N, vocabulary] float32 logits (0.35 ms a step at 254 rows of Qwen3's 152K
vocabulary on an H100); this reads them once (online max and rescaled sum, as flash attention
does). A row holding NaN answers as torch does: the first NaN's index and a NaN logprob; a row
of -inf only answers index 0 and logprob +inf (torch: NaN), as the single pass always did.

Why the vocabulary is split: one program per row looped serially over a whole row (Qwen3:
152K logits, 75 dependent loads of BLOCK), so a decode step of 20 rows ran 20 programs on an
H100's 132 SMs, and even 244 rows read their 74 MB at about a quarter of the bandwidth (0.10 ms,
H100 profile). So each row is cut into `splits` chunks of whole BLOCKs: phase 1, grid
(rows, splits), reduces each chunk to (max, first index of the max, sum of exp(x - max), first
NaN index); phase 2, grid (rows,), merges a row's partials as the single pass merges its blocks
(sums rescaled by exp(m_i - M), ties to the smallest index, the first NaN wins). With one chunk
phase 1 writes the answer itself and phase 2 is not launched.

The split count is host arithmetic on the shape (no device query, no sync: fine inside CUDA
graph capture) aiming at a few waves of programs on a 132-SM stand-in; the partial buffers come
from torch.empty per call (under capture, from the graph's pool).

On CPU the kernel runs only under the Triton interpreter (TRITON_INTERPRET=1 before triton is
imported, as tests/conftest.py arranges), where programs run one after another: there the split
count stays at 2 at most. The sampler uses it for CUDA tensors only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048              # logits per iteration of a chunk's loop
SM_STANDIN = 132          # an H100's SMs: the split count must not query the device
TARGET_PROGRAMS = 8 * SM_STANDIN   # several programs an SM, to keep loads in flight (untuned)
MIN_CHUNK_BLOCKS = 2      # loads a chunk at least, against each program's fixed cost (untuned)
MAX_SPLITS = 64           # phase 2 reads a row's partials as one block of this width
CPU_SPLITS = 2            # the interpreter runs programs serially: split only to test the path


@triton.jit
def _chunk_kernel(logits_ptr, stride_row, n_cols, chunk, ids_ptr, logprobs_ptr,
                  max_ptr, arg_ptr, sum_ptr, nan_ptr, BLOCK: tl.constexpr, FINAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, n_cols)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.full((), 0.0, tl.float32)
    best = lo                                 # a chunk of -inf only: its first index
    first_nan = n_cols
    for start in range(lo, hi, BLOCK):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, offs, n_cols), axis=0))
        x = tl.where(nan, float("-inf"), x)
        block_max = tl.max(x, axis=0)
        # the first index of the block's maximum
        block_arg = tl.min(tl.where(x == block_max, offs, n_cols), axis=0)
        new_max = tl.maximum(run_max, block_max)
        keep = tl.where(run_max == new_max, 1.0, tl.exp(run_max - new_max))
        terms = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_max))
        run_sum = run_sum * keep + tl.sum(terms, axis=0)
        best = tl.where(block_max > run_max, block_arg, best)
        run_max = new_max
    if FINAL:
        has_nan = first_nan < n_cols
        tl.store(ids_ptr + row, tl.where(has_nan, first_nan, best).to(tl.int64))
        tl.store(logprobs_ptr + row, tl.where(has_nan, float("nan"), -tl.log(run_sum)))
    else:
        slot = row * tl.num_programs(1) + part
        tl.store(max_ptr + slot, run_max)
        tl.store(arg_ptr + slot, best)
        tl.store(sum_ptr + slot, run_sum)
        tl.store(nan_ptr + slot, first_nan)


@triton.jit(do_not_specialize=["n_parts"])     # varies with the batch: one compile for all
def _merge_kernel(max_ptr, arg_ptr, sum_ptr, nan_ptr, n_parts, n_cols, ids_ptr, logprobs_ptr,
                  MAX_PARTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, MAX_PARTS)
    inside = idx < n_parts
    slots = row * n_parts + idx
    m = tl.load(max_ptr + slots, mask=inside, other=float("-inf"))
    arg = tl.load(arg_ptr + slots, mask=inside, other=n_cols)
    s = tl.load(sum_ptr + slots, mask=inside, other=0.0)
    first_nan = tl.min(tl.load(nan_ptr + slots, mask=inside, other=n_cols), axis=0)
    top = tl.max(m, axis=0)
    # as the single pass rescales its running sum: a chunk at the max keeps its sum as it is
    # (so -inf and +inf maxima need no exp(inf - inf)), a +inf's NaN sum spreads as there
    scale = tl.where(m == top, 1.0, tl.exp(m - top))
    total = tl.sum(s * scale, axis=0)
    # chunks whose max is the row's: the smallest first index (padding lanes hold n_cols)
    best = tl.min(tl.where(m == top, arg, n_cols), axis=0)
    has_nan = first_nan < n_cols
    tl.store(ids_ptr + row, tl.where(has_nan, first_nan, best).to(tl.int64))
    tl.store(logprobs_ptr + row, tl.where(has_nan, float("nan"), -tl.log(total)))


def split_plan(n_rows: int, vocab: int, on_gpu: bool, splits: int | None = None,
               block: int = BLOCK) -> tuple[int, int]:
    """(chunks per row, logits per chunk: whole blocks) for n_rows rows of vocab logits, from
    host ints only. splits None on a GPU: a row's blocks shared among the TARGET_PROGRAMS
    programs, each chunk MIN_CHUNK_BLOCKS blocks or more (Qwen3's 75 blocks: 38 chunks of 2 at
    20 rows, 5 of 17 at 244, one from 1056 rows up); under the interpreter CPU_SPLITS at most.
    An explicit splits (tests) is honoured down to one block a chunk; rounding to whole blocks
    may answer fewer chunks. Never more than MAX_SPLITS."""
    blocks = max(1, triton.cdiv(vocab, block))
    if splits is None and on_gpu:
        chunk_blocks = max(MIN_CHUNK_BLOCKS, blocks * n_rows // TARGET_PROGRAMS)
    else:
        chunk_blocks = triton.cdiv(blocks, max(1, splits or CPU_SPLITS))
    chunk = max(chunk_blocks, triton.cdiv(blocks, MAX_SPLITS)) * block
    return max(1, triton.cdiv(vocab, chunk)), chunk


def greedy_sample(logits: torch.Tensor, *, splits: int | None = None, block: int = BLOCK
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (any float dtype, unit stride along V, any row stride): (argmax ids int64
    [N], their log_softmax float32 [N]), on logits' device. splits and block are for tests
    (force the split path on small vocabularies); callers leave them to split_plan."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits of shape {tuple(logits.shape)} and strides "
                         f"{logits.stride()}: need [N, V] with unit stride along V")
    n, vocab = logits.shape
    device = logits.device
    ids = torch.empty(n, dtype=torch.int64, device=device)
    logprobs = torch.empty(n, dtype=torch.float32, device=device)
    if not n:
        return ids, logprobs
    parts, chunk = split_plan(n, vocab, logits.is_cuda, splits, block)
    if parts == 1:
        _chunk_kernel[(n, 1)](logits, logits.stride(0), vocab, chunk, ids, logprobs,
                              logprobs, ids, logprobs, ids, BLOCK=block, FINAL=True)
        return ids, logprobs
    # max and sum, argmax and first NaN; each row of these starts 64-byte aligned whatever
    # n * parts is, so the kernels' pointer specialisation (and compile) is the same every step
    width = -(-n * parts // 16) * 16
    floats = torch.empty(2, width, dtype=torch.float32, device=device)
    ints = torch.empty(2, width, dtype=torch.int32, device=device)
    _chunk_kernel[(n, parts)](logits, logits.stride(0), vocab, chunk, ids, logprobs,
                              floats[0], ints[0], floats[1], ints[1], BLOCK=block, FINAL=False)
    _merge_kernel[(n,)](floats[0], ints[0], floats[1], ints[1], parts, vocab, ids, logprobs,
                        MAX_PARTS=MAX_SPLITS, num_warps=1)
    return ids, logprobs
