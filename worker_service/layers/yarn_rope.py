"""YaRN (rope_type "yarn": Qwen2.5 / Qwen3 past 32K, GPT-OSS, DeepSeek-style configs), computed
as transformers' _compute_yarn_parameters computes it, so the tables equal its rope's:

  - frequencies: theta ** (-2i / dim), blended per dimension between the original
    (extrapolation) and the original / factor (interpolation) by a linear ramp over the
    dimensions [low, high] found from beta_fast (32) and beta_slow (1) rotations within
    original_max_position_embeddings; `truncate` (default true) floors low and ceils high;
  - cos and sin scaled by the attention factor: `attention_factor` when given, else
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set (and not
    0), else get_mscale(factor) = 0.1 * ln(factor) + 1 (1 for factor <= 1);
  - factor null: max_position_embeddings / original_max_position_embeddings (a missing
    `factor` key is refused, as transformers refuses it: rope_config.scaling_factor).

One table for every position (transformers' and vLLM's YaRN are static: nothing depends on the
sequence's length). The lengths are read by engine_common/model_files/rope_config.py.
"""
from __future__ import annotations

import math

import torch

YARN_KEYS = ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, attention factor)."""
    _check_numbers(scaling)
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = scaling["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else yarn_mscale(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    low, high = _correction_range(beta_fast, beta_slow, rotary_dim, theta, original,
                                  scaling.get("truncate", True))
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).to(torch.float) / rotary_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - _linear_ramp(low, high, rotary_dim // 2)     # 1: the original frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _check_numbers(scaling: dict) -> None:
    for key in YARN_KEYS:
        value = scaling.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValueError(f"config.json: yarn rope scaling {key}={value!r} is invalid: must "
                             "be a finite number")


def yarn_mscale(scale: float, mscale: float = 1) -> float:
    """YaRN's get_mscale: 0.1 * mscale * ln(scale) + 1, 1 for scale <= 1 (also DeepSeek's
    softmax-scale factor, layers/mla.py)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, length: int) -> float:
    """The dimension whose wavelength fits `rotations` turns in `length` positions."""
    return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def _correction_range(fast: float, slow: float, dim: int, theta: float, length: int,
                      truncate: bool) -> tuple[float, float]:
    low = _correction_dim(fast, dim, theta, length)
    high = _correction_dim(slow, dim, theta, length)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, n: int) -> torch.Tensor:
    """0 up to dimension `low`, 1 from `high` on, linear between ([n] float32)."""
    if low == high:
        high += 0.001       # as transformers: no division by zero
    return torch.clamp((torch.arange(n, dtype=torch.float32) - low) / (high - low), 0, 1)
