"""Sampling inputs from the persistent batch: min_tokens stop masks, and their exemption for rows
whose grammar is complete (it allows only eos, so the grammar wins)."""
from __future__ import annotations

import numpy as np

from engine_common.params import SamplingParams, WorkerSamplingParams
from worker_service.runner.cached_request import CachedRequestState
from worker_service.runner.input_batch import InputBatch
from worker_service.runner.sampling_inputs import stop_mask_pairs


def _batch() -> InputBatch:
    batch = InputBatch(4, 32, 4)
    for handle in range(3):
        sampling = WorkerSamplingParams(SamplingParams(), seed=0, min_tokens=5, stop_ids=(2, 9))
        batch.add(CachedRequestState(handle, [4, 5], sampling, [0], 0))
    return batch


def test_rows_below_min_tokens_mask_their_stop_ids():
    batch = _batch()
    rows = np.arange(3)
    pairs = stop_mask_pairs(batch, rows, np.array([0, 5, 1]))
    assert pairs.tolist() == [[0, 0, 2, 2], [2, 9, 2, 9]]


def test_exempt_rows_keep_their_stop_ids():
    batch = _batch()
    pairs = stop_mask_pairs(batch, np.arange(3), np.array([0, 0, 0]),
                            np.array([False, True, False]))
    assert pairs.tolist() == [[0, 0, 2, 2], [2, 9, 2, 9]]
