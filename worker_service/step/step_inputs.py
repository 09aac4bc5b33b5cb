"""Flattened model inputs for one step, computed from the persistent batch with numpy.

For the scheduled rows r0, r1, ... (in row order) with n0, n1, ... tokens each:

    input_ids      = token_ids[r, num_computed[r] : num_computed[r] + n]   laid end to end
    positions      = num_computed[r] + 0 .. n-1
    slot_mapping   = block_table[r, pos // block_size] * block_size + pos % block_size
    query_start_loc= [0, n0, n0+n1, ...]
    seq_lens       = num_computed[r] + n
A row samples only when the step reaches its last known token (the end of its prefill, or a
decode), and never a pooling request's row (it ends on its vector).

The steady decode step (every row of the batch one token: num_scheduled None) has its own path:
rows, counts, query_start_loc and logits_indices are slices of the batch's persistent index
arrays, the block table a view, and the rest about ten numpy calls whatever the batch size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker_service.batch.input_batch import InputBatch
from worker_service.failures import StepProtocolError


@dataclass
class StepInputs:
    rows: np.ndarray              # int64 [num_reqs] batch rows scheduled this step
    num_scheduled: np.ndarray     # int32 [num_reqs]
    input_ids: np.ndarray         # int64 [T]
    positions: np.ndarray         # int64 [T]
    slot_mapping: np.ndarray      # int64 [T]
    query_start_loc: np.ndarray   # int32 [num_reqs + 1]
    seq_lens: np.ndarray          # int32 [num_reqs]
    block_table: np.ndarray       # int32 [num_reqs, max blocks among them]
    sample_mask: np.ndarray       # bool [num_reqs]: the row samples a token this step
    logits_indices: np.ndarray    # int64 [num sampling rows]: last query row of each
    # A hybrid model's window group (batch.window_table): its slots and table; None else.
    window_slot_mapping: np.ndarray | None = None     # int64 [T]
    window_block_table: np.ndarray | None = None      # int32 [num_reqs, max blocks]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def prepare_step_inputs(batch: InputBatch, num_scheduled: np.ndarray | None,
                        block_size: int) -> StepInputs:
    """num_scheduled: int32 [batch.num_reqs], tokens per row this step (0 = idle); None: one
    token for every row."""
    if num_scheduled is None:
        return _one_token_each(batch, block_size)
    rows = np.flatnonzero(num_scheduled > 0)
    counts = num_scheduled[rows].astype(np.int32)
    computed = batch.num_computed[rows]
    seq_lens = computed + counts
    if np.any(seq_lens > batch.num_tokens[rows]):
        bad = rows[seq_lens > batch.num_tokens[rows]][0]
        raise StepProtocolError(
            f"handle {batch.handles[bad]}: scheduled past its known tokens "
            f"({int(batch.num_computed[bad])} computed + {int(num_scheduled[bad])} scheduled > "
            f"{int(batch.num_tokens[bad])} tokens)")
    needed_blocks = (seq_lens + block_size - 1) // block_size
    if np.any(needed_blocks > batch.num_blocks[rows]):
        bad = rows[needed_blocks > batch.num_blocks[rows]][0]
        raise StepProtocolError(f"handle {batch.handles[bad]}: not enough KV blocks for "
                                f"{int(seq_lens[rows == bad][0])} tokens")

    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    # Per token: one arange plus its row's start, then 1-D takes at flat indices into the
    # (C-contiguous) token and block tables: a prefill step's ~16k tokens cost about a third
    # of the 2-D fancy indexing's time. Every index is in range (checked above).
    positions = np.arange(total, dtype=np.int64)
    positions += np.repeat(computed.astype(np.int64) - query_start_loc[:-1], counts)
    flat = np.repeat(rows * batch.token_ids.shape[1], counts)
    flat += positions
    input_ids = batch.token_ids.ravel().take(flat)
    block_col, offset = np.divmod(positions, block_size)
    block_col += np.repeat(rows * batch.block_table.shape[1], counts)
    slot_mapping = np.multiply(batch.block_table.ravel().take(block_col), block_size,
                               dtype=np.int64)
    slot_mapping += offset

    max_blocks = int(needed_blocks.max()) if len(rows) else 0
    sample_mask = seq_lens == batch.num_tokens[rows]
    if batch.num_rows_setting["pooling"]:
        sample_mask &= ~batch.pools[rows]         # a pooling request ends on its vector
    _check_room_to_sample(batch, rows[sample_mask])
    logits_indices = (query_start_loc[1:][sample_mask] - 1).astype(np.int64)
    inputs = StepInputs(rows=rows, num_scheduled=counts, input_ids=input_ids,
                        positions=positions, slot_mapping=slot_mapping,
                        query_start_loc=query_start_loc, seq_lens=seq_lens.astype(np.int32),
                        block_table=batch.block_table[rows, :max_blocks],
                        sample_mask=sample_mask, logits_indices=logits_indices)
    if batch.window_table is not None:
        _check_window_blocks(batch, rows, needed_blocks)
        inputs.window_slot_mapping = np.multiply(batch.window_table.ravel().take(block_col),
                                                 block_size, dtype=np.int64) + offset
        inputs.window_block_table = batch.window_table[rows, :max_blocks]
    return inputs


def _check_window_blocks(batch: InputBatch, rows: np.ndarray, needed: np.ndarray) -> None:
    """Every scheduled row's window-group table reaches its last position (as its table)."""
    short = needed > batch.window_num_blocks[rows]
    if np.any(short):
        bad = rows[short][0]
        raise StepProtocolError(f"handle {batch.handles[bad]}: not enough window-group KV "
                                f"blocks ({int(batch.window_num_blocks[bad])} for "
                                f"{int(needed[short][0])} blocks of positions)")


def _one_token_each(batch: InputBatch, block_size: int) -> StepInputs:
    """prepare_step_inputs for one token in every row 0..n-1: the same arrays (the index ones
    are read-only slices of the batch's), without a gather per count."""
    n = batch.num_reqs
    if batch.window_table is not None:     # a hybrid model: the general path's window part
        return prepare_step_inputs(batch, batch.ones[:n].copy(), block_size)
    computed = batch.num_computed[:n]
    seq_lens = computed + 1
    ahead = batch.num_tokens[:n] - seq_lens        # tokens known past this one; < 0: none
    if n and int(ahead.min()) < 0:
        return prepare_step_inputs(batch, batch.ones[:n].copy(), block_size)   # raises
    if n and int(batch.num_tokens[:n].max()) >= batch.max_model_len:
        return prepare_step_inputs(batch, batch.ones[:n].copy(), block_size)   # may raise
    rows = batch.arange[:n]
    positions = computed.astype(np.int64)
    block_col, offset = np.divmod(positions, block_size)
    max_blocks = int(block_col.max()) + 1 if n else 0
    if n and (block_col >= batch.num_blocks[:n]).any():
        return prepare_step_inputs(batch, batch.ones[:n].copy(), block_size)   # raises
    slot_mapping = np.multiply(batch.block_table[rows, block_col], block_size, dtype=np.int64)
    slot_mapping += offset
    sample_mask = ahead == 0
    if batch.num_rows_setting["pooling"]:
        sample_mask &= ~batch.pools[:n]
    logits_indices = rows if sample_mask.all() else np.flatnonzero(sample_mask)
    return StepInputs(rows=rows, num_scheduled=batch.ones[:n], input_ids=batch.token_ids[
                          rows, positions], positions=positions, slot_mapping=slot_mapping,
                      query_start_loc=batch.arange[:n + 1].astype(np.int32), seq_lens=seq_lens,
                      block_table=batch.block_table[:n, :max_blocks],
                      sample_mask=sample_mask, logits_indices=logits_indices)


def _check_room_to_sample(batch: InputBatch, sampling_rows: np.ndarray) -> None:
    """A row samples its next token at index num_tokens, which must be < max_model_len (the
    row's width): the scheduler stops a request there, a diff that goes on is refused."""
    full = sampling_rows[batch.num_tokens[sampling_rows] >= batch.max_model_len]
    if len(full):
        bad = full[0]
        raise StepProtocolError(
            f"handle {batch.handles[bad]}: has {int(batch.num_tokens[bad])} tokens, so it must "
            f"not sample another: a request holds at most max_model_len ({batch.max_model_len})")
