"""Persistent input buffers for padded pure-decode steps (what a CUDA graph reads).

A captured graph replays fixed kernels on fixed addresses, so every step's inputs land in the
same device tensors. Each buffer has max_batch rows; a step with n requests padded to a captured
size b fills rows [0, n) with its inputs and rows [n, b) with harmless padding:

    row            input_ids  positions  slot_mapping  seq_lens  block_table[row, :]
    0 .. n-1       token      pos        slot          len       the request's blocks (then stale)
    n .. b-1       0          0          -1 (no write) 1         0 0 ... (block 0, read only; stale
                                                                  columns past the step's width)

plus `decode_order` (AttentionMetadata): rows 0 .. b-1 by seq_len, longest first (the padding
rows, length 1, last), sorted on the host where the lengths already are.

A padding row attends to one key of block 0 (any finite value; its output is discarded) and
writes nothing. query_start_loc is 0, 1, 2, ... (one query row per request) and never changes.
Block-table columns past a step's width may hold ids from earlier steps: they are valid block
ids and no kernel reads past ceil(seq_len / block_size) blocks.

The inputs come from the runner's staging (worker_service/step/step_buffers.py): `stage` writes the
padded rows into the staging arenas on the host (they reach the device with the step's one copy
per dtype), and `load` copies them device to device into these buffers, three copies:

    tokens      int64 [4, max_batch]   rows: input_ids, positions, slot_mapping, decode_order
    seq_lens    int32 [max_batch]
    block_table int32 [max_batch, max_blocks_per_req]   (columns [0, width) written)

On CPU every tensor is a CPU tensor, so the same code runs (uncaptured) in tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention.backend import AttentionMetadata
from worker_service.step.step_buffers import StepBuffers

TOKEN_ROWS = ("input_ids", "positions", "slot_mapping", "decode_order")   # rows of `tokens`
TOKEN_PAD = np.array([0, 0, -1], dtype=np.int64)     # padding of the first three (the order
                                                     # covers every row, padding included)
SEQ_LEN_PAD = 1


@dataclass
class StagedDecode:
    """One padded decode step in the staging arenas (device views, filled by the step's copy)."""

    num_reqs: int
    padded: int
    tokens: torch.Tensor           # int64 [4, padded]
    seq_lens: torch.Tensor         # int32 [padded]
    block_table: torch.Tensor      # int32 [padded, width]
    seq_lens_host: np.ndarray      # int32 [padded], for backends that read lengths on the host


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """Row indices by seq_len, longest first (equal lengths in reverse row order): ~4 us at 256
    rows, so every decode step stages it whatever the backend's launch order."""
    return np.argsort(seq_lens, kind="stable")[::-1]


class DecodeBuffers:
    """The device buffers (and a host seq_lens) for up to max_batch one-token requests."""

    def __init__(self, max_batch: int, max_blocks_per_req: int, device: torch.device,
                 max_seq_len: int) -> None:
        if max_batch < 1 or max_blocks_per_req < 1:
            raise ValueError(f"max_batch={max_batch}, max_blocks_per_req={max_blocks_per_req}: "
                             "both must be >= 1")
        self.max_batch = max_batch
        self.max_blocks = max_blocks_per_req
        self.device = torch.device(device)
        self.max_seq_len = max_seq_len      # host bound handed to backends (split choice)
        dev = self.device
        self.tokens = torch.zeros((len(TOKEN_ROWS), max_batch), dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((max_batch, max_blocks_per_req), dtype=torch.int32,
                                       device=dev)
        self.seq_lens_cpu = torch.zeros(max_batch, dtype=torch.int32)
        self.query_start_loc_cpu = torch.arange(max_batch + 1, dtype=torch.int32)
        self.query_start_loc = self.query_start_loc_cpu.to(dev)
        self._metas: dict[int, AttentionMetadata] = {}
        self.reset()

    def stage(self, staging: StepBuffers, num_reqs: int, padded: int, input_ids: np.ndarray,
              positions: np.ndarray, slot_mapping: np.ndarray, seq_lens: np.ndarray,
              block_table: np.ndarray) -> StagedDecode:
        """Write one step's rows [0, num_reqs) and padding rows [num_reqs, padded) into the
        staging arenas (host side; the caller flushes)."""
        self._check(num_reqs, padded, (input_ids, positions, slot_mapping, seq_lens),
                    block_table)
        tokens_host, tokens = staging.take((len(TOKEN_ROWS), padded), torch.int64,
                                           "decode tokens")
        for i, values in enumerate((input_ids, positions, slot_mapping)):
            tokens_host[i, :num_reqs] = values
        tokens_host[:3, num_reqs:] = TOKEN_PAD[:, None]
        lens_host, lens = staging.take((padded,), torch.int32, "decode seq_lens")
        lens_host[:num_reqs] = seq_lens
        lens_host[num_reqs:] = SEQ_LEN_PAD
        tokens_host[3] = longest_first(lens_host)
        table_host, table = staging.take((padded, block_table.shape[1]), torch.int32,
                                         "decode block_table")
        table_host[:num_reqs] = block_table
        table_host[num_reqs:] = 0
        return StagedDecode(num_reqs, padded, tokens, lens, table, lens_host.copy())

    def load(self, staged: StagedDecode) -> None:
        """Copy a staged step into rows [0, padded) of the buffers (device to device; call
        after the staging flush)."""
        p, width = staged.padded, staged.block_table.shape[1]
        self.tokens[:, :p].copy_(staged.tokens, non_blocking=True)
        self.seq_lens[:p].copy_(staged.seq_lens, non_blocking=True)
        self.block_table[:p, :width].copy_(staged.block_table, non_blocking=True)
        self.seq_lens_cpu[:p] = torch.from_numpy(staged.seq_lens_host)

    def reset(self) -> None:
        """Make every row a padding row (capture runs over these)."""
        for i, pad in enumerate(TOKEN_PAD.tolist()):
            self.tokens[i].fill_(pad)
        self.tokens[3].copy_(torch.arange(self.max_batch))
        self.seq_lens.fill_(SEQ_LEN_PAD)
        self.seq_lens_cpu.fill_(SEQ_LEN_PAD)
        self.block_table.zero_()

    def metadata(self, batch: int) -> AttentionMetadata:
        """Attention metadata over the first `batch` rows; the same object every call, since a
        captured graph holds on to these exact tensors."""
        if batch not in self._metas:
            self._metas[batch] = AttentionMetadata(
                num_reqs=batch, num_actual_tokens=batch, max_query_len=1,
                max_seq_len=self.max_seq_len,
                query_start_loc=self.query_start_loc[:batch + 1],
                seq_lens=self.seq_lens[:batch],
                block_table=self.block_table[:batch],
                slot_mapping=self.tokens[2, :batch],
                query_start_loc_cpu=self.query_start_loc_cpu[:batch + 1],
                seq_lens_cpu=self.seq_lens_cpu[:batch], decode_order=self.tokens[3, :batch])
        return self._metas[batch]

    def model_inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, positions) device views over the first `batch` rows."""
        return self.tokens[0, :batch], self.tokens[1, :batch]

    def _check(self, num_reqs: int, padded: int, rows: tuple[np.ndarray, ...],
               block_table: np.ndarray) -> None:
        if not 1 <= num_reqs <= padded <= self.max_batch:
            raise ValueError(f"num_reqs={num_reqs}, padded={padded}: need "
                             f"1 <= num_reqs <= padded <= {self.max_batch}")
        width = block_table.shape[1]
        if block_table.shape[0] != num_reqs or not 1 <= width <= self.max_blocks:
            raise ValueError(f"block_table shape {block_table.shape}: must be "
                             f"[{num_reqs}, 1..{self.max_blocks}]")
        for name, values in zip(TOKEN_ROWS + ("seq_lens",), rows):
            if len(values) != num_reqs:
                raise ValueError(f"{name} has {len(values)} rows: must have {num_reqs}")
