"""Phi-3 and Phi-4 (Phi3ForCausalLM: Phi-3-mini-4k and -128k, Phi-3-medium, Phi-3.5-mini, Phi-4),
as transformers' modeling_phi3: the Llama layout without biases whose checkpoints hold q/k/v as
one `qkv_proj` and gate/up as one `gate_up_proj`, and a sliding window on every layer when the config sets
one (Phi-3-mini-4k: 2047). The fused checkpoint tensors are cut into their q, k, v (gate, up)
rows at load (`split_checkpoint_tensor`), so tensor parallelism shards each part as for Llama.

The 128k models' `longrope` scaling is layers/longrope.py. Phi-4-mini (partial_rotary_factor
0.75) rotates the first 3/4 of each head (layers/rotary.py; the C++ and Triton ropes too).
"""
from __future__ import annotations

from typing import Any

from worker_service.models.llama import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):
    """Mistral's decoder (the window on every layer); fused checkpoint projections."""

    default_sliding_window = None          # Phi3Config's

    def split_checkpoint_tensor(self, name: str, tensor: Any) -> list[tuple[str, Any]] | None:
        """qkv_proj -> q_proj, k_proj, v_proj and gate_up_proj -> gate_proj, up_proj, by rows
        (a lazy safetensors slice is cut without reading the rest); None for other tensors."""
        return split_fused_projection(self.args, name, tensor)


def split_fused_projection(a, name: str, tensor: Any) -> list[tuple[str, Any]] | None:
    """A checkpoint's fused qkv_proj / gate_up_proj cut by rows into the parts the decoder
    (args `a`: a DecoderArgs) loads; None for other tensors (GLM's gate_up_proj too)."""
    if name.endswith(".self_attn.qkv_proj.weight"):
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        parts = (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv))
        fused = "qkv_proj"
    elif name.endswith(".mlp.gate_up_proj.weight"):
        inter = a.intermediate_size
        parts = (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))
        fused = "gate_up_proj"
    else:
        return None
    rows = _num_rows(tensor)
    if rows != parts[-1][2]:
        raise ValueError(f"{name}: {rows} rows, expected {parts[-1][2]} (the config's "
                         f"{' + '.join(p[0] for p in parts)})")
    return [(name.replace(f".{fused}.", f".{part}."), tensor[lo:hi]) for part, lo, hi in parts]


def _num_rows(tensor: Any) -> int:
    shape = tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape
    return int(shape[0])
