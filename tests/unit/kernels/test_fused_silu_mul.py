"""The fused Triton SiLU-and-mul against the model's torch path, silu(gate) * up (interpreter on
CPU, compiled on GPU), and its use by SiluAndMul(fused=True)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_mode import DEVICE, ON_GPU, needs_kernels

pytestmark = needs_kernels

# bf16/fp16: on a GPU the kernel rounds as torch does (libdevice expf, IEEE division), so at
# most a stray element differs, by one unit in the last place; the CPU interpreter truncates
# float32 -> bfloat16 (GPUs round to nearest even), up to 3 ulps over two casts.
ULPS = {torch.float32: 2.0 ** -20, torch.bfloat16: (1 if ON_GPU else 3) * 2.0 ** -7,
        torch.float16: (1 if ON_GPU else 3) * 2.0 ** -10}


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 2 * 3072), (3, 2 * 100), (2, 4, 2 * 64)])
def test_matches_torch(dtype, shape):
    from kernels.fused_silu_mul import silu_and_mul

    gen = torch.Generator().manual_seed(sum(shape))
    x = (4 * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)
    got, want = silu_and_mul(x), torch_silu_and_mul(x)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    scale = want.abs().clamp_min(2.0 ** -14).float()
    worst = ((got.float() - want.float()).abs() / scale).max().item()
    assert worst <= ULPS[dtype], f"relative error {worst} over {ULPS[dtype]}"
    if ON_GPU and dtype != torch.float32:
        assert (got != want).float().mean().item() <= 1e-3       # rounding as torch does


def test_reads_a_strided_row_view():
    """The MLP hands over gate_up rows as they come; a [:, :2I] view of wider rows works too."""
    from kernels.fused_silu_mul import silu_and_mul

    wide = torch.randn(4, 2 * 96 + 8).to(DEVICE)
    view = wide[:, : 2 * 96]
    torch.testing.assert_close(silu_and_mul(view), torch_silu_and_mul(view.contiguous()))


def test_refuses_an_odd_last_dim():
    from kernels.fused_silu_mul import silu_and_mul

    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))


def test_the_fused_module_takes_the_kernel():
    from worker_service.layers.activation import SiluAndMul

    x = torch.randn(3, 2 * 32).to(DEVICE)
    fused = SiluAndMul(fused=True)
    assert not fused.use_cpu_kernels()              # the Triton kernel, not kernels/cpu's
    torch.testing.assert_close(fused(x), SiluAndMul()(x))
