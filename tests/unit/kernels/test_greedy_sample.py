"""The one-pass Triton greedy sampler against torch.argmax and log_softmax (interpreter on CPU,
compiled on GPU): ties, -inf entries, NaN rows, a vocabulary that is no multiple of the block."""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_mode import DEVICE, needs_kernels

pytestmark = needs_kernels


def reference(logits: torch.Tensor):
    x = logits.double()
    ids = x.argmax(dim=-1)
    return ids, x.log_softmax(dim=-1).gather(1, ids[:, None]).squeeze(1)


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


def test_ties_across_blocks_keep_the_first_index():
    from kernels.greedy_sample import BLOCK, greedy_sample

    logits = torch.zeros(2, 3 * BLOCK + 5)
    logits[0, [BLOCK + 3, 2 * BLOCK + 1]] = 9.0      # equal maxima in two blocks
    logits[1, [3 * BLOCK + 4, 5]] = 9.0
    ids, _ = greedy_sample(logits.to(DEVICE))
    assert ids.cpu().tolist() == [BLOCK + 3, 5]


def test_a_nan_row_answers_as_torch_does():
    from kernels.greedy_sample import greedy_sample

    logits = torch.randn(2, 300)
    logits[0, 123] = float("nan")
    logits[0, 200] = float("nan")
    ids, logprobs = greedy_sample(logits.to(DEVICE))
    assert ids.cpu().tolist() == [123, int(logits[1].argmax())]
    assert torch.isnan(logprobs[0]) and torch.isfinite(logprobs[1])


def test_refuses_a_strided_vocabulary_axis():
    from kernels.greedy_sample import greedy_sample

    with pytest.raises(ValueError, match="unit stride"):
        greedy_sample(torch.zeros(4, 6).t())


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
