"""Build the sampler's inputs for the rows that sample this step, staged from the batch arrays.

Every column is sliced from the InputBatch with numpy and staged in the runner's StepBuffers
(reaching the device with the step's one copy per dtype); the ragged parts (penalty id matrices,
stop-mask pairs, logit-bias pairs) go through StepBuffers.put_ragged (per-step pinned memory, one copy). Flags and
bounds the sampler branches on (all_greedy, top_k_max, max_num_logprobs) are computed here, on
the host, so the sampler never reads a device value.
"""
from __future__ import annotations

import numpy as np
import torch

from engine_common.request.params import COLUMN_KNOBS, HISTORY_KNOBS, ID_SET_KNOBS
from worker_service.batch.input_batch import InputBatch
from worker_service.sample.sampling_metadata import SamplingMetadata
from worker_service.step.step_buffers import StepBuffers


def _opt(staging: StepBuffers, values: np.ndarray, off_value, dtype: torch.dtype,
         name: str) -> torch.Tensor | None:
    """A staged column, or None when every row has the parameter switched off."""
    if np.all(values == off_value):
        return None
    return staging.put(values, dtype, name)


def _padded_ids(batch: InputBatch, rows: np.ndarray, start: np.ndarray, end: np.ndarray,
                pad: int) -> np.ndarray:
    """token_ids[row, start:end] per row, right-padded with `pad` (an id past the vocab)."""
    width = int((end - start).max()) if len(rows) else 0
    cols = start[:, None] + np.arange(width)[None, :]
    valid = cols < end[:, None]
    ids = batch.token_ids[rows[:, None], np.where(valid, cols, 0)]
    return np.where(valid, ids, pad)


def stop_mask_pairs(batch: InputBatch, rows: np.ndarray, counters: np.ndarray,
                    exempt: np.ndarray | None = None) -> np.ndarray:
    """int64 [2, K]: (index into rows, token id) for every stop id of a row that has generated
    fewer than min_tokens tokens, except `exempt` rows (bool per row: a complete grammar, which
    allows only eos)."""
    early = counters < batch.min_tokens[rows]
    need = np.flatnonzero(early if exempt is None else early & ~exempt)
    ids = [batch.stop_ids[rows[i]] for i in need]
    pair_rows = np.repeat(need, [len(x) for x in ids]).astype(np.int64)
    pair_ids = np.fromiter((t for x in ids for t in x), dtype=np.int64, count=len(pair_rows))
    return np.stack([pair_rows, pair_ids])


def rows_setting(batch: InputBatch, name: str, rows: np.ndarray) -> np.ndarray:
    """int64 indices into `rows` of the rows whose list-valued knob `name` is not empty."""
    return np.flatnonzero(batch.num_entries[name][rows]).astype(np.int64)


def logit_bias_pairs(batch: InputBatch, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [2, K] of (index into rows, token id), float32 [K] of biases) of the rows'
    logit_bias entries."""
    some = rows_setting(batch, "logit_bias", rows)
    biases = [batch.logit_bias[rows[i]] for i in some]
    pair_rows = np.repeat(some, [len(b) for b in biases])
    flat = [pair for b in biases for pair in b]
    ids = np.fromiter((t for t, _ in flat), dtype=np.int64, count=len(flat))
    values = np.fromiter((v for _, v in flat), dtype=np.float32, count=len(flat))
    return np.stack([pair_rows, ids]), values


def top_k_bound(top_k: np.ndarray, vocab_size: int) -> int:
    """The largest active top_k (0 < k < vocab) over the rows, at least 1 (the width of the
    sampler's one topk)."""
    active = top_k[(top_k > 0) & (top_k < vocab_size)]
    return int(active.max()) if len(active) else 1


def knob_columns(batch: InputBatch, rows: np.ndarray, staging: StepBuffers
                 ) -> dict[str, torch.Tensor | None]:
    """Each knob column of `rows` staged, by name; None where every row is neutral (unless the
    knob is always staged)."""
    columns = {}
    for k in COLUMN_KNOBS:
        values, dtype = getattr(batch, k.name)[rows], getattr(torch, k.meta.column)
        columns[k.name] = (staging.put(values, dtype, k.name) if k.meta.always_staged
                           else _opt(staging, values, k.column_neutral, dtype, k.name))
    return columns


def id_set_pairs(batch: InputBatch, rows: np.ndarray) -> dict[str, np.ndarray]:
    """int64 [2, K] of (index into rows, token id) per id-set knob some row sets."""
    pairs = {}
    for k in ID_SET_KNOBS:
        some = rows_setting(batch, k.name, rows)
        if len(some):
            sets = [batch.id_sets[k.name][rows[i]] for i in some]
            pair_rows = np.repeat(some, [len(x) for x in sets])
            ids = np.fromiter((t for x in sets for t in x), dtype=np.int64, count=len(pair_rows))
            pairs[k.name] = np.stack([pair_rows, ids])
    return pairs


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                            staging: StepBuffers,
                            grammar_done: np.ndarray | None = None) -> SamplingMetadata:
    """Stage the sampling columns of `rows` (call between staging.begin() and flush()).
    `grammar_done`: bool per row, True where a complete grammar allows only eos (min_tokens
    then does not mask it: the grammar wins)."""
    greedy = batch.temperature[rows] == 0.0
    columns = knob_columns(batch, rows, staging)
    penalties = any(columns[k.name] is not None for k in HISTORY_KNOBS)
    num_prompt = batch.num_prompt_tokens[rows]
    num_tokens = batch.num_tokens[rows]
    counters = (num_tokens - num_prompt).astype(np.int64)

    ragged = []
    if penalties:
        ragged += [_padded_ids(batch, rows, np.zeros_like(num_prompt), num_prompt, vocab_size),
                   _padded_ids(batch, rows, num_prompt, num_tokens, vocab_size)]
    stop_pairs = stop_mask_pairs(batch, rows, counters, grammar_done)
    if stop_pairs.shape[1]:
        ragged.append(stop_pairs)
    id_sets = id_set_pairs(batch, rows)
    ragged += id_sets.values()
    bias_pairs, bias_values = logit_bias_pairs(batch, rows)
    if len(bias_values):   # the float32 biases travel as their bit patterns in the int64 copy
        ragged += [bias_pairs, bias_values.view(np.int32).astype(np.int64)]
    staged = staging.put_ragged(ragged) if ragged else []
    prompt_ids, output_ids = (staged[0], staged[1]) if penalties else (None, None)
    bias_index = bias = None
    if len(bias_values):
        bias_index, bias = staged[-2], staged[-1].to(torch.int32).view(torch.float32)
        staged = staged[:-2]
    staged_sets = dict(zip(id_sets, staged[len(staged) - len(id_sets):]))
    stop_index = staged[len(staged) - len(id_sets) - 1] if stop_pairs.shape[1] else None

    return SamplingMetadata(
        **columns,
        all_greedy=bool(greedy.all()),
        all_random=bool((~greedy).all()),
        seeds=staging.put(batch.seeds[rows], torch.int64, "seeds"),
        counters=staging.put(counters, torch.int64, "counters"),
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        stop_mask_index=stop_index,
        logit_bias_index=bias_index, logit_bias_values=bias,
        id_sets=staged_sets,
        max_num_logprobs=int(batch.num_logprobs[rows].max()) if len(rows) else 0,
        top_k_max=top_k_bound(batch.top_k[rows], vocab_size),
    )
