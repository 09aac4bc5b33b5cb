"""Scrubbing a runner's per-owner state when a new epoch starts (Init, Reset).

A new epoch may belong to another scheduler, and the worker cannot tell: a scheduler id is
whatever the caller declares, and Info publishes the owner's. A step of the new epoch whose block
table names blocks it never wrote would read the previous owner's keys and values through
attention, so every epoch starts from a zero KV cache on every rank, and no row of the persistent
batch keeps a previous request's token ids or block ids (the cached requests and grammars are
dropped by ModelRunner.reset, which the caller runs first).

No legitimate caller loses anything: the scheduler builds a new block pool (and prefix cache)
after every Init, and Reset drops every cached request. The cost is one fill per tensor, at Init
or Reset, never on the step path (docs/security.md, "New epoch, clean cache").
"""
from __future__ import annotations

import torch


@torch.inference_mode()
def zero_kv_caches(kv_caches: list[torch.Tensor]) -> None:
    """Zero every layer's cache in place (the tensors, and any graph captured over them, stay)."""
    for cache in kv_caches:
        cache.zero_()


def clear_batch_rows(batch) -> None:
    """Zero the persistent batch's per-row ids (an InputBatch with no request left in it): the
    token ids of old prompts and outputs, and the block tables that named their blocks."""
    batch.token_ids.fill(0)
    batch.block_table.fill(0)
    batch.num_blocks.fill(0)


def scrub_runner(runner) -> None:
    """Zero a ModelRunner's KV cache and batch rows (after its `reset`)."""
    zero_kv_caches(runner.kv_caches)
    clear_batch_rows(runner.batch)
