"""GPTQ and AWQ unpacking (layers/quant_gptq.py) on hand-made words whose every code differs,
so a wrong shift, order or offset fails: GPTQ's codes go to consecutive input columns (lowest
bits first), v1 zero points are stored minus one (15 is zero 16), AWQ's nibbles go to
output rows in AWQ's order [0, 2, 4, 6, 1, 3, 5, 7], and act order's g_idx picks each column's
group."""
from __future__ import annotations

import pytest
import torch

from worker_service.layers.quant_gptq import (awq_unpack, dequantize_grouped, gptq_codes,
                                              gptq_zeros, unpack_codes)

WORD = 0x76543210          # nibble k holds k
WORD8 = 0x04FF0201         # bytes 1, 2, 255, 4 (lowest first)


def words(*values: int) -> torch.Tensor:
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values],
                        dtype=torch.int32)


def test_codes_lowest_bits_first_and_the_sign_bit():
    assert unpack_codes(words(WORD), 4).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unpack_codes(words(0xF0000000), 4).tolist() == [[0] * 7 + [15]]
    assert unpack_codes(words(WORD8), 8).tolist() == [[1, 2, 255, 4]]


def test_gptq_codes_run_down_the_input_columns():
    """qweight [C / 8, R]: word (i, r) holds columns 8i .. 8i + 7 of output row r."""
    qweight = torch.stack([words(WORD, 0x11111111), words(0x89ABCDEF, 0)])    # [2, 2]
    q = gptq_codes(qweight, 4)
    assert q.shape == (16, 2)
    assert q[:8, 0].tolist() == list(range(8)) and q[:8, 1].tolist() == [1] * 8
    assert q[8:, 0].tolist() == [15, 14, 13, 12, 11, 10, 9, 8] and q[8:, 1].tolist() == [0] * 8
    assert gptq_codes(words(WORD8).reshape(1, 1), 8).reshape(-1).tolist() == [1, 2, 255, 4]


def test_gptq_v1_zeros_are_stored_minus_one():
    """v1 (checkpoint_format gptq) stores z - 1: 7 is zero 8, 15 is zero 16 (the code is read,
    then one added: ExLlama, vLLM's gptq_gemm, AutoGPTQ's qlinear_cuda); gptq_v2 stores z."""
    stored = words(0xF0000007).reshape(1, 1)            # rows 0 .. 7: 7, 0, ..., 0, 15
    assert gptq_zeros(stored, 4, 1).tolist() == [[8, 1, 1, 1, 1, 1, 1, 16]]
    assert gptq_zeros(stored, 4, 0).tolist() == [[7, 0, 0, 0, 0, 0, 0, 15]]
    assert gptq_zeros(words(0xFF000080).reshape(1, 1), 8, 1).tolist() == [[129, 1, 1, 256]]


def test_awq_nibbles_in_awq_order():
    """Nibble k of word j is output row 8j + AWQ_ORDER[k]: 0x76543210 reads rows
    0, 4, 1, 5, 2, 6, 3, 7 (the value at row r is the nibble holding it)."""
    assert awq_unpack(words(WORD).reshape(1, 1)).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    two = awq_unpack(torch.stack([words(WORD, 0x10000000)]))
    assert two.tolist() == [[0, 4, 1, 5, 2, 6, 3, 7, 0, 0, 0, 0, 0, 0, 0, 1]]


def test_act_order_groups_pick_their_scales_and_zeros():
    """W[r, c] = scales[g_idx[c], r] * (q[c, r] - z[g_idx[c], r]), columns visiting groups out
    of order, against the formula written out element by element."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (12, 3), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (3, 3), generator=gen, dtype=torch.int32)
    scales = torch.rand(3, 3, generator=gen).to(torch.float16)
    g_idx = torch.tensor([2, 0, 1, 1, 2, 0, 0, 2, 1, 0, 2, 1])
    got = dequantize_grouped(q, z, scales, g_idx, "m")
    assert got.shape == (3, 12)
    for r in range(3):
        for c in range(12):
            g = int(g_idx[c])
            want = float(scales[g, r]) * (int(q[c, r]) - int(z[g, r]))
            assert float(got[r, c]) == want


def test_bad_pieces_are_refused_by_name():
    q = torch.zeros(4, 2, dtype=torch.int32)
    z, s = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"m\.qweight: group index 1 .* the scales hold groups "
                                         r"\[0, 1\)"):
        dequantize_grouped(q, z, s, torch.tensor([0, 1, 0, 0]), "m.qweight")
    with pytest.raises(ValueError, match=r"m\.qweight: zeros \(1, 0\), scales \(1, 2\)"):
        dequantize_grouped(q, z[:, :0], s, torch.zeros(4, dtype=torch.long), "m.qweight")
    with pytest.raises(ValueError, match="packed codes must be int32"):
        unpack_codes(torch.zeros(2, dtype=torch.int64), 4)


def test_groups_in_order_broadcast_as_the_formula():
    """Groups 0 x 4, 1 x 4, 2 x 4 take the broadcast path (no per-column gather): the same
    values as the formula written out element by element."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (12, 3), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (3, 3), generator=gen, dtype=torch.int32)
    scales = torch.rand(3, 3, generator=gen).to(torch.float16)
    got = dequantize_grouped(q, z, scales, torch.arange(12) // 4, "m")
    for r in range(3):
        for c in range(12):
            assert float(got[r, c]) == float(scales[c // 4, r]) * (int(q[c, r]) - int(z[c // 4, r]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("g_idx", [torch.arange(8) // 4, torch.tensor([1, 0, 0, 1, 0, 1, 1, 0])])
def test_one_non_finite_scale_is_refused_in_order_or_not(bad, g_idx):
    q = torch.ones(8, 4, dtype=torch.int32)
    z = torch.zeros(2, 4, dtype=torch.int32)
    scales = torch.ones(2, 4)
    scales[1, 2] = bad
    with pytest.raises(ValueError, match=r"^m\.qweight: scales give non-finite weights"):
        dequantize_grouped(q, z, scales, g_idx, "m.qweight")
