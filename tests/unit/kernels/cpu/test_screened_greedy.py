"""csrc/screened_greedy.cpp: the LM head's argmax screened with 16-bit integer estimates and
decided in float32. Every answer is checked against float64 logits (where the top two are
further apart than float32 can blur) or against exact ties built into the weight."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import extension, linear

pytestmark = pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")


def screen(ops, x, w):
    return ops.screen_greedy(x.contiguous(), w, *ops.screen_pack(w))


def clear_argmax(x: torch.Tensor, w: torch.Tensor):
    """float64 argmax per row, and the rows whose top two differ by more than twice float32's
    worst rounding of a K-term dot product (K 2^-24 |x| |w|): there float32 cannot reorder them."""
    logits = x.double() @ w.double().T
    top2 = logits.topk(2, dim=1).values
    bound = 2 * x.shape[1] * 2.0 ** -24 * x.double().norm(dim=1) * w.double().norm(dim=1).max()
    return logits.argmax(1), (top2[:, 0] - top2[:, 1]) > bound


@pytest.fixture
def screening(ops):
    if not ops.screen_available():
        pytest.skip("this build keeps the float32 path (only the AVX2 body screens)")
    return ops


def test_only_the_avx2_body_screens(cpu_isa, ops):
    """AVX-512's float32 FMAs keep pace with its 16-bit multiply-adds, and the generic build
    has no vector body: both keep MKL's path, and prepare() builds no 16-bit copy there."""
    assert ops.screen_available() == (cpu_isa == "avx2" or ops.body() == "avx2")
    assert linear.screens_heads() == ops.screen_available()     # told without the library
    lin = linear.prepare(torch.randn(linear.TILED_FROM_N, 8))
    assert (lin.screen is not None) == ops.screen_available()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64, 257])
@pytest.mark.parametrize("k", [8, 63, 256])             # 63: an odd K (one zero pad value)
def test_matches_the_float64_argmax_wherever_float32_cannot_blur_it(screening, rows, k):
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    n = 3000 + 5                                        # a partial last block of columns
    w = torch.randn(n, k, generator=gen) * 0.1
    x = torch.randn(rows, k, generator=gen)
    want, clear = clear_argmax(x, w)
    got = screen(screening, x, w)
    assert clear.sum() >= rows - 1
    assert got[clear].tolist() == want[clear].tolist()
    assert (got >= 0).all()


def test_near_ties_below_the_integer_bound_are_decided_in_float32(screening):
    """Columns 0.1% apart are far inside the 16-bit estimate's error, and far outside float32's:
    the screen must keep them all and the float32 pass pick the larger, wherever it sits."""
    gen = torch.Generator().manual_seed(3)
    k, n = 128, 4096
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(8, k, generator=gen)
    base = x[0] / x[0].norm()
    for j, col in enumerate((5, 700, 2049, 4095)):       # rising: the last one wins
        w[col] = base * (3.0 + 1e-3 * j)
    got = screen(screening, x, w)
    assert got[0] == 4095
    want, clear = clear_argmax(x, w)
    assert got[clear].tolist() == want[clear].tolist()


def test_exact_ties_keep_the_first_column_across_blocks_and_threads(screening):
    gen = torch.Generator().manual_seed(4)
    k, n = 64, 5000
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(4, k, generator=gen)
    for col in (4000, 17, 2500):                          # the same row three times: 17 wins
        w[col] = x[1] / x[1].norm() * 4
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert screen(screening, x, w)[1] == 17
    finally:
        torch.set_num_threads(before)


def test_padding_columns_never_win_when_every_logit_is_negative(screening):
    """The last block's padding columns estimate 0, above every real logit here: they must
    not raise the bound nor be chosen."""
    k, n = 16, 16 * 40 + 3
    w = -torch.rand(n, k, generator=torch.Generator().manual_seed(5)) - 0.5
    x = torch.rand(6, k, generator=torch.Generator().manual_seed(6)) + 0.5
    want, clear = clear_argmax(x, w)
    got = screen(screening, x, w)
    assert (got < n).all() and got[clear].tolist() == want[clear].tolist()


def test_an_outlier_dimension_in_the_hidden_state_stays_exact(screening):
    """Real LM heads see hidden states with a few huge dimensions, which coarsen the 16-bit
    scale for the rest: the bound grows, more columns survive, the answer stays exact."""
    gen = torch.Generator().manual_seed(7)
    k, n = 256, 8192
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(16, k, generator=gen)
    x[:, 7] = 2000.0
    x[:8, 100] = -3000.0
    want, clear = clear_argmax(x, w)
    got = screen(screening, x, w)
    assert got[clear].tolist() == want[clear].tolist() and (got >= 0).all()


def test_rows_it_cannot_screen_come_back_for_the_float32_path(screening):
    """NaN, inf and all-zero rows, and a row where more columns tie than the screen keeps,
    are -1; CpuLinear.greedy then answers them through the float32 tiles like any row."""
    gen = torch.Generator().manual_seed(8)
    k, n = 32, linear.TILED_FROM_N + 40
    w = torch.randn(n, k, generator=gen) * 0.1
    w[:6000] = w[0]                                      # 6,000 identical columns
    x = torch.randn(6, k, generator=gen)
    x[0, 3], x[1, 5], x[2] = float("nan"), float("inf"), 0.0
    x[3] = w[0] / w[0].norm() * 10                        # the 6,000 tie for the top
    before = torch.get_num_threads()
    torch.set_num_threads(1)                              # the 4,096 kept are per thread
    try:
        got = screen(screening, x, w)
    finally:
        torch.set_num_threads(before)
    assert got[:4].tolist() == [-1, -1, -1, -1]

    lin = linear.prepare(w)
    ids, logprobs = lin.greedy(x, False)
    full, _ = extension.ops().mkl_tiled_greedy(x, lin.tiles, linear.TILE_N, n, False)
    assert logprobs.numel() == 0 and ids.tolist() == full.tolist()
    assert ids[2] == 0 and ids[3] == 0                    # all equal: the first column


def test_a_row_gets_the_same_token_alone_and_in_any_batch(screening):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(linear.TILED_FROM_N, 96, generator=gen) * 0.1
    x = torch.randn(300, 96, generator=gen)
    packed = screening.screen_pack(w)
    batch = screening.screen_greedy(x, w, *packed)
    for r in (0, 5, 299):
        for lo in (0, r):
            assert screening.screen_greedy(x[lo:r + 1].contiguous(), w, *packed)[-1] == batch[r]


def test_integer_sums_at_the_largest_values_do_not_wrap(screening):
    """Every value at its quantised maximum: the int32 sums reach K * 2047 * Qw, which the
    pack's choice of Qw keeps below 2^31."""
    k = 4097
    w = torch.ones(64, k)
    w[10] *= 1.5
    x = torch.ones(2, k)
    x[1] *= -1
    assert screen(screening, x, w).tolist() == [10, 0]    # negative: every other row ties


def test_the_engines_head_takes_the_screen_only_without_logprobs(screening):
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(linear.TILED_FROM_N + 7, 64, generator=gen) * 0.1
    x = torch.randn(80, 64, generator=gen)
    lin = linear.prepare(w)
    ids, lps = lin.greedy(x, True)                        # logprobs: the fused float32 pass
    want = F.log_softmax(F.linear(x, w), -1)
    assert lps.numel() == 80
    torch.testing.assert_close(lps, want.gather(1, ids[:, None]).squeeze(1), atol=1e-4,
                               rtol=1e-5)
    fast, none = lin.greedy(x, False)
    assert none.numel() == 0 and fast.tolist() == ids.tolist()


def test_subnormal_logits_that_tie_in_float32_keep_the_first_column(screening):
    """Products below float32's normal range round to multiples of 2^-149, far past the relative
    gamma_K bound: 0.75 and 0.9375 (x 2^-149) both become 2^-149, a tie the first column wins,
    though the exact values are 25% apart. The bound carries an absolute underflow term."""
    x = torch.tensor([[3 * 2.0 ** -76]])
    w = torch.tensor([[2.0 ** -75], [1.25 * 2.0 ** -75]])
    logits = x[0, 0] * w[:, 0]
    assert logits[0] == logits[1] == 2.0 ** -149
    assert screen(screening, x, w).tolist() == [0]


def test_estimates_past_float32_range_in_units_of_the_scale_come_back(screening):
    """Logits of 1.7e29 pass the 1e30 guard, but a tiny x makes its 16-bit scale sx tiny too and
    the estimates, in units of sx, overflow: column 0's became inf, a best that column 1 (the
    larger logit, its estimate 0.5 step low) could not reach. Such a row is the float32 path's."""
    big = 3.4028234663852886e38 / 4094 * 1.00001             # 4094 big: just past float32
    w = torch.zeros(linear.TILED_FROM_N, 2)
    w[0] = big
    w[1] = torch.tensor([1.0, 1 - 0.51 / 2047]) * big * 1.00018
    x = torch.full((1, 2), 1e-6)
    assert (x.double() @ w[:2].double().T).argmax().item() == 1
    assert screen(screening, x, w[:2]).item() in (-1, 1)
    assert linear.prepare(w).greedy(x, False)[0].tolist() == [1]


def test_a_weight_the_screen_cannot_bound_keeps_the_float32_path(screening):
    """screen_pack refuses a non-finite weight; prepare() must still give a working head."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(linear.TILED_FROM_N, 16, generator=gen)
    w[5, 3] = float("inf")
    x = torch.randn(3, 16, generator=gen)
    lin = linear.prepare(w)
    assert lin.screen is None
    full, _ = screening.mkl_tiled_greedy(x, lin.tiles, linear.TILE_N, w.shape[0], False)
    assert lin.greedy(x, False)[0].tolist() == full.tolist()


def _float_dot(x, w) -> float:
    """csrc's float_dot on the AVX2 build, exactly: 8 lanes of FMAs (each rounded once, from the
    exact product-sum), then the lanes' sum ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))."""
    def fma(a, b, c):
        exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
        near = np.float32(float(exact))
        around = (np.nextafter(near, np.float32(-np.inf)), near,
                  np.nextafter(near, np.float32(np.inf)))        # float64's double rounding
        return min(around, key=lambda v: (abs(Fraction(float(v)) - exact),
                                          int(np.array(v).view(np.int32)) & 1))
    lanes = [np.float32(0)] * 8
    for i, (a, b) in enumerate(zip(x.tolist(), w.tolist())):
        lanes[i % 8] = fma(np.float32(a), np.float32(b), lanes[i % 8])
    s = [lanes[j] + lanes[j + 4] for j in range(4)]
    return float((s[0] + s[2]) + (s[1] + s[3]))


@pytest.mark.parametrize("k", [13, 64])
def test_float32_ties_between_near_copies_go_to_the_first_column(screening, k):
    """Twelve copies of one row, a few nudged by an ulp, spread over blocks and two threads:
    their float32 logits tie or differ by an ulp (float64 often orders them otherwise), and
    the screen must return exactly the first largest of float_dot's values."""
    gen = torch.Generator().manual_seed(k)
    n, rows = 3000, 3
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen)
    x[:, 0] *= 50
    copies = torch.randperm(n, generator=gen)[:12].tolist()
    for j, col in enumerate(copies):
        w[col] = x[0] / x[0].norm() * 2
        if j % 3:                                         # every third copy stays exact
            away = np.float32((-1) ** j * np.inf)
            w[col, j % k] = float(np.nextafter(np.float32(w[col, j % k]), away))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = screen(screening, x, w)
    finally:
        torch.set_num_threads(before)
    logits = x.double() @ w.double().T
    for r in range(rows):
        near = (logits[r] >= logits[r].max() - 1e-3 * logits[r].abs().max()).nonzero()
        value = {c: _float_dot(x[r], w[c]) for c in near.flatten().tolist()}
        assert got[r].item() == min(value, key=lambda c: (-value[c], c))


def test_flush_to_zero_set_after_the_pack_changes_nothing(screening):
    """torch.set_flush_denormal(True) after prepare: column 1's 16-bit scale (1e-35 / 2047) is
    subnormal, which denormals-are-zero read as 0, an estimate of 0 below column 0's lower
    bound though column 1's logit (1e-35, normal) is twice column 0's. The kernel runs IEEE."""
    x = torch.tensor([[1.0, 0.0]])
    w = torch.tensor([[5e-36, 1e-34], [1e-35, 0.0]])
    packed = screening.screen_pack(w)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = screening.screen_greedy(x, w, *packed)
        assert (x @ w.T).argmax(1).tolist() == [1]
    finally:
        torch.set_flush_denormal(False)
    assert got.tolist() == [1]


def test_a_pack_of_another_shape_is_refused(screening):
    """A pack with more blocks than the weight (here a longer head's) once passed the check, and
    its extra columns, never chosen, could still raise the best lower bound over the argmax."""
    w = torch.randn(40, 8, generator=torch.Generator().manual_seed(12))
    longer = torch.cat([w, 100 * w[:1].expand(40, 8)])
    with pytest.raises(RuntimeError, match="does not match"):
        screening.screen_greedy(w[:2].contiguous(), w, *screening.screen_pack(longer))


def test_only_the_lm_head_keeps_a_screen(screening):
    """The screen serves greedy() alone, which only a one-rank LM head is asked: a wide
    float32 projection (an MLP's up / gate_up) takes no 16-bit copy, so its parameter is let
    go like any other linear's; the head keeps the screen and the weight it reads."""
    from torch import nn

    from worker_service.layers import cpu_kernels
    from worker_service.layers.embedding import ParallelLMHead
    from worker_service.layers.linear import ColumnParallelLinear
    from worker_service.parallel_state import single_rank_group

    tp, n, gen = single_rank_group(), linear.TILED_FROM_N, torch.Generator().manual_seed(12)
    model = nn.Module()
    model.up = ColumnParallelLinear(16, n, False, tp, torch.float32)
    model.head = ParallelLMHead(n, 16, tp, torch.float32)
    weights = [torch.randn(n, 16, generator=gen) for _ in range(2)]
    for module, w in zip((model.up, model.head), weights):
        module.weight.data.copy_(w)
    cpu_kernels.use_cpu_kernels(model)
    assert model.up.cpu_linear.screen is None and model.up.dense_released
    assert model.up.weight.untyped_storage().nbytes() == 4
    assert model.head.cpu_linear.screen is not None and not model.head.dense_released
    x = torch.randn(5, 16, generator=gen)
    torch.testing.assert_close(model.up(x), F.linear(x, weights[0]), atol=1e-4, rtol=1e-5)
    assert model.head.greedy(x, False)[0].tolist() == F.linear(x, weights[1]).argmax(-1).tolist()


@pytest.mark.parametrize("tied", [True, False])
def test_the_estimate_counts_the_screened_heads_copies(screening, tiny_models, tied):
    """The memory check runs before the library loads: it tells the AVX2 body from the CPU's
    flags (linear.screens_heads) and counts the screen (half a copy of the head) and an untied
    head's parameter, which the screen reads and so stays."""
    from engine_common.model_files.model_dir import ModelInfo
    from kernels.attention.torch_ref import TorchAttentionBackend
    from tests.unit.worker_service.runner.test_cpu_linear_memory import _held_beyond_one_copy
    from worker_service.models.loader import load_model
    from worker_service.parallel_state import single_rank_group
    from worker_service.runner.memory_fit import estimate_cpu_linear_bytes

    assert linear.screens_heads()
    path = tiny_models("llama", vocab_size=linear.TILED_FROM_N, tie_word_embeddings=tied)
    model = load_model(path, single_rank_group(), TorchAttentionBackend(), "cpu", "float32")
    assert model.lm_head.cpu_linear.screen is not None
    real = _held_beyond_one_copy(model)
    estimate = estimate_cpu_linear_bytes(ModelInfo.from_dir(path).hf_config, torch.float32)
    assert 0.9 * real <= estimate <= real, (estimate, real)


def test_the_avx2_engine_with_a_wide_mlp_equals_transformers(screening, tiny_models):
    """The whole engine on the AVX2 body, float32: the 8,192-wide gate_up runs released
    (panels and tiles, no screen), the 8,192-token head screened; greedy == transformers."""
    from deltaserve.llm import LLM
    from tests.support.engine_checks import _check, _prompts

    path = tiny_models("llama", vocab_size=linear.TILED_FROM_N, intermediate_size=4096)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    model = llm.runner.model
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert gate_up.dense_released and gate_up.cpu_linear.screen is None
    assert model.lm_head.cpu_linear.screen is not None
    _check(llm, path, _prompts(500)[:4], "llama-avx2-wide")
    assert gate_up.cpu_linear.calls > 0
