"""Per-step sampling inputs for a batch of N rows (one row per request), built by the InputBatch."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    # row -> token ids forbidden this step (the row has produced fewer than min_tokens tokens)
    stop_masks: dict[int, list[int]] = field(default_factory=dict)
    max_num_logprobs: int = 0                    # top alternatives to return; 0 = sampled only

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
    return SamplingMetadata(
        temperature=full(0.8, torch.float32), all_greedy=False, all_random=True,
        top_p=full(0.9, torch.float32), top_k=full(50, torch.int32), min_p=full(0.05, torch.float32),
        seeds=full(0, torch.int64), counters=full(0, torch.int64),
        repetition_penalty=full(1.1, torch.float32), presence_penalty=full(0.1, torch.float32),
        frequency_penalty=full(0.1, torch.float32), prompt_token_ids=ids, output_token_ids=ids,
        max_num_logprobs=max_num_logprobs)
