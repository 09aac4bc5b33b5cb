"""Time to first token of a short request sent while a long prompt prefills (issue 23 item 3).

    python -m bench.long_prefill --rounds 2 --results-file bench/results.md

The in-process engine (deltaserve.llm.LLM) on the `long-prefill` preset (6 layers, random
weights). Each round measures, in this order:
  * a 16-token request alone: its time to first token (TTFT);
  * with the long-prefill policy (the defaults): a 30,000-token prompt, then the 16-token request
    added once `--delay` seconds have passed (between steps, as a request arriving during a step
    waits for it): both TTFTs;
  * the same without the policy: long_prefill_token_threshold = max_num_batched_tokens (a long
    prefill takes the whole step, as before issue 23); odd rounds run it before the policy's.
Every prompt is fresh random ids and the prefix cache is emptied before each run. The bar
(issue 23): short TTFT behind the long prompt <= 3x alone + 2 s; the long prompt's own TTFT with
the policy <= 1.25x without. Each request asks for one token.
"""
from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import time

from bench.report import add_report_flags, append_block, git_commit

SHORT = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.long_prefill",
                                description=__doc__.splitlines()[0])
    p.add_argument("--long-tokens", type=int, default=30_000, help="default: 30000")
    p.add_argument("--delay", type=float, default=1.0,
                   help="seconds after the long prompt the short one is sent (default: 1)")
    p.add_argument("--rounds", type=int, default=2, help="default: 2")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="default: 2048")
    add_report_flags(p)
    p.set_defaults(results_file=None)
    return p


def make_llm(model: str, budget: int, policy: bool):
    from deltaserve.llm import LLM

    extra = {} if policy else {"long_prefill_token_threshold": budget}
    return LLM(model, dtype="float32", max_model_len=32_768, max_num_batched_tokens=budget,
               **extra)


def ttfts(llm, prompts: dict[str, list[int]], delays: dict[str, float]) -> dict[str, float]:
    """Add each prompt once its delay has passed (checked between steps), step until every
    one has its first token; seconds from its arrival to its first token, by name."""
    from engine_common.request.params import SamplingParams, StoppingParams
    from scheduler_service.core.request import Request

    llm.reset_prefix_cache()
    engine, eos = llm.engine, llm.model_info.eos_token_ids
    start, sent, first = time.perf_counter(), {}, {}
    while len(first) < len(prompts):
        now = time.perf_counter()
        for name, ids in prompts.items():
            if name not in sent and now - start >= delays[name]:
                sent[name] = now
                engine.add_request(Request(f"{name}-{now}", ids, SamplingParams(temperature=0),
                                           StoppingParams(max_tokens=1, ignore_eos=True), eos))
        if not engine.has_unfinished_requests():
            time.sleep(0.001)       # the short one is not due yet and nothing else runs
            continue
        for out in engine.step():
            name = out.request_id.split("-")[0]
            if out.new_token_ids and name not in first:
                first[name] = time.perf_counter() - sent[name]
    while engine.has_unfinished_requests():
        engine.step()
    return first


def run_round(llms: dict, long_tokens: int, delay: float, rng: random.Random,
              order: tuple[bool, bool]) -> dict:
    def ids(n):
        return [rng.randrange(3, 500) for _ in range(n)]

    result = {"alone": ttfts(llms[True], {"short": ids(SHORT)}, {"short": 0.0})["short"]}
    for policy in order:
        got = ttfts(llms[policy], {"long": ids(long_tokens), "short": ids(SHORT)},
                    {"long": 0.0, "short": delay})
        tag = "on" if policy else "off"
        result[f"short_{tag}"], result[f"long_{tag}"] = got["short"], got["long"]
        print(f"  policy {tag}: short TTFT {got['short']:.2f} s, long TTFT {got['long']:.2f} s",
              flush=True)
    print(f"  alone: short TTFT {result['alone']:.3f} s", flush=True)
    return result


def report(rounds: list[dict], args, model: str) -> str:
    def med(key):
        return statistics.median(r[key] for r in rounds)

    alone, short_on, short_off = med("alone"), med("short_on"), med("short_off")
    long_on, long_off = med("long_on"), med("long_off")
    bar = 3 * alone + 2
    load = os.getloadavg()
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · long-prefill fairness · "
        f"cpu (Intel Xeon Sapphire Rapids, AVX-512, {os.cpu_count()} cores)", "",
        f"- commit: `{git_commit()}`",
        f"- command: `python -m bench.long_prefill {shlex.join(sys.argv[1:])}`",
        f"- model: preset long-prefill ({model}), float32; max_num_batched_tokens "
        f"{args.max_num_batched_tokens}; a {args.long_tokens}-token prompt, a {SHORT}-token "
        f"request sent {args.delay} s after it; one output token each; medians of "
        f"{len(rounds)} rounds; load average at the end {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} (machine shared with other work)",
        f"- {SHORT}-token request alone: TTFT {alone:.3f} s",
        f"- behind the long prompt, with the policy: TTFT {short_on:.2f} s (bar 3x alone + 2 s = "
        f"{bar:.2f} s: {'met' if short_on <= bar else 'NOT met'}); without: {short_off:.2f} s",
        f"- the long prompt's TTFT: {long_on:.2f} s with the policy, {long_off:.2f} s without "
        f"({long_on / long_off:.3f}x; bar <= 1.25x: "
        f"{'met' if long_on <= 1.25 * long_off else 'NOT met'})",
        "- per round (alone / short on / short off / long on / long off, s): " + "; ".join(
            f"{r['alone']:.3f} / {r['short_on']:.2f} / {r['short_off']:.2f} / "
            f"{r['long_on']:.2f} / {r['long_off']:.2f}" for r in rounds),
    ]
    lines += [f"- note: {n}" for n in args.note]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    import torch

    from bench.presets import preset_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model = str(preset_dir("long-prefill"))
    llms = {p: make_llm(model, args.max_num_batched_tokens, p) for p in (True, False)}
    rng = random.Random(0)
    ttfts(llms[True], {"w": [rng.randrange(3, 500) for _ in range(2048)]}, {"w": 0.0})  # warm
    rounds = []
    for i in range(args.rounds):
        print(f"round {i + 1}/{args.rounds}", flush=True)
        order = (True, False) if i % 2 == 0 else (False, True)     # neither always first
        rounds.append(run_round(llms, args.long_tokens, args.delay, rng, order))
    block = report(rounds, args, f"{torch.get_num_threads()} torch threads")
    print(block)
    if args.results_file:
        append_block(args.results_file, block)
        print(f"appended to {args.results_file}")


if __name__ == "__main__":
    main()
