"""Build the sampler's inputs for the rows that sample this step, as slices of the batch arrays."""
from __future__ import annotations

import numpy as np
import torch

from worker_service.input_batch import InputBatch
from worker_service.sampling_metadata import SamplingMetadata


def _opt(values: np.ndarray, off_value, device) -> torch.Tensor | None:
    """A device tensor, or None when every row has the parameter switched off."""
    if np.all(values == off_value):
        return None
    return torch.from_numpy(np.ascontiguousarray(values)).to(device)


def _padded_ids(batch: InputBatch, rows: np.ndarray, start: np.ndarray, end: np.ndarray,
                pad: int, device) -> torch.Tensor:
    """token_ids[row, start:end] per row, right-padded with `pad` (an id past the vocab)."""
    width = int((end - start).max()) if len(rows) else 0
    cols = start[:, None] + np.arange(width)[None, :]
    valid = cols < end[:, None]
    ids = batch.token_ids[rows[:, None], np.where(valid, cols, 0)]
    return torch.from_numpy(np.where(valid, ids, pad)).to(device)


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                            device: torch.device) -> SamplingMetadata:
    temperature = batch.temperature[rows]
    greedy = temperature == 0.0
    rep = batch.repetition_penalty[rows]
    pres = batch.presence_penalty[rows]
    freq = batch.frequency_penalty[rows]
    penalties = np.any(rep != 1.0) or np.any(pres != 0.0) or np.any(freq != 0.0)
    num_prompt = batch.num_prompt_tokens[rows]
    num_tokens = batch.num_tokens[rows]
    counters = (num_tokens - num_prompt).astype(np.int64)

    stop_masks = {}
    for i in np.flatnonzero(counters < batch.min_tokens[rows]):
        ids = batch.stop_ids[rows[i]]
        if ids:
            stop_masks[int(i)] = list(ids)

    return SamplingMetadata(
        temperature=torch.from_numpy(temperature).to(device),
        all_greedy=bool(greedy.all()),
        all_random=bool((~greedy).all()),
        top_p=_opt(batch.top_p[rows], 1.0, device),
        top_k=_opt(batch.top_k[rows], 0, device),
        min_p=_opt(batch.min_p[rows], 0.0, device),
        seeds=torch.from_numpy(batch.seeds[rows]).to(device),
        counters=torch.from_numpy(counters).to(device),
        repetition_penalty=torch.from_numpy(rep).to(device) if penalties else None,
        presence_penalty=torch.from_numpy(pres).to(device) if penalties else None,
        frequency_penalty=torch.from_numpy(freq).to(device) if penalties else None,
        prompt_token_ids=(_padded_ids(batch, rows, np.zeros_like(num_prompt), num_prompt,
                                      vocab_size, device) if penalties else None),
        output_token_ids=(_padded_ids(batch, rows, num_prompt, num_tokens, vocab_size, device)
                          if penalties else None),
        stop_masks=stop_masks,
        max_num_logprobs=int(batch.num_logprobs[rows].max()) if len(rows) else 0,
    )
