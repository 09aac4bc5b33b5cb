"""The throughput cost of structured output: constrained against unconstrained generation in the
same process and run, and the step diff's size with every request constrained.

    python -m bench.structured_output                       # default model, 16 requests, CPU
    python -m bench.structured_output --num-requests 256 --max-tokens 8 --rounds 3

Every mode generates exactly --max-tokens tokens per request: the unconstrained one ignores eos,
and the constraints cannot be complete sooner (a JSON array of at least 64 people, a regex of at
least 200 words), so each mode decodes the same number of tokens. Modes alternate within a
round; each round reports tok/s per mode and each constrained mode's ratio to the unconstrained
one, and the time the masks took per step (on the helper thread, beside the forward pass) against
the step time; the summary is min / median / max over rounds. The diff sizes are those of
steady-state decode steps (every running request decodes one token; nothing arrives, resumes,
finishes or is preempted; blocks may grow), every request constrained.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deltaserve.llm import LLM
from engine_common.text.chat_template import encode_chat
from engine_common.wire.codec import decode_scheduler_output
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams

PEOPLE = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}}
MODES = {
    "unconstrained": None,
    "json_schema": Constraint("json_schema", json.dumps(PEOPLE)),
    "regex": Constraint("regex", "([a-z]+ ){200,}"),
}


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    """Chat prompts (raw text for a model without a chat template), as ids."""
    texts = [f"List people number {i} and up as JSON, with ages." for i in range(n)]
    if llm.chat_template is None:
        return [llm.tokenizer.encode(t) for t in texts]
    return [encode_chat(llm.tokenizer, llm.chat_template, [{"role": "user", "content": t}])
            for t in texts]


def _steady(diff) -> bool:
    """A steady-state decode step: every running request decodes one token (blocks may grow);
    nothing arrives, resumes, finishes or is preempted."""
    return not (diff.new_requests or diff.resumed_requests or diff.num_scheduled_tokens
                or diff.finished_handles or diff.preempted_handles)


@dataclass
class ModeRun:
    tokens_per_s: float
    step_s: float              # wall time per engine step
    mask_s: float              # grammar mask time per step (on the helper thread)


def _run_mode(llm: LLM, mode: str, n: int, max_tokens: int, sizes: list[int]) -> ModeRun:
    """One mode's run; appends the steady-state diff sizes to `sizes`."""
    ex, book = llm.engine.core.executor, llm.runner.grammar
    inner = type(ex).execute.__get__(ex)
    compute = type(book).compute_masks.__get__(book)
    steps, mask_s = [0], [0.0]

    def recording(payload: bytes) -> bytes:
        steps[0] += 1
        if _steady(decode_scheduler_output(payload)):
            sizes.append(len(payload))
        return inner(payload)

    def timed_masks(picks):
        t = time.perf_counter()
        out = compute(picks)
        mask_s[0] += time.perf_counter() - t
        return out
    ex.execute, book.compute_masks = recording, timed_masks
    stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = _prompts(llm, n)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [SamplingParams(temperature=0.8, seed=i) for i in range(n)],
                    stopping, constraint=MODES[mode])
    wall = time.perf_counter() - t0
    del ex.execute, book.compute_masks
    tokens = sum(len(o.token_ids) for o in outs)
    if tokens != n * max_tokens:
        raise RuntimeError(f"{mode}: {tokens} tokens, expected {n * max_tokens}")
    return ModeRun(tokens / wall, wall / steps[0], mask_s[0] / steps[0])


def run(llm: LLM, n: int, max_tokens: int, rounds: int) -> list[str]:
    lines = []
    runs: dict[str, list[ModeRun]] = {m: [] for m in MODES}
    sizes = {m: [] for m in MODES}
    for mode in MODES:                       # warm-up: the grammar tokenizer, compiled grammars
        _run_mode(llm, mode, 2, 4, [])
    for r in range(rounds):
        for mode in MODES:
            runs[mode].append(_run_mode(llm, mode, n, max_tokens, sizes[mode]))
        base = runs["unconstrained"][-1].tokens_per_s
        lines.append(f"round {r + 1}: " + "; ".join(_describe(m, runs[m][-1], base)
                                                    for m in MODES))
    rates = {m: [x.tokens_per_s for x in runs[m]] for m in MODES}
    for mode in MODES:
        ratios = [a / b for a, b in zip(rates[mode], rates["unconstrained"])]
        shares = [x.mask_s / x.step_s for x in runs[mode]]
        lines.append(f"{mode}: {_mmm(rates[mode], '.1f')} tok/s, ratio to unconstrained "
                     f"{_mmm(ratios, '.3f')}, mask time / step time "
                     f"{_mmm(shares, '.4f')} (min / median / max over rounds)")
    for mode in MODES:
        s = sizes[mode]
        lines.append(f"steady-state diff, {mode}: median {statistics.median(s)} / max {max(s)}"
                     f" bytes over {len(s)} steps")
    return lines


def _describe(mode: str, run: ModeRun, base: float) -> str:
    text = f"{mode} {run.tokens_per_s:.1f} tok/s, {run.step_s * 1e3:.0f} ms/step"
    if mode == "unconstrained":
        return text
    return text + f", masks {run.mask_s * 1e3:.2f} ms/step ({run.tokens_per_s / base:.3f}x)"


def _mmm(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values),
                                               max(values)))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.structured_output",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads (default: torch's own choice)")
    p.add_argument("--results-file", type=Path, default=None, help="append the figures here")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    if args.model is None:
        from deltaserve.default_model import ensure_default_model
        args.model = str(ensure_default_model())
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    n = args.num_requests
    llm = LLM(args.model, device=args.device, dtype="float32", max_num_seqs=max(n, 2),
              max_num_batched_tokens=max(2048, n), num_kv_blocks=n * 8 + 64,
              enable_prefix_caching=False, async_scheduling=args.async_scheduling)
    lines = [f"commit: `{_commit()}`",
             "command: `python -m bench.structured_output "
             + shlex.join(argv if argv is not None else sys.argv[1:]) + "`",
             f"workload: {n} chat requests, {args.max_tokens} output tokens each (sampled, "
             f"temperature 0.8), {Path(args.model).name} fp32 on {args.device}, "
             f"{'async' if args.async_scheduling else 'sync'} scheduling, no prefix caching; "
             f"{args.rounds} rounds"]
    lines += run(llm, n, args.max_tokens, args.rounds)
    if args.note:
        lines.append(f"note: {args.note}")
    block = "\n".join(f"- {line}" for line in lines)
    print(block)
    if args.results_file:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with open(args.results_file, "a") as f:
            f.write(f"\n## {stamp} · structured output · {n} requests\n\n{block}\n")


if __name__ == "__main__":
    main()
