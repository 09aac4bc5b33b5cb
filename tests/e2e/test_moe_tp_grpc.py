"""A mixture-of-experts model served by real processes: `deltaserve worker --local-ranks 2` (two
gloo rank processes, each holding half of every expert and of Qwen2-MoE's shared expert) and
`deltaserve scheduler --verify-symmetry` over loopback gRPC, float32 on the CPU, for the tiny
Qwen3-MoE, Qwen2-MoE, GPT-OSS (its attention sinks split by head, its biased experts by width) and
DeepSeek-V3 (MLA's heads split, its latent cache the same on both ranks; grouped sigmoid routing).

  - greedy tokens equal transformers' generate() on the same weights, for prompts
    that prefill in one step and in chunks (--max-num-batched-tokens 32), sent together so the
    experts see mixed prefill/decode batches,
  - a second request sharing a 40-token prefix is served partly from the prefix cache
    (usage.cached_prompt_tokens > 0) and its tokens still equal transformers',
  - seeded sampling gives the in-process TP=1 engine's tokens,
  - with --verify-symmetry on, the ranks agree every step (a divergence would fail the requests).
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.wire.protos import GENERATION_SERVICE
from tests.support.grpc_harness import (Processes, collect, free_port, generation_stub,
                                        greedy_request, health_status, wait_for)
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy

MAX_NEW = 10
PREFIX_LEN = 40


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "gpt_oss",
                                        "deepseek_v3"])
def moe_tp2(request, tiny_models, tmp_path_factory):
    """(target, model_dir): a TP=2 worker and a scheduler serving one tiny MoE model."""
    model_dir = tiny_models(request.param)
    procs = Processes(tmp_path_factory.mktemp(f"tp2_{request.param}"))
    try:
        w_port, s_port = free_port(), free_port()
        worker = procs.worker(w_port, "--local-ranks", "2", "--dist-timeout", "60",
                              "--rank-step-timeout", "60")
        sched = procs.scheduler(model_dir, [w_port], s_port, "--dtype", "float32",
                                "--verify-symmetry", "--max-num-seqs", "8",
                                "--max-num-batched-tokens", "32",
                                "--max-model-len", "256", "--block-size", "4",
                                "--step-timeout", "60")
        target = f"127.0.0.1:{s_port}"
        wait_for(lambda: serving_or_fail(target, [worker, sched]), 120,
                 f"readiness of {target}", [worker, sched])
        yield target, model_dir
    finally:
        procs.close()


def serving_or_fail(target: str, procs) -> bool:
    """Readiness, failing at once (with the log) when a process has exited."""
    for p in procs:
        assert p.alive(), f"{p.name} exited:\n{p.log_tail()}"
    return health_status(target, GENERATION_SERVICE) == "SERVING"


def generate(target: str, prompt: list[int], request_id: str, seed: int | None = None):
    """(token ids, last message) of one request: greedy, or sampled at temperature 0.8 with
    `seed`."""
    req = greedy_request(prompt, MAX_NEW, request_id)
    if seed is not None:
        req.sampling.temperature, req.sampling.seed = 0.8, seed
    with grpc.insecure_channel(target) as ch:
        ids, _, msgs = collect(generation_stub(ch).Generate(req, timeout=120))
    return ids, msgs[-1]


def check_against_transformers(model_dir: str, prompts, outputs, label: str) -> None:
    near_ties, failures = [], []
    for i, (prompt, ids) in enumerate(zip(prompts, outputs)):
        failure = compare_greedy(f"{label}/prompt{i}(len {len(prompt)})", ids,
                                 hf_greedy(model_dir, tuple(prompt), MAX_NEW), near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)


@pytest.mark.slow
def test_tp2_greedy_matches_transformers(moe_tp2):
    """Prompts of 3..70 tokens at once: the long ones prefill in 32-token chunks next to the
    short ones' decodes."""
    target, model_dir = moe_tp2
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 45, 70, 1, 29)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ip: generate(target, ip[1], f"r{ip[0]}"),
                             enumerate(prompts)))
    assert all(len(ids) == MAX_NEW for ids, _ in outs)
    check_against_transformers(model_dir, prompts, [ids for ids, _ in outs], "tp2")


@pytest.mark.slow
def test_tp2_prefix_cache_hit_matches_transformers(moe_tp2):
    target, model_dir = moe_tp2
    rng = random.Random(4)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX_LEN)]
    first, second = prefix + [7, 8, 9], prefix + [11, 12, 13, 14, 15]
    ids1, last1 = generate(target, first, "p1")
    ids2, last2 = generate(target, second, "p2")
    assert last1.usage.cached_prompt_tokens == 0
    # whole blocks of the shared prefix (block size 4) come from the cache
    assert last2.usage.cached_prompt_tokens == PREFIX_LEN, last2.usage
    check_against_transformers(model_dir, [first, second], [ids1, ids2], "tp2-prefix")


@pytest.mark.slow
def test_tp2_seeded_sampling_matches_tp1(moe_tp2):
    target, model_dir = moe_tp2
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 38)]
    got = [generate(target, p, f"s{i}", seed=100 + i)[0] for i, p in enumerate(prompts)]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=128, block_size=4)
    want = [o.token_ids for o in llm.generate(
        prompts, [SamplingParams(temperature=0.8, seed=100 + i) for i in range(len(prompts))],
        StoppingParams(max_tokens=MAX_NEW, ignore_eos=True))]
    assert got == want
