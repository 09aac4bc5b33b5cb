"""The hybrid KV cache of a model that mixes sliding-window and full-attention layers (Gemma 2,
Gemma 3, GPT-OSS, Cohere2): two groups of layers, each with its own pool of blocks.

    group    layers                  pool                     a request's table
    full     those that see every    most of the byte budget  every block of its context
             key (window 0)
    window   those with window W     window_pool_bound blocks  the blocks its window still
                                                                sees (the rest: null block)

Block j of a request's table holds positions j*bs .. j*bs + bs - 1 in both groups; a windowed
layer reads its group's table and writes its group's slots. The window group frees the blocks
that left every query's window as an all-window model's single pool does
(scheduler_service/core/sliding_window.py), so at long context it holds about W / bs blocks per
request where the full group holds the whole context.

The window pool is sized so it is never the bottleneck: a running request holds at most the
blocks of its window, of the tokens in flight (async scheduling) and of this step's chunk, each
edge in a partial block; tokens in flight and this step's chunks together are at most
max_num_batched_tokens each. The rest of the byte budget goes to the full group. A budget below
that bound keeps today's single pool (no split): the scheduler then never waits on the window
pool, which its admission and preemption counts do not look at.

Torch-free: the workers size their tensors and the scheduler its pools by the same numbers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowGroup:
    """The window group of a hybrid model: its window W (tokens) and its pool's blocks."""

    window: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("window", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WindowGroup.{name}={value!r} is invalid: must be an int >= 1")


def hybrid_window(layer_windows: Sequence[int]) -> tuple[int, str]:
    """(W, "") when some layers have the window W and the others none: a hybrid model. Else
    (0, why not): "" for a model whose layers are all alike (no window, or one on every layer),
    a reason to log for a mixed model whose windowed layers do not share one window."""
    values = {int(w) for w in layer_windows}
    if 0 not in values or values == {0}:        # no layer sees every key, or none has a window
        return 0, ""
    windows = values - {0}
    if len(windows) > 1:
        return 0, (f"its windowed layers have {len(windows)} different windows "
                   f"({sorted(windows)}); one KV pool keeps every layer's context")
    return windows.pop(), ""


def window_pool_bound(window: int, block_size: int, max_num_seqs: int,
                      max_num_batched_tokens: int) -> int:
    """Blocks the window group ever holds at once (see the module docstring): per running
    request its window and two partial edges plus one more for a draft's or a chunk's third
    edge, and two steps' worth of tokens (the one in flight and the one scheduled)."""
    per_request = -(-window // block_size) + 3
    return max_num_seqs * per_request + 2 * -(-max_num_batched_tokens // block_size)


def split_kv_blocks(num_blocks: int, num_layers: int, num_window_layers: int, window: int,
                    block_size: int, max_num_seqs: int,
                    max_num_batched_tokens: int) -> tuple[int, WindowGroup | None]:
    """The byte budget of `num_blocks` blocks of every layer, split into (full group blocks,
    the window group) for a model whose `num_window_layers` of `num_layers` layers have the
    window W; (num_blocks, None) when the budget is below window_pool_bound (one pool)."""
    num_full_layers = num_layers - num_window_layers
    if not window or num_window_layers < 1 or num_full_layers < 1:
        return num_blocks, None
    bound = window_pool_bound(window, block_size, max_num_seqs, max_num_batched_tokens)
    if num_blocks < bound:
        return num_blocks, None
    # layer-blocks of the budget, less the window pool's, all to the full group's layers
    full = (num_blocks * num_layers - bound * num_window_layers) // num_full_layers
    return full, WindowGroup(window, bound)
