"""The attention interface every backend implements, and the metadata it reads.

Paged KV cache, one tensor per layer:

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             |   `-- physical block id from the request's block table
             `-- 0 = keys, 1 = values

    token at position p of request r lives in block block_table[r, p // block_size],
    row p % block_size;  slot = block_id * block_size + p % block_size.

    element type: the model dtype, or one byte (float8_e5m2 / float8_e4m3fn, scale 1.0) with
    --kv-cache-dtype fp8 (worker_service/runner/kv_dtype.py): written by write_kv_cache's
    rounding; the torch and cpu backends widen it to float32 as they read, others refuse it.

The batch is flattened: the query tokens of request i are rows
query_start_loc[i] : query_start_loc[i + 1] of q/k/v. Each request's queries are its *last*
(query_len) positions: positions seq_len - query_len .. seq_len - 1, causal among themselves and
attending to the whole cached prefix. A decode is query_len 1; a (chunked) prefill with a cached
prefix is query_len > 1 with seq_len > query_len.

Sliding window (per layer; Mistral, Qwen2 with use_sliding_window): forward's sliding_window=W
(0: none) lets the query at position p see only keys p - W < k <= p, W keys counting its own,
as transformers' sliding_window_overlay (kv_idx > q_idx - W) and flash-attn's window_size
(W - 1, 0). When every layer has a window the scheduler frees the blocks below every query's
window (scheduler_service/core/sliding_window.py): the table still names such a block (or names
block 0) while another request may write it, so a backend must skip those keys or mask them out
(they hold finite values, never this request's keys).

Attention logit soft-capping (per layer; Gemma 2): forward's softcap=cap (0: none) replaces each
scaled score s by cap * tanh(s / cap) before the mask and softmax, as transformers'
eager_attention_forward. A backend without supports_softcap is refused at model load
(worker_service/layers/attention.py) rather than attend uncapped.

Attention sinks (per layer; GPT-OSS): forward's sinks=[Hq] float32 logits (None: none) join each
query head's softmax denominator as one more key with no value,
    out = sum_k e^(s_k) v_k / (sum_k e^(s_k) + e^(sink_h)),
as transformers' GPT-OSS eager_attention_forward (which appends the sink logit to the scores,
softmaxes and drops it). Under tensor parallelism each rank holds its own heads' sinks. A
backend without supports_sinks is refused at model load rather than attend without them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_actual_tokens: int          # rows of q/k/v that are real (the rest is padding)
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor   # int32 [num_reqs + 1], device
    seq_lens: torch.Tensor          # int32 [num_reqs], device: tokens in KV after this step
    block_table: torch.Tensor       # int32 [num_reqs, max_blocks_per_req], device
    slot_mapping: torch.Tensor      # int64 [num_tokens], device; -1 marks a padded slot
    # Host copies, for backends that loop over requests (the torch reference).
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # int64 [num_reqs], device: the requests by seq_len, longest first (a permutation), for a
    # decode kernel that starts the longest work first; None where the step staged none.
    decode_order: torch.Tensor | None = None
    # A hybrid model's window group (engine_common/request/kv_groups.py): this metadata with
    # that group's block_table and slot_mapping, which its windowed layers read; None else.
    window: "AttentionMetadata | None" = None

    def for_window(self, window: int) -> "AttentionMetadata":
        """The metadata of a layer with this window (0: none): its group's."""
        return self.window if window and self.window is not None else self


def check_sliding_window(window: int) -> int:
    """window as an int >= 0 (0: none), else ValueError."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"sliding_window={window!r} is invalid: must be an int >= 0 (0: none)")
    return window


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """sinks as a contiguous float32 [num_heads] tensor (None: none), else ValueError."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks={shape} is invalid: must be a tensor of shape "
                         f"[num_heads={num_heads}] (one logit per query head)")
    return sinks.float().contiguous()


def check_softcap(cap: float) -> float:
    """cap as a float >= 0 (0: none), else ValueError."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 0:
        raise ValueError(f"softcap={cap!r} is invalid: must be a number >= 0 (0: none)")
    return float(cap)


class AttentionBackend(ABC):
    """Writes this step's keys/values into the paged cache, then attends."""

    name: str = "abstract"
    # True: forward also takes kv_written=True, meaning this call's keys/values are already in
    # the cache (the fused rope wrote them, kernels/fused_rope.py) and must not be written again.
    writes_kv_from_rope: bool = False
    # True: forward takes sliding_window=W (> 0) and attends within it. A layer with a window
    # refuses, at model load, a backend without it (worker_service/layers/attention.py).
    supports_sliding_window: bool = False
    # True: forward takes softcap=cap (> 0) and caps the scores; a layer with a cap refuses a
    # backend without it.
    supports_softcap: bool = False
    # True: forward takes sinks=[Hq] logits and adds e^(sink) to each softmax denominator; a
    # layer with sinks refuses a backend without it.
    supports_sinks: bool = False
    # True: forward takes v_head_dim=Dv (< D) and returns [T, Hq, Dv], the attention over each
    # value row's first Dv dims (MLA's latent, layers/attention.py); the layer slices the
    # whole-head output of a backend without it.
    supports_value_prefix: bool = False

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D], kv_cache as drawn above.
        Returns [T, Hq, D] in query's dtype. Rows past meta.num_actual_tokens are undefined.
        A backend with supports_sliding_window also takes sliding_window: int = 0; one with
        supports_softcap also takes softcap: float = 0.0; one with supports_sinks also takes
        sinks: torch.Tensor | None = None; one with supports_value_prefix also takes
        v_head_dim: int = 0."""
