"""The one-pass Triton greedy sampler against torch.argmax and log_softmax (interpreter on CPU,
compiled on GPU): ties, -inf entries, NaN rows, a vocabulary that is no multiple of the block;
the split path (chunks of a row merged by a second kernel) with forced splits on small
vocabularies; the host's split plan; a compile of both kernels for sm_90 without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.lanes import split_grid
from tests.support.paths import REPO
from tests.support.triton_mode import DEVICE, needs_kernels, triton


def reference(logits: torch.Tensor):
    x = logits.double()
    ids = x.argmax(dim=-1)
    return ids, x.log_softmax(dim=-1).gather(1, ids[:, None]).squeeze(1)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 2048, 5000])
def test_matches_argmax_and_log_softmax(dtype, vocab):
    from kernels.greedy_sample import greedy_sample

    gen = torch.Generator().manual_seed(vocab)
    logits = (4 * torch.randn(5, vocab, generator=gen)).to(dtype)
    logits[1, vocab // 2] = logits[1].max() + 1      # a clear winner mid-row
    logits[2, :] = 0.5                               # all tied: the first index wins
    logits[3, -1] = float("inf") if dtype == torch.float32 else logits[3].max() + 3
    logits[4, : vocab // 2] = float("-inf")          # masked-out half
    ids, logprobs = greedy_sample(logits.to(DEVICE))
    ref_ids, ref_lp = reference(logits)
    assert ids.cpu().tolist() == ref_ids.tolist()
    finite = torch.isfinite(ref_lp)
    assert torch.allclose(logprobs.cpu()[finite].double(), ref_lp[finite], atol=1e-4)
    assert logprobs.dtype == torch.float32 and ids.dtype == torch.int64


@needs_kernels
def test_ties_across_blocks_keep_the_first_index():
    from kernels.greedy_sample import BLOCK, greedy_sample

    logits = torch.zeros(2, 3 * BLOCK + 5)
    logits[0, [BLOCK + 3, 2 * BLOCK + 1]] = 9.0      # equal maxima in two blocks
    logits[1, [3 * BLOCK + 4, 5]] = 9.0
    ids, _ = greedy_sample(logits.to(DEVICE))
    assert ids.cpu().tolist() == [BLOCK + 3, 5]


@needs_kernels
def test_a_nan_row_answers_as_torch_does():
    from kernels.greedy_sample import greedy_sample

    logits = torch.randn(2, 300)
    logits[0, 123] = float("nan")
    logits[0, 200] = float("nan")
    ids, logprobs = greedy_sample(logits.to(DEVICE))
    assert ids.cpu().tolist() == [123, int(logits[1].argmax())]
    assert torch.isnan(logprobs[0]) and torch.isfinite(logprobs[1])


@needs_kernels
def test_refuses_a_strided_vocabulary_axis():
    from kernels.greedy_sample import greedy_sample

    with pytest.raises(ValueError, match="unit stride"):
        greedy_sample(torch.zeros(4, 6).t())


@needs_kernels
def test_padded_bf16_rows_answer_as_their_float32_widening():
    """The LM head's CUDA greedy path reads model-dtype logits whose rows may be padded (a
    [:, :vocab] view): widening bf16 is exact, so the ids are the float32 logits' own; the
    logprobs agree to float32 rounding (on a GPU the compiled sums run in another order for
    2-byte loads: 1-ulp differences seen on an H100)."""
    from kernels.greedy_sample import greedy_sample

    gen = torch.Generator().manual_seed(3)
    padded = (6 * torch.randn(4, 3000 + 24, generator=gen)).to(torch.bfloat16).to(DEVICE)
    view = padded[:, :3000]
    ids, logprobs = greedy_sample(view)
    ids32, logprobs32 = greedy_sample(view.float().contiguous())
    assert torch.equal(ids, ids32)
    torch.testing.assert_close(logprobs, logprobs32, rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.skipif(DEVICE != "cuda", reason="the LM head samples from model-dtype logits on CUDA")
def test_lm_head_greedy_on_cuda_matches_its_float32_logits():
    from worker_service.layers.embedding import ParallelLMHead
    from worker_service.parallel_state import single_rank_group

    torch.manual_seed(0)
    head = ParallelLMHead(5000, 64, single_rank_group(), torch.bfloat16).to(DEVICE)
    torch.nn.init.normal_(head.weight)
    hidden = torch.randn(7, 64, dtype=torch.bfloat16, device=DEVICE)
    ids, logprobs = head.greedy(hidden)
    ref_ids, ref_lp = reference(head(hidden).cpu())
    assert ids.cpu().tolist() == ref_ids.tolist()
    assert torch.allclose(logprobs.cpu().double(), ref_lp, atol=1e-4)


def split_case_logits(vocab: int, chunk: int, parts: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that put each merge rule to work at the chunk borders of a forced split."""
    gen = torch.Generator().manual_seed(vocab + parts)
    x = 4 * torch.randn(8, vocab, generator=gen)
    top = float(x.abs().max()) + 10
    x[0, vocab - 1] = top                          # the max in the last (short) chunk
    x[1, [chunk - 1, chunk, 2 * chunk]] = top      # tied across two borders: the first wins
    x[2, [2 * chunk + 1, 1]] = top                 # the tie's first index in an earlier chunk
    x[3, 3] = top                                  # the max in chunk 0 ...
    x[3, [2 * chunk + 5, vocab - 2]] = float("nan")    # ... the first NaN in a later one
    x[4, :] = float("-inf")                        # nothing but -inf
    x[5, chunk + 2] = float("inf")                 # +inf, with a finite max elsewhere
    x[5, 0] = top
    x[6, : 2 * chunk] = float("-inf")              # whole chunks of -inf before the max
    x[7, :] = 0.25                                 # every chunk at the max: index 0
    return x.to(dtype)


# (vocab, splits, block): no vocabulary a multiple of the block or of the split count
FORCED_PLANS = [(1000, 4, 128), (4999, 3, 512), (3001, 7, 256)]


@needs_kernels
@pytest.mark.parametrize("plan,dtype", split_grid(
    [FORCED_PLANS, [torch.float32, torch.bfloat16]],
    fast={(FORCED_PLANS[0], torch.float32), (FORCED_PLANS[1], torch.bfloat16),
          (FORCED_PLANS[2], torch.float32)}))
def test_forced_splits_match_argmax_and_log_softmax(plan, dtype):
    """Splits > 1 on vocabularies that are no multiple of the block or of the split count;
    each chunk spans several blocks where the sizes allow (its own loop is exercised too)."""
    vocab, splits, block = plan
    from kernels.greedy_sample import greedy_sample, split_plan

    parts, chunk = split_plan(8, vocab, False, splits, block)
    assert parts >= 3 and (parts - 1) * chunk < vocab <= parts * chunk
    logits = split_case_logits(vocab, chunk, parts, dtype)
    ids, logprobs = greedy_sample(logits.to(DEVICE), splits=splits, block=block)
    ref_ids, ref_lp = reference(logits)
    assert ids.cpu().tolist() == ref_ids.tolist()
    lp = logprobs.cpu().double()
    finite = torch.isfinite(ref_lp)
    assert torch.allclose(lp[finite], ref_lp[finite], atol=1e-4)
    assert torch.isnan(lp[[3, 5]]).all()           # a NaN, and +inf - +inf, as torch
    assert lp[4] == float("inf")                   # all -inf: as the single pass (torch: NaN)


@needs_kernels
def test_split_and_single_pass_agree_on_strided_bf16_rows():
    """Every other row of a padded bf16 buffer (row stride 2 * (vocab + pad)): the split path
    answers the single pass's ids and, to float32 rounding, its logprobs."""
    from kernels.greedy_sample import greedy_sample

    gen = torch.Generator().manual_seed(11)
    padded = (6 * torch.randn(6, 2500 + 40, generator=gen)).to(torch.bfloat16).to(DEVICE)
    view = padded[::2, :2500]
    assert view.stride() == (2 * 2540, 1)
    ids, logprobs = greedy_sample(view, splits=5, block=128)
    ids1, logprobs1 = greedy_sample(view, splits=1, block=128)
    ref_ids, ref_lp = reference(view.cpu())
    assert ids.cpu().tolist() == ids1.cpu().tolist() == ref_ids.tolist()
    torch.testing.assert_close(logprobs, logprobs1, rtol=1e-6, atol=1e-6)
    assert torch.allclose(logprobs.cpu().double(), ref_lp, atol=1e-4)


def test_the_split_plan_fills_an_h100_with_chunks_of_whole_blocks():
    """Host ints only (it runs under CUDA graph capture): a few waves of programs on 132 SMs
    at every batch, each chunk whole blocks and at least MIN_CHUNK_BLOCKS of them."""
    from kernels.greedy_sample import (BLOCK, MAX_SPLITS, MIN_CHUNK_BLOCKS, SM_STANDIN,
                                       split_plan)

    vocab = 151_936
    for n in (1, 20, 64, 244, 512, 2048):
        parts, chunk = split_plan(n, vocab, True)
        assert chunk % BLOCK == 0 and (parts - 1) * chunk < vocab <= parts * chunk
        assert 1 <= parts <= MAX_SPLITS
        if parts > 1:
            assert chunk >= MIN_CHUNK_BLOCKS * BLOCK
        if n >= 20:
            assert n * parts >= 4 * SM_STANDIN, (n, parts)
    assert split_plan(20, vocab, True)[0] > split_plan(244, vocab, True)[0] > 1
    assert split_plan(2048, vocab, True)[0] == 1       # enough rows: no second kernel
    assert split_plan(4, 1000, True)[0] == 1           # under one block: one chunk
    assert split_plan(4, vocab, False)[0] == 2         # the interpreter: two at most


# Run in a fresh process without TRITON_INTERPRET: builds both kernels for sm_90, with the
# divisibility the launcher gives aligned buffers, and checks the logits load 16 bytes at once.
COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import greedy_sample as gs

def build(fn, ptrs, constexprs, **options):
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in constexprs}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

parts = dict(max_ptr="*fp32", arg_ptr="*i32", sum_ptr="*fp32", nan_ptr="*i32",
             ids_ptr="*i64", logprobs_ptr="*fp32")
for dt in ("fp32", "fp16", "bf16"):
    for final in (False, True):
        k = build(gs._chunk_kernel, dict(parts, logits_ptr="*" + dt),
                  dict(BLOCK=gs.BLOCK, FINAL=final), num_warps=4)
        assert "ld.global.v4" in k.asm["ptx"], (dt, final, "logits loads not vectorised")
build(gs._merge_kernel, parts, dict(MAX_PARTS=gs.MAX_SPLITS), num_warps=1)
"""


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="pip triton without a bundled ptxas cannot compile for sm_90")
@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts things the compiler rejects: compile both phases for sm_90 in a
    fresh process (no TRITON_INTERPRET), every logits dtype, with and without the merge."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
