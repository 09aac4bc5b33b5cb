"""Persistent staging for a step's inputs: one host arena per dtype and its device mirror.

Every per-step array the model and the sampler read (input ids, positions, slot mapping,
query_start_loc, seq_lens, block table, logits indices, the sampler's per-row columns) is written
with numpy into the host arena of its dtype; `flush()` then moves each arena to the device with ONE
non-blocking copy. The arenas are allocated once, at the largest step the runner accepts
(max_num_batched_tokens tokens, max_num_seqs rows, max blocks per request):

    arena[dtype].host  (pinned on CUDA)  | region 0 |pad| region 1 |pad| ... | free ...
    arena[dtype].dev   (same layout)     | region 0 |pad| region 1 |pad| ... |
    regions are handed out in order from offset 0 each step, each starting on a 64-byte
    boundary (Triton specialises kernels on 16-byte pointer alignment); flush() copies
    host[:used] -> dev[:used].

On CPU the device mirror *is* the host arena: no copy at all.

Reuse rule: a step may overwrite a host arena only once the previous step's copy out of it has
completed. The synchronous runner guarantees it: every step ends with one host sync (the token
read-back, or `wait_copies()` when nothing samples) that comes after the step's copies.
`begin()` checks the rule without waiting (an event query) and raises if it was broken. Async
scheduling keeps the rule too (see the last paragraph).

Arrays with no useful size bound (penalty id matrices, stop-mask index pairs) go through
`put_ragged`: one freshly pinned tensor per step and one non-blocking copy. PyTorch's caching
host allocator makes that cheap after the first steps and never hands the block out again
before the copy has read it.

A runner that launches a step before finishing the previous one (ModelRunner.pipelined) uses
two StepBuffers, one per step parity: the buffers of step t+1 were last used by step t-1, which
was finished (synced) before step t+1 is launched.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from math import prod
from typing import Sequence

import numpy as np
import torch

from kernels.attention.backend import AttentionMetadata
from worker_service.failures import StepProtocolError
from worker_service.step.step_inputs import StepInputs

ALIGN_BYTES = 64
MAX_CACHED_VIEWS = 1024        # region views an arena keeps (a few per distinct step shape)


class StepTooLarge(StepProtocolError):
    """A step needs more tokens, rows or blocks than the buffers were sized for."""

    def __init__(self, field_name: str, value: int, limit_name: str, limit: int):
        self.field, self.value, self.limit = field_name, value, limit
        super().__init__(f"{field_name}={value} is invalid: must be <= {limit_name}={limit}")


def aligned(n: int, dtype: torch.dtype) -> int:
    """n elements of dtype rounded up to a whole number of ALIGN_BYTES."""
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-n // per) * per


class StagingArena:
    """One dtype's flat host buffer and its device mirror, handed out region by region."""

    def __init__(self, dtype: torch.dtype, capacity: int, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.dtype = dtype
        self.host = torch.zeros(capacity, dtype=dtype, pin_memory=on_cuda)
        self.dev = torch.zeros(capacity, dtype=dtype, device=device) if on_cuda else self.host
        self._np = self.host.numpy()
        self.used = 0              # elements handed out this step (aligned)
        # (start, shape) -> the region's two views and where the next region starts: steps of
        # one shape take the same regions, so a steady step makes no view (a torch view costs
        # microseconds). Bounded.
        self._views: dict[tuple, tuple[tuple[np.ndarray, torch.Tensor], int]] = {}

    @property
    def capacity(self) -> int:
        return self.host.shape[0]

    def take(self, shape: tuple[int, ...], name: str) -> tuple[np.ndarray, torch.Tensor]:
        """The next region of `shape`: (host numpy view to fill, device view)."""
        key = (self.used, shape)
        hit = self._views.get(key)
        if hit is not None:
            self.used = hit[1]
            return hit[0]
        n = prod(shape)
        start, end = self.used, self.used + n
        if end > self.capacity:
            raise StepTooLarge(f"staged {self.dtype} elements ({name} {shape})", end,
                               "arena capacity", self.capacity)
        self.used = min(aligned(end, self.dtype), self.capacity)
        if len(self._views) >= MAX_CACHED_VIEWS:
            self._views.clear()
        views = (self._np[start:end].reshape(shape), self.dev[start:end].view(shape))
        self._views[key] = (views, self.used)
        return views

    def flush(self) -> None:
        """Copy the regions handed out this step to the device (non-blocking; none on CPU)."""
        if self.dev is not self.host and self.used:
            self.dev[:self.used].copy_(self.host[:self.used], non_blocking=True)


@dataclass
class StagedInputs:
    """Device views of one step's model inputs; layouts as in StepInputs."""

    input_ids: torch.Tensor         # int64 [T]
    positions: torch.Tensor         # int64 [T]
    slot_mapping: torch.Tensor      # int64 [T]
    query_start_loc: torch.Tensor   # int32 [num_reqs + 1]
    seq_lens: torch.Tensor          # int32 [num_reqs]
    block_table: torch.Tensor       # int32 [num_reqs, max blocks among them], contiguous
    logits_indices: torch.Tensor    # int64 [num sampling rows]
    window_slot_mapping: torch.Tensor | None = None   # a hybrid model's window group's
    window_block_table: torch.Tensor | None = None


class StepBuffers:
    """The arenas of one runner (see the module docstring for the layout and the reuse rule)."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device | str, row_regions: Sequence[torch.dtype] = (),
                 window_group: bool = False) -> None:
        """`row_regions`: the dtype of each further per-row array a step stages (the sampler's
        columns: sampling_metadata.staged_row_dtypes), one region of max(tokens, rows) each: a
        speculative step samples at every draft position. `window_group`: room for a hybrid
        model's second slots and block table."""
        for name, value in (("max_num_tokens", max_num_tokens), ("max_num_reqs", max_num_reqs),
                            ("max_blocks_per_req", max_blocks_per_req)):
            if value < 1:
                raise ValueError(f"{name}={value} is invalid: must be >= 1")
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.device = torch.device(device)
        tok, req, blk = max(max_num_tokens, max_num_reqs), max_num_reqs, max_blocks_per_req
        # The regions one step takes at most, per dtype (a padded decode batch may hold more
        # rows than the token budget, hence max(tokens, rows) token rows).
        regions = {
            torch.int64: [tok] * 3 + [req] * 3,      # ids, positions, slots (or a padded
                                                     # decode's [3, rows]), logits rows,
                                                     # the token feed's two index arrays
            torch.int32: [req + 1, req, req * blk],  # query_start_loc, seq_lens, block table
            torch.float32: [],
        }
        if window_group:
            regions[torch.int64].append(tok)
            regions[torch.int32].append(req * blk)
        for dtype in row_regions:   # token rows: a speculative step samples every draft
            regions.setdefault(dtype, []).append(tok)
        self.arenas = {dtype: StagingArena(dtype, sum(aligned(n, dtype) for n in sizes),
                                           self.device) for dtype, sizes in regions.items()}
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None

    def check_fits(self, num_tokens: int, num_reqs: int, num_blocks: int) -> None:
        """Raise StepTooLarge unless a step of this size fits the buffers."""
        for field_name, value, limit_name, limit in (
                ("num_tokens", num_tokens, "max_num_batched_tokens", self.max_num_tokens),
                ("num_reqs", num_reqs, "max_num_seqs", self.max_num_reqs),
                ("num_blocks", num_blocks, "max_blocks_per_req", self.max_blocks_per_req)):
            if value > limit:
                raise StepTooLarge(field_name, value, limit_name, limit)

    def begin(self) -> None:
        """Start a step: every region is free again. Raises RuntimeError if the previous
        step's copies have not completed (the reuse rule was broken); never waits."""
        if self._copied is not None and not self._copied.query():
            raise RuntimeError("StepBuffers.begin: the previous step's staging copies are "
                               "still in flight; end each step with its host sync first")
        for arena in self.arenas.values():
            arena.used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype,
             name: str = "region") -> tuple[np.ndarray, torch.Tensor]:
        """A region to fill on the host: (numpy view, device view)."""
        return self.arenas[dtype].take(tuple(shape), name)

    def put(self, values: np.ndarray, dtype: torch.dtype, name: str = "region") -> torch.Tensor:
        """Stage `values` (cast to dtype); returns its device view."""
        host, dev = self.take(values.shape, dtype, name)
        host[...] = values
        return dev

    def flush(self) -> None:
        """One non-blocking copy per arena used this step; then the copy event is recorded."""
        for arena in self.arenas.values():
            arena.flush()
        if self._copied is not None:   # on this device's stream, whatever the thread's device
            self._copied.record(torch.cuda.current_stream(self.device))

    @property
    def copied(self) -> torch.cuda.Event | None:
        """The event the last flush recorded (None on CPU)."""
        return self._copied

    def wait_copies(self) -> None:
        """Block until this step's staging copies are done (a step's one sync when it
        samples nothing)."""
        if self._copied is not None:
            self._copied.synchronize()

    def put_ragged(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Stage int64 arrays of any size in one per-step pinned tensor with one non-blocking
        copy; returns their device views, shapes kept."""
        sizes = [a.size for a in arrays]
        on_cuda = self.device.type == "cuda"
        host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=on_cuda)
        flat = host.numpy()
        offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        for a, start, end in zip(arrays, offsets, offsets[1:]):
            flat[start:end] = a.reshape(-1)
        dev = host.to(self.device, non_blocking=True) if on_cuda else host
        return [dev[s:e].view(a.shape) for a, s, e in zip(arrays, offsets, offsets[1:])]


def stage_step_inputs(buffers: StepBuffers, inputs: StepInputs) -> StagedInputs:
    """Stage a step's model inputs (eager path); raises StepTooLarge if they do not fit."""
    n = len(inputs.rows)
    buffers.check_fits(inputs.num_tokens, n, inputs.block_table.shape[1])
    # One region per array, so each starts aligned (a [3, T] block would misalign rows 1, 2).
    staged = StagedInputs(
        input_ids=buffers.put(inputs.input_ids, torch.int64, "input_ids"),
        positions=buffers.put(inputs.positions, torch.int64, "positions"),
        slot_mapping=buffers.put(inputs.slot_mapping, torch.int64, "slot_mapping"),
        query_start_loc=buffers.put(inputs.query_start_loc, torch.int32, "query_start_loc"),
        seq_lens=buffers.put(inputs.seq_lens, torch.int32, "seq_lens"),
        block_table=buffers.put(inputs.block_table, torch.int32, "block_table"),
        logits_indices=buffers.put(inputs.logits_indices, torch.int64, "logits_indices"))
    if inputs.window_slot_mapping is not None:
        staged.window_slot_mapping = buffers.put(inputs.window_slot_mapping, torch.int64,
                                                 "window_slot_mapping")
        staged.window_block_table = buffers.put(inputs.window_block_table, torch.int32,
                                                "window_block_table")
    return staged


def attention_metadata(inputs: StepInputs, staged: StagedInputs) -> AttentionMetadata:
    """A step's metadata: device tensors from the staging; host lengths and bounds (ints and
    the *_cpu tensors) from the numpy StepInputs, so nothing is read back."""
    meta = AttentionMetadata(
        num_reqs=len(inputs.rows), num_actual_tokens=inputs.num_tokens,
        max_query_len=int(inputs.num_scheduled.max()), max_seq_len=int(inputs.seq_lens.max()),
        query_start_loc=staged.query_start_loc, seq_lens=staged.seq_lens,
        block_table=staged.block_table, slot_mapping=staged.slot_mapping,
        query_start_loc_cpu=torch.from_numpy(inputs.query_start_loc),
        seq_lens_cpu=torch.from_numpy(inputs.seq_lens))
    if staged.window_block_table is not None:      # a hybrid model's windowed layers read it
        meta.window = dataclasses.replace(meta, block_table=staged.window_block_table,
                                          slot_mapping=staged.window_slot_mapping)
    return meta
