"""The attention layer: reshapes flat q/k/v into heads and hands them to a backend.

The backend (kernels/attention) writes this step's keys/values into the layer's paged KV cache,
which the caller passes in explicitly, then attends. Head counts are per rank. A layer with a
sliding window (kernels/attention/backend.py: query p sees keys p - W < k <= p) hands it to
the backend on every call and refuses a backend that cannot apply it; so does a layer with an
attention logit softcap (Gemma 2's attn_logit_softcapping), and so does a layer with attention
sinks (GPT-OSS: the sink logits are the caller's parameter, handed over on every call).
A layer whose value is the first v_head_dim dims of the cached value row (MLA: the latent is
both, layers/mla.py) returns [T, Hq * v_head_dim]: a backend with supports_value_prefix (cpu)
attends only those dims; the others attend the whole head, and the layer slices it.
A windowed layer of a hybrid model reads its KV group's block table and slots
(AttentionMetadata.for_window): its cache tensor is sized by that group's pool.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.attention.backend import (AttentionBackend, AttentionMetadata,
                                       check_sliding_window, check_softcap)


class Attention(nn.Module):
    """q [T, Hq * D], k/v [T, Hkv * D] -> [T, Hq * Dv] (Dv: v_head_dim, else D)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend, sliding_window: int = 0,
                 softcap: float = 0.0, sinks: bool = False, v_head_dim: int = 0) -> None:
        """sliding_window: W > 0 attends to the last W positions only; 0 to all.
        v_head_dim: 0 (values are whole heads), or the value is each cached value row's first
        v_head_dim dims (MLA).
        softcap: cap > 0 caps the scaled scores to cap * tanh(s / cap); 0: none.
        sinks: forward gets each head's sink logit (backend.py), so the backend must apply it."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.sliding_window = check_sliding_window(sliding_window)
        if self.sliding_window and not getattr(backend, "supports_sliding_window", False):
            raise ValueError(f"sliding_window={sliding_window}: the {backend.name!r} attention "
                             "backend cannot apply a sliding window (it would attend to every "
                             "key); pick one that does: torch, cpu, triton or flash_attn")
        self.softcap = check_softcap(softcap)
        if self.softcap and not getattr(backend, "supports_softcap", False):
            raise ValueError(f"attention softcap={softcap}: the {backend.name!r} attention "
                             "backend cannot apply it (it would attend uncapped); pick one "
                             "that does: torch, cpu, triton or flash_attn")
        if sinks and not getattr(backend, "supports_sinks", False):
            raise ValueError(f"attention sinks: the {backend.name!r} attention backend cannot "
                             "apply them (it would attend without them); pick one that does: "
                             "torch, cpu or triton")
        if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or not (
                0 <= v_head_dim <= head_dim):
            raise ValueError(f"v_head_dim={v_head_dim!r} is invalid: must be an int in "
                             f"0..head_dim={head_dim} (0: the whole head)")
        self.v_head_dim = v_head_dim if v_head_dim and v_head_dim < head_dim else 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_written: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """kv_written: k/v are already in kv_cache (only for a backend with
        writes_kv_from_rope, which then skips its write). sinks: [num_heads] sink logits
        (only for a layer built with sinks=True)."""
        num_tokens = q.shape[0]
        if self.sliding_window and meta is not None and meta.window is not None:
            meta = meta.window          # a hybrid model's windowed layer: its KV group's
        # Only a writes_kv_from_rope backend takes the flag; the others keep their call.
        extra = {"kv_written": True} if kv_written else {}
        if self.sliding_window:      # only then: a windowless call stays as it was
            extra["sliding_window"] = self.sliding_window
        if self.softcap:
            extra["softcap"] = self.softcap
        if sinks is not None:
            extra["sinks"] = sinks
        prefix = self.v_head_dim and getattr(self.backend, "supports_value_prefix", False)
        if prefix:
            extra["v_head_dim"] = self.v_head_dim
        out = self.backend.forward(
            q.reshape(num_tokens, self.num_heads, self.head_dim),
            k.reshape(num_tokens, self.num_kv_heads, self.head_dim),
            v.reshape(num_tokens, self.num_kv_heads, self.head_dim),
            kv_cache, meta, self.scale, **extra)
        if self.v_head_dim and not prefix:
            out = out[..., :self.v_head_dim]
        return out.reshape(num_tokens, self.num_heads * (self.v_head_dim or self.head_dim))
