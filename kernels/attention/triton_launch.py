"""Launch choices of the Triton attention kernels, in one frozen config (pure Python: no torch).

Two kernels, launched by triton_paged_attention.py: the varlen kernel ("prefill": any query
lengths, also correct for one-token queries; triton_prefill_kernel.py) and the split-KV
flash-decoding kernel ("decode": exactly one query token per request, plus a reduce kernel when
a request's context is split; triton_decode_kernels.py).
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

from dataclasses import dataclass, replace

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
# Wide heads: a head dim padded to WIDE_HEAD_DIM or more (DeepSeek's MLA latent, 576 -> 1024)
# takes its own tiles, because at the ordinary ones a 64-row tile of 1024-wide queries and two
# stages of 64 keys needed 655,360 bytes of shared memory (sm_90 allows 232,448 a block). Its
# tiles hold WIDE_TILE_ROWS rows (tokens x query heads; a GQA group above it is cut into tiles
# of that many heads, each its own program) and step WIDE_BLOCK_N keys at a time; a cache whose
# value half is its key half (MLA's, stride 0) is read once for both (KV_SHARED).
# tests/gpu/test_mla_kernel_fit.py compiles every such launch for sm_90.
WIDE_HEAD_DIM = 512
WIDE_TILE_ROWS = 16
WIDE_BLOCK_N = 16


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
    # wide heads (WIDE_HEAD_DIM): tile rows (both kernels; a GQA group above it is cut into
    # tiles), the varlen kernel's keys per step and warps. Chosen to fit sm_90, never timed on
    # a GPU (docs/gpu.md)
    wide_tile_rows: int = WIDE_TILE_ROWS
    wide_block_n: int = WIDE_BLOCK_N
    wide_num_warps: int = 4

    def __post_init__(self) -> None:
        _check_pow2("block_q_rows", self.block_q_rows, MIN_DOT_ROWS)
        _check_pow2("decode_q_rows", self.decode_q_rows, MIN_DOT_ROWS)
        _check_pow2("wide_tile_rows", self.wide_tile_rows, MIN_DOT_ROWS)
        _check_pow2("wide_block_n", self.wide_block_n, MIN_DOT_ROWS)
        _check_pow2("wide_num_warps", self.wide_num_warps, 1, MAX_WARPS)
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


def is_wide_head(padded_head_dim: int) -> bool:
    """Whether a head dim (padded to a power of two) takes the wide-head tiles."""
    return padded_head_dim >= WIDE_HEAD_DIM


def head_tiles(group: int, block_g: int, padded_head_dim: int, wide_rows: int,
               min_rows: int = 1) -> tuple[int, int]:
    """(query heads per tile, tiles per kv head) for a GQA group of `group` heads, padded to
    block_g (a power of two), and tiles of at least min_rows heads: one tile of the whole group,
    except for a wide head, whose tiles hold at most wide_rows heads."""
    tile = max(min_rows, block_g)
    if is_wide_head(padded_head_dim):
        tile = max(min_rows, min(block_g, wide_rows))
    return tile, -(-group // tile)


@dataclass(frozen=True)
class TileShape:
    """One launch's tile: query heads per tile (block_g), tiles per kv head (g_tiles), tokens
    per tile (block_q: varlen only), head dim padded (block_d), and the kernel's KernelTiles."""

    block_g: int
    g_tiles: int
    block_q: int
    block_d: int
    tiles: KernelTiles


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The kernels' BLOCK_D: head_dim padded to a power of two >= 16."""
    return max(MIN_DOT_ROWS, _pow2_at_least(head_dim))


def prefill_tile_shape(launch: TritonLaunchConfig, group: int, head_dim: int, elem_bytes: int,
                       block_q_rows: int | None = None) -> TileShape:
    """The varlen kernel's tile for `group` query heads per kv head of head_dim, in a cache
    of elem_bytes elements: launch.prefill and block_q_rows (or launch.block_q_rows) rows, or
    for a wide head the wide tiles. A tile has at least tl.dot's 16 rows."""
    block_d = padded_head_dim(head_dim)
    tiles, rows = launch.prefill, block_q_rows or launch.block_q_rows
    if is_wide_head(block_d):
        tiles, rows = wide_prefill_tiles(launch), launch.wide_tile_rows
    block_g, g_tiles = head_tiles(group, _pow2_at_least(group), block_d, launch.wide_tile_rows)
    block_q = max(1, rows // block_g)
    if block_q * block_g < MIN_DOT_ROWS:
        block_q = MIN_DOT_ROWS // block_g
    return TileShape(block_g, g_tiles, block_q, block_d, tiles)


def decode_tile_shape(launch: TritonLaunchConfig, group: int, head_dim: int, elem_bytes: int,
                      block_n: int | None = None) -> TileShape:
    """The decode kernel's tile (block_q 1): launch.decode with its keys per step capped by
    decode_keys_per_step, and at least 16 query-head rows (a group below it is padded)."""
    block_d = padded_head_dim(head_dim)
    block_g, g_tiles = head_tiles(group, _pow2_at_least(group), block_d, launch.wide_tile_rows,
                                  MIN_DOT_ROWS)
    keys = decode_keys_per_step(block_n or launch.decode.block_n, block_d, elem_bytes)
    return TileShape(block_g, g_tiles, 1, block_d, replace(launch.decode, block_n=keys))


def wide_prefill_tiles(launch: TritonLaunchConfig) -> KernelTiles:
    """The varlen kernel's launch for a wide head: launch.wide_block_n keys a step on
    launch.wide_num_warps warps, launch.prefill's stages."""
    return KernelTiles(block_n=launch.wide_block_n, num_warps=launch.wide_num_warps,
                       num_stages=launch.prefill.num_stages)


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
