"""TokenFeed.plan: the rows of a step's input ids that the previous step sampled. A step launched
at the batch layout of the previous one, over the same rows, maps row i to sampled id i without a
search; the search finds the same mapping."""
from __future__ import annotations

import numpy as np
import torch

from engine_common.request.params import SamplingParams, WorkerSamplingParams
from worker_service.batch.input_batch import CachedRequestState, InputBatch
from worker_service.sample.token_readback import PendingStep, TokenFeed
from worker_service.step.step_buffers import StepBuffers
from worker_service.step.step_inputs import prepare_step_inputs


def _batch() -> InputBatch:
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_blocks_per_req=4)
    for h in (7, 3, 5):
        batch.add(CachedRequestState(h, [1, 2, 3], WorkerSamplingParams(SamplingParams(), 0),
                                     [h], 3))
    return batch


def _launched(batch: InputBatch) -> PendingStep:
    """A step that sampled rows 0..2 and counted their tokens (ids not written yet)."""
    rows = np.arange(3)
    prev = PendingStep(0, [7, 3, 5], batch.num_tokens[rows].copy(), rows=rows,
                       layout=batch.layout, sampled=torch.tensor([9, 8, 7]))
    batch.num_tokens[:3] += 1
    return prev


def _plans(batch: InputBatch, prev: PendingStep) -> list:
    inputs = prepare_step_inputs(batch, None, 4)
    plans = []
    for layout in (batch.layout, None):
        staging = StepBuffers(16, 4, 4, "cpu")
        staging.begin()
        feed = TokenFeed.plan(prev, batch.handle_ids, inputs, staging, layout)
        plans.append(None if feed is None else (feed.dst.tolist(), feed.src.tolist()))
    return plans


def test_the_same_rows_map_without_a_search_and_as_the_search_does():
    batch = _batch()
    prev = _launched(batch)
    fast, searched = _plans(batch, prev)
    assert fast == searched == ([0, 1, 2], [0, 1, 2])


def test_rows_that_changed_hands_are_searched_by_handle():
    batch = _batch()
    prev = _launched(batch)
    batch.remove(7)                # handle 5 moves into row 0
    batch.condense()
    fast, searched = _plans(batch, prev)
    assert fast == searched == ([0, 1], [2, 1])


def test_pending_step_waits_on_its_read_back():
    """The pipelined worker's watcher waits on a launched step's device work through
    PendingStep.wait_device (service/step_pipeline.py); a module function placed inside the
    dataclass once left it without the method, and every pipelined worker's step 1 hung."""
    waited = []

    class Tokens:
        def wait_device(self):
            waited.append("tokens")

    PendingStep(3, tokens=Tokens()).wait_device()
    PendingStep(4).wait_device()                    # nothing sampled, no copies: returns
    assert waited == ["tokens"]
