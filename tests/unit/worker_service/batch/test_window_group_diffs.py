"""A hybrid model's window group on the worker (engine_common/request/kv_groups.py) through a
real ModelRunner (tiny Gemma 2: layers window 8 / full alternating): the split of the cache and
its tensors, and the diffs' window tables checked before anything is applied."""
from __future__ import annotations

import pytest

from engine_common.request.kv_groups import WindowGroup
from engine_common.wire.diff import SchedulerOutput
from tests.support.garbage_diffs import PROMPT, enc, new
from worker_service.config import RunnerConfig
from worker_service.failures import FailureKind, as_failure
from worker_service.runner.model_runner import ModelRunner

LIMITS = dict(block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
BOUND = 4 * (2 + 3) + 2 * 16          # kv_groups.window_pool_bound of LIMITS and window 8


def _runner(path: str, num_blocks: int, **config) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model_dir=path, dtype="float32", **LIMITS, **config))
    runner.init_kv_cache(num_blocks)
    return runner


@pytest.fixture(scope="module")
def gemma(tiny_models) -> ModelRunner:
    return _runner(tiny_models("gemma2", seed=4), 100)


def _prefill(window_ids: dict) -> bytes:
    return enc(SchedulerOutput(0, new_requests=[new()], num_scheduled_tokens={0: len(PROMPT)},
                               new_window_block_ids=window_ids))


def _refused(runner: ModelRunner, payload: bytes) -> str:
    runner.reset()
    with pytest.raises(Exception) as err:
        runner.execute(payload)
    failure = as_failure(err.value)
    assert failure.kind in (FailureKind.BAD_PAYLOAD, FailureKind.BAD_STATE), failure
    return str(failure)


def test_the_cache_splits_into_a_full_and_a_window_pool(gemma):
    full = (100 * 4 - BOUND * 2) // 2
    assert gemma.window_group == WindowGroup(8, BOUND)
    assert [c.shape[1] for c in gemma.kv_caches] == [BOUND, full, BOUND, full]
    assert (gemma.diff_bounds.num_kv_blocks, gemma.diff_bounds.num_window_blocks) == (full, BOUND)
    assert gemma.graph_runner is None


def test_a_budget_below_the_bound_keeps_one_pool(tiny_models):
    runner = _runner(tiny_models("gemma2", seed=4), BOUND - 1)
    assert runner.window_group is None and runner.batch.window_table is None
    assert [c.shape[1] for c in runner.kv_caches] == [BOUND - 1] * 4


def test_vllms_flag_keeps_one_pool(tiny_models):
    runner = _runner(tiny_models("gemma2", seed=4), 100, disable_hybrid_kv_cache_manager=True)
    assert runner.window_group is None and runner.diff_bounds.num_window_blocks == 0
    assert [c.shape[1] for c in runner.kv_caches] == [100] * 4


def test_a_prefill_with_its_window_table_runs(gemma):
    gemma.reset()
    out = gemma.execute(_prefill({0: [5, 6, 7, 8]}))
    assert out                                             # it sampled (an encoded reply)


def test_window_ids_past_the_pool_are_refused_naming_the_field(gemma):
    message = _refused(gemma, _prefill({0: [5, 6, 7, BOUND]}))
    assert f"new_window_block_ids[0][3]={BOUND} is invalid: must be < num_window_blocks " \
           f"({BOUND})" in message
    assert not gemma.requests


def test_a_request_without_its_window_table_is_refused(gemma):
    assert "not enough window-group KV blocks" in _refused(gemma, _prefill({}))


def test_a_model_without_a_window_group_refuses_window_ids(tiny_models):
    runner = _runner(tiny_models("qwen3"), 100)
    message = _refused(runner, _prefill({0: [1, 2, 3, 4]}))
    assert "new_window_block_ids[0]" in message and "no window group" in message
