"""Configuration, one frozen dataclass per concern, validated where it is built.

Values derived at run time (the number of KV-cache blocks that fit in device memory) are never
written back into a config: they travel as separate arguments or result objects.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine_common.params import ParamError


def _check_pos_int(name: str, value, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, value, "an integer")
    if value < 1 or (hi is not None and value > hi):
        raise ParamError(name, value, f"in [1, {'inf' if hi is None else hi}]")


@dataclass(frozen=True)
class SchedulerConfig:
    """The continuous-batching policy's limits. Chunked prefill is always on.

    max_num_seqs: requests in the running batch at once.
    max_num_batched_tokens: tokens (prefill chunks + decodes) scheduled in one step.
    max_model_len: prompt + output tokens of one request.
    block_size: tokens per KV-cache block (a power of two).
    enable_prefix_caching: reuse full KV blocks of identical prompt prefixes.
    max_waiting: requests queued but not running before new ones are refused.
    async_scheduling: keep two steps in flight, scheduling step t+1 while the workers run step t
        (the workers feed their own sampled tokens back), so scheduling, output processing and
        the round trip overlap the forward pass.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_waiting: int = 1024
    async_scheduling: bool = False

    def __post_init__(self):
        _check_pos_int("max_num_seqs", self.max_num_seqs)
        _check_pos_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_pos_int("max_model_len", self.max_model_len)
        _check_pos_int("block_size", self.block_size, 1024)
        _check_pos_int("max_waiting", self.max_waiting)
        if self.block_size & (self.block_size - 1):
            raise ParamError("block_size", self.block_size, "a power of two in [1, 1024]")
        for name in ("enable_prefix_caching", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError(name, getattr(self, name), "a bool")
        # Every running request must be able to decode one token per step.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ParamError("max_num_batched_tokens", self.max_num_batched_tokens,
                             f">= max_num_seqs ({self.max_num_seqs})")
