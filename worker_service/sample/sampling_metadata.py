"""The sampler's per-step inputs: SamplingMetadata, and its build from the batch columns of the
rows that sample this step.

Every knob column (engine_common/request/params.py KNOBS) is sliced from the InputBatch with
numpy and staged in the runner's StepBuffers (reaching the device with the step's one copy per
dtype; `staged_row_dtypes` sizes its regions); the ragged parts (penalty id matrices, stop-mask
pairs, logit-bias pairs, id sets) go through StepBuffers.put_ragged (per-step pinned memory, one
copy). Everything the sampler branches on (all_greedy, top_k_max, max_num_logprobs, shapes) is
computed here, on the host, so sampling never reads a device value back: no host sync. A feature
no live row of the batch turns on (InputBatch.num_rows_setting) costs no numpy call at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine_common.request.params import COLUMN_KNOBS, HISTORY_KNOBS, ID_SET_KNOBS
from engine_common.wire.diff import NewRequestData
from worker_service.batch.input_batch import InputBatch
from worker_service.step.step_buffers import StepBuffers


@dataclass
class SamplingMetadata:
    """Everything the sampler needs, as device tensors indexed by batch row.

    Optional tensors are None when no row uses the feature; a row that does not use it carries the
    neutral value (top_p 1.0, top_k 0, min_p 0.0, repetition 1.0, presence/frequency 0.0).
    Token-id matrices are padded with vocab_size (an id the sampler ignores).
    """

    temperature: torch.Tensor                    # float32 [N]; 0.0 = greedy row
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None                   # float32 [N]; 1.0 = off
    top_k: torch.Tensor | None                   # int32 [N]; 0 = off
    min_p: torch.Tensor | None                   # float32 [N]; 0.0 = off
    seeds: torch.Tensor                          # int64 [N], in [0, 2^63)
    counters: torch.Tensor                       # int64 [N]: tokens generated so far by the row
    repetition_penalty: torch.Tensor | None      # float32 [N]
    presence_penalty: torch.Tensor | None        # float32 [N]
    frequency_penalty: torch.Tensor | None       # float32 [N]
    prompt_token_ids: torch.Tensor | None        # int64 [N, P], padded with vocab_size
    output_token_ids: torch.Tensor | None        # int64 [N, O], padded with vocab_size
    # int64 [2, K]: (row, token id) pairs forbidden this step (the row has produced fewer than
    # min_tokens tokens); None = nothing forbidden
    stop_mask_index: torch.Tensor | None = None
    # int64 [2, K] (row, token id) and float32 [K]: biases added to those logits first (the
    # request's logit_bias); None = no row has one
    logit_bias_index: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    # Per knob that is a set of token ids (engine_common/request/sampling_knobs.py), int64 [2, K] of
    # (row, token id) pairs; a knob no row sets is absent
    id_sets: dict[str, torch.Tensor] = field(default_factory=dict)
    max_num_logprobs: int = 0                    # top alternatives to return; 0 = sampled only
    # Some row wants its sampled token's logprob (False: none is computed; the sampler returns
    # an empty logprob tensor)
    wants_logprobs: bool = True
    # Host-known upper bound of the active top_k values (>= every top_k in (0, vocab)): the
    # width of the one topk apply_top_k runs. Required (>= 1) when top_k is set.
    top_k_max: int = 0
    # Structured output: the rows (int64 [K]; None = every row, in order) whose request is
    # constrained and their masks as an additive bias, float32 [K, V] of 0 (allowed) / -inf
    # (worker_service/sample/grammar.py); grammar_bias None = nothing constrained.
    grammar_rows: torch.Tensor | None = None
    grammar_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k_max < 1:
            raise ValueError(f"top_k_max={self.top_k_max} is invalid: must be >= 1 (an upper "
                             "bound of the rows' top_k) when top_k is set")

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty is not None or self.presence_penalty is not None
                or self.frequency_penalty is not None)


def worst_case_sampling_metadata(num_rows: int, vocab_size: int, device: torch.device | str,
                                 max_num_logprobs: int = 20) -> SamplingMetadata:
    """Every feature on for every row (the sampler's largest temporaries), for memory profiling."""
    def full(value, dtype):
        return torch.full((num_rows,), value, dtype=dtype, device=device)

    ids = torch.zeros((num_rows, 16), dtype=torch.int64, device=device)
    stop = torch.stack([torch.arange(num_rows, device=device), ids[:, 0]])   # id 0 per row
    allowed = torch.stack([stop[0], stop[1] + 1])     # every row restricted to id 1
    return SamplingMetadata(
        temperature=full(0.8, torch.float32), all_greedy=False, all_random=True,
        top_p=full(0.9, torch.float32), top_k=full(50, torch.int32), min_p=full(0.05, torch.float32),
        seeds=full(0, torch.int64), counters=full(0, torch.int64),
        repetition_penalty=full(1.1, torch.float32), presence_penalty=full(0.1, torch.float32),
        frequency_penalty=full(0.1, torch.float32), prompt_token_ids=ids, output_token_ids=ids,
        stop_mask_index=stop, max_num_logprobs=max_num_logprobs, top_k_max=50,
        id_sets={k.name: allowed for k in ID_SET_KNOBS})


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
        if not (k.meta.always_staged or batch.num_rows_setting[k.name]):
            columns[k.name] = None
            continue
        values, dtype = getattr(batch, k.name)[rows], getattr(torch, k.meta.column)
        columns[k.name] = (staging.put(values, dtype, k.name) if k.meta.always_staged
                           else _opt(staging, values, k.column_neutral, dtype, k.name))
    return columns


def id_set_pairs(batch: InputBatch, rows: np.ndarray) -> dict[str, np.ndarray]:
    """int64 [2, K] of (index into rows, token id) per id-set knob some row sets."""
    pairs = {}
    for k in ID_SET_KNOBS:
        if not batch.num_rows_setting[k.name]:
            continue
        some = rows_setting(batch, k.name, rows)
        if len(some):
            sets = [batch.id_sets[k.name][rows[i]] for i in some]
            pair_rows = np.repeat(some, [len(x) for x in sets])
            ids = np.fromiter((t for x in sets for t in x), dtype=np.int64, count=len(pair_rows))
            pairs[k.name] = np.stack([pair_rows, ids])
    return pairs


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                            staging: StepBuffers,
                            grammar_done: np.ndarray | None = None,
                            num_tokens: np.ndarray | None = None) -> SamplingMetadata:
    """Stage the sampling columns of `rows` (call between staging.begin() and flush()).
    `grammar_done`: bool per row, True where a complete grammar allows only eos (min_tokens
    then does not mask it: the grammar wins). `num_tokens`: per entry of `rows`, the tokens
    known before the one it samples (default: the batch's num_tokens). A speculative step
    samples a row at several positions (`rows` repeats it), each with the counter, penalty
    history and min_tokens masks of its own position (spec_verify.py)."""
    setting = batch.num_rows_setting
    columns = knob_columns(batch, rows, staging)
    penalties = any(columns[k.name] is not None for k in HISTORY_KNOBS)
    num_prompt = batch.num_prompt_tokens[rows]
    if num_tokens is None:
        num_tokens = batch.num_tokens[rows]
    counters = (num_tokens - num_prompt).astype(np.int64)

    ragged = []
    if penalties:
        ragged += [_padded_ids(batch, rows, np.zeros_like(num_prompt), num_prompt, vocab_size),
                   _padded_ids(batch, rows, num_prompt, num_tokens, vocab_size)]
    stop_pairs = (stop_mask_pairs(batch, rows, counters, grammar_done)
                  if setting["min_tokens"] else None)
    if stop_pairs is not None and stop_pairs.shape[1]:
        ragged.append(stop_pairs)
    else:
        stop_pairs = None
    id_sets = id_set_pairs(batch, rows)
    ragged += id_sets.values()
    bias_values = ()
    if setting["logit_bias"]:
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
    stop_index = staged[len(staged) - len(id_sets) - 1] if stop_pairs is not None else None
    all_greedy, all_random = _greediness(batch, rows)
    return SamplingMetadata(
        **columns, all_greedy=all_greedy, all_random=all_random,
        seeds=staging.put(batch.seeds[rows], torch.int64, "seeds"),
        counters=staging.put(counters, torch.int64, "counters"),
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        stop_mask_index=stop_index,
        logit_bias_index=bias_index, logit_bias_values=bias,
        id_sets=staged_sets,
        **_logprob_wishes(batch, rows, setting["num_logprobs"]),
        top_k_max=top_k_bound(batch.top_k[rows], vocab_size) if setting["top_k"] else 1,
    )


def _logprob_wishes(batch: InputBatch, rows: np.ndarray, num_set: int) -> dict:
    """max_num_logprobs and wants_logprobs of the sampling rows. num_logprobs is NO_LOGPROBS
    (-1) for a row that wants none; with no row off 0 (num_set 0) no numpy call is made."""
    if not num_set or not len(rows):
        return {"max_num_logprobs": 0, "wants_logprobs": True}
    wanted = batch.num_logprobs[rows]
    return {"max_num_logprobs": max(0, int(wanted.max())),
            "wants_logprobs": bool((wanted >= 0).any())}


def _greediness(batch: InputBatch, rows: np.ndarray) -> tuple[bool, bool]:
    """(every row greedy, no row greedy); both True for no rows."""
    if not batch.num_rows_setting["temperature"]:
        return True, not len(rows)
    greedy = batch.temperature[rows] == 0.0
    return bool(greedy.all()), bool((~greedy).all())


def staged_row_dtypes() -> list[torch.dtype]:
    """One per-row region per array build_sampling_metadata stages in the StepBuffers' arenas:
    seeds, counters, then each knob column."""
    return [torch.int64, torch.int64] + [getattr(torch, k.meta.column) for k in COLUMN_KNOBS]


def history_needed(batch: InputBatch, new_requests: list[NewRequestData]) -> bool:
    """Whether a running row or a new request sets a knob that reads the prompt and output ids
    (a penalty): the step must then see the previous step's sampled ids on the host."""
    if any(batch.num_rows_setting[k.name] for k in HISTORY_KNOBS):
        return True
    return any(new.sampling.sampling.has_penalties for new in new_requests)
