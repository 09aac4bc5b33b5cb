"""Where a steady decode step's time goes: the device's busy share, the idle gap between steps,
the top kernels, and the host's phases.

    python -m bench.step_profile --preset qwen3-0.6b                 # on a GPU: the profile stage
    python -m bench.step_profile --preset tiny --device cpu --num-seqs 64 --min-len 16 --max-len 64

Runs bench.throughput's workload on the in-process engine with the same flags (so the engine's
defaults are what is profiled) and, once `--skip` pure-decode steps have passed, records
`--steps` steps under torch.profiler (`--skip 0`: from the run's first step, so the prefill
steps are in the window). Prints:
  - device busy: the union of the kernels' time over the window's wall time, and the idle time
    per step (the window minus that union), i.e. how long the device waited for the host;
  - the top kernels by device time, and the top host-side torch ops by self CPU time;
  - host phases per step (min / median / max over the window): the engine's schedule + encode,
    its wait for the runner, decode + update, output processing; the runner's input preparation,
    forward launch, sampling launch and read-back wait, each also in the runner thread's CPU
    time (wall well above CPU: the thread was blocked, not busy);
  - on CUDA, the caching allocator's device allocations, frees and retries in the window.
`--host-only` records no torch.profiler trace: the host phases without its per-op overhead.
No result file is written: this answers "where does the time go", the throughput benchmark
answers "how fast".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

from bench.throughput import (_generate, _llm_kwargs, apply_experiments,
                              build_parser as throughput_parser)
from bench.workload import model_and_workload, warmup_workload, workload_shape
from worker_service.step.step_clock import StepClock


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.step_profile",
                                description=__doc__.splitlines()[0])
    throughput_parser(p)
    g = p.add_argument_group("profile")
    g.add_argument("--skip", type=int, default=30,
                   help="pure-decode steps to let pass before recording (default: 30)")
    g.add_argument("--steps", type=int, default=50,
                   help="steps to record, of any kind (default: 50)")
    g.add_argument("--top", type=int, default=12, help="rows in each top list (default: 12)")
    g.add_argument("--host-only", action="store_true",
                   help="no torch.profiler: the host phases without its per-op overhead")
    return p


class DecodeWindow:
    """Wraps one engine's step(): counts pure-decode steps, runs `on_start` before step
    `skip + 1` and `on_stop` after `skip + steps`, and keeps each recorded step's phases."""

    def __init__(self, llm, skip: int, steps: int, on_start, on_stop):
        self.llm, self.skip, self.steps = llm, skip, steps
        self.on_start, self.on_stop = on_start, on_stop
        self.decode_steps = 0
        self.recording = False
        self.done = False
        self.phases: dict[str, list[float]] = defaultdict(list)
        self.batch_sizes: list[int] = []
        self.kv_tokens: list[int] = []     # positions attention reads, per recorded step
        self.wall = 0.0
        engine = llm.engine
        self._step, self._process = engine.step, engine.output_processor.process
        engine.step = self._wrapped_step
        engine.output_processor.process = self._timed_process
        self._out_s = 0.0

    def _timed_process(self, updates):
        start = time.perf_counter()
        try:
            return self._process(updates)
        finally:
            self._out_s += time.perf_counter() - start

    def _wrapped_step(self):
        core = self.llm.engine.core
        if not self.done and not self.recording and self.decode_steps >= self.skip:
            self.recording = True
            self.on_start()
            self._t0 = time.perf_counter()
        self._out_s = 0.0
        start = time.perf_counter()
        outputs = self._step()
        step_s = time.perf_counter() - start
        stats = core.last_step
        if stats.num_reqs and stats.num_tokens == stats.num_reqs:
            self.decode_steps += 1
        if self.recording:
            self._record(step_s, stats)
            if len(self.batch_sizes) >= self.steps:
                self.wall = time.perf_counter() - self._t0
                self.on_stop()
                self.recording, self.done = False, True
        return outputs

    def _record(self, step_s: float, stats) -> None:
        p = self.phases
        p["engine: whole step"].append(step_s)
        p["engine: schedule + encode"].append(stats.schedule_s)
        p["engine: wait for the runner"].append(stats.round_trip_s)
        p["engine: decode + update"].append(stats.update_s)
        p["engine: output processing"].append(self._out_s)
        clock = self.llm.runner.clock
        for name, seconds in clock.phases.items():
            p[f"runner: {name}"].append(seconds)
        for name, seconds in clock.cpu_phases.items():
            p[f"runner: {name}, thread cpu"].append(seconds)
        self.batch_sizes.append(stats.num_reqs)
        self.kv_tokens.append(sum(r.num_computed_tokens for r in self.llm.scheduler.running))


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def device_report(prof, window_s: float, num_steps: int, top: int) -> list[str]:
    """Busy share, idle per step and the top kernels from a torch.profiler run."""
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    lines = []
    if kernels:
        spans = [(e.time_range.start, e.time_range.end) for e in kernels]
        busy_us = _union_us(spans)
        first, last = min(s for s, _ in spans), max(e for _, e in spans)
        span_us = last - first
        lines.append(f"device busy: {busy_us / 1e3:.1f} ms of a {span_us / 1e3:.1f} ms kernel "
                     f"span ({busy_us / span_us:.1%}); host window {window_s * 1e3:.1f} ms "
                     f"({busy_us / 1e3 / (window_s * 1e3):.1%} of it busy)")
        lines.append(f"per step: device busy {busy_us / num_steps / 1e3:.2f} ms, idle "
                     f"{(window_s * 1e6 - busy_us) / num_steps / 1e3:.2f} ms "
                     f"(host window / steps = {window_s / num_steps * 1e3:.2f} ms)")
        lines += gap_report(kernels, num_steps)
        by_name: dict[str, list[float]] = defaultdict(list)
        for e in kernels:
            by_name[e.name].append(e.time_range.end - e.time_range.start)
        lines.append(f"top kernels by device time (of {busy_us / 1e3:.1f} ms):")
        ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        for name, times in ranked:
            lines.append(f"  {sum(times) / 1e3:8.2f} ms {sum(times) / busy_us:6.1%} "
                         f"x{len(times):<5} {name[:90]}")
    else:
        lines.append("device: no kernels recorded (CPU run): the host phases below are the step")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top,
                                      max_name_column_width=60)
    lines.append("top host-side ops by self CPU time:")
    lines.extend("  " + line for line in table.splitlines())
    return lines


ATTENTION_KERNELS = ("_decode_kernel", "_reduce_kernel")


def attention_report(kernels, window: DecodeWindow, kv_bytes_per_token: int,
                     copy_bytes_per_s: float) -> list[str]:
    """The decode attention kernels' time per step against the KV bytes the window's steps read:
    how near the copy bandwidth attention runs in the real batch (mixed context lengths)."""
    us = sum(e.time_range.end - e.time_range.start for e in kernels
             if e.name in ATTENTION_KERNELS)
    steps = len(window.kv_tokens)
    if not us or not steps:
        return []
    kv_bytes = kv_bytes_per_token * sum(window.kv_tokens) / steps
    rate = kv_bytes / (us / steps * 1e-6)
    return [f"decode attention: {us / steps / 1e3:.2f} ms per step for {kv_bytes / 1e9:.2f} GB "
            f"of KV (mean context {sum(window.kv_tokens) / sum(window.batch_sizes):.0f}) = "
            f"{rate / 1e9:.0f} GB/s, {rate / copy_bytes_per_s:.3f} of the copy bandwidth "
            f"{copy_bytes_per_s / 1e9:.0f} GB/s"]


def gap_report(kernels, num_steps: int, min_gap_us: float = 10.0, top: int = 6) -> list[str]:
    """Idle gaps between kernels: how many a step has over min_gap_us and the largest, each
    with the kernels on either side (one big gap a step: the host launched late; many small
    ones: eager launches between the graph replays)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    gaps, end, last = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start - end > min_gap_us:
            gaps.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    total = sum(g for g, _, _ in gaps)
    lines = [f"gaps over {min_gap_us:.0f} us: {len(gaps) / num_steps:.1f} per step, "
             f"{total / num_steps / 1e3:.2f} ms per step; largest:"]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap / 1e3:6.2f} ms after {before[:50]} -> before {after[:50]}")
    return lines


class AllocatorCounters:
    """The CUDA caching allocator's counters over the window: device allocations and frees
    (cudaMalloc / cudaFree, which synchronizes) and retries after a failed allocation (each
    frees the cache and synchronizes). A steady loop has none."""

    KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")

    def __init__(self, device: str | None):
        self.device, self.before, self.after = device, {}, {}

    def _read(self) -> dict:
        import torch
        stats = torch.cuda.memory_stats(self.device)
        return {k: stats.get(k, 0) for k in self.KEYS}

    def start(self) -> None:
        if self.device:
            self.before = self._read()

    def stop(self) -> None:
        if self.device:
            self.after = self._read()

    def report(self) -> list[str]:
        if not self.after:
            return []
        return ["allocator in the window: " + ", ".join(
            f"{k} {self.after[k] - self.before[k]}" for k in self.KEYS)]


def phase_report(window: DecodeWindow) -> list[str]:
    lines = [f"host phases over {len(window.batch_sizes)} recorded steps, mean batch "
             f"{statistics.mean(window.batch_sizes):.1f} (ms: min / median / max):"]
    for name, values in window.phases.items():
        ms = [v * 1e3 for v in values]
        lines.append(f"  {name:32s} {min(ms):7.3f} / {statistics.median(ms):7.3f} / "
                     f"{max(ms):7.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from deltaserve.llm import LLM
    from worker_service.device_info import resolve_device

    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    model_dir, workload, _ = model_and_workload(args, args.preset or "qwen3-0.6b", device)
    kwargs, _ = _llm_kwargs(args, device, workload_shape(args).max_total_len)
    llm = LLM(model_dir, **kwargs)
    llm.runner.clock = StepClock(cpu=time.thread_time)    # the phases' thread CPU time too
    for note in apply_experiments(llm, args):
        print(f"experiment: {note}")
    print(f"engine: async_scheduling={llm.scheduler.config.async_scheduling}, "
          f"max_num_batched_tokens={llm.scheduler.config.max_num_batched_tokens}, "
          f"graphs={'on' if llm.runner.graph_runner is not None else 'off'}")
    if args.warmup:
        _generate(llm, warmup_workload(workload, llm.model_info.vocab_size, 8, 16), args)
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    on_cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    allocator = AllocatorCounters(device if on_cuda else None)
    enter = (lambda: None) if args.host_only else prof.__enter__
    leave = (lambda: None) if args.host_only else (lambda: prof.__exit__(None, None, None))
    window = DecodeWindow(llm, args.skip, args.steps, lambda: (sync(), allocator.start(), enter()),
                          lambda: (sync(), allocator.stop(), leave()))
    start = time.perf_counter()
    completions = _generate(llm, workload, args)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in completions)
    print(f"run: {tokens} output tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s "
          f"(the recorded window {window.wall:.2f} s of it)")
    if not window.done:
        print(f"only {window.decode_steps} decode steps: nothing recorded (lower --skip/--steps)")
        return 1
    for line in phase_report(window) + allocator.report():
        print(line)
    if args.host_only:
        return 0
    for line in device_report(prof, window.wall, len(window.batch_sizes), args.top):
        print(line)
    if on_cuda:
        from torch.autograd import DeviceType

        from bench.bandwidth import kv_bytes_per_token, measure_copy_bandwidth
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        for line in attention_report(kernels, window, kv_bytes_per_token(llm.runner),
                                     measure_copy_bandwidth(device)):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
