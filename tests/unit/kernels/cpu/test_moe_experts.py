"""kernels/cpu/csrc/moe_experts.cpp (through kernels/cpu/moe_experts.py) against the grouped torch
path of worker_service/layers/moe.py, once per body this machine runs: shapes that are not
multiples of the 32-column panels, experts with more rows than one register block (the k-chunked
panel walk), experts with none; exact in bfloat16 (the same roundings), float32 within
rounding. Whole blocks against transformers: tests/integration/test_moe_cpu_packed.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import extension, moe_experts
from worker_service.layers.moe import MoEExperts
from worker_service.parallel_state import single_rank_group

pytestmark = [pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]


def experts(num: int, hidden: int, inter: int, dtype: torch.dtype) -> MoEExperts:
    m = MoEExperts(num, hidden, inter, single_rank_group(), dtype)
    gen = torch.Generator().manual_seed(hidden + inter)
    with torch.no_grad():
        m.w13_weight.copy_(0.2 * torch.randn(m.w13_weight.shape, generator=gen))
        m.w2_weight.copy_(0.2 * torch.randn(m.w2_weight.shape, generator=gen))
    m.act_fn.use_cpu_kernels()
    assert m.use_cpu_kernels()
    return m


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0)])
@pytest.mark.parametrize("num, hidden, inter, tokens, top_k", [
    (6, 40, 20, 1, 2),        # one token: two experts of six, partial panels
    (4, 96, 48, 30, 2),       # 15 rows per expert on average: more than a register block
    (5, 33, 70, 3, 5),        # top-k = E
])
def test_equals_the_grouped_path(dtype, atol, num, hidden, inter, tokens, top_k):
    m = experts(num, hidden, inter, dtype)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen).to(dtype)
    with torch.no_grad():
        got = m(x, weights, ids)
        assert m.cpu_experts.calls == 1
        m.cpu_experts = None
        want = m(x, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def test_an_expert_id_out_of_range_is_refused():
    m = experts(4, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match=r"expert id 4 is out of range \[0, 4\)"):
        m(torch.randn(2, 32), torch.ones(2, 1), torch.tensor([[0], [4]]))


def test_no_tokens_gives_an_empty_output():
    m = experts(4, 32, 16, torch.float32)
    out = m(torch.randn(0, 32), torch.ones(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, 32) and m.cpu_experts.calls == 1


def test_other_dtypes_and_devices_are_not_packed():
    w13, w2 = torch.zeros(2, 8, 4, dtype=torch.float16), torch.zeros(2, 4, 4, dtype=torch.float16)
    assert moe_experts.prepare(w13, w2) is None
    assert moe_experts.prepare(w13.float().to("meta"), w2.float().to("meta")) is None


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_an_expert_with_many_rows_matches_float64(dtype, tol):
    """Expert 0 takes every token's first slot (64 or 128 rows: many register blocks of the
    panels' k-chunked walk, rows split evenly over them), the others share the second; k 150
    and 70 (not multiples of the 64-value chunk), N 140 and 150 (partial last panels): the
    float64 layer on the same (rounded) weights."""
    num = 4 if dtype == torch.float32 else 8
    tokens = moe_experts.MAX_MEAN_ROWS[dtype] * num // 2      # the most the kernel takes
    m = experts(num, 150, 70, dtype)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, 150, generator=gen).to(dtype)
    ids = torch.stack([torch.zeros(tokens, dtype=torch.long),
                       torch.randint(1, num, (tokens,), generator=gen)], 1)
    weights = torch.rand(tokens, 2, generator=gen).to(dtype)
    w13, w2 = m.w13_weight.double(), m.w2_weight.double()
    with torch.no_grad():
        got = m(x, weights, ids)
    assert m.cpu_experts.calls == 1
    want = torch.zeros(tokens, 150, dtype=torch.float64)
    for slot in range(2):
        gate, up = torch.einsum("th,tih->ti", x.double(), w13[ids[:, slot]]).chunk(2, -1)
        down = torch.einsum("ti,thi->th", F.silu(gate) * up, w2[ids[:, slot]])
        want += weights[:, slot, None].double() * down
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)
