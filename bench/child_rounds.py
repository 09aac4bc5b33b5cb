"""What the host lane benchmarks share (bench/host_overhead.py, bench/prefill_host.py): a tiny
model built once in the cache, a child script run in a fresh process on some checkout that
prints one JSON line, rounds that alternate between this tree and baseline checkouts so both
see the same machine, and the min / median / max of a figure over the rounds."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def tiny_model_dir(name: str, **config) -> str:
    """A 1-layer, hidden-64 qwen3 model (make_tiny_model's, `config` over it) in the cache's
    presets/<name>, built once."""
    from engine_common.runtime.paths import cache_dir
    from worker_service.models.tiny_model import make_tiny_model

    out = cache_dir() / "presets" / name
    if not (out / "config.json").exists():
        make_tiny_model(out, "qwen3", num_hidden_layers=1, **config)
    return str(out)


def run_child(script: Path, tree: Path, argv: list[str]) -> dict:
    """`script` (a file of this tree's bench/) with `argv`, importing from `tree`, one torch
    thread; the last JSON line it printed. RuntimeError with its stderr when it fails."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), *argv], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{script.stem} failed ({tree}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def alternating_rounds(rounds: int, baseline_trees: list[str],
                       run_round: Callable[[Path], dict]) -> dict[str, list[dict]]:
    """`run_round(tree)` `rounds` times on this tree and on each baseline checkout, one tree
    after the other within a round: each tree's results by its name ("this tree", "baseline
    DIR")."""
    trees = [("this tree", REPO)] + [(f"baseline {tree}", Path(tree).resolve())
                                     for tree in baseline_trees]
    results: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for _ in range(rounds):
        for name, tree in trees:
            results[name].append(run_round(tree))
    return results


def spread(values: list[float], digits: int = 2) -> str:
    """min / median / max."""
    return " / ".join(f"{v:.{digits}f}" for v in
                      (min(values), statistics.median(values), max(values)))
