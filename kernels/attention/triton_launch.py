"""Launch choices of the Triton attention kernels, in one frozen config (pure Python: no torch).

Two kernels live in triton_paged_attention.py: the varlen kernel ("prefill": any query lengths,
also correct for one-token queries) and the split-KV flash-decoding kernel ("decode": exactly
one query token per request, plus a reduce kernel when a request's context is split).
`dispatch` says which kernel serves which requests:

    by_batch     a batch whose max_query_len is 1 takes the decode kernel; any other batch
                 (prefill, chunked prefill, mixed) takes the varlen kernel, where decode rows
                 fill one token of a tile. The default.
    unified      the varlen kernel serves every batch: the single-kernel design. A pure-decode
                 batch uses tiles of decode_q_rows rows (the smallest tl.dot allows).
    per_request  each request by its query length: one-token requests take the decode kernel,
                 the rest the varlen kernel, so a mixed batch makes two launches. Needs no host
                 sync: each kernel skips the other's requests on the device.

A one-token request is a decode whatever its history (its query is its last position and sees
every key), so all three are exact. The defaults are the values the kernels were written with;
`python -m bench.attention_bandwidth --sweep` times the alternatives on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

DISPATCH_MODES = ("by_batch", "unified", "per_request")
# decode: the order programs start in. request_fastest runs one kv head of every request, then
# the next head; head_fastest runs all kv heads of a request side by side, so the programs in
# flight read each token's whole K/V row (Hkv * D contiguous) together; longest_first is
# head_fastest over the requests sorted by context length (AttentionMetadata.decode_order,
# where the step staged one), so the last programs to start are the shortest and the SMs run
# out of work together (the longest-processing-time-first rule).
DECODE_ORDERS = ("request_fastest", "head_fastest", "longest_first")
MIN_SPLIT_TOKENS = 256       # decode: fewest keys worth a split of their own
MAX_SPLITS = 32
SPLIT_WAVES = 2              # decode: split until the programs fill this many waves of SMs
MIN_DOT_ROWS = 16            # tl.dot wants >= 16 rows and >= 16 keys per step
# decode: at most this many bytes of keys per step (and as many of values), whatever block_n
# asks: 128 bf16 keys of head_dim 128. fp32 or head_dim 256 take fewer keys, so the kernel's
# shared memory stays ~75 KB (128 fp32 keys of 128 dims needed 147 KB: over the 99 KB of
# sm_86/sm_89 GPUs).
DECODE_MAX_TILE_BYTES = 32 * 1024
MAX_WARPS = 16


def _check_pow2(name: str, value: int, lo: int, hi: int | None = None) -> None:
    """Raise ValueError unless value is a power of two in [lo, hi]."""
    ok = isinstance(value, int) and value >= lo and not value & (value - 1)
    if not ok or (hi is not None and value > hi):
        bound = f"a power of two >= {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise ValueError(f"{name}={value!r} is invalid: must be {bound}")


@dataclass(frozen=True)
class KernelTiles:
    """Launch choices of one kernel."""

    block_n: int = 64        # keys per inner step: a power of two >= 16
    num_warps: int = 4       # a power of two, 1 .. 16
    num_stages: int = 2      # software-pipelining depth, >= 1

    def __post_init__(self) -> None:
        _check_pow2("block_n", self.block_n, MIN_DOT_ROWS)
        _check_pow2("num_warps", self.num_warps, 1, MAX_WARPS)
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} is invalid: must be >= 1")


@dataclass(frozen=True)
class TritonLaunchConfig:
    """Every launch choice of the Triton attention backend; the defaults are today's values."""

    prefill: KernelTiles = KernelTiles()   # the varlen kernel
    # the split-KV decode kernel: 128 keys a step ran decode steps ~1% faster than 64 on an
    # H100, 256 12% slower (bench/results.md, 2026-11-27 night)
    decode: KernelTiles = KernelTiles(block_n=128)
    block_q_rows: int = 64       # varlen tile height in (token, query head) rows
    decode_q_rows: int = 16      # the same for a pure-decode batch under dispatch="unified"
    decode_splits: int | None = None       # fixed splits (e.g. for CUDA graphs); None: heuristic
    min_split_tokens: int = MIN_SPLIT_TOKENS
    max_splits: int = MAX_SPLITS
    split_waves: int = SPLIT_WAVES
    dispatch: str = "by_batch"
    decode_order: str = "request_fastest"

    def __post_init__(self) -> None:
        _check_pow2("block_q_rows", self.block_q_rows, MIN_DOT_ROWS)
        _check_pow2("decode_q_rows", self.decode_q_rows, MIN_DOT_ROWS)
        if self.decode_splits is not None and self.decode_splits < 1:
            raise ValueError(f"decode_splits={self.decode_splits} is invalid: "
                             "must be >= 1 or None")
        for name in ("min_split_tokens", "max_splits", "split_waves"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        for name, allowed in (("dispatch", DISPATCH_MODES), ("decode_order", DECODE_ORDERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be one of "
                                 f"{allowed}")

    def splits_for(self, num_reqs: int, num_kv_heads: int, max_seq_len: int,
                   num_sms: int) -> int:
        """decode_splits if fixed, else the heuristic's choice for this batch (host ints)."""
        if self.decode_splits is not None:
            return self.decode_splits
        return choose_num_splits(num_reqs, num_kv_heads, max_seq_len, num_sms,
                                 self.min_split_tokens, self.max_splits, self.split_waves)


def decode_keys_per_step(block_n: int, padded_head_dim: int, elem_bytes: int) -> int:
    """The decode kernel's keys per step: block_n, halved until one step's keys fit
    DECODE_MAX_TILE_BYTES (never below tl.dot's 16)."""
    while block_n > MIN_DOT_ROWS and block_n * padded_head_dim * elem_bytes > DECODE_MAX_TILE_BYTES:
        block_n //= 2
    return block_n


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      min_split_tokens: int = MIN_SPLIT_TOKENS,
                      max_splits: int = MAX_SPLITS, split_waves: int = SPLIT_WAVES) -> int:
    """Splits per request so decode fills ~split_waves waves of SMs, keeping >=
    min_split_tokens keys per split and at most max_splits (host ints only: no sync)."""
    programs = max(1, num_reqs * num_kv_heads)
    wanted = -(-split_waves * num_sms // programs)
    worth = -(-max(1, max_seq_len) // min_split_tokens)
    return max(1, min(wanted, worth, max_splits))
