"""On CUDA: a model-runner step makes no host sync before its one token read-back.

ModelRunner.execute_diff is launch_step (apply the diff, stage the inputs with one copy per
staging arena, forward, sample, queue the read-back copies) then finish_step (the one allowed
sync: the read-back event, or the staging copies when nothing samples). Each launch_step of the
scenario in tests/step_scenario.py (mixed prefill + decode, chunked prefill, a step that samples
nothing, pure decodes with and without a non-sampling row, padded graph batches; greedy, seeded
top-k / top-p / min-p, penalties, min_tokens stop masks, top logprobs; the tiny qwen3 model and
the tiny qwen3_moe one, whose experts take the fused MoE kernels on CUDA) runs under
torch.cuda.set_sync_debug_mode("error"), which raises on every synchronizing CUDA call torch
makes (.item(), .tolist(), .cpu(), nonzero, boolean-mask indexing, blocking copies,
torch.tensor(list, device="cuda"), stream/device synchronize). The scenario is run once first
as a warm-up (Triton compiles, allocators grow), then again after reset() under the check; the
tokens must match the warm-up's. Once eager (enforce_eager) and once with decode CUDA graphs.
Marked `gpu`; skipped without CUDA.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tests.support.step_scenario import PURE_DECODE_STEPS, RUNNER_LIMITS, scenario_diffs
from worker_service.config import RunnerConfig
from worker_service.runner.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@contextmanager
def sync_is_an_error():
    """Every synchronizing CUDA call torch makes inside raises RuntimeError."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def run(runner: ModelRunner, checked: bool) -> dict[int, list[int]]:
    """The scenario; with `checked`, every launch_step runs under sync_is_an_error."""
    tokens: dict[int, list[int]] = {}
    for diff in scenario_diffs():
        if checked:
            with sync_is_an_error():
                pending = runner.launch_step(diff)
        else:
            pending = runner.launch_step(diff)
        out = runner.finish_step(pending)              # the step's one allowed sync
        for handle, tok in zip(out.handles, out.sampled_token_ids):
            tokens.setdefault(handle, []).append(tok)
    return tokens


def test_sync_debug_mode_catches_a_sync():
    """The check itself works here: an .item() inside raises."""
    x = torch.ones(2, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"):
        with sync_is_an_error():
            x.sum().item()


def count_replays(runner: ModelRunner) -> list[int]:
    """The padded sizes of the decode steps that go through the graph runner from now on."""
    sizes: list[int] = []
    g = runner.graph_runner
    if g is not None:
        inner = g.replay_hidden          # what the model runner calls after staging

        def counted(staged):
            sizes.append(staged.padded)
            return inner(staged)

        g.replay_hidden = counted
    return sizes


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])    # MoE: the fused experts' path
def test_no_host_sync_before_the_read_back(tiny_models, arch, enforce_eager):
    runner = ModelRunner(RunnerConfig(model_dir=tiny_models(arch), device="cuda",
                                      dtype="float32", attention_backend="triton",
                                      enforce_eager=enforce_eager, max_graph_batch=4,
                                      **RUNNER_LIMITS))
    runner.init_kv_cache(runner.determine_num_blocks())
    assert (runner.graph_runner is None) == enforce_eager
    replays = count_replays(runner)
    warm = run(runner, checked=False)
    runner.reset()
    replays.clear()
    checked = run(runner, checked=True)
    assert checked == warm
    assert sum(len(t) for t in checked.values()) > 40
    if not enforce_eager:
        assert len(replays) == len(PURE_DECODE_STEPS) and set(replays) == {2, 4}
        assert sorted(runner.graph_runner.graphs) == [1, 2, 4]
