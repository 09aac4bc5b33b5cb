"""Kernel arguments that vary with the batch are not specialised: Triton compiles a kernel again
for an int that turns 1 or a multiple of 16, so such an argument mid-run costs a compile
(docs/gpu.md). The interpreter drops `do_not_specialize`, so a fresh process imports the kernels
compiled (no GPU needed) and reads each kernel's unspecialised parameters."""
from __future__ import annotations

import os
import subprocess
import sys
import json

import pytest

from tests.support.paths import REPO

pytest.importorskip("triton")

# kernel -> its arguments that change from step to step (all must be unspecialised)
STEP_VARYING = {
    "kernels.fused_rope:_rope_kernel": ["num_slots"],        # len(slot_mapping), or T
    "kernels.greedy_sample:_merge_kernel": ["n_parts"],      # chunks per row, from n_rows
    "kernels.attention.triton_prefill_kernel:_prefill_kernel": ["num_reqs", "stride_bt"],
    # the block table's row stride; the grid (kv heads x G tiles, requests, splits) is no
    # argument, and G_TILES / KV_SHARED are per-model constexprs
    # num_splits: the split heuristic's count moves with the batch (eager decode)
    "kernels.attention.triton_decode_kernels:_decode_kernel": ["stride_bt", "num_splits"],
    "kernels.attention.triton_decode_kernels:_reduce_kernel": ["num_splits"],
}

SCRIPT = """
import importlib, json, sys
out = {}
for name in json.loads(sys.argv[1]):
    module, kernel = name.split(":")
    fn = getattr(importlib.import_module(module), kernel)
    out[name] = [p.name for p in fn.params if p.do_not_specialize]
print(json.dumps(out))
"""


@pytest.mark.slow               # a compiled-mode process, like the sm_90 compile checks
def test_batch_varying_arguments_are_not_specialised():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(list(STEP_VARYING))],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    unspecialised = json.loads(result.stdout.strip().splitlines()[-1])
    for name, varying in STEP_VARYING.items():
        missing = sorted(set(varying) - set(unspecialised[name]))
        assert not missing, f"{name} specialises on {missing}, which vary with the batch"
