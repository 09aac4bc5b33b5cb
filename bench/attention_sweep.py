"""Triton attention designs and launch choices, timed on one batch (attention_bandwidth.py's
--unified, --mixed and --sweep; the designs are kernels/attention/triton_launch.py's dispatch).

--unified   the decode batch through the split-KV decode kernel (dispatch by_batch, the default)
            and through the varlen kernel alone (dispatch unified), then `split/unified
            (decode)`: the time ratio, below 1 when the two-kernel design wins.
--mixed     the mixed batch with per-request dispatch (decode kernel for the one-token requests
            plus varlen kernel for the chunks: two launches) and unified (one launch, which is
            also what dispatch by_batch does with a mixed batch); `split/unified (mixed)`.
--sweep     a grid of launch choices on the decode batch; each point is checked against the
            reference before it is timed, and a point that fails to build, launch or match is
            reported and skipped:

                split-KV:  num_warps x BLOCK_N x num_stages x splits (auto, 1, 2, 4, 8)
                unified (with --unified):  num_warps x BLOCK_N x num_stages x tile rows

            Run order, so that a budget cut keeps what matters: each design's default point,
            then every point that changes one choice, then the rest at the default num_stages
            (fewest changes first), then the other num_stages last: compiled offline for sm_90
            (Triton 3.9), both kernels gave byte-identical binaries for num_stages 1, 2 and 3.
            The designs alternate. "auto" splits is the heuristic; the explicit split count it
            resolves to on this batch is dropped as a duplicate.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import astuple, dataclass

from bench.attention_batch import BackendRun, Batch, Session

SWEEP_WARPS = (2, 4, 8)
SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_STAGES = (1, 2, 3)
SWEEP_SPLITS = (None, 1, 2, 4, 8)        # None: the heuristic ("auto")
SWEEP_Q_ROWS = (16, 32, 64)              # unified: tile rows of a pure-decode batch
SPLIT, UNIFIED = "split-KV", "unified"


@dataclass(frozen=True)
class SweepPoint:
    """One launch choice of one design. `variant`: splits (split-KV; None = auto) or the
    varlen kernel's tile rows (unified)."""

    design: str
    num_warps: int
    block_n: int
    num_stages: int
    variant: int | None

    def config(self):
        """The TritonLaunchConfig of this point (raises ValueError for invalid values)."""
        from kernels.attention.triton_launch import KernelTiles, TritonLaunchConfig

        tiles = KernelTiles(self.block_n, self.num_warps, self.num_stages)
        if self.design == SPLIT:
            return TritonLaunchConfig(decode=tiles, decode_splits=self.variant)
        return TritonLaunchConfig(prefill=tiles, decode_q_rows=self.variant, dispatch="unified")

    def variant_text(self, auto_splits: int) -> str:
        if self.design == UNIFIED:
            return f"{self.variant} rows"
        return f"auto (={auto_splits})" if self.variant is None else str(self.variant)

    def label(self, auto_splits: int) -> str:
        what = "tile rows" if self.design == UNIFIED else "splits"
        return (f"{self.design} num_warps {self.num_warps}, BLOCK_N {self.block_n}, num_stages "
                f"{self.num_stages}, {what} {self.variant_text(auto_splits).replace(' rows', '')}")

    def changes(self, other: SweepPoint) -> int:
        """How many launch choices differ from `other`'s."""
        return sum(a != b for a, b in zip(astuple(self)[1:], astuple(other)[1:]))


def default_point(design: str) -> SweepPoint:
    """The design's point at TritonLaunchConfig's defaults."""
    from kernels.attention.triton_launch import TritonLaunchConfig

    d = TritonLaunchConfig()
    tiles = d.decode if design == SPLIT else d.prefill
    return SweepPoint(design, tiles.num_warps, tiles.block_n, tiles.num_stages,
                      d.decode_splits if design == SPLIT else d.decode_q_rows)


def sweep_points(with_unified: bool, auto_splits: int) -> list[SweepPoint]:
    """Every grid point, in run order (module docstring)."""
    designs = [(SPLIT, [s for s in SWEEP_SPLITS if s != auto_splits])]
    if with_unified:
        designs.append((UNIFIED, list(SWEEP_Q_ROWS)))
    keyed = []
    for design_index, (design, variants) in enumerate(designs):
        default = default_point(design)
        grid = [SweepPoint(design, w, n, s, v) for w, n, s, v in itertools.product(
            SWEEP_WARPS, SWEEP_BLOCK_N, SWEEP_STAGES, variants)]
        groups: dict[tuple[int, int], int] = {}
        for p in sorted(grid, key=lambda p: p != default):     # the default point first
            c = p.changes(default)
            phase = 0 if c <= 1 else 2 if p.num_stages != default.num_stages else 1
            rank = groups[phase, c] = groups.get((phase, c), -1) + 1
            keyed.append(((phase, c, rank, design_index), p))
    return [p for _, p in sorted(keyed, key=lambda kp: kp[0])]


@dataclass(frozen=True)
class SweepResult:
    runs: list[tuple[SweepPoint, BackendRun]]
    failures: list[tuple[SweepPoint, str]]
    not_reached: int
    seconds: float


def run_points(points: list[SweepPoint], session: Session, batch: Batch, auto_splits: int,
               max_points: int | None = None, budget_s: float | None = None) -> SweepResult:
    """Check, then time, each point in order; the first always runs, later ones only while
    under max_points and budget_s (seconds since the start). An interrupt (SIGINT, e.g. from
    `timeout`) ends the sweep like the budget does. One progress line per point to stderr."""
    start = time.perf_counter()
    runs, failures = [], []
    for i, p in enumerate(points):
        late = budget_s is not None and time.perf_counter() - start > budget_s
        if i and (late or (max_points is not None and i >= max_points)):
            return SweepResult(runs, failures, len(points) - i, time.perf_counter() - start)
        try:
            outcome = _run_point(p, session, batch, auto_splits)
        except KeyboardInterrupt:
            print("sweep: interrupted", file=sys.stderr, flush=True)
            return SweepResult(runs, failures, len(points) - i, time.perf_counter() - start)
        (runs if isinstance(outcome, BackendRun) else failures).append((p, outcome))
        done = f"{outcome.median_s * 1e3:.4g} ms" if isinstance(outcome, BackendRun) else outcome
        print(f"sweep point {i + 1}/{len(points)}: {p.label(auto_splits)}: {done}",
              file=sys.stderr, flush=True)
    return SweepResult(runs, failures, 0, time.perf_counter() - start)


def _run_point(p: SweepPoint, session: Session, batch: Batch,
               auto_splits: int) -> BackendRun | str:
    """The point's timed run, or why it was skipped (build, launch or check failure)."""
    from kernels.attention.triton_backend import TritonAttentionBackend

    try:
        backend = TritonAttentionBackend(launch=p.config())
        err, ok = session.check(backend, batch)
        if not ok:
            return f"check vs float32 reference {err:.2e}: over tolerance"
        return BackendRun(p.label(auto_splits), session.timings(backend, batch), err, ok)
    except Exception as e:  # noqa: BLE001 (compile errors, out of resources: skip the point)
        return _why(e)


def _why(e: Exception) -> str:
    """The exception's type and the first line of its message (at most 200 characters)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def sweep_lines(result: SweepResult, session: Session, auto_splits: int, total: int,
                budget_s: float | None) -> list[str]:
    """Summary line, the table sorted by time, each design's best point, failures."""
    budget = "" if budget_s is None else f" (budget {budget_s:.4g} s)"
    lines = [f"sweep: {len(result.runs) + len(result.failures)} of {total} points run in "
             f"{result.seconds:.1f} s{budget}, {len(result.failures)} failed, "
             f"{result.not_reached} not reached",
             "| rank | design | num_warps | BLOCK_N | num_stages | splits / tile rows | "
             "median ms | GB/s | of copy | check error |",
             "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    ranked = sorted(result.runs, key=lambda pr: pr[1].median_s)
    for rank, (p, r) in enumerate(ranked, 1):
        bps = session.total_bytes / r.median_s
        lines.append(f"| {rank} | {p.design} | {p.num_warps} | {p.block_n} | {p.num_stages} | "
                     f"{p.variant_text(auto_splits)} | {r.median_s * 1e3:.4g} | "
                     f"{bps / 1e9:.4g} | {bps / session.copy_bps:.3g} | {r.check_error:.1e} |")
    best = {}
    for design in (SPLIT, UNIFIED):
        mine = [pr for pr in ranked if pr[0].design == design]
        if mine:
            best[design] = mine[0][1]
            lines.append(_best_line(design, mine, session))
    if len(best) == 2:
        lines.append(ratio_line("sweep, best of each", best[SPLIT], best[UNIFIED]))
    lines += [f"sweep failed: {p.label(auto_splits)}: {why}" for p, why in result.failures]
    return lines


def _best_line(design: str, ranked: list[tuple[SweepPoint, BackendRun]],
               session: Session) -> str:
    """`sweep best DESIGN: ...`, with the default point's time when it ran."""
    p, r = ranked[0]
    bps = session.total_bytes / r.median_s
    line = (f"sweep best {design}: {r.label.split(' ', 1)[1]}: {r.median_s * 1e3:.4g} ms, "
            f"{bps / 1e9:.4g} GB/s = {bps / session.copy_bps:.3g} of copy")
    default = [dr for dp, dr in ranked if dp == default_point(design)]
    if default:
        d = default[0].median_s
        line += f"; default {d * 1e3:.4g} ms (best is {d / r.median_s:.3g}x as fast)"
    return line


def ratio_line(what: str, split: BackendRun, unified: BackendRun) -> str:
    """`split/unified (what): ratio = split ms / unified ms: verdict`."""
    # The verdict follows the printed ratio: 3 significant digits that read 1 are "equal".
    ratio = float(f"{split.median_s / unified.median_s:.3g}")
    verdict = ("two kernels faster" if ratio < 1 else
               "one kernel faster" if ratio > 1 else "equal")
    return (f"split/unified ({what}): {ratio:.3g} = {split.median_s * 1e3:.4g} ms / "
            f"{unified.median_s * 1e3:.4g} ms: {verdict}")


def compare_designs(args: argparse.Namespace, session: Session) -> tuple[list[str], bool]:
    """Two-kernel design vs the varlen kernel alone on this session's batch, and the ratio."""
    from kernels.attention.triton_backend import TritonAttentionBackend
    from kernels.attention.triton_launch import TritonLaunchConfig

    batch = session.batch(args.block_size)
    mixed = session.shape.num_prefills > 0
    two = TritonAttentionBackend(launch=TritonLaunchConfig(
        decode_splits=args.decode_splits, dispatch="per_request" if mixed else "by_batch"))
    one = TritonAttentionBackend(launch=TritonLaunchConfig(dispatch="unified"))
    splits = two.num_splits(batch.tensors[4], session.shape.num_kv_heads, batch.tensors[3].device)
    how = f"{'fixed' if args.decode_splits else 'auto'}: {splits} split{'s' * (splits > 1)}"
    path = "two kernels: per-request dispatch" if mixed else "split-KV decode kernel"
    rows = one.launch.block_q_rows if mixed else one.launch.decode_q_rows
    head = f"triton (block {args.block_size}, "
    r_two = session.measure(f"{head}{path}, {how})", two, batch)
    r_one = session.measure(f"{head}unified: varlen kernel, {rows}-row tiles)", one, batch)
    lines = [session.line(r_two), session.line(r_one),
             ratio_line("mixed" if mixed else "decode", r_two, r_one)]
    return lines, r_two.check_ok and r_one.check_ok


def run_triton_designs(args: argparse.Namespace, session: Session) -> tuple[list[str], bool]:
    """--sweep, else --unified / --mixed. ok: every timed run matched the reference (a sweep:
    at least one point ran and matched)."""
    if not args.sweep:
        return compare_designs(args, session)
    from kernels.attention.triton_backend import TritonAttentionBackend

    batch = session.batch(args.block_size)
    auto = TritonAttentionBackend().num_splits(batch.tensors[4], session.shape.num_kv_heads,
                                               batch.tensors[3].device)
    points = sweep_points(args.unified, auto)
    result = run_points(points, session, batch, auto, args.sweep_points, args.sweep_budget)
    lines = sweep_lines(result, session, auto, len(points), args.sweep_budget)
    return lines, bool(result.runs)
