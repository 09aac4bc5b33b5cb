"""The fused MoE experts (kernels/fused_moe.py; interpreter on CPU, compiled on GPU) against the
grouped torch path of layers/moe.py and against transformers' sparse blocks: 1, 3 and 37 tokens,
top-1/2/4, experts without tokens, every token on one expert; the path each module takes; and
that the fused forward's every tensor shape follows from the batch shape alone (what CUDA graph
capture needs), where the grouped path's does not; both kernels compile for sm_90 without a
GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.paths import REPO
from tests.support.triton_mode import DEVICE, needs_kernels, triton
from worker_service.layers.moe import MoEExperts
from worker_service.parallel_state import single_rank_group

pytestmark = needs_kernels

E, H, I = 8, 32, 48          # I: not a multiple of the kernels' 64-column tiles


def experts(dtype=torch.float32, fused_moe=None, seed=0) -> MoEExperts:
    torch.manual_seed(seed)
    m = MoEExperts(E, H, I, single_rank_group(), dtype, fused_moe=fused_moe)
    with torch.no_grad():
        m.w13_weight.normal_(0.0, 0.3)
        m.w2_weight.normal_(0.0, 0.3)
    return m.to(DEVICE)


def routing(num_tokens: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    x = torch.randn(num_tokens, H, generator=gen)
    return x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)


def run_both(x, weights, ids, dtype=torch.float32):
    from kernels.fused_moe import fused_experts

    m = experts(dtype, fused_moe=False)
    x, weights = x.to(dtype), weights.to(dtype)
    with torch.no_grad():
        want = m(x, weights, ids)
        got = fused_experts(x, m.w13_weight, m.w2_weight, weights, ids)
    assert got.shape == want.shape == x.shape and got.dtype == dtype
    return got, want


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_matches_the_grouped_path(num_tokens, top_k):
    """1 token leaves 8 - k experts idle; 37 tokens fill several blocks of some experts."""
    got, want = run_both(*routing(num_tokens, top_k, seed=num_tokens + top_k))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ids", [[[5]] * 37, [[7, 0]] * 37, [[2, 3, 4, 6]] * 3],
                         ids=["all-on-one", "first-and-last", "four-of-eight"])
def test_crowded_and_idle_experts(ids):
    ids = torch.tensor(ids, device=DEVICE)
    x, weights, _ = routing(ids.shape[0], ids.shape[1], seed=7)
    got, want = run_both(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_close_to_the_grouped_path():
    """bf16: both round gate, up, h and each slot's output to bf16; the sums' orders differ,
    and the interpreter truncates where a GPU rounds, so a few bf16 ulps apart."""
    got, want = run_both(*routing(37, 2, seed=3), dtype=torch.bfloat16)
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= 4 * 2 ** -7 * scale


def test_the_module_picks_its_path():
    cpu = MoEExperts(E, H, I, single_rank_group(), torch.float32)
    assert not cpu.fused                                   # CPU weights: the grouped path
    assert MoEExperts(E, H, I, single_rank_group(), torch.float32, fused_moe=True).fused
    if DEVICE == "cuda":
        assert cpu.to("cuda").fused                        # CUDA weights: the kernels
    forced = experts(fused_moe=True)
    x, weights, ids = routing(5, 2, seed=11)
    with torch.no_grad():
        torch.testing.assert_close(forced(x, weights, ids),
                                   experts(fused_moe=False)(x, weights, ids),
                                   rtol=1e-5, atol=1e-5)


# aten ops whose output size comes from the data, or that read a value back to the host
DATA_DEPENDENT = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "bincount",
                  "repeat_interleave", "masked_scatter")


class ShapeRecorder(TorchDispatchMode):
    """Every aten op run inside, with its output shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((str(func), tuple(tuple(o.shape) for o in outs
                                          if isinstance(o, torch.Tensor))))
        return out


def recorded(module: MoEExperts, ids: torch.Tensor) -> list[tuple[str, tuple]]:
    x, weights, _ = routing(ids.shape[0], ids.shape[1], seed=5)
    with torch.no_grad(), ShapeRecorder() as rec:
        module(x, weights, ids)
    return rec.ops


def test_fused_shapes_follow_the_batch_shape_only():
    """The same ops with the same shapes for a spread routing and an all-on-one-expert routing
    of 37 x 2 pairs, and no op that sizes its output from the data or syncs; the grouped path
    fails both checks (bincount, then one GEMM pair per expert that has tokens)."""
    spread = routing(37, 2, seed=1)[2]
    crowded = torch.tensor([[6, 1]] * 37, device=DEVICE)
    fused = experts(fused_moe=True)
    ops = recorded(fused, spread)
    assert ops == recorded(fused, crowded)
    assert not [name for name, _ in ops if any(bad in name for bad in DATA_DEPENDENT)]
    grouped = experts(fused_moe=False)
    plain = recorded(grouped, spread)
    assert any("bincount" in name for name, _ in plain)
    assert plain != recorded(grouped, crowded)


@pytest.mark.parametrize("arch,norm", [("qwen3_moe", True), ("qwen2_moe", False)])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_fused_block_matches_transformers(arch, norm, num_tokens):
    from tests.unit.worker_service.models.test_moe import H as HF_H, hf_block, our_block

    cfg, theirs = hf_block(arch, norm)
    ours = our_block(cfg, theirs, single_rank_group())
    ours.experts.fused_moe = True
    x = torch.randn(num_tokens, HF_H)
    with torch.no_grad():
        expected = theirs(x[None])[0]
        got = ours.to(DEVICE)(x.to(DEVICE)).cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


# Run in a fresh process without TRITON_INTERPRET: both kernels for sm_90 in every activation
# dtype and both block heights (the interpreter accepts what the compiler may reject: tl.dot's
# operand types, the early return); each must issue tensor-core MMAs (wgmma/mma).
COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import fused_moe as fm

def build(fn, ptrs, constexprs):
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))

index = dict(slots_ptr="*i32", block_expert_ptr="*i32", num_blocks_ptr="*i32")
for dt in ("fp32", "bf16", "fp16"):
    prec = "ieee" if dt == "fp32" else "tf32"
    for block_m in (fm.SMALL_BLOCK_M, fm.LARGE_BLOCK_M):
        tiles = dict(BLOCK_M=block_m, BLOCK_N=fm.BLOCK_N, BLOCK_K=fm.BLOCK_K, PRECISION=prec,
                     ON_GPU=True)
        for fn, ptrs in ((fm._gate_up_kernel, dict(x_ptr=dt, w_ptr=dt, h_ptr=dt)),
                         (fm._down_kernel, dict(h_ptr=dt, w_ptr=dt, out_ptr=dt,
                                                weights_ptr=dt))):
            k = build(fn, dict(index, **{n: "*" + t for n, t in ptrs.items()}), tiles)
            ptx = k.asm["ptx"]
            assert dt == "fp32" or "mma" in ptx, (fn.__name__, dt, block_m, "no MMA")
"""


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="pip triton without a bundled ptxas cannot compile for sm_90")
@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
