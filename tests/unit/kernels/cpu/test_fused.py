"""kernels/cpu/csrc/elementwise.cpp against the torch code it replaces (worker_service/layers
and the sampler): exact in bfloat16 (the same roundings), within a float32 ulp or two."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import extension
from worker_service.layers.norm import RMSNorm
from worker_service.layers.rotary import get_rope

pytestmark = [pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm_and_the_residual_form(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x = torch.randn(37, hidden, generator=gen).to(dtype)
    res = torch.randn(37, hidden, generator=gen).to(dtype)
    want_y, want_res = norm(x, res.clone())
    want_plain = norm(x)
    assert norm.use_cpu_kernels()
    res_in = res.clone()
    got_y, got_res = norm(x, res_in)
    assert got_res is res_in                              # updated in place
    torch.testing.assert_close(got_res, want_res, **tol(dtype))
    torch.testing.assert_close(got_y, want_y, **tol(dtype))
    torch.testing.assert_close(norm(x), want_plain, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_strided_views_in_place(dtype):
    gen = torch.Generator().manual_seed(1)
    cfg = {"rope_theta": 100000.0, "max_position_embeddings": 4096}
    rope = get_rope(64, cfg)
    positions = torch.randint(0, 4096, (23,), generator=gen)
    qkv = torch.randn(23, (4 + 2 * 2) * 64, generator=gen).to(dtype)
    q, k = qkv[:, :256].view(23, 4, 64), qkv[:, 256:384].view(23, 2, 64)
    want_q, want_k = rope(positions, q, k)
    assert rope.use_cpu_kernels()
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **tol(dtype))
    torch.testing.assert_close(got_k, want_k, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(ops, dtype):
    gen = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(19, 2 * 300, generator=gen)).to(dtype)
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    want = F.silu(x[:, :300]) * x[:, 300:]
    torch.testing.assert_close(ops.silu_and_mul(x), want, **tol(dtype))


def test_greedy_sample_is_argmax_with_its_logprob(ops):
    gen = torch.Generator().manual_seed(3)
    x = 5 * torch.randn(9, 1003, generator=gen)        # 1003: a tail past the 16-wide body
    x[1, 17] = x[1, 900] = 99.0                         # a tie: the first index wins
    x[2, :] = float("-inf")
    x[2, 1001] = 0.0                                    # the max in the tail, all else -inf
    x[3, 5] = float("-inf")
    ids, logprobs = ops.greedy_sample(x)
    assert ids.tolist() == x.argmax(-1).tolist() and ids[1] == 17 and ids[2] == 1001
    want = x.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(x, -1)
    torch.testing.assert_close(logprobs, want, atol=1e-5, rtol=1e-5)


def test_greedy_sample_rows_with_inf_or_nan_take_the_one_pass_path(ops):
    # Pieces with a NaN or a max that is not finite take the lane-wise update: the argmax of
    # the numbers (a NaN is never picked) and a logprob that is not finite, as torch's is not.
    # A NaN that is the first value its lane sees (columns 0 and 7) counts too.
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(4))
    x[0, 40] = float("inf")
    x[1, :] = float("-inf")
    x[2, 7] = float("nan")
    x[3, 0] = float("nan")
    x[4, 50:] = float("nan")
    ids, logprobs = ops.greedy_sample(x)
    assert ids[0] == 40 and ids[1] == 0
    for r in (2, 3, 4):
        assert ids[r] == x[r].nan_to_num(float("-inf")).argmax(), r
        assert torch.isnan(logprobs[r]), r
    assert torch.isnan(logprobs[0])
    short = torch.tensor([[float("nan")] + [float("-inf")] * 7])    # a NaN alone in its lane
    assert torch.isnan(ops.greedy_sample(short)[1][0])


def test_greedy_sample_argmax_only_gives_the_lse_kernels_ids(ops):
    # logprobs=False skips the exponentials: the same ids as the log-sum-exp pass (first index
    # on ties, a NaN never picked, an all -inf row 0) on every body, and no logprob at all.
    x = 5 * torch.randn(12, 1003, generator=torch.Generator().manual_seed(6))
    x[1, 17] = x[1, 900] = 99.0                         # a tie: the first index wins
    x[2, :] = float("-inf")
    x[2, 1001] = 0.0                                    # the max in the tail, all else -inf
    x[3, :] = float("-inf")                             # nothing but -inf: 0
    x[4, 40] = float("inf")
    x[5, 7] = float("nan")
    x[6, 0] = float("nan")
    x[7, 50:] = float("nan")
    x[8, :] = float("nan")                              # nothing but NaN: 0
    x[9, :] = 1.0                                       # all equal: 0
    x[10, 16 * 31:] = 50.0                              # a tie spanning the vector width
    ids, logprobs = ops.greedy_sample(x, False)
    assert logprobs.numel() == 0
    assert ids.tolist() == ops.greedy_sample(x)[0].tolist()
    assert ids.tolist() == x.nan_to_num(float("-inf")).argmax(-1).tolist()
    assert ids[1] == 17 and ids[3] == 0 and ids[8] == 0 and ids[10] == 16 * 31


def test_sampler_takes_the_kernel_only_for_plain_greedy_steps():
    from worker_service.sample.sampler import Sampler
    from worker_service.sample.sampling_metadata import SamplingMetadata

    def meta(n, **kw):
        base = dict(temperature=torch.zeros(n), all_greedy=True, all_random=False, top_p=None,
                    top_k=None, min_p=None, seeds=torch.zeros(n, dtype=torch.long),
                    counters=torch.zeros(n, dtype=torch.long), repetition_penalty=None,
                    presence_penalty=None, frequency_penalty=None, prompt_token_ids=None,
                    output_token_ids=None)
        return SamplingMetadata(**{**base, **kw})
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    plain = Sampler().forward(logits, meta(4))
    assert plain.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    with_top = Sampler().forward(logits, meta(4, max_num_logprobs=2))
    assert with_top.top_ids is not None
    torch.testing.assert_close(plain.logprobs, with_top.logprobs, atol=1e-5, rtol=1e-5)
    # no row wants a logprob: the argmax-only kernel, and on the torch path (a stop mask)
    # no log-sum-exp either
    bare = Sampler().forward(logits, meta(4, wants_logprobs=False))
    assert bare.sampled_token_ids.tolist() == plain.sampled_token_ids.tolist()
    assert bare.logprobs.numel() == 0 and bare.top_ids is None
    stop = torch.tensor([[0], [int(plain.sampled_token_ids[0])]])
    masked = Sampler().forward(logits, meta(4, wants_logprobs=False, stop_mask_index=stop))
    assert masked.logprobs.numel() == 0
    assert masked.sampled_token_ids.tolist()[1:] == plain.sampled_token_ids.tolist()[1:]
    assert masked.sampled_token_ids[0] != plain.sampled_token_ids[0]
