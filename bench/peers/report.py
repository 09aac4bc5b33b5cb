"""The peer comparison's figures: per-engine tok/s over rounds, the per-round ratio
(DeltaServe / peer, min/median/max), greedy-token agreement and roofline fractions; printed and,
when a results file is named, appended to it as a Markdown block.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone

from bench.peers.roofline import Floor


@dataclass
class EngineRuns:
    """One engine's timed runs of the same workload, in round order."""

    name: str
    description: str = ""
    startup_s: float = 0.0
    wall_s: list[float] = field(default_factory=list)
    token_ids: list[list[list[int]]] = field(default_factory=list)   # per round, per request
    cpu_s: list[float] = field(default_factory=list)  # CPU seconds of its processes, per round

    def tokens_per_s(self, i: int) -> float:
        return sum(len(ids) for ids in self.token_ids[i]) / self.wall_s[i]

    @property
    def rates(self) -> list[float]:
        return [self.tokens_per_s(i) for i in range(len(self.wall_s))]

    def self_consistent(self) -> bool:
        """Every round produced the same tokens (greedy decoding is deterministic)."""
        return all(ids == self.token_ids[0] for ids in self.token_ids[1:])


def spread(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, str | None]:
    """(requests whose token ids are identical, where the first differing one diverges)."""
    same = sum(x == y for x, y in zip(a, b))
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return same, f"request {i} at output position {pos} of {len(x)}"
    return same, None


@dataclass
class Comparison:
    """Everything one workload's comparison produced: the peer (None when not run) and
    DeltaServe's paths (in-process first, then gRPC when asked)."""

    title: str                       # workload, dtype, threads
    workload: str                    # in words
    peer: EngineRuns | None
    ours: list[EngineRuns]
    floor: Floor | None
    notes: list[str] = field(default_factory=list)

    def ratios(self, runs: EngineRuns) -> list[float]:
        """runs / peer per round (both timed in the same round)."""
        return [o / p for o, p in zip(runs.rates, self.peer.rates)]


def _rate_line(runs: EngineRuns, floor: Floor | None) -> str:
    lo, med, hi = spread(runs.rates)
    line = (f"{runs.name}: {med:.1f} tok/s median (min {lo:.1f}, max {hi:.1f}) over "
            f"{len(runs.rates)} rounds; wall {statistics.median(runs.wall_s):.2f} s median")
    if runs.cpu_s and all(c > 0 for c in runs.cpu_s):
        per_cpu = [sum(map(len, ids)) / c for ids, c in zip(runs.token_ids, runs.cpu_s)]
        line += (f"; CPU {statistics.median(runs.cpu_s):.2f} s median in all its processes "
                 f"= {statistics.median(per_cpu):.1f} tok per CPU-second")
    if floor is not None:
        frac = floor.seconds / statistics.median(runs.wall_s)
        line += f"; {frac:.2f} of the roofline floor"
    return line


def _versus_peer(c: Comparison, runs: EngineRuns) -> list[str]:
    lo, med, hi = spread(c.ratios(runs))
    same, first = agreement(runs.token_ids[0], c.peer.token_ids[0])
    return [f"{runs.name} / {c.peer.name}: {med:.2f}x median (min {lo:.2f}x, max {hi:.2f}x); "
            f"per round: " + ", ".join(f"{r:.2f}x" for r in c.ratios(runs)),
            f"greedy tokens, {runs.name} vs {c.peer.name}: {same}/{len(runs.token_ids[0])} "
            f"requests identical" + ("" if first is None else f" (first difference: {first})")]


def format_lines(c: Comparison) -> list[str]:
    everyone = ([c.peer] if c.peer else []) + c.ours
    lines = [f"workload: {c.workload}"] + [f"{r.name} engine: {r.description}"
                                           for r in everyone]
    if c.floor is not None:
        f = c.floor
        lines.append(f"roofline floor: {f.seconds:.2f} s = {f.matmul_flops / 1e12:.3g} TFLOP at "
                     f"{f.gemm_flops_per_s / 1e9:.0f} GFLOP/s ({f.gemm_how}) = {f.compute_s:.2f}"
                     f" s + {f.decode_bytes / 1e9:.3g} GB decode reads at "
                     f"{f.copy_bytes_per_s / 1e9:.1f} GB/s copy bandwidth = {f.memory_s:.2f} s")
    for runs in everyone:
        lines.append(_rate_line(runs, c.floor))
        if not runs.self_consistent():
            lines.append(f"WARNING: {runs.name}'s tokens differ between rounds")
    if c.peer is not None:
        for runs in c.ours:
            lines += _versus_peer(c, runs)
    elif len(c.ours) > 1:
        same, first = agreement(c.ours[1].token_ids[0], c.ours[0].token_ids[0])
        lines.append(f"greedy tokens, {c.ours[1].name} vs {c.ours[0].name}: {same}/"
                     f"{len(c.ours[0].token_ids[0])} requests identical")
    return lines + [f"note: {n}" for n in c.notes]


def table_rows(c: Comparison) -> list[str]:
    """One row per DeltaServe path: | workload | peer | ours | ratio | tokens | floor |"""
    rows = []
    for runs in c.ours:
        ours = statistics.median(runs.rates)
        title = c.title if len(c.ours) == 1 else f"{c.title}, {runs.name}"
        if c.peer is None:
            rows.append(f"| {title} | - | {ours:.1f} | - | - | - |")
            continue
        peer = statistics.median(c.peer.rates)
        lo, med, hi = spread(c.ratios(runs))
        same, _ = agreement(runs.token_ids[0], c.peer.token_ids[0])
        frac = "-"
        if c.floor is not None:
            frac = " / ".join(f"{c.floor.seconds / statistics.median(r.wall_s):.2f}"
                              for r in (c.peer, runs))
        rows.append(f"| {title} | {peer:.1f} | {ours:.1f} | {lo:.2f} / {med:.2f} / {hi:.2f} | "
                    f"{same}/{len(runs.token_ids[0])} | {frac} |")
    return rows


TABLE_HEAD = ("| workload | vLLM tok/s | DeltaServe tok/s | ratio min / median / max | "
              "identical greedy requests | floor fraction vLLM / DeltaServe |\n"
              "| --- | --- | --- | --- | --- | --- |")


def format_block(comparisons: list[Comparison], command: str, commit: str,
                 machine: str, platform_lines: list[str] = ()) -> str:
    """The Markdown block; platform_lines (the CPU, the ISA) follow the command."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"## {now} · bench-peers · {machine}", "", f"- commit: `{commit}`",
           f"- command: `{command}`", *(f"- {line}" for line in platform_lines), "",
           TABLE_HEAD]
    out += [row for c in comparisons for row in table_rows(c)] + [""]
    for c in comparisons:
        out += [f"### {c.title}", ""] + [f"- {line}" for line in format_lines(c)] + [""]
    return "\n".join(out)
