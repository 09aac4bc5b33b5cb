"""Persistent step staging: allocated once, staged views equal the numpy inputs, errors on
overflow; the model runner stages every step (eager and decode-graph paths) from the same
arenas. CPU; the no-host-sync check on CUDA is tests/test_gpu_no_host_sync.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_common.wire.diff import SchedulerOutput
from tests.support.step_scenario import NUM_STEPS, PURE_DECODE_STEPS, RUNNER_LIMITS, scenario_diffs
from worker_service.config import RunnerConfig
from worker_service.step.cuda_graphs import DecodeGraphRunner
from worker_service.runner.model_runner import ModelRunner
from worker_service.sample.sampling_metadata import build_sampling_metadata
from worker_service.step.step_buffers import (ALIGN_BYTES, StepBuffers, StepTooLarge,
                                                attention_metadata, stage_step_inputs)
from worker_service.failures import FailureKind, StepProtocolError, as_failure
from worker_service.batch.diff_check import BadDiff
from worker_service.step.step_inputs import prepare_step_inputs


def make_runner(model_dir: str, graph_path: bool = False) -> ModelRunner:
    """A CPU runner at the scenario's limits; graph_path routes pure-decode steps through an
    (uncaptured) DecodeGraphRunner sharing the runner's staging, as CUDA would."""
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, dtype="float32",
                                      attention_backend="torch", **RUNNER_LIMITS))
    runner.init_kv_cache(runner.determine_num_blocks())
    if graph_path:
        runner.graph_runner = DecodeGraphRunner(
            runner.model, runner.kv_caches, runner.config.max_num_seqs,
            runner.batch.block_table.shape[1], runner.max_model_len, "cpu", runner.staging)
    return runner


def arena_pointers(runner: ModelRunner) -> list[int]:
    return [t.data_ptr() for a in runner.staging.arenas.values() for t in (a.host, a.dev)]


def inside(view: torch.Tensor, base: torch.Tensor) -> bool:
    start = base.data_ptr()
    return start <= view.data_ptr() and (view.data_ptr() + view.numel() * view.element_size()
                                         <= start + base.numel() * base.element_size())


def scheduled_counts(runner: ModelRunner, diff: SchedulerOutput) -> np.ndarray:
    """What the runner schedules per batch row for `diff` (after the diff is applied)."""
    counts = np.ones(runner.batch.num_reqs, dtype=np.int32)
    for handle, n in diff.num_scheduled_tokens.items():
        counts[runner.batch.handle_to_row[handle]] = n
    return counts


def run_scenario(runner: ModelRunner) -> tuple[dict[int, list[int]], list[dict]]:
    """Run every scenario step; returns (tokens per handle, what each eager forward read)."""
    seen: list[dict] = []
    current: dict = {}

    def record(module, args):
        """Keep what the forward reads: copies (the arenas are reused next step) and whether
        each device tensor is an aligned view of the staging arenas."""
        input_ids, positions, _, meta = args
        i64 = runner.staging.arenas[torch.int64].dev
        i32 = runner.staging.arenas[torch.int32].dev
        views = dict(input_ids=(input_ids, i64), positions=(positions, i64),
                     slot_mapping=(meta.slot_mapping, i64),
                     query_start_loc=(meta.query_start_loc, i32),
                     seq_lens=(meta.seq_lens, i32), block_table=(meta.block_table, i32))
        seen.append(dict(
            step=current["diff"].step, meta=meta,
            staged={name: t.tolist() for name, (t, _) in views.items()},
            in_arena={name: inside(t, arena) and t.data_ptr() % ALIGN_BYTES == 0
                      for name, (t, arena) in views.items()},
            host=(meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()),
            expected=prepare_step_inputs(runner.batch, scheduled_counts(runner, current["diff"]),
                                         runner.block_size)))

    hook = runner.model.register_forward_pre_hook(record)
    tokens: dict[int, list[int]] = {}
    try:
        for diff in scenario_diffs():
            current["diff"] = diff
            out = runner.execute_diff(diff)
            for handle, tok in zip(out.handles, out.sampled_token_ids):
                tokens.setdefault(handle, []).append(tok)
            assert 0 in out.top_logprobs or 0 not in out.handles
    finally:
        hook.remove()
    return tokens, seen


def test_runner_stages_every_step_in_buffers_allocated_once(tiny_models):
    """Over the whole scenario (a 16-token step = max_num_batched_tokens, 4-row steps =
    max_num_seqs, chunked prefill, a step that samples nothing) the arenas keep their
    addresses, every eager forward reads views of them, and those equal the numpy StepInputs."""
    runner = make_runner(tiny_models("qwen3"))
    before = arena_pointers(runner)
    readback = (runner.readback._ids.data_ptr(), runner.readback._logprobs.data_ptr())
    tokens, seen = run_scenario(runner)
    assert arena_pointers(runner) == before
    assert (runner.readback._ids.data_ptr(), runner.readback._logprobs.data_ptr()) == readback
    assert [s["step"] for s in seen] == list(range(NUM_STEPS))
    assert max(s["expected"].num_tokens for s in seen) == RUNNER_LIMITS["max_num_batched_tokens"]
    assert max(len(s["expected"].rows) for s in seen) == RUNNER_LIMITS["max_num_seqs"]
    for s in seen:
        exp, meta = s["expected"], s["meta"]
        assert all(s["in_arena"].values()), s["in_arena"]
        for name, values in s["staged"].items():
            assert values == getattr(exp, name).tolist(), (s["step"], name)
        assert s["host"] == (exp.query_start_loc.tolist(), exp.seq_lens.tolist())
        assert (meta.max_query_len, meta.max_seq_len) == (int(exp.num_scheduled.max()),
                                                          int(exp.seq_lens.max()))
    # every request sampled once per step it reached its last known token
    assert {h: len(t) for h, t in tokens.items()} == {0: 6, 1: 9, 2: 11, 3: 12, 4: 8, 5: 3}
    assert all(t not in (5, 9, 11) for t in tokens[3][:3])       # min_tokens stop mask


def test_decode_graph_path_shares_the_staging_and_gives_the_same_tokens(tiny_models):
    """Pure-decode steps through the decode buffers (padded, uncaptured) sample exactly what
    the eager path samples; only mixed steps reach the model eagerly."""
    eager_tokens, _ = run_scenario(make_runner(tiny_models("qwen3")))
    runner = make_runner(tiny_models("qwen3"), graph_path=True)
    before = arena_pointers(runner)
    graph_tokens, seen = run_scenario(runner)
    assert graph_tokens == eager_tokens
    assert arena_pointers(runner) == before
    buffers = runner.graph_runner.buffers
    graph_steps = [s for s in seen if s["meta"] is buffers.metadata(s["meta"].num_reqs)]
    assert [s["step"] for s in graph_steps] == list(PURE_DECODE_STEPS)
    for s in graph_steps:                        # real rows, then padding rows
        exp, padded = s["expected"], s["meta"].num_reqs
        n = len(exp.rows)
        assert padded == (4 if n == 3 else n)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            assert s["staged"][name][:n] == getattr(exp, name).tolist(), (s["step"], name)
        assert s["staged"]["slot_mapping"][n:] == [-1] * (padded - n)
        assert s["staged"]["seq_lens"][n:] == [1] * (padded - n)
        assert s["host"][1][:n] == exp.seq_lens.tolist()


def test_a_step_larger_than_the_buffers_is_rejected(tiny_models):
    runner = make_runner(tiny_models("qwen3"))
    first = scenario_diffs()[0]
    first.new_requests[0].prompt_token_ids += [3]                   # 11 + 6 = 17 tokens
    first.num_scheduled_tokens[0] = 11
    # The diff check refuses it before the staging buffers are asked (they stay a backstop).
    with pytest.raises(BadDiff, match=r"tokens in the step=17 is invalid: must be <= "
                                      r"max_num_batched_tokens \(16\)") as err:
        runner.execute_diff(first)
    assert as_failure(err.value).kind == FailureKind.BAD_PAYLOAD     # reported, not a crash


def test_staging_layout_alignment_and_limits():
    buf = StepBuffers(max_num_tokens=8, max_num_reqs=3, max_blocks_per_req=2, device="cpu",
                      row_regions=[torch.float32])
    buf.begin()
    a = buf.put(np.arange(5), torch.int64)
    b = buf.put(np.array([1.5, 2.5]), torch.float32)
    c = buf.put(np.arange(3), torch.int64)
    assert a.tolist() == [0, 1, 2, 3, 4] and b.tolist() == [1.5, 2.5] and c.tolist() == [0, 1, 2]
    assert all(t.data_ptr() % ALIGN_BYTES == 0 for t in (a, b, c))
    host, dev = buf.take((2, 3), torch.int32)
    host[:] = [[1, 2, 3], [4, 5, 6]]
    assert dev.tolist() == [[1, 2, 3], [4, 5, 6]] and dev.is_contiguous()
    buf.begin()                                                      # regions free again
    assert buf.put(np.array([9]), torch.int64).data_ptr() == a.data_ptr()
    with pytest.raises(StepTooLarge, match="num_reqs=4 is invalid: must be <= max_num_seqs=3"):
        buf.check_fits(num_tokens=4, num_reqs=4, num_blocks=1)
    with pytest.raises(StepTooLarge, match="num_blocks=3 .* max_blocks_per_req=2"):
        buf.check_fits(num_tokens=4, num_reqs=1, num_blocks=3)
    with pytest.raises(StepTooLarge, match="arena capacity"):       # never writes past the end
        buf.put(np.zeros(10_000), torch.float32)
    ragged = buf.put_ragged([np.array([[1, 2], [3, 4]]), np.array([7])])
    assert [r.tolist() for r in ragged] == [[[1, 2], [3, 4]], [7]]


def test_stage_step_inputs_and_sampling_columns_equal_numpy(tiny_models):
    """Direct staging of one mixed step: model inputs, attention metadata, and the sampling
    metadata built from the batch slices (penalty id matrices, stop-mask pairs, top_k_max)."""
    runner = make_runner(tiny_models("qwen3"))
    diffs = scenario_diffs()
    for diff in diffs[:2]:
        runner.execute_diff(diff)
    runner._apply_diff(diffs[2])                                     # h2, h3 join: 4 rows
    inputs = prepare_step_inputs(runner.batch, scheduled_counts(runner, diffs[2]), 4)
    runner.staging.begin()
    staged = stage_step_inputs(runner.staging, inputs)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "block_table", "logits_indices"):
        assert getattr(staged, name).tolist() == getattr(inputs, name).tolist(), name
    meta = attention_metadata(inputs, staged)
    assert meta.num_actual_tokens == 7 and meta.max_query_len == 3
    b, rows = runner.batch, inputs.rows[inputs.sample_mask]
    sm = build_sampling_metadata(b, rows, runner.vocab_size, runner.staging)
    runner.staging.flush()
    assert sm.temperature.tolist() == b.temperature[rows].tolist()
    assert sm.top_k.tolist() == b.top_k[rows].tolist() and sm.top_k_max == 5
    assert sm.seeds.tolist() == b.seeds[rows].tolist()
    assert sm.counters.tolist() == (b.num_tokens[rows] - b.num_prompt_tokens[rows]).tolist()
    assert sm.repetition_penalty.tolist() == pytest.approx(b.repetition_penalty[rows].tolist())
    h3 = list(rows).index(b.handle_to_row[3])
    assert sm.stop_mask_index.tolist() == [[h3] * 3, [5, 9, 11]]
    h2 = list(rows).index(b.handle_to_row[2])
    prompt_h2 = runner.requests[2].prompt_token_ids
    assert sm.prompt_token_ids[h2, :3].tolist() == prompt_h2
    assert set(sm.prompt_token_ids[h2, 3:].tolist()) <= {runner.vocab_size}
    assert not sm.all_greedy and not sm.all_random and sm.max_num_logprobs == 2


def test_a_step_of_the_same_shape_reuses_its_region_views_and_the_cache_is_bounded(
        monkeypatch):
    from worker_service.step import step_buffers
    monkeypatch.setattr(step_buffers, "MAX_CACHED_VIEWS", 8)
    buffers = StepBuffers(64, 8, 4, "cpu")
    views = []
    for values in (np.arange(5), np.arange(5) + 100):
        buffers.begin()
        views.append(buffers.put(values, torch.int64, "ids"))
        assert views[-1].tolist() == values.tolist()
    assert views[0] is views[1]
    arena = buffers.arenas[torch.int64]
    for n in range(1, 30):
        arena.used = 0
        host, dev = arena.take((n, 1), "many shapes")
        assert host.shape == tuple(dev.shape) == (n, 1)
    assert 1 <= len(arena._views) <= 8
