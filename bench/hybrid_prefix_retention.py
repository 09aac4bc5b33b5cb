"""Prefix-cache retention of a hybrid model's KV cache (engine_common/request/kv_groups.py):
the hit rate of repeated-prefix workloads through the scheduler alone (bench/fake_worker.py),
one pool against the full/window split of the same byte budget. No model, no device: what is
measured is which blocks the pools keep cached, not time.

    python -m bench.hybrid_prefix_retention [--budget 3000] [--chunks 512,2048]

Shapes: GPT-OSS-style (24 layers, 12 with window 128) and Gemma-3-1B-style (26 layers, 22 with
window 1024); blocks of 16, 16 sequences.
"""
from __future__ import annotations

import argparse
import random

from engine_common.configuration.config import SchedulerConfig
from engine_common.request.kv_groups import split_kv_blocks
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.wire.codec import encode_scheduler_output
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from bench.fake_worker import FakeWorker

SHAPES = {"gpt-oss W=128 (12/24 windowed)": (24, 12, 128),
          "gemma-3 W=1024 (22/26 windowed)": (26, 22, 1024)}
BLOCK, SEQS = 16, 16


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


def documents(num_docs: int, length: int) -> list[list[list[int]]]:
    """Each document asked twice, the second round after every other document (waves of 1)."""
    rng = random.Random(1)
    docs = [_ids(rng, length) for _ in range(num_docs)]
    return [[doc + [5 + r, 6 + d]] for r in range(2) for d, doc in enumerate(docs)]


def system_prompt(len_system: int, len_question: int, num: int) -> list[list[list[int]]]:
    """One shared system prompt, a fresh question each, one request at a time."""
    rng = random.Random(2)
    system = _ids(rng, len_system)
    return [[system + _ids(rng, len_question)] for _ in range(num)]


def hit_rate(shape: tuple[int, int, int], budget: int, split: bool, chunk: int,
             waves: list[list[list[int]]]) -> float:
    """Prefix-cache hit rate of the waves (each run to its end before the next arrives)."""
    layers, windowed, window = shape
    config = SchedulerConfig(block_size=BLOCK, max_num_seqs=SEQS, max_num_batched_tokens=chunk,
                             max_model_len=16384, enable_prefix_caching=True)
    full, group = (split_kv_blocks(budget, layers, windowed, window, BLOCK, SEQS, chunk)
                   if split else (budget, None))
    sched = Scheduler(config, full, rng=random.Random(0), window_group=group)
    worker, n = FakeWorker(BLOCK), 0
    for wave in waves:
        for prompt in wave:
            sched.add_request(Request(f"r{n}", prompt, SamplingParams(seed=1),
                                      StoppingParams(max_tokens=32, ignore_eos=True),
                                      eos_token_ids=(2,)))
            n += 1
        while sched.has_unfinished_requests():
            out = sched.schedule()
            sched.update_from_output(out, worker.execute(encode_scheduler_output(out)))
    return sched.kv.stats.hit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=3000, help="blocks of every layer")
    parser.add_argument("--chunks", default="512,2048", help="max_num_batched_tokens values")
    args = parser.parse_args()
    workloads = {"8 documents of 2048, twice": documents(8, 2048),
                 "16 documents of 2048, twice": documents(16, 2048),
                 "system 1536 + question 512, x24": system_prompt(1536, 512, 24),
                 "system 1536 + question 2048, x24": system_prompt(1536, 2048, 24)}
    print("hit rate: one pool / split (same bytes)")
    for name, shape in SHAPES.items():
        for label, waves in workloads.items():
            for chunk in map(int, args.chunks.split(",")):
                one = hit_rate(shape, args.budget, False, chunk, waves)
                two = hit_rate(shape, args.budget, True, chunk, waves)
                print(f"{name} | {label} | chunk {chunk}: {one:.3f} / {two:.3f}", flush=True)


if __name__ == "__main__":
    main()
