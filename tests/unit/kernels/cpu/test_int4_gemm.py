"""csrc/int4_gemm.cpp (kernels/cpu/int4_gemm.py): many-row linears read straight from torch's
packed int4 weight, on every body this machine runs, against x @ W^T on the same weight
dequantized by torch's formula and rounded to bfloat16 (what the dequantized load runs)."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import int4_gemm


def weight(n: int, k: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    sz = torch.stack([0.01 * (0.5 + torch.rand(k // group, n, generator=gen)),
                      0.05 * torch.randn(k // group, n, generator=gen)], dim=-1)
    return codes, sz.bfloat16()


def test_the_probe_reads_this_torchs_layout(cpu_isa):
    lay = int4_gemm.layout(cpu_isa)
    assert lay is not None
    codes, sz = weight(208, 96, 32, seed=3)          # 3 blocks of 64 and a tail of 16
    got = int4_gemm.extension.ops(cpu_isa).int4pack_dequantize(
        int4_gemm.pack(codes), sz, 32, 208, lay.block, lay.interleaved)
    assert torch.equal(got, int4_gemm.reference(codes, sz, 32))


# N: tails of 16 / 48 rows after full 64-row blocks, a single 16; K: chunks of 256 and a
# remainder (320 = 256 + 64, 384 = 256 + 128), one group of 256
@pytest.mark.parametrize("n,k,group", [(80, 320, 32), (112, 320, 64), (48, 384, 128),
                                       (16, 256, 256), (176, 512, 128)])
@pytest.mark.parametrize("m", [1, 5, 17, 64, 300])
def test_matches_the_dequantized_weight(cpu_isa, n, k, group, m):
    codes, sz = weight(n, k, group, seed=m)
    w = int4_gemm.reference(codes, sz, group).bfloat16().float()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    got = int4_gemm.linear(x, int4_gemm.pack(codes), sz, group, n, cpu_isa)
    want = x.float() @ w.t()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # against bfloat16-rounded weights (the bfloat16 body applies scale and zero in float32
    # per group, the portable body dequantizes in float32): the output's rounding plus the
    # weights'
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2 * float(want.abs().max()))


def test_zero_rows(cpu_isa):
    codes, sz = weight(64, 64, 32)
    got = int4_gemm.linear(torch.empty(0, 64, dtype=torch.bfloat16), int4_gemm.pack(codes), sz,
                           32, 64, cpu_isa)
    assert got.shape == (0, 64)


@pytest.mark.parametrize("change,field", [
    ({"group": 48}, "group=48"),
    ({"n": 40}, "n=40"),
    ({"block": 16}, "block=16"),
    ({"x": torch.zeros(2, 64)}, "x must be contiguous bfloat16"),
    ({"x": torch.zeros(2, 32, dtype=torch.bfloat16)}, "K=64"),
    ({"sz": torch.zeros(2, 64, 2)}, "scales_and_zeros must be"),
])
def test_bad_arguments_name_the_field(ops, change, field):
    codes, sz = weight(64, 64, 32)
    args = {"x": torch.zeros(2, 64, dtype=torch.bfloat16), "packed": int4_gemm.pack(codes),
            "sz": sz, "group": 32, "n": 64, "block": 64, "interleaved": True}
    args.update(change)
    with pytest.raises(RuntimeError, match=field):
        ops.int4pack_linear(args["x"], args["packed"], args["sz"], args["group"], args["n"],
                            args["block"], args["interleaved"])


def pack_like_torch(codes: torch.Tensor, interleave_rows=(64,), k_tile: int | None = None):
    """torch's AVX-512 int4 pack written out (blocks of 64 rows, a full block interleaved, a
    last block of fewer rows in pairs), with knobs for the ways another torch might differ:
    `interleave_rows` the block heights it interleaves, `k_tile` k tiles laid out across the
    blocks ([K / tile][blocks][tile][rows / 2] instead of [blocks][K][rows / 2])."""
    n, k = codes.shape
    blocks = []
    for b0 in range(0, n, 64):
        blk = codes[b0:b0 + 64].to(torch.uint8)
        rows = blk.shape[0]
        lo, hi = ((blk[:rows // 2], blk[rows // 2:]) if rows in interleave_rows
                  else (blk[0::2], blk[1::2]))
        blocks.append((lo | (hi << 4)).t().contiguous())              # [K, rows / 2]
    tile = k_tile or k
    return torch.cat([b[t:t + tile].reshape(-1) for t in range(0, k, tile)
                      for b in blocks]).view(n, k // 2)


@pytest.fixture
def fresh_probe():
    int4_gemm._probe.cache_clear()
    yield
    int4_gemm._probe.cache_clear()


@pytest.mark.parametrize("variant", [{"interleave_rows": (64, 48, 32)}, {"k_tile": 128}])
def test_the_probe_refuses_a_pack_that_differs_past_its_first_tail(monkeypatch, fresh_probe,
                                                                   variant):
    """A torch that interleaved tails of 32 / 48 rows, or tiled k across the blocks past 64
    values, packs an [80, 64] probe as this one does: the probe must see such a layout and
    refuse it (the kernel would misread every layer with that tail, or K)."""
    if not int4_gemm.extension.load():
        pytest.skip(f"deltaserve_cpu not built: {int4_gemm.extension.status()}")
    codes = torch.randint(0, 16, (240, 512), generator=torch.Generator().manual_seed(5))
    if not torch.equal(pack_like_torch(codes), int4_gemm.pack(codes)):
        pytest.skip("this torch does not pack as its AVX-512 build does")
    assert int4_gemm.layout() == (64, True)
    int4_gemm._probe.cache_clear()
    monkeypatch.setattr(int4_gemm, "pack", lambda c: pack_like_torch(c, **variant))
    assert int4_gemm.layout() is None


def test_one_thread_and_two_give_the_same_bits(cpu_isa):
    """Threads split the output panels, never a sum: the thread count changes no bit."""
    codes, sz = weight(208, 576, 64, seed=9)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(9)).bfloat16()
    packed, kept = int4_gemm.pack(codes), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int4_gemm.linear(x, packed, sz, 64, 208, cpu_isa)
        torch.set_num_threads(2)
        two = int4_gemm.linear(x, packed, sz, 64, 208, cpu_isa)
    finally:
        torch.set_num_threads(kept)
    assert torch.equal(one, two)
