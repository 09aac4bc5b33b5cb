"""Before a GPU session: every launch the engine makes of the Triton attention kernels, compiled
for sm_90 in a fresh process without TRITON_INTERPRET (no GPU needed; the interpreter checks no
resource), fits an H100/H200's shared memory (232,448 bytes a block: Triton refuses the launch
above it). The launches are the backend's own choices (triton_launch.prefill_tile_shape /
decode_tile_shape) for the head sizes we serve: ordinary heads (64/128/256; 8 query heads per kv
head, and 1 at 128: the tile is 64 rows either way) and DeepSeek's MLA latent (576, padded to 1024, over the stride-0 cache whose value
half is its key half; 4 query heads per kv head as the tiny models, 16 and 128 as V2/V3 across
TP sizes), each in bf16 and float32, varlen (prefill) and decode. The sm_89/86 limit (101,376)
is reported, not asserted.

Measured here (triton 3.9, 2026-11-29), before the wide-head tiles: the varlen kernel needed
655,360 bytes at head 576 in bf16 (64 rows of 1024-wide queries, 64 keys, K and V, two stages),
and decode with 128 query heads a kv head 393,216. The figures now: docs/gpu.md. Skipped where
CUDA is present: the CUDA tests launch the kernels there. Slow: 5 compiles (~3 minutes on 2
cores without Triton's cache); DS_FIT_ALL=1 compiles all 28 (~15 minutes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO

triton = pytest.importorskip("triton")

SM90_SHARED_BYTES = 232_448
SM89_SHARED_BYTES = 101_376
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: test_mla_kernel_fit.py's "
                       "launches run in the CUDA tests"),
    pytest.mark.skipif(not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                       reason="pip triton without a bundled ptxas cannot compile for sm_90")]

# (head_dim, query heads per kv head, the cache's value half is its key half)
ORDINARY = [(64, 8, False), (128, 1, False), (128, 8, False), (256, 8, False)]
MLA = [(576, group, True) for group in (4, 16, 128)]
ALL_LAUNCHES = [(kind, dt, *shape) for shape in ORDINARY + MLA for dt in ("bf16", "fp32")
                for kind in ("prefill", "decode")]
# The suite compiles the launches that bound the answer (~30 s each on 2 cores): MLA at 128 heads
# a kv head in both dtypes and kinds, and the largest ordinary one (head 256, fp32 prefill).
# DS_FIT_ALL=1 compiles all 28 (the ordinary heads' launch choices did not change with MLA's).
CI_LAUNCHES = ([l for l in ALL_LAUNCHES if l[2:4] == (576, 128)]
               + [("prefill", "fp32", 256, 8, False)])
LAUNCHES = ALL_LAUNCHES if os.environ.get("DS_FIT_ALL") == "1" else CI_LAUNCHES

# Each launch built as the backend builds it; prints {launch id: shared bytes}.
SCRIPT = """
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.attention.triton_decode_kernels import _decode_kernel
from kernels.attention.triton_prefill_kernel import _prefill_kernel
from kernels.attention.triton_launch import (TritonLaunchConfig, decode_tile_shape,
                                             prefill_tile_shape)

launch, out = TritonLaunchConfig(), {}
for kind, dt, head_dim, group, shared in json.loads(sys.argv[1]):
    size = {"bf16": 2, "fp32": 4}[dt]
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, PRECISION="ieee"
                  if dt == "fp32" else "tf32", UPCAST=False, SLIDING=False, SOFTCAP=False,
                  SINKS=False, KV_SHARED=shared, FP8=0)
    if kind == "decode":
        fn, s = _decode_kernel, decode_tile_shape(launch, group, head_dim, size)
        consts = dict(NUM_HEADS=group, PARTIALS=False, HEAD_FASTEST=False, ORDERED=False)
    else:
        fn, s = _prefill_kernel, prefill_tile_shape(launch, group, head_dim, size)
        consts = dict(BLOCK_Q=s.block_q, SKIP_DECODES=False)
    consts.update(common, BLOCK_G=s.block_g, BLOCK_D=s.block_d, BLOCK_N=s.tiles.block_n,
                  G_TILES=s.g_tiles)
    ptrs = {n: "*" + (dt if n in ("q_ptr", "out_ptr", "cache_ptr") else
                      "i64" if n == "order_ptr" else
                      "fp32" if n in ("m_ptr", "l_ptr", "acc_ptr", "sinks_ptr") else "i32")
            for n in fn.arg_names if n.endswith("_ptr")}
    sig = {n: "constexpr" if n in consts else ptrs.get(n) or
           ("fp32" if n in ("qk_scale", "softcap") else "i64" if n.startswith("stride_c")
            else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n.endswith("_ptr") or n.startswith("stride_c")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=s.tiles.num_warps, num_stages=s.tiles.num_stages))
    out["-".join(map(str, (kind, dt, head_dim, group)))] = k.metadata.shared
    print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def shared_bytes() -> dict[str, int]:
    """{launch id: shared memory in bytes} for every launch of LAUNCHES, in one process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(LAUNCHES)], env=env,
                            cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("launch", ["-".join(map(str, l[:4])) for l in LAUNCHES])
def test_launch_fits_sm90(shared_bytes, launch):
    used = shared_bytes[launch]
    sm89 = "fits" if used <= SM89_SHARED_BYTES else "over"
    print(f"{launch}: {used:,} bytes of shared memory ({sm89} sm_89/86's {SM89_SHARED_BYTES:,})")
    assert used <= SM90_SHARED_BYTES, f"{launch} needs {used:,} bytes; sm_90 allows " \
        f"{SM90_SHARED_BYTES:,}"
