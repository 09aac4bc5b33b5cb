"""Per-step sampling inputs for a batch of N rows (one row per request), built from the InputBatch.

Everything the sampler branches on is known on the host (flags, top_k_max, shapes), so sampling
never reads a device value back: no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_common.request.params import ID_SET_KNOBS


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
