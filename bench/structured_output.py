"""The throughput cost of structured output: constrained against unconstrained generation in the
same process and run, and the step diff's size with every request constrained.

    python -m bench.structured_output                       # default model, 16 requests, CPU
    python -m bench.structured_output --num-requests 256 --max-tokens 8 --rounds 3

Every mode generates exactly --max-tokens tokens per request: the unconstrained one ignores eos,
and the constraints cannot be complete sooner (a JSON array of at least 64 people, a regex of at
least 200 words), so each mode decodes the same number of tokens. Modes alternate within a
round; each round reports tok/s per mode and each constrained mode's ratio to the unconstrained
one; the summary is min / median / max over rounds. The diff sizes are those of steady-state
steps (no new request in them), every request constrained.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from deltaserve.llm import LLM
from engine_common.chat_template import encode_chat
from engine_common.codec import decode_scheduler_output
from engine_common.constraint import Constraint
from engine_common.params import SamplingParams, StoppingParams

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


def _run_mode(llm: LLM, mode: str, n: int, max_tokens: int, sizes: list[int]) -> float:
    """tok/s of one mode; appends the steady-state diff sizes to `sizes`."""
    ex = llm.engine.core.executor
    inner = type(ex).execute.__get__(ex)

    def recording(payload: bytes) -> bytes:
        if not decode_scheduler_output(payload).new_requests:
            sizes.append(len(payload))
        return inner(payload)
    ex.execute = recording
    stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = _prompts(llm, n)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [SamplingParams(temperature=0.8, seed=i) for i in range(n)],
                    stopping, constraint=MODES[mode])
    wall = time.perf_counter() - t0
    del ex.execute
    tokens = sum(len(o.token_ids) for o in outs)
    if tokens != n * max_tokens:
        raise RuntimeError(f"{mode}: {tokens} tokens, expected {n * max_tokens}")
    return tokens / wall


def run(llm: LLM, n: int, max_tokens: int, rounds: int) -> list[str]:
    lines = []
    rates = {m: [] for m in MODES}
    sizes = {m: [] for m in MODES}
    for mode in MODES:                       # warm-up: the grammar tokenizer, compiled grammars
        _run_mode(llm, mode, 2, 4, [])
    for r in range(rounds):
        for mode in MODES:
            rates[mode].append(_run_mode(llm, mode, n, max_tokens, sizes[mode]))
        base = rates["unconstrained"][-1]
        lines.append(f"round {r + 1}: " + "; ".join(
            f"{m} {rates[m][-1]:.1f} tok/s" + ("" if m == "unconstrained" else
                                               f" ({rates[m][-1] / base:.3f}x)")
            for m in MODES))
    for mode in MODES:
        ratios = [a / b for a, b in zip(rates[mode], rates["unconstrained"])]
        lines.append(f"{mode}: {_mmm(rates[mode], '.1f')} tok/s, ratio to unconstrained "
                     f"{_mmm(ratios, '.3f')} (min / median / max over rounds)")
    for mode in MODES:
        s = sizes[mode]
        lines.append(f"steady-state diff, {mode}: median {statistics.median(s)} / max {max(s)}"
                     f" bytes over {len(s)} steps")
    return lines


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
    p.add_argument("--results-file", type=Path, default=None, help="append the figures here")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    if args.model is None:
        from deltaserve.default_model import ensure_default_model
        args.model = str(ensure_default_model())
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
