"""Rotary position embedding (the "rotate half" layout Llama/Qwen checkpoints use).

Supported rope types: "default", "linear", "llama3", "longrope" (layers/longrope.py; its older
name "su" too), "yarn"
(layers/yarn_rope.py) and "dynamic" (dynamic NTK, layers/dynamic_rope.py). The settings are read
from either config layout:
  - transformers >= 5: `rope_parameters = {"rope_type": ..., "rope_theta": ..., "factor": ...}`
  - older configs:     `rope_theta` plus `rope_scaling = {"type" or "rope_type": ..., ...}`
Both set is refused (engine_common/model_files/rope_config.py: rope_layout says why).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from engine_common.model_files.model_dir import model_position_limit
from engine_common.model_files.rope_config import (canonical_rope_type, declared_max_positions,
                                                   original_length, rope_layout,
                                                   scaling_factor)
from kernels.cpu.fused import ops_for
from worker_service.layers.dynamic_rope import dynamic_ntk_cos_sin
from worker_service.layers.longrope import longrope_cos_sin
from worker_service.layers.yarn_rope import yarn_inv_freq

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "dynamic")


@dataclass(frozen=True)
class RopeSettings:
    """Rope type, base and the scaling fields that type needs (factor, *_freq_factor, ...)."""

    rope_type: str = "default"
    theta: float = 10000.0
    scaling: dict = field(default_factory=dict)
    partial_rotary_factor: float = 1.0   # Phi-4-mini: only the first head_dim * this rotate

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "RopeSettings":
        merged = dict(rope_layout(hf_config))
        rope_type = canonical_rope_type(merged.pop("rope_type", None) or merged.pop("type", None))
        merged.pop("type", None)
        theta = merged.pop("rope_theta", None) or hf_config.get("rope_theta") or 10000.0
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={rope_type!r} is not supported: "
                             f"must be one of {ROPE_TYPES}")
        partial = merged.pop("partial_rotary_factor", None)
        if partial is None:
            partial = hf_config.get("partial_rotary_factor")
        partial = _partial_factor(1.0 if partial is None else partial)
        merged.update(_scaling_lengths(rope_type, hf_config, merged))
        return cls(rope_type=rope_type, theta=float(theta), scaling=merged,
                   partial_rotary_factor=partial)

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dims of each head rotate (transformers: int(head_dim * factor))."""
        dim = int(head_dim * self.partial_rotary_factor)
        if dim < 2 or dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} is invalid "
                             f"for head_dim={head_dim}: int(head_dim * factor) = {dim} must be "
                             "an even number >= 2")
        return dim


def _scaling_lengths(rope_type: str, hf_config: dict, scaling: dict) -> dict:
    """The lengths a rope type's tables are built from (engine_common's rope_config reads them
    for max_model_len too), and a bad factor refused naming it."""
    if rope_type in ("longrope", "llama3", "yarn"):    # their factor and cut-off: the lengths
        if rope_type == "yarn":
            scaling_factor({**scaling, "rope_type": rope_type}, required=False)
        return {"max_position_embeddings": declared_max_positions(hf_config),
                "original_max_position_embeddings": original_length(hf_config, scaling,
                                                                    rope_type)}
    if rope_type == "dynamic":
        scaling_factor({**scaling, "rope_type": rope_type})
        return {"max_position_embeddings": declared_max_positions(hf_config)}
    return {}


def _partial_factor(value) -> float:
    """partial_rotary_factor as a float in (0, 1], or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"partial_rotary_factor={value!r} is invalid: must be a number in (0, 1]")
    return float(value)


def default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """theta ** (-2i / rotary_dim) for i in 0 .. rotary_dim/2 - 1, float32, computed on the CPU
    (as the reference does) so every device starts from the same frequencies."""
    even = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu")
    exponents = even.float() / rotary_dim
    return 1.0 / (theta ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    the band between blended linearly in (original_context / wavelength)."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    in_band = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(in_band, blended, slowed)


def compute_inv_freq(rotary_dim: int, settings: RopeSettings) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2], float32, for the configured rope type."""
    inv_freq = default_inv_freq(rotary_dim, settings.theta)
    if settings.rope_type == "linear":
        return inv_freq / float(settings.scaling["factor"])
    if settings.rope_type == "llama3":
        return llama3_inv_freq(inv_freq, settings.scaling)
    return inv_freq


def rope_cos_sin(rotary_dim: int, max_position: int,
                 settings: RopeSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin caches [max_position, rotary_dim], float32, each row [f, f], times the rope
    type's attention factor (YaRN, LongRoPE; 1 for the others)."""
    theta, scaling = settings.theta, settings.scaling
    if settings.rope_type == "longrope":    # per-position factors and a scale: its module
        return longrope_cos_sin(rotary_dim, max_position, theta, scaling)
    if settings.rope_type == "dynamic":     # per-position bases past max_position_embeddings
        return dynamic_ntk_cos_sin(rotary_dim, max_position, theta, scaling)
    attention = 1.0
    if settings.rope_type == "yarn":
        inv_freq, attention = yarn_inv_freq(rotary_dim, theta, scaling)
    else:
        inv_freq = compute_inv_freq(rotary_dim, settings)
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.to(positions.device))
    angles = torch.cat((freqs, freqs), dim=-1)          # [max_position, rotary_dim]
    if attention == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention, angles.sin() * attention


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to q [T, Hq, D] and k [T, Hkv, D] at the given positions [T].

    cos/sin are precomputed in float32 for positions 0 .. max_position - 1 and cast to the
    activations' dtype before use, as the reference implementation does. Each cache row is
    [f, f]: both halves hold the same D/2 angles.

    Partial rotary (settings.partial_rotary_factor < 1, Phi-4-mini): only the first
    rotary_dim = int(head_dim * factor) dims of each head rotate, in halves within them; the
    rest pass through, as transformers does. The caches are then [max_position, rotary_dim]
    and the C++ and Triton ropes rotate the first cache-width dims of each head, as torch does.

    fused=False returns new tensors. fused=True runs kernels/fused_rope.py's Triton kernel (same
    rounding; needs CUDA or Triton's interpreter): q and k are rotated IN PLACE, one launch for
    both, and returned. On the CPU, after use_cpu_kernels(), kernels/cpu's rope also rotates
    them in place (float32 / bfloat16 activations).

    kv_write = (value, kv_cache, slot_mapping), fused only: the same launch also stores the
    rotated keys and the values in the paged cache (kernels/fused_rope.py), so an attention
    backend with writes_kv_from_rope need not.
    """

    _cpu = None

    def __init__(self, head_dim: int, max_position: int, settings: RopeSettings,
                 fused: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = settings.rotary_dim(head_dim)
        self.fused = fused
        self._fused_kernel = _load_fused_kernel() if self.fused else None
        cos, sin = rope_cos_sin(self.rotary_dim, max_position, settings)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def use_cpu_kernels(self) -> bool:
        """Rotate CPU float32 / bfloat16 inputs with kernels/cpu's rope from now on (unless
        fused); True when that library is loaded."""
        if not self.fused and self.cos_cache.device.type == "cpu":
            self._cpu = ops_for(torch.float32)
        return self._cpu is not None

    @property
    def kernel(self) -> str:
        """Which rope rotates inputs it takes: "triton" (fused), "cpu" (kernels/cpu, after
        use_cpu_kernels()) or "torch"."""
        return "triton" if self.fused else "cpu" if self._cpu is not None else "torch"

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_norm / k_norm (both or neither): per-head RMSNorms applied first (Qwen3); fused,
        the same launch normalises and rotates. kv_write: see the class docstring."""
        if kv_write is not None and self._fused_kernel is None:
            raise ValueError("kv_write needs the fused rope (RotaryEmbedding(fused=True))")
        write = {} if kv_write is None else dict(zip(("value", "kv_cache", "slot_mapping"),
                                                     kv_write))
        if q_norm is not None:
            if self._fused_kernel is not None and q_norm.eps == k_norm.eps \
                    and q_norm.weight.dtype == query.dtype:
                return self._fused_kernel(positions, query, key, self.cos_cache, self.sin_cache,
                                          q_norm.weight, k_norm.weight, q_norm.eps, **write)
            query, key = q_norm(query), k_norm(key)
        if (not write and self._cpu is not None
                and query.dtype in (torch.float32, torch.bfloat16)
                and query.stride(-1) == 1 and key.stride(-1) == 1 and positions.is_contiguous()):
            self._cpu.rope(positions, query, key, self.cos_cache, self.sin_cache)
            return query, key
        if self._fused_kernel is not None:
            return self._fused_kernel(positions, query, key, self.cos_cache, self.sin_cache,
                                      **write)
        cos = self.cos_cache[positions].to(query.dtype)[:, None, :]   # [T, 1, rotary_dim]
        sin = self.sin_cache[positions].to(query.dtype)[:, None, :]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


class NoRope(nn.Module):
    """The rope of a layer without position embedding (NoPE: SmolLM3's every 4th layer): q and
    k pass through, after their per-head norms if any. Never fused, so no attention asks it to
    write the KV cache (the backend writes it)."""

    fused = False
    kernel = "none"

    def use_cpu_kernels(self) -> bool:
        return False

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                kv_write=None) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_write is not None:
            raise ValueError("kv_write needs the fused rope; a NoPE layer has none")
        if q_norm is not None:
            return q_norm(query), k_norm(key)
        return query, key


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated over its first cos.shape[-1] dims, the rest passed through."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def _load_fused_kernel():
    """kernels.fused_rope.fused_rope, imported only when asked for (it imports triton)."""
    from kernels.fused_rope import fused_rope
    return fused_rope


def get_rope(head_dim: int, hf_config: dict, fused: bool = False) -> RotaryEmbedding:
    """The rotary embedding a Hugging Face config asks for (fused: see RotaryEmbedding)."""
    settings = RopeSettings.from_hf_config(hf_config)
    max_position = model_position_limit(hf_config)     # max_model_len's bound: as long
    return RotaryEmbedding(head_dim, max_position, settings, fused)
