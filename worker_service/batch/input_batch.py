"""The persistent batch: preallocated per-row arrays that survive across steps.

Rows 0 .. num_reqs-1 are the requests currently in the batch. A request keeps its row while it
runs; removing one leaves a hole that the next added request fills, and `condense()` moves the
last rows into the remaining holes so the batch stays dense. Nothing is rebuilt in steady state:
a decode step writes one token per row.

    token_ids[row, :num_tokens[row]]   prompt ids, then the ids this worker sampled
    block_table[row, :num_blocks[row]] physical KV block ids, in position order
    num_computed[row]                  tokens whose KV is in the cache
    num_known_ids[row]                 tokens whose ids are in token_ids (a launched step's
                                       sampled ids arrive at its finish)
    <knob>[row]                        each sampling knob with a column (params.KNOBS)
    pools[row]                         a pooling request's row: it never samples
    id_sets[<knob>][row]               each knob that is a set of token ids, a tuple per row

A running request's sampled ids live only in its row (its cached state gets them when the row is
given up: `output_ids`), and `num_rows_setting` counts the live rows that turn each sampling
feature on, so a steady decode step touches no request in Python: no loop over rows, and a
feature no row uses costs nothing (sampling_metadata.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from engine_common.runtime.identity_cache import IdentityCache
from engine_common.request.params import COLUMN_KNOBS, ID_SET_KNOBS, SamplingParams
from engine_common.request.pooling import NO_POOLING
from engine_common.wire.diff import NewRequestData


@dataclass(eq=False)     # NewRequestData's __eq__: a prompt array equals its ids' list
class CachedRequestState(NewRequestData):
    """The worker's cached copy of one request (its row is filled from it): the diff's new
    request and the tokens this worker sampled itself (the scheduler never sends them back). It
    outlives a preemption, so a resumed request refills its row. While the request runs, its
    row is the truth (block table, computed count, sampled ids); block_ids, num_computed_tokens
    and output_token_ids are as of its last entry into or exit from the batch."""

    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


# What InputBatch.num_rows_setting counts: each knob column off its neutral value, each
# list-valued knob with entries, stop ids masked for min_tokens, top alternatives asked for.
# "pooling": rows of pooling requests, which never sample (step_inputs.py).
FEATURES = (tuple(k.name for k in COLUMN_KNOBS) + ("logit_bias",)
            + tuple(k.name for k in ID_SET_KNOBS) + ("min_tokens", "num_logprobs", "pooling"))


class BatchFullError(RuntimeError):
    """More requests or longer ones than the batch was sized for."""


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.handles: list[int | None] = [None] * max_num_reqs
        self.handle_ids = np.full(max_num_reqs, -1, dtype=np.int64)   # handles, -1: no request
        self.handle_to_row: dict[int, int] = {}
        self.num_reqs = 0  # rows in use including holes; dense after condense()
        self._holes: list[int] = []
        # Bumped whenever a row changes hands (add, remove, move): a step launched at the same
        # layout can still name its rows by index at its finish.
        self.layout = 0

        r = max_num_reqs
        self.token_ids = np.zeros((r, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(r, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(r, dtype=np.int32)
        self.num_computed = np.zeros(r, dtype=np.int32)
        self.num_known_ids = np.zeros(r, dtype=np.int32)
        self.block_table = np.zeros((r, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(r, dtype=np.int32)
        # A hybrid model's window-group tables (enable_window_group), same places; else None.
        self.window_table: np.ndarray | None = None
        self.window_num_blocks: np.ndarray | None = None
        # Sampling knobs as arrays, so the sampler's inputs are slices, not Python loops.
        for k in COLUMN_KNOBS:
            setattr(self, k.name, np.full(r, k.column_neutral, dtype=k.meta.column))
        self.id_sets: dict[str, list[tuple[int, ...]]] = {k.name: [()] * r for k in ID_SET_KNOBS}
        self.seeds = np.zeros(r, dtype=np.int64)
        self.min_tokens = np.zeros(r, dtype=np.int32)
        # top alternatives per row; -1 (NO_LOGPROBS): no logprob at all
        self.num_logprobs = np.zeros(r, dtype=np.int32)
        # LoRA adapter slot per row (adapter id - 1; -1: the base model)
        self.lora_slots = np.full(r, -1, dtype=np.int32)
        # A pooling (embedding) request's row: it computes its prompt and never samples.
        self.pools = np.zeros(r, dtype=bool)
        self.stop_ids: list[tuple[int, ...]] = [()] * r
        self.logit_bias: list[tuple[tuple[int, float], ...]] = [()] * r
        # Entries per row of each list-valued knob: a step finds the rows that set one with a
        # vector test instead of a Python loop over every row.
        self.num_entries = {name: np.zeros(r, dtype=np.int32)
                            for name in ("logit_bias", *self.id_sets)}
        # Live rows that turn each feature on (FEATURES): zero means the step skips it.
        self.num_rows_setting = dict.fromkeys(FEATURES, 0)
        self._row_features: list[tuple[str, ...]] = [()] * r    # what each row counts there
        # Index arrays a step slices instead of building (rows 0..n, one token per row).
        self.arange = np.arange(r + 1, dtype=np.int64)
        self.ones = np.ones(r, dtype=np.int32)
        self.arange.flags.writeable = self.ones.flags.writeable = False

    def enable_window_group(self) -> None:
        """Keep a second block table per row for a hybrid model's windowed layers
        (engine_common/request/kv_groups.py); a row's starts empty when it joins."""
        self.window_table = np.zeros_like(self.block_table)
        self.window_num_blocks = np.zeros_like(self.num_blocks)

    # -- membership -------------------------------------------------------------------------

    def add(self, state: CachedRequestState) -> int:
        """Put a request in a free row (a hole first) and fill that row from its state."""
        if state.handle in self.handle_to_row:
            raise ValueError(f"handle {state.handle} is already in the batch")
        if self._holes:
            row = self._holes.pop()
        elif self.num_reqs < self.max_num_reqs:
            row = self.num_reqs
            self.num_reqs += 1
        else:
            raise BatchFullError(f"batch holds at most {self.max_num_reqs} requests")
        self.handles[row] = state.handle
        self.handle_ids[row] = state.handle
        self.handle_to_row[state.handle] = row
        self._fill_row(row, state)
        self._count_features(row, 1)
        self.layout += 1
        return row

    def remove(self, handle: int) -> None:
        row = self.handle_to_row.pop(handle)
        self._count_features(row, -1)
        self.handles[row] = None
        self.handle_ids[row] = -1
        self._holes.append(row)
        self.layout += 1

    def output_ids(self, handle: int) -> list[int]:
        """The ids a running request has sampled so far (those whose step has finished)."""
        row = self.handle_to_row[handle]
        return self.token_ids[row, self.num_prompt_tokens[row]:self.num_known_ids[row]].tolist()

    def condense(self) -> None:
        """Move the last live rows into the holes so rows 0..num_reqs-1 are all live."""
        holes = sorted(self._holes)
        self._holes.clear()
        for hole in holes:
            while self.num_reqs > 0 and self.handles[self.num_reqs - 1] is None:
                self.num_reqs -= 1
            if hole >= self.num_reqs:
                break
            self._move_row(self.num_reqs - 1, hole)
            self.num_reqs -= 1
        while self.num_reqs > 0 and self.handles[self.num_reqs - 1] is None:
            self.num_reqs -= 1

    # -- per-row updates --------------------------------------------------------------------

    def set_block_ids(self, row: int, block_ids: list[int]) -> None:
        self._check_blocks(len(block_ids))
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        self._append(self.block_table, self.num_blocks, row, block_ids)

    def append_one_block_each(self, rows: list[int], block_ids: list[int]) -> None:
        """Append block_ids[i] to row rows[i]'s table. Scalar writes: a step grows a few rows,
        and numpy's scalar path stays cheap when a CPU forward pass has just evicted the
        caches (a vectorised write measured slower there)."""
        num_blocks, table, width = self.num_blocks, self.block_table, self.block_table.shape[1]
        for row, block_id in zip(rows, block_ids):
            col = int(num_blocks[row])
            if col >= width:
                self._check_blocks(col + 1)
            table[row, col] = block_id
            num_blocks[row] = col + 1

    def append_window_block_ids(self, row: int, block_ids: list[int]) -> None:
        """Append to the row's window-group table (enable_window_group first)."""
        self._append(self.window_table, self.window_num_blocks, row, block_ids)

    def _append(self, table: np.ndarray, counts: np.ndarray, row: int,
                block_ids: list[int]) -> None:
        start = int(counts[row])
        self._check_blocks(start + len(block_ids))
        table[row, start:start + len(block_ids)] = block_ids
        counts[row] = start + len(block_ids)

    def write_sampled(self, rows: np.ndarray, positions: np.ndarray,
                      token_ids: np.ndarray) -> None:
        """Write one sampled id per row at its position (launched steps finish in order)."""
        self.token_ids[rows, positions] = token_ids
        self.num_known_ids[rows] = positions + 1

    # -- internals --------------------------------------------------------------------------

    def _check_blocks(self, n: int) -> None:
        if n > self.block_table.shape[1]:
            raise BatchFullError(f"{n} blocks exceed max_blocks_per_req={self.block_table.shape[1]}")

    def _fill_row(self, row: int, state: CachedRequestState) -> None:
        n = state.num_tokens
        if n > self.max_model_len:
            raise BatchFullError(f"request {state.handle} has {n} tokens > max_model_len="
                                 f"{self.max_model_len}")
        self.token_ids[row, :len(state.prompt_token_ids)] = state.prompt_token_ids
        self.token_ids[row, len(state.prompt_token_ids):n] = state.output_token_ids
        self.num_tokens[row] = self.num_known_ids[row] = n
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed[row] = state.num_computed_tokens
        self.set_block_ids(row, state.block_ids)
        if self.window_num_blocks is not None:
            self.window_num_blocks[row] = 0          # the diff's new_window_block_ids fill it
        sp = state.sampling.sampling
        columns, features = _row_of(sp)
        for name, value in columns:
            getattr(self, name)[row] = value
        for k in ID_SET_KNOBS:
            self.id_sets[k.name][row] = getattr(sp, k.name)
            self.num_entries[k.name][row] = len(getattr(sp, k.name))
        self.seeds[row] = state.sampling.seed
        self.min_tokens[row] = state.sampling.min_tokens
        self.stop_ids[row] = state.sampling.stop_ids
        self.logit_bias[row] = sp.logit_bias
        self.num_entries["logit_bias"][row] = len(sp.logit_bias)
        self.num_logprobs[row] = state.num_logprobs
        self.lora_slots[row] = state.lora_id - 1
        self.pools[row] = state.pooling != NO_POOLING
        if self.pools[row]:
            features += ("pooling",)
        if state.sampling.min_tokens and state.sampling.stop_ids:
            features += ("min_tokens",)
        if state.num_logprobs:          # alternatives, or none at all (-1)
            features += ("num_logprobs",)
        self._row_features[row] = features

    def _count_features(self, row: int, sign: int) -> None:
        """The row's features (as _fill_row found them) counted in or out."""
        counts = self.num_rows_setting
        for name in self._row_features[row]:
            counts[name] += sign

    _ROW_ARRAYS = ("num_tokens", "num_prompt_tokens", "num_computed", "num_known_ids",
                   "num_blocks", "seeds", "min_tokens", "num_logprobs", "lora_slots", "pools") + tuple(
                       k.name for k in COLUMN_KNOBS)

    def _move_row(self, src: int, dst: int) -> None:
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = int(self.num_blocks[src])
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        if self.window_table is not None:
            nw = int(self.window_num_blocks[src])
            self.window_table[dst, :nw] = self.window_table[src, :nw]
            self.window_num_blocks[dst] = nw
        for name in self._ROW_ARRAYS:
            arr = getattr(self, name)
            arr[dst] = arr[src]
        self.stop_ids[dst] = self.stop_ids[src]
        self.logit_bias[dst] = self.logit_bias[src]
        self._row_features[dst] = self._row_features[src]
        for rows in self.id_sets.values():
            rows[dst] = rows[src]
        for counts in self.num_entries.values():
            counts[dst] = counts[src]
        handle = self.handles[src]
        self.handles[dst] = handle
        self.handles[src] = None
        self.handle_ids[dst], self.handle_ids[src] = handle, -1
        self.handle_to_row[handle] = dst
        self.layout += 1


# A SamplingParams with more token ids than this is not cached (the key keeps its ids alive:
# up to 1024 logit_bias entries and 1024 allowed ids, ~140 KB, per distinct request).
MAX_CACHED_ROW_IDS = 16


def _row_of(sp: SamplingParams) -> tuple[tuple[tuple[str, object], ...], tuple[str, ...]]:
    """_sampling_row, cached for params with few token ids (the usual ones)."""
    row = _ROWS_BY_ID.get_by_id(id(sp))
    if row is not None:
        return row
    if len(sp.logit_bias) + sum(len(getattr(sp, k.name)) for k in ID_SET_KNOBS) \
            > MAX_CACHED_ROW_IDS:
        return _sampling_row.__wrapped__(sp)
    row = _sampling_row(sp)
    _ROWS_BY_ID.put(sp, row)
    return row


# params -> _sampling_row(params): a decoded prefill diff shares one SamplingParams object per
# distinct message (the codec caches them), so its hundreds of rows find theirs by identity
# instead of hashing every field of the frozen dataclass for the lru_cache (~5 us a row).
MAX_ROWS_BY_ID = 256
_ROWS_BY_ID = IdentityCache(MAX_ROWS_BY_ID)


@lru_cache(maxsize=1024)       # requests mostly share their sampling params (frozen, hashable)
def _sampling_row(sp: SamplingParams) -> tuple[tuple[tuple[str, object], ...], tuple[str, ...]]:
    """A row's knob columns for `sp`, (name, value) each, and the features (FEATURES) among
    its columns and id lists that `sp` turns on: a column as stored (its dtype) off its
    neutral value, a list with entries."""
    columns = tuple((k.name, k.column_value(getattr(sp, k.name))) for k in COLUMN_KNOBS)
    features = tuple(k.name for k, (_, value) in zip(COLUMN_KNOBS, columns)
                     if np.array([value], dtype=k.meta.column)[0] != k.column_neutral)
    features += ("logit_bias",) if sp.logit_bias else ()
    return columns, features + tuple(k.name for k in ID_SET_KNOBS if getattr(sp, k.name))
