"""The attention microbenchmark's batch, its float32 reference, and the timing of one backend.

A batch is `num_reqs` requests in the order decodes first, then prefill chunks (the order the
engine's input batch keeps): decode i has `context` tokens after this step and one query token;
each prefill chunk has `chunk` query tokens after `context` cached ones. Every request owns an
unshared random set of the cache's blocks; the cache holds exactly those blocks, random values.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from bench.kernel_timing import time_calls

CHECK_REQS = 4              # requests compared with the float32 reference: first and last half
CHECK_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}   # relative L2 error


@dataclass(frozen=True)
class Shape:
    num_reqs: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_prefills: int = 0       # the last num_prefills requests are prefill chunks
    chunk: int = 0              # query tokens per prefill chunk, after `context` cached

    def seq_lens(self) -> list[int]:
        """Tokens in each request's KV after this step."""
        decodes = self.num_reqs - self.num_prefills
        return [self.context] * decodes + [self.context + self.chunk] * self.num_prefills

    def query_lens(self) -> list[int]:
        """This step's query tokens per request."""
        return [1] * (self.num_reqs - self.num_prefills) + [self.chunk] * self.num_prefills

    def bytes_per_call(self, elem: int) -> tuple[int, int]:
        """(KV bytes read, all other bytes moved: Q read, O written, this step's K/V written)."""
        kv_row = self.num_kv_heads * self.head_dim * 2 * elem      # one position's K and V
        tokens = sum(self.query_lens())
        q_o = 2 * tokens * self.num_heads * self.head_dim * elem
        return sum(self.seq_lens()) * kv_row, q_o + tokens * kv_row

    def describe(self) -> str:
        heads = (f"{self.num_heads} query heads, {self.num_kv_heads} KV heads, head_dim "
                 f"{self.head_dim}, {self.dtype}")
        if not self.num_prefills:
            return f"{self.num_reqs} requests x {self.context} context, {heads}"
        return (f"{self.num_reqs - self.num_prefills} decodes x {self.context} context + "
                f"{self.num_prefills} prefill chunks of {self.chunk} tokens after "
                f"{self.context} cached, {heads}")


@dataclass(frozen=True)
class BackendRun:
    label: str                  # backend name with its block size and settings
    seconds: list[float]        # one per timed call
    check_error: float          # relative L2 error against the float32 reference
    check_ok: bool

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


@dataclass(frozen=True)
class Batch:
    """A built batch: (query, key, value, kv_cache, AttentionMetadata), the requests checked,
    and their float32 reference output rows."""

    shape: Shape
    tensors: tuple
    check_rows: torch.Tensor    # int64 row indices of the checked requests' query tokens
    reference: torch.Tensor     # float32 [len(check_rows), Hq, D]


@dataclass(frozen=True)
class Session:
    """What every timed run of one invocation shares: shape, device, timing and bandwidth."""

    shape: Shape
    device: str
    iters: int
    warmup: int
    seed: int
    copy_bps: float             # measured copy bandwidth, bytes moved per second

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.shape.dtype)).element_size()

    @property
    def total_bytes(self) -> int:
        return sum(self.shape.bytes_per_call(self.elem))

    def batch(self, block_size: int) -> Batch:
        """This session's batch at `block_size`, with the reference of the checked requests."""
        return prepare_batch(self.shape, block_size, self.device, self.seed)

    def check(self, backend, batch: Batch) -> tuple[float, bool]:
        """(relative L2 error of backend's output against the reference, within tolerance)."""
        q, k, v, cache, meta = batch.tensors
        out = backend.forward(q, k, v, cache, meta, self.shape.head_dim ** -0.5)
        got = out[batch.check_rows].float()
        err = float((got - batch.reference).norm() / batch.reference.norm())
        return err, err <= CHECK_TOL[self.shape.dtype]

    def timings(self, backend, batch: Batch) -> list[float]:
        """Seconds per forward call on the batch."""
        q, k, v, cache, meta = batch.tensors
        scale = self.shape.head_dim ** -0.5
        return time_calls(lambda: backend.forward(q, k, v, cache, meta, scale), self.device,
                           self.iters, self.warmup)

    def measure(self, label: str, backend, batch: Batch) -> BackendRun:
        """Check, then time (a failed check is still timed and reported)."""
        err, ok = self.check(backend, batch)
        return BackendRun(label, self.timings(backend, batch), err, ok)

    def line(self, r: BackendRun) -> str:
        """The printed line of one run."""
        bps = self.total_bytes / r.median_s
        return (f"{r.label}: {r.median_s * 1e3:.4g} ms median of {len(r.seconds)} calls "
                f"(min {min(r.seconds) * 1e3:.4g}, max {max(r.seconds) * 1e3:.4g}), "
                f"{bps / 1e9:.4g} GB/s = {bps / self.copy_bps:.3g} of copy bandwidth; check vs "
                f"float32 reference {r.check_error:.2e} ({'ok' if r.check_ok else 'FAILED'})")


def prepare_batch(shape: Shape, block_size: int, device: str, seed: int) -> Batch:
    """make_batch, this step's K/V written into the cache (every forward rewrites the same
    values), and the float32 reference of the first and last CHECK_REQS // 2 requests."""
    from kernels.attention.torch_ref import attend_one, gather_kv, write_kv_cache

    q, k, v, cache, meta = make_batch(shape, block_size, device, seed)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    half = CHECK_REQS // 2
    ids = sorted(set(range(min(half, shape.num_reqs)))
                 | set(range(max(0, shape.num_reqs - half), shape.num_reqs)))
    starts, seq_lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    scale = shape.head_dim ** -0.5
    rows, refs = [], []
    for i in ids:
        rows.append(torch.arange(starts[i], starts[i + 1]))
        keys, values = gather_kv(cache, meta.block_table[i], seq_lens[i])
        refs.append(attend_one(q[starts[i]:starts[i + 1]], keys, values, scale))
    return Batch(shape, (q, k, v, cache, meta), torch.cat(rows).to(device), torch.cat(refs))


def make_batch(shape: Shape, block_size: int, device: str, seed: int):
    """(query, key, value, kv_cache, AttentionMetadata) of the shape's batch (see the module
    docstring); this step's keys go to each request's last query_len positions."""
    from kernels.attention.backend import AttentionMetadata

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    seq_lens = torch.tensor(shape.seq_lens(), dtype=torch.int32)
    query_lens = torch.tensor(shape.query_lens(), dtype=torch.int32)
    blocks = (seq_lens + block_size - 1) // block_size
    perm = torch.randperm(int(blocks.sum()), device=device, generator=gen).to(torch.int32)
    table = torch.nn.utils.rnn.pad_sequence(list(perm.split(blocks.tolist())), batch_first=True)
    cache = torch.randn((2, int(blocks.sum()), block_size, shape.num_kv_heads, shape.head_dim),
                        dtype=dtype, device=device, generator=gen)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
    num_tokens = int(qsl[-1])

    def rand(heads: int):
        return torch.randn((num_tokens, heads, shape.head_dim), dtype=dtype, device=device,
                           generator=gen)

    q, k, v = rand(shape.num_heads), rand(shape.num_kv_heads), rand(shape.num_kv_heads)
    req = torch.repeat_interleave(torch.arange(shape.num_reqs), query_lens.long())
    pos = (seq_lens - query_lens)[req] + torch.arange(num_tokens) - qsl[req]
    req, pos = req.to(device), pos.to(device)
    slots = table[req, pos // block_size].to(torch.int64) * block_size + pos % block_size
    meta = AttentionMetadata(
        num_reqs=shape.num_reqs, num_actual_tokens=num_tokens,
        max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
        query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device), block_table=table,
        slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    return q, k, v, cache, meta


def make_decode_batch(shape: Shape, block_size: int, device: str, seed: int):
    """make_batch for a pure-decode shape (kept for its callers)."""
    return make_batch(shape, block_size, device, seed)
