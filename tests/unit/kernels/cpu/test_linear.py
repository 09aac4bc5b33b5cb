"""kernels/cpu/linear.py: the weight panels, MKL's packed float32 GEMM and its bf16 GEMM, and
oneDNN's blocked GEMM (kernels/cpu/onednn_gemm.py) against F.linear, the shapes that fall back,
which rows take which layout, and the layers' hook (worker_service/layers/cpu_gemm.py)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import extension, linear, onednn_gemm

pytestmark = [pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]


@pytest.fixture(params=["mkl", "onednn"])
def many_rows(request, monkeypatch):
    """The layout many-row calls take, forced through the switch (either runs on any x86)."""
    monkeypatch.setenv(onednn_gemm.ENV_SWITCH, "1" if request.param == "onednn" else "0")
    return request.param


@pytest.mark.parametrize("rows", [1, 4, 5, 13, 31, 48, 49, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_panels_and_packed_float32_match_f_linear(rows, bias, many_rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(100, 40, generator=gen)                # 100: a partial last panel
    b = torch.randn(100, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    lin = linear.prepare(w)
    assert lin is not None
    assert (lin.packed is not None, lin.onednn is not None) == (many_rows == "mkl",
                                                                many_rows == "onednn")
    torch.testing.assert_close(lin(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert lin.calls == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [40, 150, 700])
def test_panels_match_float64_at_every_row_block_split(k, dtype):
    """panel_linear itself at 1-26 rows (every split of the rows into register blocks: AVX2's
    6-row blocks over half panels, AVX-512's 12-row ones; 36 / 37 and 48 / 49 the next
    AVX-512 splits), a partial last panel (N 100), k
    within one chunk, over several with a partial last (150), and past an x slice (700, 200
    rows: 96-row slices); the float64 product of the same (rounded) inputs."""
    ops = extension.ops()
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(100, k, generator=gen).to(dtype)
    panels = ops.panel_pack(w)
    for rows in [*range(1, 27), 36, 37, 48, 49, 97, 200]:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        want = F.linear(x.double(), w.double())
        got = ops.panel_linear(x, panels, 100, None)
        assert got.dtype == dtype and got.shape == (rows, 100)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want, atol=tol * k ** 0.5, rtol=tol)


def past_the_panels(dtype: torch.dtype) -> int:
    """The fewest rows the many-row GEMM takes from the panels on this body and thread count
    (AVX2 bodies keep the panels to 256 rows against MKL)."""
    return linear.panel_max_rows(dtype, onednn_gemm.wanted(dtype)) + 1


@pytest.mark.parametrize("rows", [1, 4, 33, 64, 65, 130, None])     # None: past_the_panels
def test_bf16_matches_float32_math_rounded_once(rows, many_rows):
    if many_rows == "onednn" and not onednn_gemm.bf16_runs():
        many_rows = "mkl"             # no bf16 oneDNN GEMM on this CPU: forced, MKL's runs
    rows = rows or past_the_panels(torch.bfloat16)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 64, generator=gen).bfloat16()
    b = torch.randn(80, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    lin = linear.prepare(w)
    assert (lin.onednn is not None) == (many_rows == "onednn")
    got = lin(x, w, b)
    want = (F.linear(x.float(), w.float()) + b.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and lin.calls == 1
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=1e-2)
    assert (got == want).float().mean() > 0.95        # the same rounding almost everywhere
    if rows > linear.panel_max_rows(torch.bfloat16, lin.onednn is not None):
        many = (onednn_gemm.linear(x, lin.onednn, b) if lin.onednn is not None
                else extension.ops().mkl_bf16_linear(x, w, b))
        assert torch.equal(got, many)                 # the many-row GEMM ran


def test_more_threads_send_more_rows_to_the_panels(monkeypatch):
    """MKL's own threading splits few rows poorly, the panels split evenly: with 2+ threads
    float32 takes the panels up to 128 rows ahead of MKL on an AVX-512 build (and the greedy
    LM head up to 64); on an AVX2 body the panels keep up to 256 rows at any thread count."""
    monkeypatch.setenv(onednn_gemm.ENV_SWITCH, "0")
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(100, 40, generator=gen)
    x = torch.randn(100, 40, generator=gen)
    lin = linear.prepare(w)
    before = torch.get_num_threads()
    body = "avx2" if extension.avx2_body() else "wide"
    try:
        torch.set_num_threads(1)
        assert linear.panel_max_rows(torch.float32) == {"wide": 48, "avx2": 256}[body]
        torch.set_num_threads(2)
        assert linear.panel_max_rows(torch.float32) == {"wide": 128, "avx2": 256}[body]
        assert linear.panel_max_rows(torch.bfloat16) == {"wide": 128, "avx2": 256}[body]
        got = lin(x, w)
        panels = extension.ops().panel_linear(x.contiguous(), lin.panels, 100, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, panels)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_take_onednn_above_its_panel_limit(dtype, monkeypatch):
    """With oneDNN the panels stop sooner (AVX-512: 15 float32 rows on one thread, 48 on two;
    AVX2: 96): the row after the limit is oneDNN's own result, the limit itself the panels'."""
    monkeypatch.setenv(onednn_gemm.ENV_SWITCH, "1")
    if dtype == torch.bfloat16 and not onednn_gemm.bf16_runs():
        pytest.skip("torch's oneDNN linear takes no bfloat16 weight on this CPU (AVX2)")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(100, 64, generator=gen).to(dtype)
    lin = linear.prepare(w)
    ops = extension.ops()
    before = torch.get_num_threads()
    try:
        body = "avx2" if extension.avx2_body() else "wide"
        for threads, limit in ((1, linear.PANEL_MAX_ROWS[body, "onednn", False][dtype]),
                               (2, linear.PANEL_MAX_ROWS[body, "onednn", True][dtype])):
            torch.set_num_threads(threads)
            assert linear.panel_max_rows(dtype, onednn=True) == limit
            at, past = (torch.randn(m, 64, generator=gen).to(dtype) for m in (limit, limit + 1))
            assert torch.equal(lin(at, w), ops.panel_linear(at, lin.panels, 100, None))
            assert torch.equal(lin(past, w), onednn_gemm.linear(past, lin.onednn, None))
    finally:
        torch.set_num_threads(before)


def test_onednn_is_chosen_by_isa_and_switch(monkeypatch, cpu_isa):
    """auto: float32 on the native build of an AVX-512 or AVX2 CPU, bf16 only with bf16 dot
    products (never on an AVX2 body); the avx2 build emulated on a wider CPU only with oneDNN
    capped at AVX2 (uncapped it would run its AVX-512 kernels: test_onednn_gemm.py); 0 / 1
    override; anything else is refused by name."""
    monkeypatch.delenv(onednn_gemm.ENV_SWITCH, raising=False)
    flags = set(extension.cpu_flags().split())
    avx2 = extension.avx2_body()
    takes = (cpu_isa == "native" and ("avx512f" in flags or avx2)
             or cpu_isa == "avx2" and onednn_gemm.capped_at_avx2())
    assert onednn_gemm.wanted(torch.float32) == takes
    assert onednn_gemm.wanted(torch.bfloat16) == (takes and not avx2 and bool(
        flags & set(onednn_gemm.BF16_FLAGS)))
    assert not onednn_gemm.wanted(torch.float16)
    monkeypatch.setenv(onednn_gemm.ENV_SWITCH, "0")
    assert not onednn_gemm.wanted(torch.float32)
    monkeypatch.setenv(onednn_gemm.ENV_SWITCH, "1")      # forced: wherever oneDNN takes it
    assert onednn_gemm.wanted(torch.float32)
    assert onednn_gemm.wanted(torch.bfloat16) == onednn_gemm.bf16_runs()
    assert onednn_gemm.bf16_runs({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert onednn_gemm.bf16_runs({"avx2", "avx_ne_convert"})
    assert not onednn_gemm.bf16_runs({"avx2", "fma", "f16c", "avx512f"})
    monkeypatch.setenv(onednn_gemm.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match="DELTASERVE_CPU_ONEDNN='yes' must be auto, 0 or 1"):
        onednn_gemm.wanted(torch.float32)


def test_odd_inputs_run_the_kernels_without_the_dense_weight():
    """3-D rows flattened, another dtype cast to the weight's and back: the NaN stand-in the
    module keeps after prepare is never read."""
    w, b = torch.randn(16, 8), torch.randn(16)
    lin = linear.prepare(w)
    stand_in = torch.full((1, 1), float("nan")).expand(16, 8)
    for x in (torch.randn(2, 5, 8), torch.randn(6, 8).double(), torch.randn(8)):
        got = lin(x, stand_in, b.to(x.dtype))
        assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], 16)
        torch.testing.assert_close(got, F.linear(x, w.to(x.dtype), b.to(x.dtype)),
                                   atol=1e-5, rtol=1e-5)
    assert lin.calls == 3
    with pytest.raises(ValueError, match="last dim 7 must be the weight's in_features 8"):
        lin(torch.randn(2, 3, 7))


def test_only_cpu_float32_and_bf16_weights_are_prepared():
    assert linear.prepare(torch.randn(4, 4).half()) is None
    assert linear.prepare(torch.randn(4)) is None


def test_loaded_cpu_model_runs_its_linears_through_the_kernels(tiny_models):
    from worker_service.models.loader import load_model
    from worker_service.parallel_state import single_rank_group
    from kernels.attention.torch_ref import TorchAttentionBackend

    model = load_model(tiny_models("llama"), single_rank_group(), TorchAttentionBackend(),
                       "cpu", "float32")
    layer = model.model.layers[0]
    for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
              layer.mlp.down_proj, model.lm_head):
        assert m.cpu_linear is not None
    x = torch.randn(8, model.args.hidden_size)
    gate_up = torch.cat([_checkpoint_tensor(tiny_models("llama"), f"model.layers.0.mlp.{p}.weight")
                         for p in ("gate_proj", "up_proj")])
    torch.testing.assert_close(layer.mlp.gate_up_proj(x), F.linear(x, gate_up),
                               atol=1e-5, rtol=1e-5)
    assert layer.mlp.gate_up_proj.cpu_linear.calls == 1
    weight = layer.mlp.gate_up_proj.weight      # let go after prepare: a NaN stand-in
    assert weight.shape == gate_up.shape and weight.untyped_storage().nbytes() == 4
    assert weight.isnan().all()


def _checkpoint_tensor(model_dir, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [7, 60, 100, 300])     # 300: three row blocks on 1 thread
@pytest.mark.parametrize("with_logprobs", [True, False])
def test_wide_weights_are_tiled_and_fuse_the_greedy_argmax(threads, rows, with_logprobs):
    gen = torch.Generator().manual_seed(threads)
    n = linear.TILED_FROM_N + 100                      # a partial last tile
    w = torch.randn(n, 32, generator=gen)
    x = torch.randn(rows, 32, generator=gen)
    lin = linear.prepare(w)
    assert lin.fuses_greedy and len(lin.tiles) == -(-n // linear.TILE_N)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits = F.linear(x, w)
        torch.testing.assert_close(lin(x, w), logits, atol=1e-4, rtol=1e-5)
        x[3] = 0.0                                     # an all-equal row: the first index wins
        ids, logprobs = lin.greedy(x, with_logprobs)
    finally:
        torch.set_num_threads(before)
    logits = F.linear(x, w)
    assert ids.tolist() == logits.argmax(-1).tolist() and ids[3] == 0
    if not with_logprobs:                              # the argmax alone
        assert logprobs.numel() == 0
        return
    want = logits.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(logits, -1)
    torch.testing.assert_close(logprobs, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_logprobs", [True, False])
def test_tiled_greedy_finds_the_first_max_across_tiles(threads, with_logprobs):
    # One-hot rows of x pick one weight column each, so each row's logits are set exactly: the
    # max pass looks for the max's index only when a tile beats the row's max so far, so a later
    # tile that only ties it must keep the earlier index, and a later larger one must win.
    tile, n = 64, 64 * 7 + 37                             # a 37-wide last tile: a vector tail
    w = torch.randn(n, 8, generator=torch.Generator().manual_seed(5))
    w[10, 0] = w[3 * tile + 7, 0] = 50.0                  # a tie across tiles: 10
    w[2, 1], w[4 * tile + 3, 1] = 40.0, 50.0              # beaten in tile 4: 4 * 64 + 3
    w[tile + 5, 2] = w[tile + 60, 2] = 50.0               # a tie inside one tile: 69
    w[n - 1, 3] = 50.0                                    # the last column, in the tail
    w[:, 4] = -torch.arange(n, dtype=torch.float32) / 8   # descending: column 0
    x = torch.eye(8)[:5]
    ops = extension.ops()
    tiles = [ops.mkl_pack(w[i:i + tile].contiguous()) for i in range(0, n, tile)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ids, logprobs = ops.mkl_tiled_greedy(x, tiles, tile, n, with_logprobs)
    finally:
        torch.set_num_threads(before)
    assert ids.tolist() == [10, 4 * tile + 3, tile + 5, n - 1, 0]
    if not with_logprobs:
        assert logprobs.numel() == 0
        return
    logits = w.T[:5]
    want = logits.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(logits, -1)
    torch.testing.assert_close(logprobs, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_keeps_the_weight_the_embedding_reads(tiny_models, tied):
    """A head tied to the embedding shares its parameter: the embedding looks rows up in it,
    so it stays; an untied head's parameter goes as every other prepared linear's does."""
    from worker_service.models.loader import load_model
    from worker_service.parallel_state import single_rank_group
    from kernels.attention.torch_ref import TorchAttentionBackend

    path = tiny_models("llama", tie_word_embeddings=tied)
    model = load_model(path, single_rank_group(), TorchAttentionBackend(), "cpu", "float32")
    embed = _checkpoint_tensor(path, "model.embed_tokens.weight")
    assert model.lm_head_is_tied == tied and model.lm_head.cpu_linear is not None
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert model.lm_head.weight.isnan().all() != tied
    hidden = torch.randn(3, embed.shape[1])
    head = embed if tied else _checkpoint_tensor(path, "lm_head.weight")
    torch.testing.assert_close(model.lm_head(hidden), F.linear(hidden, head),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("onednn", ["0", "1"])
def test_the_parameter_goes_unless_the_kernels_read_it(monkeypatch, dtype, onednn):
    """Without oneDNN a bfloat16 weight's many-row calls run MKL's bf16 GEMM on the weight
    itself, so the module keeps it; every other layout leaves the parameter a NaN stand-in,
    and the layer's output is unchanged either way."""
    from worker_service.layers.linear import RowParallelLinear
    from worker_service.parallel_state import single_rank_group

    monkeypatch.setenv(onednn_gemm.ENV_SWITCH, onednn)
    layer = RowParallelLinear(64, 48, False, single_rank_group(), dtype)
    with torch.no_grad():
        layer.weight.normal_()
    w = layer.weight.detach().clone()
    assert layer.use_cpu_kernels()
    reads = dtype == torch.bfloat16 and (onednn == "0" or not onednn_gemm.bf16_runs())
    assert (layer.cpu_linear.weight is not None) == reads
    assert layer.release_dense_weight() != reads
    assert layer.weight.shape == w.shape and layer.weight.isnan().all() != reads
    packs = layer.cpu_linear
    assert layer.use_cpu_kernels()                  # a second prepare never packs the NaN
    assert (layer.cpu_linear is packs) != reads     # a kept weight is packed again
    for rows in (3, past_the_panels(dtype)):        # panels, then the pack / MKL bf16 GEMM
        x = torch.randn(rows, 64).to(dtype)
        torch.testing.assert_close(layer.matmul(x), F.linear(x.float(), w.float()).to(dtype),
                                   atol=1e-3, rtol=2e-2)
