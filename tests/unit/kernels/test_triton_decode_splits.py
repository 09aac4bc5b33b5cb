"""Eager decode over every split count: one compiled variant set, and the same answer.

The split heuristic (choose_num_splits) may pick any count up to max_splits as the batch moves;
without CUDA graphs each new count that Triton compiles anew is a compile in mid-run
(docs/gpu.md). The variants are counted by Triton's own cache key (its binder's specialization
and options, as JITFunction.run builds it for sm_90) in a compiled-mode process, no GPU needed:
the launches are recorded, not run. The answers are compared under the interpreter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.attention_cases import make_case, needs_kernels, triton_attn
from tests.support.paths import REPO

pytestmark = pytest.mark.slow          # a compiled-mode process; the interpreter runs 32 decodes

SPLIT_COUNTS = range(1, 33)            # 1 .. TritonLaunchConfig().max_splits
MAX_VARIANTS = 6

# Records each launch's Triton cache key instead of launching; prints {kernel: distinct keys}.
SCRIPT = """
import json, sys, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature
from kernels.attention import triton_paged_attention as pa

backend = make_backend(GPUTarget("cuda", 90, 32))
keys = {}

class Recorder:
    def __init__(self, name):
        self.name, fn = name, getattr(pa, name)
        self.binder = create_function_from_signature(fn.signature, fn.params, backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            keys.setdefault(self.name, set()).add(compute_cache_key({}, specialization, options))
        return launch

for name in ("_decode_kernel", "_reduce_kernel"):
    setattr(pa, name, Recorder(name))
num_reqs, heads, kv_heads, dim, block = 5, 8, 2, 128, 16
query = torch.zeros(num_reqs, heads, dim, dtype=torch.bfloat16)
out = torch.zeros_like(query)
kv_cache = torch.zeros(2, 64, block, kv_heads, dim, dtype=torch.bfloat16)
qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
seq_lens = torch.tensor([1, 17, 64, 130, 300], dtype=torch.int32)
table = torch.zeros(num_reqs, 32, dtype=torch.int32)
for splits in json.loads(sys.argv[1]):
    pa.paged_decode_attention(query, kv_cache, out, qsl, seq_lens, table, num_reqs, splits,
                              dim ** -0.5)
print(json.dumps({name: len(found) for name, found in keys.items()}))
"""


def test_split_counts_compile_a_handful_of_variants():
    """Split counts 1..32 at one model's shapes: at most MAX_VARIANTS kernels to compile (a
    constexpr split count made 32 decode and 31 reduce variants)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(list(SPLIT_COUNTS))],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    variants = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(variants) == {"_decode_kernel", "_reduce_kernel"}, variants
    assert sum(variants.values()) <= MAX_VARIANTS, variants


@needs_kernels
@pytest.mark.parametrize("window", [0, 40])
def test_every_split_count_matches_one_split(window):
    """Contexts from 1 key (most splits empty) to 300 (32 splits of 16 keys), a padded row,
    GQA 2, with and without a sliding window: every count gives split 1's output."""
    seq_lens = [1, 130, 300]
    query, _, _, kv_cache, meta = make_case(5, seq_lens, [1] * len(seq_lens), 2, 1, 32, 16,
                                            num_pad=1)
    outputs = {}
    for splits in SPLIT_COUNTS:
        out = torch.zeros_like(query)
        triton_attn.paged_decode_attention(
            query, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
            meta.num_reqs, splits, 32 ** -0.5, block_n=16, window=window)
        outputs[splits] = out[:meta.num_actual_tokens]
    assert outputs[1].abs().sum() > 0
    for splits, out in outputs.items():
        torch.testing.assert_close(out, outputs[1], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, s=splits: f"{s} splits: {m}")
