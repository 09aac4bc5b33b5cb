"""Persistent input buffers for padded pure-decode steps (what a CUDA graph reads).

A captured graph replays fixed kernels on fixed addresses, so every step's inputs are copied into
the same tensors. Each buffer has max_batch rows; a step with n requests padded to a captured
size b fills rows [0, n) with its inputs and rows [n, b) with harmless padding:

    row            input_ids  positions  slot_mapping  seq_lens  block_table[row, :]
    0 .. n-1       token      pos        slot          len       the request's blocks (then stale)
    n .. b-1       0          0          -1 (no write) 1         0 0 0 ... (block 0, read only)

A padding row attends to one key of block 0 (any finite value; its output is discarded) and
writes nothing. query_start_loc is 0, 1, 2, ... (one query row per request) and never changes.
Block-table columns past a real request's last block may hold ids from earlier steps: they are
valid block ids and no kernel reads past ceil(seq_len / block_size) blocks.

Every buffer lives twice: a host staging copy (pinned on CUDA) filled with numpy, and the device
copy the model reads, refreshed with one non-blocking copy per buffer. On CPU both are CPU
tensors, so the same code runs (uncaptured) in tests.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.attention.backend import AttentionMetadata

# name -> dtype of each per-row buffer (block_table and query_start_loc are handled apart)
ROW_BUFFERS = {"input_ids": torch.int64, "positions": torch.int64,
               "slot_mapping": torch.int64, "seq_lens": torch.int32}
PAD_VALUES = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 1}


class DecodeBuffers:
    """Host staging + device buffers for up to max_batch one-token requests."""

    def __init__(self, max_batch: int, max_blocks_per_req: int, device: torch.device,
                 max_seq_len: int) -> None:
        if max_batch < 1 or max_blocks_per_req < 1:
            raise ValueError(f"max_batch={max_batch}, max_blocks_per_req={max_blocks_per_req}: "
                             "both must be >= 1")
        self.max_batch = max_batch
        self.max_blocks = max_blocks_per_req
        self.device = torch.device(device)
        self.max_seq_len = max_seq_len      # host bound handed to backends (split choice)
        pin = self.device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        shapes = {name: (max_batch,) for name in ROW_BUFFERS}
        shapes["block_table"] = (max_batch, max_blocks_per_req)
        dtypes = {**ROW_BUFFERS, "block_table": torch.int32}
        for name, shape in shapes.items():
            self.host[name] = torch.zeros(shape, dtype=dtypes[name], pin_memory=pin)
            self.dev[name] = torch.zeros(shape, dtype=dtypes[name], device=self.device)
        self.query_start_loc_cpu = torch.arange(max_batch + 1, dtype=torch.int32)
        self.query_start_loc = self.query_start_loc_cpu.to(self.device)
        self._np = {name: t.numpy() for name, t in self.host.items()}
        self._copy_done = torch.cuda.Event() if pin else None
        self._metas: dict[int, AttentionMetadata] = {}
        self.reset()

    def load(self, num_reqs: int, padded: int, input_ids: np.ndarray, positions: np.ndarray,
             slot_mapping: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray) -> None:
        """Stage one step's inputs in rows [0, num_reqs), pad rows [num_reqs, padded), and
        copy rows [0, padded) to the device (non-blocking on CUDA)."""
        if not 1 <= num_reqs <= padded <= self.max_batch:
            raise ValueError(f"num_reqs={num_reqs}, padded={padded}: need "
                             f"1 <= num_reqs <= padded <= {self.max_batch}")
        width = block_table.shape[1]
        if block_table.shape[0] != num_reqs or width > self.max_blocks:
            raise ValueError(f"block_table shape {block_table.shape}: must be "
                             f"[{num_reqs}, <= {self.max_blocks}]")
        if self._copy_done is not None:
            self._copy_done.synchronize()       # the previous step's copies have left staging
        rows = {"input_ids": input_ids, "positions": positions, "slot_mapping": slot_mapping,
                "seq_lens": seq_lens}
        for name, values in rows.items():
            if len(values) != num_reqs:
                raise ValueError(f"{name} has {len(values)} rows: must have {num_reqs}")
            self._np[name][:num_reqs] = values
        self._np["block_table"][:num_reqs, :width] = block_table
        self.fill_padding(num_reqs, padded)
        self._to_device(padded)

    def reset(self) -> None:
        """Make every row a padding row, staged and on the device (capture runs over these)."""
        self.fill_padding(0, self.max_batch)
        self._to_device(self.max_batch)

    def fill_padding(self, start: int, stop: int) -> None:
        """Make staged rows [start, stop) padding rows (see the table above)."""
        for name, value in PAD_VALUES.items():
            self._np[name][start:stop] = value
        self._np["block_table"][start:stop] = 0

    def _to_device(self, rows: int) -> None:
        non_blocking = self._copy_done is not None
        for name, host in self.host.items():
            self.dev[name][:rows].copy_(host[:rows], non_blocking=non_blocking)
        if self._copy_done is not None:
            self._copy_done.record()

    def metadata(self, batch: int) -> AttentionMetadata:
        """Attention metadata over the first `batch` rows; the same object every call, since a
        captured graph holds on to these exact tensors."""
        if batch not in self._metas:
            self._metas[batch] = AttentionMetadata(
                num_reqs=batch, num_actual_tokens=batch, max_query_len=1,
                max_seq_len=self.max_seq_len,
                query_start_loc=self.query_start_loc[:batch + 1],
                seq_lens=self.dev["seq_lens"][:batch],
                block_table=self.dev["block_table"][:batch],
                slot_mapping=self.dev["slot_mapping"][:batch],
                query_start_loc_cpu=self.query_start_loc_cpu[:batch + 1],
                seq_lens_cpu=self.host["seq_lens"][:batch])
        return self._metas[batch]

    def model_inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, positions) device views over the first `batch` rows."""
        return self.dev["input_ids"][:batch], self.dev["positions"][:batch]
