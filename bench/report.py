"""One benchmark run's figures, printed and appended to bench/results.md as a Markdown block.

The block is the same text that is printed, so the file is a log of what people saw. Units: bytes
shown in MB/GB are powers of ten; tok/s counts output tokens only.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from bench.step_timer import StepSummary

if TYPE_CHECKING:  # hf_baseline imports torch; this module stays importable without it
    from bench.hf_baseline import HFResult

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class BenchResult:
    model: str                   # preset name or model directory
    device: str                  # "cpu" | "cuda" | "cuda:N"
    device_name: str
    engine: str                  # backend, dtype, cache and batch limits, in words
    workload: str                # in words
    output_tokens: int
    wall_s: float
    steps: StepSummary
    weight_bytes: int            # read once per decode step
    kv_bytes_per_token: int      # per cached position, all layers
    copy_bytes_per_s: float      # measured, bytes moved (read + write)
    hf: HFResult | None = None
    jit_compiles: str = ""       # Triton compiles inside the timed run, in words ("" not asked)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_read_bytes(self) -> float:
        """Bytes read by all decode steps together: weights each step plus the KV they attend to."""
        return (self.weight_bytes * self.steps.num_decode_steps
                + self.kv_bytes_per_token * self.steps.decode_kv_tokens)

    @property
    def decode_bytes_per_s(self) -> float:
        s = self.steps.decode_seconds
        return self.decode_read_bytes / s if s > 0 else 0.0

    @property
    def ratio_vs_hf(self) -> float | None:
        best = None if self.hf is None else self.hf.best
        return None if best is None or best.tokens_per_s == 0 else self.tokens_per_s / best.tokens_per_s


def format_lines(r: BenchResult) -> list[str]:
    """The figures, one per line (Markdown list items without the leading dash)."""
    st = r.steps
    per_step = r.decode_read_bytes / st.num_decode_steps if st.num_decode_steps else 0.0
    lines = [
        f"engine: {r.engine}",
        f"workload: {r.workload}",
        f"output tokens: {r.output_tokens}",
        f"wall time: {r.wall_s:.3f} s",
        f"output throughput: {r.tokens_per_s:.1f} tok/s",
        f"decode steps: {st.num_decode_steps} of {st.num_steps} steps, mean batch "
        f"{st.mean_decode_batch:.1f}, {st.mean_decode_step_s * 1e3:.3f} ms per decode step",
        f"decode read: {per_step / 1e6:.3g} MB per step (weights {r.weight_bytes / 1e6:.3g} MB "
        f"+ KV), {r.decode_bytes_per_s / 1e9:.3g} GB/s = "
        f"{r.decode_bytes_per_s / r.copy_bytes_per_s:.3g} of measured copy bandwidth "
        f"{r.copy_bytes_per_s / 1e9:.3g} GB/s",
    ]
    lines += _other_step_lines(r)
    lines += _hf_lines(r)
    lines += [f"note: {n}" for n in r.notes]
    return lines


def _other_step_lines(r: BenchResult) -> list[str]:
    """Where the wall time outside the decode steps went: the steps that prefilled, the time
    outside any step (adding requests, building outputs), Triton compiles."""
    st = r.steps
    if not st.step_seconds:
        return []
    slowest = ", ".join(f"{s * 1e3:.0f} ms ({t} tokens, {n} requests)"
                        for s, t, n in st.slowest_other)
    lines = [f"other steps: {st.num_steps - st.num_decode_steps} steps with prefill, "
             f"{st.other_seconds:.3f} s for {st.other_tokens} tokens"
             + (f"; slowest {slowest}" if slowest else ""),
             f"outside steps: {r.wall_s - st.step_seconds:.3f} s of the wall time"]
    if r.jit_compiles:
        lines.append(f"triton compiles in the timed run: {r.jit_compiles}")
    return lines


def _hf_lines(r: BenchResult) -> list[str]:
    if r.hf is None:
        return []
    tried = ", ".join(
        f"{t.batch_size}: {t.error}" if t.error else
        f"{t.batch_size}: {t.tokens_per_s:.1f} tok/s over {t.num_seqs} seqs"
        for t in r.hf.trials)
    best = r.hf.best
    if best is None:
        return [f"transformers generate(): no batch size completed ({tried})"]
    return [f"transformers generate(): best batch {best.batch_size}: "
            f"{best.tokens_per_s:.1f} tok/s (tried {tried})",
            f"ours / transformers: {r.ratio_vs_hf:.2f}x"]


def format_block(r: BenchResult, command: str) -> str:
    """The Markdown block appended to the results file."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [f"## {now} · {r.model} · {r.device} ({r.device_name})", "",
            f"- commit: `{git_commit()}`", f"- command: `{command}`"]
    return "\n".join(head + [f"- {line}" for line in format_lines(r)]) + "\n"


DEFAULT_RESULTS = Path(__file__).resolve().parent / "results.md"


def add_report_flags(parser) -> None:
    """--note and --results-file, the same on every benchmark."""
    parser.add_argument("--note", action="append", default=[],
                        help="a remark recorded with the result (repeatable)")
    parser.add_argument("--results-file", default=str(DEFAULT_RESULTS),
                        help="Markdown file the result block is appended to (default: "
                             "bench/results.md)")


def append_block(path: str | Path, block: str) -> None:
    """Append `block` to the results file, creating it with a title if it does not exist."""
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write("# Benchmark results\n\nAppended by `python -m bench.throughput` "
                    "(`make bench`), newest last.\n")
        f.write("\n" + block)


def print_and_append(lines: list[str], module: str, argv: list[str] | None,
                     results_file: str | None) -> int:
    """A lane benchmark's report: `lines` and the command that made them (`python -m module`
    and its arguments), printed and, given a file, appended to it; returns the exit code 0."""
    command = " ".join([f"python -m {module}", *(argv or sys.argv[1:])])
    block = "\n".join(lines + ["", f"command: `{command}`", ""])
    print(block)
    if results_file:
        append_block(results_file, block)
    return 0


def git_commit() -> str:
    """Short HEAD commit, with "+modified" when tracked files differ from it; "unknown" outside
    a git checkout."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+modified" if dirty else "")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True, timeout=10).stdout.strip()
