"""LongRoPE (rope_type "longrope": Phi-3-mini-128k, Phi-3-medium-128k, Phi-3.5-mini): two sets of
per-frequency divisors, `short_factor` for positions below `original_max_position_embeddings`
and `long_factor` from there on, and cos/sin scaled by an attention factor
(sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original, unless the
config gives `factor` or `attention_factor`), as transformers' _compute_longrope_parameters.

Which factors a position gets: transformers computes the frequencies of each forward from its
longest position (long once it reaches `original`) and keeps the keys it cached, so decoding one
token at a time a position p >= original is rotated long and the earlier keys keep their short
rotation. Our cache is per position (vLLM's way), which is exactly that forward's result
(tests/integration/test_mixtral_phi3_vs_transformers.py). transformers' generate() goes further:
when a sequence first crosses `original` it drops its cache and recomputes the whole sequence
long (Phi3ForCausalLM.prepare_inputs_for_generation), which a paged cache shared by a batch
does not do: past `original` our tokens can differ from generate()'s.
"""
from __future__ import annotations

import math

import torch


def longrope_cos_sin(rotary_dim: int, max_position: int, theta: float,
                     scaling: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin caches [max_position, rotary_dim], float32, each row [f, f]. rotary_dim is
    head_dim, or less with a partial_rotary_factor (the factors then have rotary_dim / 2)."""
    half = rotary_dim // 2
    short, long = (_factors(scaling, key, half) for key in ("short_factor", "long_factor"))
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor)
                                                        / math.log(original))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.where((positions >= original)[:, None],
                        torch.outer(positions, 1.0 / (long * theta ** exponents)),
                        torch.outer(positions, 1.0 / (short * theta ** exponents)))
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * attention, angles.sin() * attention


def _factors(scaling: dict, key: str, half: int) -> torch.Tensor:
    values = scaling.get(key)
    if not isinstance(values, (list, tuple)) or len(values) != half:
        n = len(values) if isinstance(values, (list, tuple)) else values
        raise ValueError(f"rope {key}={n!r} is invalid: must be a list of rotary_dim / 2 = {half} "
                         "numbers")
    return torch.tensor([float(v) for v in values], dtype=torch.float32)
