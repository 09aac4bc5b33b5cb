"""CachedRequests: a running request's sampled ids live in its batch row; its cached state gets
them when it is preempted (so a resumed request refills its row with every id), and a token of a
step launched before the preemption still reaches the state."""
from __future__ import annotations

import numpy as np

from engine_common.request.params import SamplingParams, WorkerSamplingParams
from engine_common.wire.diff import NewRequestData, ResumedRequestData, SchedulerOutput
from worker_service.batch.cached_requests import CachedRequests
from worker_service.batch.input_batch import InputBatch


def _new(handle: int, prompt: list[int]) -> NewRequestData:
    return NewRequestData(handle, prompt, WorkerSamplingParams(SamplingParams(), seed=0),
                          [handle], len(prompt))


def _launch(cached: CachedRequests, handles: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """What a launched step keeps: its rows, the positions its ids go to, the layout."""
    batch = cached.batch
    rows = np.array([batch.handle_to_row[h] for h in handles], dtype=np.int64)
    positions = batch.num_tokens[rows].copy()
    batch.num_tokens[rows] += 1
    return rows, positions, batch.layout


def test_a_preempted_request_takes_its_sampled_ids_and_a_late_one_along():
    cached = CachedRequests(InputBatch(max_num_reqs=4, max_model_len=16, max_blocks_per_req=4))
    cached.apply(SchedulerOutput(0, new_requests=[_new(0, [5, 6]), _new(1, [7])]))
    rows, positions, layout = _launch(cached, [0, 1])
    assert cached.batch.layout == layout
    assert cached.record([0, 1], positions, np.array([10, 11]), rows) == [10, 11]
    rows, positions, _ = _launch(cached, [0, 1])         # step 2 launched, not finished...
    cached.apply(SchedulerOutput(1, preempted_handles=[0], new_block_ids={1: [3]}))
    assert cached.batch.layout != layout                   # ...when handle 0 leaves its row
    assert cached.states[0].output_token_ids == [10]
    assert cached.states[0].block_ids == [0]
    cached.record([0, 1], positions, np.array([20, 21]))  # looked up: handle 0 is gone
    assert cached.states[0].output_token_ids == [10, 20]
    assert cached.batch.output_ids(1) == [11, 21]
    row1 = cached.batch.handle_to_row[1]
    assert cached.batch.block_table[row1, :cached.batch.num_blocks[row1]].tolist() == [1, 3]
    cached.apply(SchedulerOutput(2, resumed_requests=[ResumedRequestData(0, [2], 0)]))
    row0 = cached.batch.handle_to_row[0]
    assert cached.batch.token_ids[row0, :4].tolist() == [5, 6, 10, 20]
    assert cached.batch.output_ids(0) == [10, 20]


def test_a_finished_request_takes_no_late_token():
    cached = CachedRequests(InputBatch(max_num_reqs=2, max_model_len=16, max_blocks_per_req=4))
    cached.apply(SchedulerOutput(0, new_requests=[_new(0, [5]), _new(1, [6])]))
    rows, positions, _ = _launch(cached, [0, 1])
    cached.apply(SchedulerOutput(1, finished_handles=[0]))
    assert cached.record([0, 1], positions, np.array([8, 9])) == [8, 9]
    assert 0 not in cached.states
    assert cached.batch.output_ids(1) == [9]
