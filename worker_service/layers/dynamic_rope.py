"""Dynamic NTK rope (rope_type "dynamic"): the base grows with the sequence's length L past
max_position_embeddings M,

    base(L) = theta * (factor * L / M - (factor - 1)) ** (dim / (dim - 2)),   L > M,

and is theta itself up to M (transformers' _compute_dynamic_ntk_parameters with
max(L, M)).

Which L a position gets. transformers recomputes the frequencies in each forward from its
longest position (L = that position + 1) and keeps the keys it cached: decoding one token at a
time, the token at position p >= M is rotated with base(p + 1) and the earlier keys keep theirs.
Our table is per position (as layers/longrope.py's): row p < M holds transformers' frequencies
below M, row p >= M base(p + 1)'s, which is exactly that forward's result. So:
  - a sequence that stays within M is rotated as transformers rotates it (and the scaling has
    no effect, as there);
  - past M, a prefill transformers runs in one forward rotates every position with the base of
    the whole length, which a paged, shared cache does not: there our tokens can differ from
    transformers' generate();
  - vLLM instead builds one table for factor * M positions with base(factor * M) for every
    position, short sequences included, so vLLM differs from transformers (and from us) even
    within M.
The table's length, factor * M, is vLLM's (engine_common/model_files/rope_config.py).
"""
from __future__ import annotations

import torch


def dynamic_ntk_cos_sin(rotary_dim: int, max_position: int, theta: float,
                        scaling: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin caches [max_position, rotary_dim], float32, each row [f, f]."""
    if rotary_dim < 4:
        raise ValueError(f"dynamic rope needs a rotary dim of at least 4 (its exponent is "
                         f"dim / (dim - 2)): got {rotary_dim}")
    factor = float(scaling["factor"])
    base_len = int(scaling["max_position_embeddings"])
    exponent = rotary_dim / (rotary_dim - 2)
    even = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    # below M: the frequencies transformers computes at init (seq_len = M, in Python floats)
    base = theta * ((factor * base_len / base_len) - (factor - 1)) ** exponent
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, 1.0 / (base ** even))
    if max_position > base_len:     # from M on: base(p + 1), in float32 as transformers' update
        lengths = torch.arange(base_len + 1, max_position + 1, dtype=torch.int64)
        bases = theta * ((factor * lengths / base_len) - (factor - 1)) ** exponent
        freqs[base_len:] = positions[base_len:, None] * (1.0 / (bases[:, None] ** even))
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()
