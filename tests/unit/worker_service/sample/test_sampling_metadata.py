"""Sampling metadata from the persistent batch: min_tokens stop masks, and their exemption for rows
whose grammar is complete (it allows only eos, so the grammar wins); logit_bias and
allowed_token_ids pairs."""
from __future__ import annotations

import numpy as np
import torch

from engine_common.request.params import SamplingParams, WorkerSamplingParams
from worker_service.batch.input_batch import CachedRequestState, InputBatch
from worker_service.sample.sampling_metadata import (build_sampling_metadata, staged_row_dtypes,
                                                     stop_mask_pairs)
from worker_service.step.step_buffers import StepBuffers


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


def test_logit_bias_reaches_the_sampler_as_row_id_pairs_and_exact_floats():
    """Staged through the step's one int64 copy (the float32 biases as their bit patterns)."""
    batch = InputBatch(4, 32, 4)
    biases = [{3: -100.0, 7: 0.1}, {}, {1: 2.5}]
    for handle, bias in enumerate(biases):
        sampling = WorkerSamplingParams(SamplingParams(logit_bias=bias), seed=0)
        batch.add(CachedRequestState(handle, [4, 5], sampling, [0], 0))
    rows = np.array([2, 0, 1])          # the batch's rows in the order they sample
    staging = StepBuffers(8, 4, 4, "cpu", staged_row_dtypes())
    staging.begin()
    meta = build_sampling_metadata(batch, rows, 32, staging)
    staging.flush()
    assert meta.logit_bias_index.tolist() == [[0, 1, 1], [1, 3, 7]]
    assert meta.logit_bias_values.dtype == torch.float32
    assert meta.logit_bias_values.tolist() == np.array([2.5, -100.0, 0.1], np.float32).tolist()
    staging.begin()
    plain = build_sampling_metadata(batch, np.array([1]), 32, staging)
    assert plain.logit_bias_index is None and plain.logit_bias_values is None


def test_allowed_token_ids_reach_the_sampler_as_row_id_pairs_and_survive_condense():
    batch = InputBatch(4, 32, 4)
    for handle, ids in enumerate([(3, 7), (), (1,), (8, 9)]):
        sampling = WorkerSamplingParams(SamplingParams(allowed_token_ids=ids), seed=0)
        batch.add(CachedRequestState(handle, [4, 5], sampling, [0], 0))
    batch.remove(1)
    batch.condense()                    # row 3 (ids 8, 9) moves into row 1's hole
    staging = StepBuffers(8, 4, 4, "cpu", staged_row_dtypes())
    staging.begin()
    meta = build_sampling_metadata(batch, np.array([2, 0, 1]), 32, staging)
    staging.flush()
    assert meta.id_sets["allowed_token_ids"].tolist() == [[0, 1, 1, 2, 2], [1, 3, 7, 8, 9]]
    staging.begin()
    moved = build_sampling_metadata(batch, np.array([1]), 32, staging)
    assert moved.id_sets["allowed_token_ids"].tolist() == [[0, 0], [8, 9]]
