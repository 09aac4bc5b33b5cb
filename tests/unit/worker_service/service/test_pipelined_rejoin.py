"""A pipelined node worker (step t+1 launched before step t is finished: the Step stream of
service/step_pipeline.py) given a diff in which a handle leaves the batch and joins it again:
the token step t sampled for the request that left must not land in the row of the one that
joined (it was recorded by handle after the diff was applied: over the new request's prompt).
The tiny model on the simulated device, whose launches are asynchronous as on CUDA."""
from __future__ import annotations

import pytest

from engine_common.wire.codec import decode_runner_output
from engine_common.wire.diff import ResumedRequestData, SchedulerOutput
from tests.support.garbage_diffs import enc, new
from worker_service.config import NodeLayout, RunnerConfig
from worker_service.ranks.runner_keeper import RunnerKeeper
from worker_service.service.node_worker import NodeWorker

FIRST = [3, 14, 15, 92, 65, 35]
SECOND = [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]     # SECOND[6] is not the device's token at 6


@pytest.fixture
def worker(tiny_models):
    node = NodeWorker(RunnerKeeper("cpu"), NodeLayout())
    node.init(RunnerConfig(model_dir=tiny_models("qwen3"), dtype="float32", block_size=4,
                           max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                           num_kv_blocks=64, simulated_device_ms=0.0), NodeLayout(), epoch=1)
    assert node.pipelined
    yield node
    node.close()


def _run(worker: NodeWorker, diffs: list[SchedulerOutput]) -> list:
    """Launch every diff on one stream, each before the previous one is finished; the replies'
    RunnerOutputs in step order."""
    stream = worker.open_stream(worker.stream_key(worker.epoch))
    replies = []
    for diff in diffs:
        replies += worker.launch_step(stream, 1, diff.step, enc(diff))
    replies += worker.flush(stream)
    return [decode_runner_output(reply.payload) for _, reply in replies]


def test_a_recycled_handle_gets_no_token_of_the_request_before_it(worker):
    outs = _run(worker, [
        SchedulerOutput(0, new_requests=[new(0, FIRST)], num_scheduled_tokens={0: 6}),
        SchedulerOutput(1, finished_handles=[0], new_requests=[new(0, SECOND)],
                        num_scheduled_tokens={0: 4})])       # a prefill chunk: no token
    assert [(o.step, o.handles) for o in outs] == [(0, [0]), (1, [])]
    batch = worker.ranks.runner.batch
    row = batch.handle_to_row[0]
    assert batch.token_ids[row, :len(SECOND)].tolist() == SECOND
    assert int(batch.num_known_ids[row]) == len(SECOND)


def test_a_request_preempted_and_resumed_in_one_diff_keeps_its_token(worker):
    """Resumed, it recomputes the tokens the scheduler knows (the prompt: step 0's token has
    not reached it) and samples nothing; the worker holds step 0's token for it. It was lost
    instead, and the request sampled index 6 a second time."""
    outs = _run(worker, [
        SchedulerOutput(0, new_requests=[new(0, FIRST)], num_scheduled_tokens={0: 6}),
        SchedulerOutput(1, preempted_handles=[0], resumed_requests=[
            ResumedRequestData(0, [4, 5], 0)], num_scheduled_tokens={0: 6})])
    assert [(o.step, o.handles) for o in outs] == [(0, [0]), (1, [])]
    batch = worker.ranks.runner.batch
    row = batch.handle_to_row[0]
    assert batch.token_ids[row, :7].tolist() == FIRST + outs[0].sampled_token_ids
    assert int(batch.num_tokens[row]) == int(batch.num_known_ids[row]) == 7
