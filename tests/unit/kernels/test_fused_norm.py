"""The fused Triton RMSNorm against the model's torch RMSNorm (interpreter on CPU, compiled on
GPU). Not wired into the model: this only pins its numerics."""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_mode import DEVICE, ON_GPU, needs_kernels
from worker_service.layers.norm import RMSNorm

pytestmark = needs_kernels


def make(hidden, rows, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-6, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=gen))
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    res = torch.randn(rows, hidden, generator=gen).to(dtype)
    return norm.to(DEVICE), x.to(DEVICE), res.to(DEVICE)


# float32 agrees to rounding; fp16/bf16 to about one unit in the last place. The CPU interpreter
# truncates float32 -> bfloat16 (GPUs round to nearest even), up to 3 ulps over two casts.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if ON_GPU else 3 * 2.0 ** -7,
       torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden,rows", [(64, 3), (48, 5), (128, 1)])
def test_matches_torch_rms_norm(dtype, hidden, rows):
    from kernels.fused_norm import rms_norm

    norm, x, res = make(hidden, rows, dtype, seed=hidden + rows)
    tol = TOL[dtype]
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), norm(x),
                                   atol=tol, rtol=tol)
        want_out, want_res = norm(x, res)
        got_out, got_res = rms_norm(x, norm.weight, norm.eps, res)
    if dtype == torch.bfloat16 and not ON_GPU:
        # one truncating cast: 1 ulp
        torch.testing.assert_close(got_res, want_res, atol=0, rtol=2.0 ** -7)
    else:
        assert torch.equal(got_res, want_res), "the residual sum must round like torch's add"
    torch.testing.assert_close(got_out, want_out, atol=tol, rtol=tol)
    assert got_out.dtype == dtype and got_out.shape == x.shape


def test_leading_dims_and_empty_input():
    from kernels.fused_norm import rms_norm

    norm, x, _ = make(32, 6, torch.float32, seed=0)
    x3 = x.view(2, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x3, norm.weight, norm.eps), norm(x3))
        assert rms_norm(x[:0], norm.weight, norm.eps).shape == (0, 32)


def test_bad_inputs_are_named():
    from kernels.fused_norm import rms_norm

    norm, x, res = make(32, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, norm.weight[:16], norm.eps)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, norm.weight, norm.eps, res[:1])
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.t(), norm.weight[:2], norm.eps)
