"""The worker's cached copy of one request. Lives across steps; only diffs update it."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_common.request.params import WorkerSamplingParams


@dataclass
class CachedRequestState:
    handle: int
    prompt_token_ids: list[int]
    sampling: WorkerSamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_logprobs: int = 0
    # Tokens this worker sampled itself; the scheduler never sends them back.
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
