"""The scheduler's per-step control work, driven alone: no model, no engine, no gRPC.

    python -m bench.scheduler_step                       (make bench-scheduler)

Each round builds a fresh Scheduler, queues --num-requests requests with prompts uniform in
[--min-prompt, --max-prompt] token ids, and runs schedule() -> fake worker -> update_from_output()
until every request is decoding (the prefill steps are not timed). Then it times --steps decode
steps: `schedule()` and `update_from_output()` separately, each with time.perf_counter_ns, and
the encoded SchedulerOutput diff of each step in bytes. With block size 16 a decoding request
takes a new KV block every 16 tokens, so about num_requests / 16 requests grow a block per step.
The fake worker (bench/fake_worker.py) is outside the timed calls.

Prints, per round, min / median / p90 over steps of each call (ms); then over rounds the min /
median / max of the per-round medians, and the diff sizes (mean / median / max bytes) of all
timed steps. --profile prints a cProfile of one extra round's timed steps instead of timing.
With --results-file the same lines are appended to that Markdown file (nothing is written
without it).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from engine_common.wire.codec import encode_scheduler_output
from engine_common.configuration.config import SchedulerConfig
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler

from bench.fake_worker import FakeWorker
from bench.report import append_block, git_commit

EOS_ID = 2
MAX_PREFILL_STEPS = 10_000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.scheduler_step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256, help="default: 256")
    p.add_argument("--min-prompt", type=int, default=100, help="default: 100 tokens")
    p.add_argument("--max-prompt", type=int, default=300, help="default: 300 tokens")
    p.add_argument("--block-size", type=int, default=16, help="default: 16")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="default: 2048")
    p.add_argument("--steps", type=int, default=1000, help="timed decode steps per round "
                                                           "(default: 1000)")
    p.add_argument("--rounds", type=int, default=5, help="default: 5")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule step t+1 before step t's output is processed")
    p.add_argument("--profile", action="store_true",
                   help="print a cProfile of one round's timed steps (no timing)")
    p.add_argument("--note", action="append", default=[],
                   help="a remark recorded with the result (repeatable)")
    p.add_argument("--results-file", default=None,
                   help="Markdown file the result block is appended to (default: none)")
    return p


@dataclass
class RoundResult:
    schedule_ms: list[float]
    update_ms: list[float]
    diff_bytes: list[int]
    num_growing: list[int]       # requests that took a new block, per timed step


def make_scheduler(args) -> tuple[Scheduler, FakeWorker]:
    max_tokens = args.steps + MAX_PREFILL_STEPS
    max_len = args.max_prompt + max_tokens
    num_blocks = args.num_requests * (-(-(args.max_prompt + args.steps + 64) // args.block_size))
    config = SchedulerConfig(max_num_seqs=args.num_requests,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=max_len, block_size=args.block_size,
                             enable_prefix_caching=not args.no_prefix_caching,
                             async_scheduling=args.async_scheduling)
    sched = Scheduler(config, num_blocks, rng=random.Random(args.seed))
    rng = random.Random(args.seed)
    for i in range(args.num_requests):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(args.min_prompt,
                                                                    args.max_prompt))]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0.8, seed=i),
                                  StoppingParams(max_tokens=max_tokens),
                                  eos_token_ids=(EOS_ID,)))
    return sched, FakeWorker(args.block_size)


def _steady(sched: Scheduler, out, args) -> bool:
    """Every request runs and this step scheduled exactly one token for each."""
    return (sched.num_running == args.num_requests and not out.new_requests
            and not out.num_scheduled_tokens)


class _Driver:
    """schedule -> encode -> worker -> update, one step in flight or two (async)."""

    def __init__(self, sched: Scheduler, worker: FakeWorker, async_scheduling: bool):
        self.sched, self.worker = sched, worker
        self.pending: list = []
        self.depth = 2 if async_scheduling else 1

    def step(self, timed: RoundResult | None):
        t0 = time.perf_counter_ns()
        out = self.sched.schedule()
        t1 = time.perf_counter_ns()
        payload = encode_scheduler_output(out)
        self.pending.append((out, self.worker.execute(payload)))
        if timed is not None:
            timed.schedule_ms.append((t1 - t0) / 1e6)
            timed.diff_bytes.append(len(payload))
            timed.num_growing.append(len(out.new_block_ids))
        if len(self.pending) >= self.depth:
            done, runner_out = self.pending.pop(0)
            t2 = time.perf_counter_ns()
            self.sched.update_from_output(done, runner_out)
            t3 = time.perf_counter_ns()
            if timed is not None:
                timed.update_ms.append((t3 - t2) / 1e6)
        return out


def run_round(args, profiler: cProfile.Profile | None = None) -> RoundResult:
    sched, worker = make_scheduler(args)
    driver = _Driver(sched, worker, args.async_scheduling)
    for _ in range(MAX_PREFILL_STEPS):
        if _steady(sched, driver.step(None), args):
            break
    else:
        raise RuntimeError("the requests never all reached decode")
    for _ in range(16):        # untimed: the first decode steps after prefill
        driver.step(None)
    result = RoundResult([], [], [], [])
    if profiler is not None:
        profiler.enable()
    for _ in range(args.steps):
        driver.step(result)
    if profiler is not None:
        profiler.disable()
    return result


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _stats(values: list[float]) -> str:
    return (f"min {min(values):.3f} / median {statistics.median(values):.3f} / "
            f"p90 {_quantile(values, 0.9):.3f} ms")


def _spread(values: list[float]) -> str:
    return (f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f} ms "
            f"(min / median / max over rounds)")


def format_lines(args, rounds: list[RoundResult]) -> list[str]:
    lines = [f"workload: {args.num_requests} decoding requests, prompts uniform in "
             f"[{args.min_prompt}, {args.max_prompt}] tokens, block size {args.block_size}, "
             f"max_num_batched_tokens {args.max_num_batched_tokens}, prefix caching "
             f"{'off' if args.no_prefix_caching else 'on'}, "
             f"{'async' if args.async_scheduling else 'sync'} scheduling; {args.steps} timed "
             f"steps x {len(rounds)} rounds; Python {sys.version.split()[0]}, one thread"]
    for i, r in enumerate(rounds):
        lines.append(f"round {i + 1}: schedule() {_stats(r.schedule_ms)}; "
                     f"update_from_output() {_stats(r.update_ms)}")
    sched_med = [statistics.median(r.schedule_ms) for r in rounds]
    upd_med = [statistics.median(r.update_ms) for r in rounds]
    both = [s + u for s, u in zip(sched_med, upd_med)]
    lines += [f"schedule() median: {_spread(sched_med)}",
              f"update_from_output() median: {_spread(upd_med)}",
              f"schedule() + update_from_output() median: {_spread(both)}"]
    sizes = [b for r in rounds for b in r.diff_bytes]
    growing = [g for r in rounds for g in r.num_growing]
    lines.append(f"encoded diff: mean {statistics.fmean(sizes):.1f} / median "
                 f"{statistics.median(sizes):g} / max {max(sizes)} bytes per step; requests "
                 f"growing a block per step: mean {statistics.fmean(growing):.1f}, max "
                 f"{max(growing)}")
    lines += [f"note: {n}" for n in args.note]
    return lines


def profile(args) -> str:
    prof = cProfile.Profile()
    run_round(args, prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.profile:
        print(profile(args))
        return 0
    rounds = [run_round(args) for _ in range(args.rounds)]
    lines = format_lines(args, rounds)
    print("\n".join(lines))
    if args.results_file:
        now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m bench.scheduler_step " + shlex.join(sys.argv[1:] if argv is None
                                                                  else argv)
        head = [f"## {now} · scheduler step · {args.num_requests} requests", "",
                f"- commit: `{git_commit()}`", f"- command: `{command}`"]
        append_block(args.results_file, "\n".join(head + [f"- {x}" for x in lines]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
