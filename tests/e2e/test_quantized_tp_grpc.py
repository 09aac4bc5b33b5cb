"""A Qwen3-MoE saved as Qwen3-*-FP8 ships it (e4m3 weights, per-block weight_scale_inv) served by
real processes: `deltaserve worker --local-ranks 2` (two gloo ranks, each dequantizing only the
blocks of its half of every expert and projection) and `deltaserve scheduler --verify-symmetry`
over loopback gRPC, float32 on the CPU. Greedy tokens, some prefilled in chunks next to
decodes, equal transformers' generate() on the dequantized twin; the ranks agree every step."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.test_moe_tp_grpc import check_against_transformers, generate, serving_or_fail
from tests.support.grpc_harness import Processes, free_port, wait_for
from tests.support.quant_models import make_quantized_pair


@pytest.mark.slow
def test_fp8_moe_tp2_greedy_matches_transformers_on_the_twin(tiny_models, tmp_path):
    quantized, twin = make_quantized_pair(tiny_models("qwen3_moe"), tmp_path / "q", "fp8")
    (tmp_path / "logs").mkdir()
    procs = Processes(tmp_path / "logs")
    try:
        w_port, s_port = free_port(), free_port()
        worker = procs.worker(w_port, "--local-ranks", "2", "--dist-timeout", "60",
                              "--rank-step-timeout", "60")
        sched = procs.scheduler(str(quantized), [w_port], s_port, "--dtype", "float32",
                                "--verify-symmetry", "--max-num-seqs", "8",
                                "--max-num-batched-tokens", "32", "--max-model-len", "256",
                                "--block-size", "4", "--step-timeout", "60")
        target = f"127.0.0.1:{s_port}"
        wait_for(lambda: serving_or_fail(target, [worker, sched]), 120,
                 f"readiness of {target}", [worker, sched])
        rng = random.Random(6)
        prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 45, 70, 12)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ip: generate(target, ip[1], f"q{ip[0]}")[0],
                                 enumerate(prompts)))
        check_against_transformers(str(twin), prompts, outs, "fp8-tp2")
    finally:
        procs.close()
