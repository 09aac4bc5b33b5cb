"""The checks tests/gpu/test_mla_cuda.py and test_hybrid_rope_cuda.py share: a model family's
engine runs on CUDA (engine_runs.py) held to transformers and to their own eager runs.

A family is (tiny_models arch, its overrides, the head size the cache holds, the graph refusal
expected: None when decode graphs must capture). Per family: the caches' layout; bf16 with
graphs asked for and eager under test_engine_bf16's divergence rule (teacher-forced gap within
4 bf16 ulps, divergences from generate() printed); graphs give the eager tokens exactly where
they were captured, or are refused with the expected reason, logged; float32 equals
transformers' greedy tokens (near ties reported).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.gpu.engine_runs import EngineRun, run_engine
from tests.gpu.test_engine_bf16 import MAX_NEW, check_bf16
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy

ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)


@dataclass(frozen=True)
class Family:
    """A tiny model variant and what its CUDA run must show."""

    arch: str
    overrides: dict
    head_size: int
    shared_halves: bool = False        # MLA: the [2, ...] cache one memory (stride 0)
    hybrid: bool = False               # a window group beside the full one
    graphs_refused: str | None = None  # the start of the logged refusal; None: captured


def runs(tiny_models, families: dict[str, Family]):
    """run(name, dtype, enforce_eager) -> (model dir, EngineRun), memoized."""
    done: dict[tuple, tuple[str, EngineRun]] = {}

    def run(name: str, dtype: str, enforce_eager: bool) -> tuple[str, EngineRun]:
        key = (name, dtype, enforce_eager)
        if key not in done:
            fam = families[name]
            path = tiny_models(fam.arch, **fam.overrides)
            done[key] = (path, run_engine(path, dtype, enforce_eager, **ENGINE))
        return done[key]

    return run


def check_layout(fam: Family, run: EngineRun) -> None:
    assert run.head_sizes == {fam.head_size}
    assert run.shared_halves == [fam.shared_halves] * len(run.shared_halves)
    assert run.hybrid == fam.hybrid


def check_bf16_run(name: str, path: str, run: EngineRun, enforce_eager: bool) -> None:
    label = f"{name}/triton/{'eager' if enforce_eager else 'graphs'}"
    reports, failures = [], []
    for i, (p, ours) in enumerate(zip(run.prompts, run.tokens)):
        failure = check_bf16(f"{label}/prompt{i}(len {len(p)})", path, p, ours, reports)
        if failure:
            failures.append(failure)
    for line in reports:
        print("BF16 DIVERGENCE from generate() (accepted, within tolerance):", line)
    assert not failures, "\n".join(failures)


def check_graphs(name: str, fam: Family, graphed: EngineRun, eager: EngineRun) -> None:
    assert eager.graphs_off == "enforce_eager is set" and eager.replays == 0
    if fam.graphs_refused is not None:
        assert graphed.graphs_off is not None \
            and graphed.graphs_off.startswith(fam.graphs_refused), (
                f"{name}: expected graphs refused with {fam.graphs_refused!r}, the runner "
                f"logged {graphed.graphs_off!r}")
        assert graphed.replays == 0
        print(f"GRAPHS REFUSED (expected) for {name}: {graphed.graphs_off}")
        return
    assert graphed.graphs_off is None, f"{name}: decode graphs refused: {graphed.graphs_off}"
    assert graphed.replays >= MAX_NEW - 1, f"only {graphed.replays} decode steps replayed"
    for i, (a, b) in enumerate(zip(graphed.tokens, eager.tokens)):
        assert a == b, f"{name} prompt {i}: graphs {a} != eager {b}"


def check_fp32_run(name: str, path: str, run: EngineRun) -> None:
    near_ties, failures = [], []
    for i, (p, ours) in enumerate(zip(run.prompts, run.tokens)):
        ref = hf_greedy(path, tuple(p), len(ours), dtype=torch.float32, device="cuda")
        failure = compare_greedy(f"{name}/triton/fp32/prompt{i}(len {len(p)})", ours, ref,
                                 near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)
