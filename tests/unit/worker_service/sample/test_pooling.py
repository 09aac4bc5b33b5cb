"""worker_service.sample.pooling: what a worker refuses of a pooling request (before the diff is
applied), and the token types a step's sentence pairs give the model."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_common.request.params import SamplingParams
from engine_common.request.pooling import NO_POOLING, PoolerConfig, with_pair_start
from engine_common.wire.diff import NewRequestData, WorkerSamplingParams
from worker_service.batch.diff_check import BadDiff
from worker_service.sample.pooling import PoolingBook

EMBED = PoolerConfig("CLS", True, True).code
CLASSIFY = PoolerConfig("CLS", False, True, classify=True).code


def new(handle: int, pooling: int, n: int = 6) -> NewRequestData:
    return NewRequestData(handle, list(range(3, 3 + n)),
                          WorkerSamplingParams(SamplingParams(), seed=1), [handle], 0,
                          pooling=pooling)


@pytest.mark.parametrize("book, pooling, says", [
    (PoolingBook(only=True), NO_POOLING, "no LM head"),
    (PoolingBook(only=True), CLASSIFY, "CLASSIFY set exactly when.*classifier \\(False\\)"),
    (PoolingBook(only=True, classifier=True), EMBED, "classifier \\(True\\)"),
    (PoolingBook(only=True, classifier=True), with_pair_start(CLASSIFY, 2),
     "no pair start \\(this model has no token types\\)"),
    (PoolingBook(only=True, classifier=True, token_types=True), with_pair_start(CLASSIFY, 6),
     "a pair start below the prompt's 6 tokens"),
])
def test_refused_before_anything_is_applied(book, pooling, says):
    with pytest.raises(BadDiff, match=says):
        book.check_new([new(1, pooling)])


def test_a_steps_pairs_give_type_one_rows():
    """Two whole-prompt requests in one step: rows 0-5 (pair from 4) and 6-9 (no pair)."""
    book = PoolingBook(only=True, classifier=True, token_types=True)
    diff = SimpleNamespace(finished_handles=[], new_requests=[
        new(1, with_pair_start(CLASSIFY, 4)), new(2, CLASSIFY, 4)])
    book.check_new(diff.new_requests)
    book.apply(diff)
    batch = SimpleNamespace(handle_ids=np.array([1, 2]), num_computed=np.array([0, 0]))
    inputs = SimpleNamespace(rows=np.array([0, 1]), num_scheduled=np.array([6, 4]),
                             query_start_loc=np.array([0, 6, 10]))
    step = book.plan(batch, inputs)
    assert step.type1_rows == [(4, 6)]
    types = step.token_type_ids(12, torch.device("cpu"))
    assert types.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
    assert not book.pending                           # both prompts done in this step
